//! Tensor maps of the sm90 configs: each operand described as a 2-D bf16 (or, for `dh`'s
//! accumulator, f32) tensor with the 128-byte swizzle, encoded by the driver and copied,
//! stream-ordered, into a small device buffer that lives until the launch is queued.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use lmhead_core::config::TileConfig;

use crate::error::{Context as _, Error, Result};

/// A bf16 operand of a TMA config: `rows` rows of `cols` contiguous elements, `stride` elements
/// apart, loaded in boxes of 64 columns (one 128-byte swizzle span) × `box_rows` rows. K-major
/// operands have K along the columns (boxes 64 × the tile's rows); MN-major ones
/// (`TileConfig::mn`) have K along the rows and M or N along the columns (boxes 64 × 64, one per
/// 64-wide slab of the tile). `f32` marks `dh`'s accumulator, 32-column boxes.
#[derive(Clone, Copy, Debug)]
pub(super) struct TmaOperand {
    pub(super) ptr: u64,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) stride: usize,
    pub(super) box_rows: u32,
    pub(super) f32: bool,
}

impl TmaOperand {
    /// `[rows][k]` read K-major by tiles of `box_rows` rows.
    pub(super) fn k_major(ptr: u64, rows: usize, k: usize, stride: usize, box_rows: u16) -> Self {
        Self { ptr, rows, cols: k, stride, box_rows: box_rows.into(), f32: false }
    }

    /// `[k][mn]` read MN-major, 64 × 64 boxes.
    pub(super) fn mn_major(ptr: u64, k: usize, mn: usize, stride: usize) -> Self {
        Self { ptr, rows: k, cols: mn, stride, box_rows: 64, f32: false }
    }

    /// An f32 `[rows][cols]` accumulator written in 32 × 64 boxes (`dh`'s, `Store::Tma`).
    pub(super) fn f32_acc(ptr: u64, rows: usize, cols: usize, stride: usize) -> Self {
        Self { ptr, rows, cols, stride, box_rows: 64, f32: true }
    }
}

/// The tensor map of one operand: 2-D, bf16 (or f32), 128-byte swizzle (the layout the `wgmma`
/// descriptors read; boxes one swizzle span wide), out-of-bounds elements zero-filled (and
/// skipped by stores), 256-byte L2 promotion.
pub(super) fn encode_tmap(op: TmaOperand) -> Result<[u8; 128]> {
    let (elem, dtype) = if op.f32 {
        (4usize, sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32)
    } else {
        (2usize, sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    };
    if !op.ptr.is_multiple_of(16) || !(op.stride * elem).is_multiple_of(16) || op.stride < op.cols || op.rows == 0 || op.cols == 0 {
        return Err(Error::Config(format!("no tensor map for {op:?}: 16-byte aligned rows and base needed")));
    }
    if op.rows > u32::MAX as usize || op.cols > u32::MAX as usize || op.box_rows == 0 || op.box_rows > 256 {
        return Err(Error::Config(format!("no tensor map for {op:?}: dimensions out of range")));
    }
    let dims: [u64; 2] = [op.cols as u64, op.rows as u64];
    let strides: [u64; 1] = [(op.stride * elem) as u64];
    let boxes: [u32; 2] = [(128 / elem) as u32, op.box_rows];
    let elem_strides: [u32; 2] = [1, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer argument points to a live local array of the length the rank (2)
    // implies (`strides` has rank − 1 entries); `map` is writable, 64-byte aligned storage for
    // one CUtensorMap; the global address is only recorded here, not dereferenced.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            op.ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Config(format!("cuTensorMapEncodeTiled failed ({r:?}) for {op:?}")));
    }
    // SAFETY: the call succeeded, so it initialised the map (and `zeroed` covered it before).
    let map = unsafe { map.assume_init() };
    let mut bytes = [0u8; 128];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(map.opaque.iter()) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    Ok(bytes)
}

/// The tensor maps of a TMA launch (A, then B, then for a `tma_store` d-logits the staging
/// buffer, for a `tma_store` `dh` the f32 accumulator) in device memory, 128 bytes apart, stream-ordered before the kernel, and their device
/// address. Keep the returned buffer until the launch is queued: dropping it frees it on the same
/// stream, after the kernel.
pub(super) fn tma_maps(stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(CudaSlice<u8>, u64)> {
    let mut all = vec![0u8; 128 * ops.len()];
    for (slot, &op) in all.chunks_exact_mut(128).zip(ops) {
        slot.copy_from_slice(&encode_tmap(op)?);
    }
    let dev = stream.clone_htod(&all).during(|| "copying tensor maps to the device".to_string())?;
    let addr = dev.device_ptr(stream).0;
    if !addr.is_multiple_of(64) {
        return Err(Error::Config("tensor-map buffer is not 64-byte aligned".into()));
    }
    Ok((dev, addr))
}

/// [`tma_maps`] for a TMA `cfg`; for any other config no buffer and address 0 (the kernel's
/// `tmaps` parameter is then unused).
pub(super) fn tma_maps_for(cfg: TileConfig, stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(Option<CudaSlice<u8>>, u64)> {
    if !cfg.is_sm90() {
        return Ok((None, 0));
    }
    let (buf, addr) = tma_maps(stream, ops)?;
    Ok((Some(buf), addr))
}
