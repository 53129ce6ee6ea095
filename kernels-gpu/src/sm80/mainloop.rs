//! The `mma.sync` tensor-core mainloop (`MmaSync`) under the kernels of `sm80/` (the forward in
//! `fwd.rs`, the backward bodies through `Sm80` in `mod.rs`): a multi-stage `cp.async` ring in shared memory, `ldmatrix` fragment loads and `mma.m16n8k16`
//! bf16 → f32.
//!
//! GEMM naming: `C[M, N] = Σ_K A · B`. For the logits kernels `T≙M, V≙N, D≙K`: A = `h` (K-major,
//! `[t][d]`), B = `W` (K-major, `[v][d]`). The backward GEMMs have N-major B (`[k][n]`) and, for
//! `dW`, an M-major A (`[k][m]`); `ldmatrix.trans` turns those into the same fragments.
//!
//! **Shared-memory layout.** Stage `s` holds the A tile then the B tile. A K-major tile is
//! `(rows, BK)` with rows of `BK/8` 16-byte chunks; an MN-major tile is `(BK, rows)` with rows of
//! `rows/8` chunks. Chunks are XOR-swizzled within each 128-byte period so that the eight row
//! addresses of one `ldmatrix` 8×8 matrix fall into eight different 16-byte bank groups:
//! `BK = 64`: chunk `c ^ (row & 7)`; `BK = 32` (two rows per 128 bytes): `c ^ ((row >> 1) & 3)`;
//! MN-major (rows of ≥ 128 bytes): `c ^ (row & 7)`.
//!
//! **Bounds.** A 16-byte chunk is loaded when its row is in range and its first element is
//! below the column bound; otherwise it is zero-filled (`cp.async` with source size 0). Rows of
//! `h` and `W` are whole chunks (`d % 8 == 0`); the backward staging buffer has its padding
//! columns written as zeros, so a chunk that straddles its column bound reads zeros.

use crate::epilogue::Acc;
use crate::intrinsics::{self, SmemAddr};

/// One operand in global memory: bf16 elements, `stride` elements between its rows. Its rows
/// are M (or N) for a K-major operand and K for an MN-major one.
#[derive(Clone, Copy)]
pub struct Operand {
    pub ptr: *const u16,
    pub stride: u64,
    /// Exclusive bound of the M (or N) index.
    pub mn_bound: u32,
    /// Exclusive bound of the K index.
    pub k_bound: u32,
}

/// 16-byte chunk index of (row, chunk) in a K-major tile with `BK` columns.
#[inline(always)]
pub fn swz_k<const BK: usize>(row: u32, chunk: u32) -> u32 {
    if BK == 64 {
        row * 8 + (chunk ^ (row & 7))
    } else {
        row * 4 + (chunk ^ ((row >> 1) & 3))
    }
}

/// 16-byte chunk index of (row, chunk) in an MN-major tile with `R` columns (R ≥ 64).
#[inline(always)]
pub fn swz_mn<const R: usize>(row: u32, chunk: u32) -> u32 {
    row * (R as u32 / 8) + (chunk ^ (row & 7))
}

/// Issue the `cp.async` loads of one `R`-row tile of `op` (R = BM or BN) at `(r0, k0)` into
/// `smem`.
///
/// # Safety
/// Called by all `threads` threads of the block (a compile-time constant after inlining) with
/// their own `tid`; `smem` must hold `R·BK` bf16; `op` must describe readable memory for every
/// in-bound row and chunk.
#[inline(always)]
pub unsafe fn load_tile<const R: usize, const BK: usize, const KMAJ: bool>(
    smem: SmemAddr,
    op: Operand,
    r0: u32,
    k0: u32,
    tid: u32,
    threads: usize,
) {
    let per_thread = R * BK / 8 / threads;
    unroll!(per_thread, |i| {
        let c = tid + (i * threads) as u32;
        let (grow, gcol, dst) = if KMAJ {
            let ch = (BK / 8) as u32;
            let (row, col) = (c / ch, c % ch);
            (r0 + row, k0 + col * 8, swz_k::<BK>(row, col))
        } else {
            let ch = (R / 8) as u32;
            let (row, col) = (c / ch, c % ch);
            // For an MN-major operand the global row is the K index.
            (k0 + row, r0 + col * 8, swz_mn::<R>(row, col))
        };
        let (row_ok, col_ok) = if KMAJ { (grow < op.mn_bound, gcol < op.k_bound) } else { (grow < op.k_bound, gcol < op.mn_bound) };
        let valid = row_ok && col_ok;
        let src = if valid { op.ptr.wrapping_add((grow as u64 * op.stride + gcol as u64) as usize) } else { op.ptr };
        // SAFETY: `dst` is inside this stage's tile (`c < R·BK/8` chunks); `src` is in bounds
        // when `valid` (checked above) and is never read otherwise.
        unsafe { intrinsics::cp_async_16(smem + dst * 16, src as *const u8, valid) };
    });
}

/// `cp.async.wait_group (ST − 2)`: the oldest stage in flight has landed.
#[inline(always)]
pub fn wait_oldest<const ST: usize>() {
    match ST {
        2 => intrinsics::cp_async_wait::<0>(),
        3 => intrinsics::cp_async_wait::<1>(),
        4 => intrinsics::cp_async_wait::<2>(),
        5 => intrinsics::cp_async_wait::<3>(),
        _ => intrinsics::cp_async_wait::<0>(),
    }
}

/// Multiply one stage: `acc += A_tile · B_tile` for this warp's `(MI·16) × (NI·8)` sub-tile at
/// `(wm0, wn0)` inside the block tile.
///
/// # Safety
/// Executed by all lanes of the warp together; `a_s`, `b_s` hold a loaded stage.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mma_stage<
    const BM: usize,
    const BN: usize,
    const BK: usize,
    const MI: usize,
    const NI: usize,
    const A_KMAJ: bool,
    const B_KMAJ: bool,
>(
    a_s: SmemAddr,
    b_s: SmemAddr,
    acc: &mut Acc<MI, NI>,
    wm0: u32,
    wn0: u32,
    lane: u32,
) {
    unroll!(BK / 16, |kk| {
        let kk = kk as u32;
        let mut af = [[0u32; 4]; MI];
        unroll!(MI, |mi| {
            let m_base = wm0 + (mi * 16) as u32;
            af[mi] = if A_KMAJ {
                let row = m_base + (lane & 15);
                let chunk = kk * 2 + (lane >> 4);
                // SAFETY: row < BM, chunk < BK/8: inside the A tile; the warp is converged.
                unsafe { intrinsics::ldmatrix_x4(a_s + swz_k::<BK>(row, chunk) * 16) }
            } else {
                let k = kk * 16 + (lane & 7) + ((lane >> 4) << 3);
                let chunk = m_base / 8 + ((lane >> 3) & 1);
                // SAFETY: k < BK, chunk < BM/8: inside the A tile; the warp is converged.
                unsafe { intrinsics::ldmatrix_x4_trans(a_s + swz_mn::<BM>(k, chunk) * 16) }
            };
        });
        let mut bf = [[0u32; 2]; NI];
        unroll!(NI / 2, |nj| {
            let n_base = wn0 + (nj * 16) as u32;
            let r = if B_KMAJ {
                let n = n_base + (lane & 7) + ((lane >> 4) << 3);
                let chunk = kk * 2 + ((lane >> 3) & 1);
                // SAFETY: n < BN, chunk < BK/8: inside the B tile; the warp is converged.
                unsafe { intrinsics::ldmatrix_x4(b_s + swz_k::<BK>(n, chunk) * 16) }
            } else {
                let k = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                let chunk = n_base / 8 + (lane >> 4);
                // SAFETY: k < BK, chunk < BN/8: inside the B tile; the warp is converged.
                unsafe { intrinsics::ldmatrix_x4_trans(b_s + swz_mn::<BN>(k, chunk) * 16) }
            };
            bf[2 * nj] = [r[0], r[1]];
            bf[2 * nj + 1] = [r[2], r[3]];
        });
        unroll!(MI, |mi| {
            unroll!(NI, |ni| {
                // SAFETY: the warp is converged (no divergent branch encloses the mainloop).
                unsafe { intrinsics::mma_bf16_16816(&mut acc[mi][ni], &af[mi], &bf[ni]) };
            });
        });
    });
}

/// The producer side of a `cp.async` ring: the (tile, k step) whose operands load next, into
/// which stage. Each `step` issues one stage's loads (while any remain; the loads run across tile
/// boundaries) and always commits a group, so that group counting stays uniform.
pub struct Producer<const ST: usize> {
    ring: SmemAddr,
    stage_bytes: u32,
    kt: u32,
    total: u32,
    issued: u32,
    tile: u32,
    k: u32,
    stage: u32,
}

impl<const ST: usize> Producer<ST> {
    #[inline(always)]
    pub fn new(ring: SmemAddr, stage_bytes: u32, n_tiles: u32, kt: u32) -> Self {
        Self { ring, stage_bytes, kt, total: n_tiles * kt, issued: 0, tile: 0, k: 0, stage: 0 }
    }

    /// Issue the next stage's loads through `load(stage_smem, tile, k)` and commit.
    #[inline(always)]
    pub fn step(&mut self, load: &mut impl FnMut(SmemAddr, u32, u32)) {
        if self.issued < self.total {
            load(self.ring + self.stage * self.stage_bytes, self.tile, self.k);
            self.issued += 1;
            self.k += 1;
            if self.k == self.kt {
                self.k = 0;
                self.tile += 1;
            }
        }
        intrinsics::cp_async_commit();
        self.stage = if self.stage + 1 == ST as u32 { 0 } else { self.stage + 1 };
    }
}

/// The pipelined K loop over `n_tiles` consecutive output tiles (the forward walks several vocab
/// tiles per block; the other kernels one). `load(stage_smem, tile, k0)` issues the loads of one
/// stage, `finish(tile, acc)` runs after the last K step of each tile and must leave `acc`
/// zeroed for the next one. Loads of the next tile overlap the epilogue of the current one.
///
/// # Safety
/// Called by all threads of the block with the same `n_tiles` and `kt` (it contains barriers);
/// `ring` must hold `ST` stages of `stage_bytes`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn pipeline<const ST: usize, A>(
    ring: SmemAddr,
    stage_bytes: u32,
    n_tiles: u32,
    kt: u32,
    acc: &mut A,
    mut load: impl FnMut(SmemAddr, u32, u32),
    mut compute: impl FnMut(SmemAddr, &mut A),
    mut finish: impl FnMut(u32, &mut A),
) {
    // Prologue: fill ST − 1 stages.
    let mut producer = Producer::<ST>::new(ring, stage_bytes, n_tiles, kt);
    for _ in 0..ST - 1 {
        producer.step(&mut load);
    }
    // Main loop: the consumer walks (tile, k); the producer runs ST − 1 stages ahead, across tile
    // boundaries. `finish` sits after the K loop (not inside it), so its loop-invariant address
    // arithmetic is not hoisted into registers that stay live through the mainloop.
    let mut stage = 0u32;
    let mut tile = 0u32;
    while tile < n_tiles {
        let mut k = 0u32;
        while k < kt {
            wait_oldest::<ST>();
            // SAFETY: every thread runs the same trip counts.
            unsafe { intrinsics::sync_threads() };
            // The stage loaded now was consumed in the previous iteration, which every warp has
            // finished (barrier above).
            producer.step(&mut load);

            compute(ring + stage * stage_bytes, acc);
            stage = if stage + 1 == ST as u32 { 0 } else { stage + 1 };
            k += 1;
        }
        finish(tile, acc);
        tile += 1;
    }
    // Drain (the last groups are empty) and make the ring reusable by the caller.
    intrinsics::cp_async_wait::<0>();
    // SAFETY: every thread reaches this point once.
    unsafe { intrinsics::sync_threads() };
}
