//! Launches of the active-row kernels (`kernels-gpu/src/compact.rs`): the count, the placement
//! (index list, row → slot map, per-row gathers), and the two row maps; and the zero fill of an
//! output no row of which is active.

use cudarc::driver::CudaStream;
use lmhead_core::compact::blocks;
use lmhead_core::config::fixed;
use lmhead_core::params::{CompactParams, RowMapParams, FLAGS_NONE, FLAGS_READ, FLAGS_WRITE};

use super::{launch, Dev, Labels};
use crate::device::Gpu;
use crate::error::{Context as _, Error, Result};

/// What decides whether a row of `[0, t)` is active: its label against `ignore_index` and, in the
/// backward, the upstream gradients (a row is active when one given gradient is non-zero).
#[derive(Clone, Copy)]
pub struct ActiveRows<'a, 'b> {
    pub t: usize,
    pub labels: &'b Labels<'a>,
    pub ignore_index: i64,
    pub grad_logprob: Option<&'b Dev<'a>>,
    pub grad_entropy: Option<&'b Dev<'a>>,
}

/// How the count treats the per-row flags (tensor parallelism: each rank writes its flags, the
/// group MAX-reduces them, then every rank counts the same rows).
#[derive(Clone, Copy)]
pub enum Flags<'a, 'b> {
    /// Count the rows as the labels and gradients say.
    None,
    /// Write each row's flag (f32 `[t]`, 1 or 0); nothing is counted.
    Write(&'b Dev<'a>),
    /// Count (and place) the rows whose flag is positive.
    Read(&'b Dev<'a>),
}

fn params(rows: &ActiveRows, flags: Flags) -> Result<CompactParams> {
    let t = rows.t;
    if t > u32::MAX as usize {
        return Err(Error::Config(format!("{t} rows: the active-row kernels index rows with 32 bits")));
    }
    let mut p = CompactParams {
        labels: rows.labels.dev.check_exact(t, rows.labels.elem())?,
        ignore_index: rows.ignore_index,
        t: t as u32,
        label_kind: rows.labels.kind,
        flags_mode: FLAGS_NONE,
        ..Default::default()
    };
    if let Some(g) = rows.grad_logprob {
        p.grad_logprob = g.check_exact(t, 4)?;
    }
    if let Some(g) = rows.grad_entropy {
        p.grad_entropy = g.check_exact(t, 4)?;
    }
    match flags {
        Flags::None => {}
        Flags::Write(f) => (p.flags, p.flags_mode) = (f.check(t, 4)?, FLAGS_WRITE),
        Flags::Read(f) => (p.flags, p.flags_mode) = (f.check(t, 4)?, FLAGS_READ),
    }
    Ok(p)
}

fn grid(t: usize) -> (u32, u32) {
    (blocks(t).max(1) as u32, 1)
}

/// The count: `block_counts[b]` for each block of [`lmhead_core::compact::ROWS_PER_BLOCK`] rows and their sum added to
/// `count[0]` (the caller zeroes it first); with [`Flags::Write`], the flags only.
pub fn active_count(gpu: &Gpu, stream: &CudaStream, rows: &ActiveRows, flags: Flags, block_counts: &Dev, count: &Dev) -> Result<()> {
    let mut p = params(rows, flags)?;
    if !matches!(flags, Flags::Write(_)) {
        p.block_counts = block_counts.check(blocks(rows.t), 4)?;
        p.count = count.check(1, 4)?;
    }
    let smem = 4 * (fixed::THREADS / 32);
    launch(gpu, stream, fixed::ACTIVE_COUNT, smem, grid(rows.t), fixed::THREADS, p)
}

/// What [`active_place`] gathers into the active rows' slots besides the index lists: their
/// labels (in the labels' width) and up to four f32 arrays `[t]` (`(source, destination [n])`).
#[derive(Default)]
pub struct Gathers<'a, 'b> {
    pub labels: Option<&'b Dev<'a>>,
    pub values: Vec<(&'b Dev<'a>, &'b Dev<'a>)>,
}

/// A row map written by [`active_place`]: `n` entries, each a row below `rows` or
/// [`lmhead_core::compact::NO_SLOT`].
pub struct RowMap<'a, 'b> {
    map: &'b Dev<'a>,
    n: usize,
    rows: usize,
}

impl RowMap<'_, '_> {
    /// Entries (destination rows).
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// The placement of the `n` active rows (as counted with the same `rows` and `flags`, into
/// `block_counts`): `idx [n]` (slot → row, in row order), `slot [t]` (row → slot), and the
/// gathers. Returns the two maps: `idx` (gathers rows of `t` into `n`) and `slot` (scatters `n`
/// slots back into `t` rows).
pub fn active_place<'a, 'b>(
    gpu: &Gpu,
    stream: &CudaStream,
    (rows, flags): (&ActiveRows, Flags),
    block_counts: &Dev,
    n: usize,
    (idx, slot): (&'b Dev<'a>, &'b Dev<'a>),
    gathers: &Gathers,
) -> Result<(RowMap<'a, 'b>, RowMap<'a, 'b>)> {
    let t = rows.t;
    if n > t {
        return Err(Error::Config(format!("{n} active rows of {t}")));
    }
    let mut p = params(rows, flags)?;
    p.n = n as u32;
    p.block_counts = block_counts.check(blocks(t), 4)?;
    p.idx = idx.check(n, 4)?;
    p.slot = slot.check(t, 4)?;
    if let Some(l) = gathers.labels {
        p.labels_out = l.check(n, rows.labels.elem())?;
    }
    if gathers.values.len() > p.values.len() {
        return Err(Error::Config(format!("{} gathered arrays, at most {}", gathers.values.len(), p.values.len())));
    }
    for (j, (src, dst)) in gathers.values.iter().enumerate() {
        p.values[j] = src.check_exact(t, 4)?;
        p.values_out[j] = dst.check(n, 4)?;
    }
    let smem = 4 * (fixed::THREADS / 32) * (1 + lmhead_core::compact::STEPS);
    launch(gpu, stream, fixed::ACTIVE_PLACE, smem, grid(t), fixed::THREADS, p)?;
    Ok((RowMap { map: idx, n, rows: t }, RowMap { map: slot, n: t, rows: n }))
}

/// Blocks of a row map over `n` rows: enough for a few waves, at least one.
fn map_blocks(gpu: &Gpu, rows_per_block: usize, n: usize) -> u32 {
    let cap = gpu.info().sm_count as usize * 16;
    n.div_ceil(rows_per_block).clamp(1, cap.max(1)) as u32
}

/// `dst[i] = src[map[i]]` for the map's `n` rows of `row_bytes` bytes (a multiple of 16), zeros
/// where the map has no slot: `src` holds the map's source rows, `dst` `n` rows (elements of
/// `elem` bytes). Moves 16-byte chunks where both are 16-byte aligned, else 4-byte words.
pub fn copy_rows(gpu: &Gpu, stream: &CudaStream, map: &RowMap, row_bytes: usize, src: &Dev, elem: usize, dst: &Dev) -> Result<()> {
    if !row_bytes.is_multiple_of(16) || !row_bytes.is_multiple_of(elem) || row_bytes / 4 > u32::MAX as usize {
        return Err(Error::Config(format!("rows of {row_bytes} bytes: the row copy moves whole 16-byte chunks")));
    }
    let per = row_bytes / elem;
    let chunk = if src.ptr.is_multiple_of(16) && dst.ptr.is_multiple_of(16) { 16 } else { 4 };
    let p = RowMapParams {
        map: map.map.check(map.n, 4)?,
        src: [src.check(map.rows * per, chunk)?, 0, 0],
        dst: [dst.check(map.n * per, chunk)?, 0, 0],
        n: map.n as u32,
        row_chunks: (row_bytes / chunk) as u32,
        src_rows: map.rows as u32,
        chunk_bytes: chunk as u32,
        ..Default::default()
    };
    let warps = (fixed::THREADS / 32) as usize;
    launch(gpu, stream, fixed::COPY_ROWS, 0, (map_blocks(gpu, warps, map.n), 1), fixed::THREADS, p)
}

/// For each `(src, dst, fill)`: `dst[i] = src[map[i]]` (f32) for the map's `n` rows, `fill`
/// where the map has no slot (at most three arrays; each `src` holds the map's source rows, each
/// `dst` exactly `n`: the caller's outputs).
pub fn map_values(gpu: &Gpu, stream: &CudaStream, map: &RowMap, arrays: &[(&Dev, &Dev, f32)]) -> Result<()> {
    let mut p = RowMapParams { map: map.map.check(map.n, 4)?, n: map.n as u32, src_rows: map.rows as u32, ..Default::default() };
    if arrays.len() > p.dst.len() {
        return Err(Error::Config(format!("{} mapped arrays, at most {}", arrays.len(), p.dst.len())));
    }
    for (j, &(src, dst, fill)) in arrays.iter().enumerate() {
        p.src[j] = src.check(map.rows, 4)?;
        p.dst[j] = dst.check_exact(map.n, 4)?;
        p.fill[j] = fill;
    }
    launch(gpu, stream, fixed::MAP_VALUES, 0, (map_blocks(gpu, fixed::THREADS as usize, map.n), 1), fixed::THREADS, p)
}

/// Zeroes the first `n` elements of `elem` bytes of `buf` (a caller's output no row of which is
/// active), stream-ordered (`cuMemsetD8Async`: capturable in a CUDA graph).
pub fn zero_fill(stream: &CudaStream, buf: &Dev, n: usize, elem: usize) -> Result<()> {
    buf.check(n, 1)?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: `buf` is a live device buffer of the stream's context holding at least `n`
    // elements of `elem` bytes (checked above), ordered on `stream` by its `Dev` guard; zero
    // bytes are a valid f32, bf16 and integer.
    unsafe { cudarc::driver::result::memset_d8_async(buf.ptr, 0, n * elem, stream.cu_stream()) }.during(|| format!("zeroing {}", buf.what))
}

/// Sets the first `n` f32 of `buf` to `value`, stream-ordered (`cuMemsetD32Async`).
pub fn fill_f32(stream: &CudaStream, buf: &Dev, n: usize, value: f32) -> Result<()> {
    buf.check(n, 4)?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: `buf` is a live, 4-byte aligned device buffer of the stream's context holding at
    // least `n` f32 (checked above), ordered on `stream` by its `Dev` guard.
    unsafe { cudarc::driver::sys::cuMemsetD32Async(buf.ptr, value.to_bits(), n, stream.cu_stream()) }
        .result()
        .during(|| format!("filling {}", buf.what))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_grid_covers_every_row() {
        for t in [0usize, 1, 2047, 2048, 2049, 1 << 20] {
            let (b, _) = super::grid(t);
            assert!(b as usize * lmhead_core::compact::ROWS_PER_BLOCK as usize >= t && b >= 1, "{t}");
        }
    }
}
