//! Tensor maps of the sm90 configs: each operand described as a 2-D bf16 (or, for `dh`'s
//! accumulator, f32) tensor with the 128-byte swizzle, encoded by the driver and copied,
//! stream-ordered, into a small device buffer the kernel reads.
//!
//! Eager launches copy their maps from a temporary host buffer into a device buffer freed on the
//! same stream after the kernel. A launch captured into a CUDA graph cannot: the graph replays
//! the copy from the host address it was captured with, and replays it long after that buffer is
//! gone. So a captured launch takes its maps from [`Arena`]: each distinct set of maps is written
//! once into pinned host memory that lives as long as the process, beside a device slot of the
//! same size, and the captured copy (pinned slot → device slot, the same bytes at every replay)
//! runs before the kernel. Sets are found by their bytes, so capturing the same launch again (a
//! graph re-recorded, another graph on the same buffers) reuses its slot; two graphs sharing a
//! slot may copy into it while the other's kernel reads it, which is harmless: every copy
//! writes the bytes the slot already holds.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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
/// buffer, for a `tma_store` `dh` the f32 accumulator, for a `_keep` forward the kept q plane)
/// in device memory, 128 bytes apart,
/// stream-ordered before the kernel, and their device address. Keep the returned buffer until the
/// launch is queued: dropping it frees it on the same stream, after the kernel. On a capturing
/// stream the maps come from the process's [`Arena`] instead (no buffer is returned).
pub(super) fn tma_maps(stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(Option<CudaSlice<u8>>, u64)> {
    let mut all = vec![0u8; 128 * ops.len()];
    for (slot, &op) in all.chunks_exact_mut(128).zip(ops) {
        slot.copy_from_slice(&encode_tmap(op)?);
    }
    if crate::capture::capturing(stream)? {
        return Ok((None, captured_maps(stream, &all)?));
    }
    let dev = stream.clone_htod(&all).during(|| "copying tensor maps to the device".to_string())?;
    let addr = dev.device_ptr(stream).0;
    if !addr.is_multiple_of(64) {
        return Err(Error::Config("tensor-map buffer is not 64-byte aligned".into()));
    }
    Ok((Some(dev), addr))
}

/// [`tma_maps`] for a TMA `cfg`; for any other config no buffer and address 0 (the kernel's
/// `tmaps` parameter is then unused).
pub(super) fn tma_maps_for(cfg: TileConfig, stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(Option<CudaSlice<u8>>, u64)> {
    if !cfg.is_sm90() {
        return Ok((None, 0));
    }
    tma_maps(stream, ops)
}

/// Bytes of pinned host memory (and of device memory beside it) the arena adds at a time: 8192
/// maps, a few hundred captured launches (a forward captures one, a backward three per vocab
/// chunk).
const CHUNK_BYTES: usize = 1 << 20;

/// One chunk of the arena: `CHUNK_BYTES` of pinned host memory and of device memory, the first
/// `used` bytes of both holding interned map sets.
struct Chunk {
    host: *mut u8,
    dev: u64,
    used: usize,
}

/// The interned tensor-map sets of one CUDA context (see the module docs): never freed, since a
/// graph that captured a copy from a slot may replay for as long as the process lives.
struct Arena {
    ctx: usize,
    chunks: Vec<Chunk>,
    /// A set's bytes → its chunk and offset.
    slots: HashMap<Vec<u8>, (usize, usize)>,
}

// SAFETY: the raw pointers name pinned host memory and device memory that the arena owns and
// never frees; they are read and written only under the `ARENAS` lock.
unsafe impl Send for Arena {}

static ARENAS: Mutex<Vec<Arena>> = Mutex::new(Vec::new());

impl Arena {
    /// The slot of `bytes` (pinned host address, device address), interned on first use. A new
    /// chunk is allocated in relaxed capture mode (the calls are "potentially unsafe" under a
    /// global-mode capture); nothing of it touches the capturing stream.
    fn slot(&mut self, bytes: &[u8]) -> Result<(*const u8, u64)> {
        if let Some(&(c, off)) = self.slots.get(bytes) {
            let chunk = &self.chunks[c];
            // SAFETY: `off + bytes.len()` is inside the chunk (checked when the slot was made).
            return Ok((unsafe { chunk.host.add(off) } as *const u8, chunk.dev + off as u64));
        }
        if bytes.len() > CHUNK_BYTES {
            return Err(Error::Config(format!("{} bytes of tensor maps for one launch", bytes.len())));
        }
        if self.chunks.last().is_none_or(|c| c.used + bytes.len() > CHUNK_BYTES) {
            let chunk = crate::capture::relaxed(|| {
                // SAFETY: plain allocations of CHUNK_BYTES in the current (bound) context; both
                // are owned by the arena from here on.
                let host = unsafe { cudarc::driver::result::malloc_host(CHUNK_BYTES, sys::CU_MEMHOSTALLOC_PORTABLE) }
                    .during(|| "allocating pinned memory for captured tensor maps".into())?;
                // SAFETY: as above.
                let dev = match unsafe { cudarc::driver::result::malloc_sync(CHUNK_BYTES) } {
                    Ok(d) => d,
                    Err(source) => {
                        // SAFETY: `host` was just allocated and is not used.
                        let _ = unsafe { cudarc::driver::result::free_host(host) };
                        return Err(Error::Driver { during: "allocating device memory for captured tensor maps".into(), source });
                    }
                };
                Ok(Chunk { host: host as *mut u8, dev, used: 0 })
            })?;
            self.chunks.push(chunk);
        }
        let c = self.chunks.len() - 1;
        let chunk = &mut self.chunks[c];
        let off = chunk.used;
        // SAFETY: `[off, off + len)` is inside the chunk's pinned allocation (checked above) and
        // not yet handed out, so nothing reads it; once written it never changes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), chunk.host.add(off), bytes.len()) };
        chunk.used += bytes.len();
        self.slots.insert(bytes.to_vec(), (c, off));
        // SAFETY: as above.
        Ok((unsafe { chunk.host.add(off) } as *const u8, chunk.dev + off as u64))
    }
}

/// The device address of `bytes` for a launch on the capturing `stream`: its arena slot, with
/// the copy from the pinned slot queued (captured) on `stream`.
fn captured_maps(stream: &Arc<CudaStream>, bytes: &[u8]) -> Result<u64> {
    stream.context().bind_to_thread().during(|| "binding the context".into())?;
    let ctx = stream.context().cu_ctx() as usize;
    let mut arenas = ARENAS.lock().unwrap();
    let i = match arenas.iter().position(|a| a.ctx == ctx) {
        Some(i) => i,
        None => {
            arenas.push(Arena { ctx, chunks: Vec::new(), slots: HashMap::new() });
            arenas.len() - 1
        }
    };
    let (host, dev) = arenas[i].slot(bytes)?;
    // SAFETY: `host` names `bytes.len()` bytes of pinned memory that never change or go away
    // (the arena's), `dev` as many bytes of the arena's device memory in the stream's context;
    // the copy is queued on `stream` (recorded into its graph), before the kernel that reads it.
    unsafe { cudarc::driver::result::memcpy_htod_async(dev, std::slice::from_raw_parts(host, bytes.len()), stream.cu_stream()) }
        .during(|| "copying captured tensor maps".into())?;
    Ok(dev)
}
