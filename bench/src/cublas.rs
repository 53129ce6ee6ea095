//! The baseline: cuBLAS bf16 GEMM `logits[t][v] = h[t] · W[v]` (f32 compute, bf16 out), the
//! GEMM a non-fused LM head runs first.

use std::sync::Arc;

use lmhead::bf16;
use lmhead::cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm as _, GemmConfig};
use lmhead::cudarc::driver::{CudaSlice, CudaStream};

pub struct Gemm {
    blas: CudaBlas,
    out: CudaSlice<bf16>,
    t: usize,
    v: usize,
    d: usize,
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>, t: usize, v: usize, d: usize) -> lmhead::Result<Self> {
        let out = lmhead::testing::zeros::<bf16>(&stream, t * v, "cuBLAS logits")?;
        let blas = CudaBlas::new(stream).map_err(|e| lmhead::Error::Invalid(format!("cuBLAS: {e:?}")))?;
        Ok(Self { blas, out, t, v, d })
    }

    /// Column-major view: `C (v × t) = Wᵀ' (v × d) · h' (d × t)` with `W`, `h` row-major.
    pub fn run(&mut self, h: &CudaSlice<bf16>, w: &CudaSlice<bf16>) -> lmhead::Result<()> {
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: self.v as i32,
            n: self.t as i32,
            k: self.d as i32,
            alpha: bf16::ONE,
            lda: self.d as i32,
            ldb: self.d as i32,
            beta: bf16::ZERO,
            ldc: self.v as i32,
        };
        // SAFETY: `w` holds v·d, `h` t·d and `out` t·v bf16 (checked by construction and the
        // callers' shapes); the leading dimensions match those row-major layouts.
        unsafe { self.blas.gemm(cfg, w, h, &mut self.out) }.map_err(|e| lmhead::Error::Invalid(format!("cuBLAS gemm: {e:?}")))
    }
}
