//! The active-row kernels: the compaction of the rows the loss reads into the workspace, so that
//! the dense kernels run on them alone, and the row maps that move rows and values between the
//! caller's buffers and the compact ones.
//!
//! - [`active_count`]: each block's active rows into `block_counts`, their sum into `count`; or,
//!   in [`FLAGS_WRITE`] mode, each row's activity as an f32 flag (tensor parallelism reduces the
//!   flags across ranks, then counts them in [`FLAGS_READ`] mode).
//! - [`active_place`]: the compact index list (slot → row) and the row → slot map, in row order
//!   (`lmhead_core::compact` models the order on the CPU), and the per-row values of the active
//!   rows gathered into their slots. No atomics: each slot is the block's offset (the sum of the
//!   earlier blocks' counts) plus the active rows before it in the block.
//! - [`copy_rows`]: rows of 16-byte chunks through a row map, one warp per row (the gather of `h`,
//!   the scatter of `dh`, zeros where the map says [`NO_SLOT`]).
//! - [`map_values`]: f32 values of up to three arrays through a row map (the forward's outputs,
//!   each array's fill where the map says [`NO_SLOT`]).
//!
//! The maps come from [`active_place`], but the row maps check every entry against the source's
//! length anyway, and the placement every slot against the list's: no buffer's contents can make
//! a kernel read or write out of bounds.
//!
//! Grids: `ceil(t / ROWS_PER_BLOCK)` blocks of [`THREADS`] threads for the first two; any grid of
//! `THREADS`-thread blocks for the row maps (they stride over the rows).

use crate::epilogue::labels::load_label;
use crate::intrinsics::{self, ballot, ld_shared_u32, shfl_xor, smem_base, st_shared_u32, sync_threads_divergent};
use lmhead_core::compact::{row_of, NO_SLOT, STEPS, THREADS};
use lmhead_core::params::{CompactParams, RowMapParams, FLAGS_READ, FLAGS_WRITE, LABELS_I64};

/// Warps per block.
const WARPS: u32 = THREADS / 32;

/// Whether row `row` is active (see [`CompactParams`]).
///
/// # Safety
/// `row < p.t`; the buffers `p` names hold `t` elements.
#[inline(always)]
unsafe fn is_active(p: &CompactParams, row: u32) -> bool {
    let r = row as usize;
    // SAFETY: row < t and every per-row buffer named holds t elements (caller).
    unsafe {
        if p.flags_mode == FLAGS_READ {
            return *(p.flags as *const f32).add(r) > 0.0;
        }
        if load_label(p.labels, p.label_kind, row) == p.ignore_index {
            return false;
        }
        if p.grad_logprob == 0 && p.grad_entropy == 0 {
            return true;
        }
        // A NaN gradient is not zero: such a row stays active and its NaN reaches dh and dW.
        (p.grad_logprob != 0 && *(p.grad_logprob as *const f32).add(r) != 0.0)
            || (p.grad_entropy != 0 && *(p.grad_entropy as *const f32).add(r) != 0.0)
    }
}

/// Row `k` of this thread in block `b`, when it is below `t`.
#[inline(always)]
fn row_below(p: &CompactParams, b: u32, k: u32, x: u32) -> Option<u32> {
    let r = row_of(b, k, x);
    if r < p.t as u64 {
        Some(r as u32)
    } else {
        None
    }
}

/// The sum of `x` over the warp (every lane gets it).
///
/// # Safety
/// All 32 lanes of the warp execute it.
#[inline(always)]
unsafe fn warp_sum(mut x: u32) -> u32 {
    let mut m = 16;
    while m > 0 {
        // SAFETY: the caller guarantees the whole warp; the shuffle moves the bits unchanged.
        x = x.wrapping_add(unsafe { shfl_xor(f32::from_bits(x), m) }.to_bits());
        m /= 2;
    }
    x
}

/// Count the active rows of this block into `block_counts[b]` and add them to `count`; in
/// [`FLAGS_WRITE`] mode write each row's flag instead.
///
/// # Safety
/// Grid `ceil(t / ROWS_PER_BLOCK)` blocks of [`THREADS`] threads with `4 · WARPS` bytes of
/// shared memory; the buffers of [`CompactParams`] as its docs say.
#[inline(always)]
pub unsafe fn active_count(p: &CompactParams) {
    let (b, x) = (intrinsics::block_idx_x(), intrinsics::thread_idx());
    let (warp, lane) = (x / 32, x % 32);
    if p.flags_mode == FLAGS_WRITE {
        for k in 0..STEPS {
            if let Some(r) = row_below(p, b, k, x) {
                // SAFETY: r < t; flags holds t floats (contract).
                unsafe { *(p.flags as *mut f32).add(r as usize) = if is_active(p, r) { 1.0 } else { 0.0 } };
            }
        }
        return;
    }
    let mut n = 0u32;
    for k in 0..STEPS {
        // SAFETY: the row is below t.
        let a = row_below(p, b, k, x).is_some_and(|r| unsafe { is_active(p, r) });
        // SAFETY: every lane of every warp runs each step (the loop bound is uniform).
        n += unsafe { ballot(a) }.count_ones();
    }
    let smem = smem_base();
    // SAFETY: the block has 4 · WARPS bytes of shared memory; `warp < WARPS`; every thread reaches
    // the barrier once.
    unsafe {
        if lane == 0 {
            st_shared_u32(smem + 4 * warp, n);
        }
        sync_threads_divergent();
        if x == 0 {
            let mut total = 0;
            for w in 0..WARPS {
                total += ld_shared_u32(smem + 4 * w);
            }
            *(p.block_counts as *mut u32).add(b as usize) = total;
            intrinsics::atomic_add(p.count as *mut u32, total);
        }
    }
}

/// Place this block's active rows: `idx[slot] = row`, `slot[row]` (or [`NO_SLOT`]), and the
/// gathers of [`CompactParams`] (`labels_out`, `values_out`) at each slot.
///
/// # Safety
/// As [`active_count`], with `4 · WARPS · (1 + STEPS)` bytes of shared memory, and
/// `block_counts` holding every block's count; `idx` and the gather outputs hold `n` elements
/// (slots from `n` on are not written: the row then maps to [`NO_SLOT`]).
#[inline(always)]
pub unsafe fn active_place(p: &CompactParams) {
    let (b, x) = (intrinsics::block_idx_x(), intrinsics::thread_idx());
    let (warp, lane) = (x / 32, x % 32);
    let smem = smem_base();
    // The block's offset: the earlier blocks' counts, summed over the block.
    let mut acc = 0u32;
    let mut i = x;
    while i < b {
        // SAFETY: i < b < the grid's block count = block_counts' length (contract).
        acc += unsafe { *(p.block_counts as *const u32).add(i as usize) };
        i += THREADS;
    }
    // SAFETY: every lane reaches the reduction; shared memory holds 4 · WARPS · (1 + STEPS)
    // bytes, of which the first WARPS words take the warps' sums; every thread reaches each
    // barrier once.
    let offset = unsafe {
        let s = warp_sum(acc);
        if lane == 0 {
            st_shared_u32(smem + 4 * warp, s);
        }
        sync_threads_divergent();
        let mut o = 0u32;
        for w in 0..WARPS {
            o += ld_shared_u32(smem + 4 * w);
        }
        o
    };
    // Each step's ballot per warp; the warps' counts go to shared memory after the sums.
    let counts = smem + 4 * WARPS;
    let mut masks = [0u32; STEPS as usize];
    unroll!(STEPS as usize, |k| {
        // SAFETY: the row is below t.
        let a = row_below(p, b, k as u32, x).is_some_and(|r| unsafe { is_active(p, r) });
        // SAFETY: every lane runs every step; the word is inside the shared memory above.
        unsafe {
            masks[k] = ballot(a);
            if lane == 0 {
                st_shared_u32(counts + 4 * (k as u32 * WARPS + warp), masks[k].count_ones());
            }
        }
    });
    // SAFETY: every thread reaches the barrier once.
    unsafe { sync_threads_divergent() };
    let mut base = offset;
    unroll!(STEPS as usize, |k| {
        let (mut before, mut total) = (0u32, 0u32);
        for w in 0..WARPS {
            // SAFETY: inside the shared memory written above (ordered by the barrier).
            let c = unsafe { ld_shared_u32(counts + 4 * (k as u32 * WARPS + w)) };
            total += c;
            if w < warp {
                before += c;
            }
        }
        if let Some(r) = row_below(p, b, k as u32, x) {
            let m = masks[k];
            // SAFETY: r < t; a row is placed only at a slot below n, the length of idx and of
            // the gather outputs (contract).
            unsafe {
                let s = base + before + (m & ((1u32 << lane) - 1)).count_ones();
                if (m >> lane) & 1 == 1 && s < p.n {
                    place_row(p, r, s);
                } else {
                    *(p.slot as *mut u32).add(r as usize) = NO_SLOT;
                }
            }
        }
        base += total;
    });
}

/// The writes of active row `r` at slot `s`.
///
/// # Safety
/// `r < t`, `s < n` (the gather outputs' length).
#[inline(always)]
unsafe fn place_row(p: &CompactParams, r: u32, s: u32) {
    let (r, s) = (r as usize, s as usize);
    // SAFETY: r < t, s < n; every buffer holds t (inputs, slot) or n (outputs) elements.
    unsafe {
        *(p.idx as *mut u32).add(s) = r as u32;
        *(p.slot as *mut u32).add(r) = s as u32;
        if p.labels_out != 0 {
            if p.label_kind == LABELS_I64 {
                *(p.labels_out as *mut i64).add(s) = *(p.labels as *const i64).add(r);
            } else {
                *(p.labels_out as *mut i32).add(s) = *(p.labels as *const i32).add(r);
            }
        }
        unroll!(4, |j| {
            if p.values_out[j] != 0 {
                *(p.values_out[j] as *mut f32).add(s) = *(p.values[j] as *const f32).add(r);
            }
        });
    }
}

/// `dst[i] = src[map[i]]` (rows of `row_chunks` chunks of `chunk_bytes`; zeros where `map[i]` is
/// [`NO_SLOT`]) for `i < n`, one warp per row.
///
/// # Safety
/// `THREADS`-thread blocks; `map` holds `n` entries; `src[0]` holds `src_rows` rows and `dst[0]`
/// `n` rows, both aligned to `chunk_bytes` (16 or 4; an entry at or above `src_rows` reads as
/// [`NO_SLOT`]).
#[inline(always)]
pub unsafe fn copy_rows(p: &RowMapParams) {
    if p.chunk_bytes != 16 {
        // SAFETY: the same contract, in 4-byte words.
        unsafe { copy_rows_words(p) };
        return;
    }
    let (x, chunks) = (intrinsics::thread_idx(), p.row_chunks as usize);
    let lane = (x % 32) as usize;
    let mut i = intrinsics::block_idx_x() * WARPS + x / 32;
    let stride = intrinsics::grid_dim_x() * WARPS;
    while i < p.n {
        // SAFETY: i < n (map's length); each chunk index is below `chunks`, inside row `i` of
        // `dst` and row `from < src_rows` of `src` (contract); every address is 16-byte aligned.
        unsafe {
            let from = *(p.map as *const u32).add(i as usize);
            let dst = (p.dst[0] as *mut u32).add(i as usize * chunks * 4);
            let mut c = lane;
            if from >= p.src_rows {
                while c < chunks {
                    intrinsics::st_global_v4_b32(dst.add(4 * c), [0; 4]);
                    c += 32;
                }
            } else {
                let src = (p.src[0] as *const u32).add(from as usize * chunks * 4);
                // Four chunks in flight per lane, then the tail.
                while c + 96 < chunks {
                    let mut v = [[0u32; 4]; 4];
                    unroll!(4, |u| {
                        v[u] = intrinsics::ld_global_v4_b32(src.add(4 * (c + 32 * u)));
                    });
                    unroll!(4, |u| {
                        intrinsics::st_global_v4_b32(dst.add(4 * (c + 32 * u)), v[u]);
                    });
                    c += 128;
                }
                while c < chunks {
                    intrinsics::st_global_v4_b32(dst.add(4 * c), intrinsics::ld_global_v4_b32(src.add(4 * c)));
                    c += 32;
                }
            }
        }
        i += stride;
    }
}

/// [`copy_rows`] in 4-byte words, for rows that are not 16-byte aligned (a caller's `dh` at an
/// 8-byte offset).
///
/// # Safety
/// As [`copy_rows`] with `chunk_bytes` 4.
#[inline(always)]
unsafe fn copy_rows_words(p: &RowMapParams) {
    let (x, words) = (intrinsics::thread_idx(), p.row_chunks as usize);
    let lane = (x % 32) as usize;
    let mut i = intrinsics::block_idx_x() * WARPS + x / 32;
    let stride = intrinsics::grid_dim_x() * WARPS;
    while i < p.n {
        // SAFETY: i < n; each word index is below `words`, inside row `i` of `dst` and row
        // `from < src_rows` of `src` (contract); the addresses are 4-byte aligned.
        unsafe {
            let from = *(p.map as *const u32).add(i as usize);
            let dst = (p.dst[0] as *mut u32).add(i as usize * words);
            let src = (p.src[0] as *const u32).add(from.min(p.src_rows) as usize * words);
            let mut c = lane;
            while c < words {
                *dst.add(c) = if from < p.src_rows { *src.add(c) } else { 0 };
                c += 32;
            }
        }
        i += stride;
    }
}

/// `dst[j][i] = src[j][map[i]]` (or `fill[j]` where `map[i]` is [`NO_SLOT`]) for `i < n` and each
/// `j < 3` with a non-zero `dst[j]`; one thread per row.
///
/// # Safety
/// `THREADS`-thread blocks; `map` holds `n` entries; each non-zero `dst[j]` holds `n` f32 and its
/// `src[j]` `src_rows` (an entry at or above `src_rows` reads as [`NO_SLOT`]).
#[inline(always)]
pub unsafe fn map_values(p: &RowMapParams) {
    let mut i = intrinsics::block_idx_x() * THREADS + intrinsics::thread_idx();
    let stride = intrinsics::grid_dim_x() * THREADS;
    while i < p.n {
        // SAFETY: i < n; `from` is read only below src_rows, inside every src (contract).
        unsafe {
            let from = *(p.map as *const u32).add(i as usize);
            unroll!(3, |j| {
                if p.dst[j] != 0 {
                    let v = if from >= p.src_rows { p.fill[j] } else { *(p.src[j] as *const f32).add(from as usize) };
                    *(p.dst[j] as *mut f32).add(i as usize) = v;
                }
            });
        }
        i += stride;
    }
}
