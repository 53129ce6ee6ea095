//! The forward's kept logits (`FwdOptions::keep_logits`) in the format of
//! `lmhead_core::kept`: while `epilogue::fwd::fold_tile` folds a finished tile, the `_keep` entry
//! also forms, for each of this thread's kept rows, `q = 2^{y − g}` of its columns (fp16 pairs in
//! the accumulator layout), and writes the maximum `g` of each 32-column group (f32) and the
//! label's raw logit (f32), at the caller's row of each row (a compacted launch maps its rows
//! through `kept_map`). The backward reads them back in `crate::kept` instead of recomputing the
//! tile.
//!
//! `q` reuses the fold's own `2^{y − m}` (`m` the row state's maximum) times one `2^{m − g}` per
//! group, so the mode adds a multiply and half a conversion per logit to the fold, no `ex2`; the
//! fold's arithmetic, and so the log-probs and entropy, are those of the plain entry.
//!
//! Who writes `q`: on the Hopper mainloop with the caller's rows in order (no map), the warpgroup
//! hands each 64-column half tile to the tensor memory accelerator through swizzled shared-memory
//! boxes (`sm90::StoreBoxes`: four `stmatrix` per warp and one bulk copy, whole 128-byte lines),
//! so the warps that issue `wgmma` spend few instructions on it. Otherwise ([`KeptRows::direct`]:
//! the `mma.sync` mainloop, or a compacted launch whose rows scatter) each thread stores its own
//! pairs with `st.global.cs` (evict-first), one 4-byte pair per `m16n8` fragment row. The group
//! maxima are stored by the first lane of each quad either way.

use super::{Acc, WarpPos};
use crate::intrinsics::{self, max_nan};
use lmhead_core::kept::{label_plane, max_plane, GROUP};
use lmhead_core::params::LogitsParams;

/// No kept row.
const NONE: u32 = u32::MAX;

/// The caller's row of each of this thread's rows that the kept buffer holds (else `NONE`).
pub(crate) struct KeptRows<const MI: usize> {
    row: [[u32; 2]; MI],
    /// This thread stores its own `q` pairs ([`store_q`]); else the caller stores the tile's
    /// packed pairs, which `fold_tile` hands back, through shared memory.
    pub(crate) direct: bool,
}

impl<const MI: usize> KeptRows<MI> {
    /// No row kept (what a forward without the mode would hold; never read there).
    #[inline(always)]
    pub(crate) fn none() -> Self {
        Self { row: [[NONE; 2]; MI], direct: false }
    }
}

/// This thread's kept rows (`w.row(mi, h)` of the tile at `m0`); `direct`: this thread stores
/// its own `q` pairs.
///
/// # Safety
/// `p.kept_map` is 0 or holds `t` u32.
#[inline(always)]
pub(crate) unsafe fn kept_rows<const MI: usize>(p: &LogitsParams, w: &WarpPos, m0: u32, direct: bool) -> KeptRows<MI> {
    let mut k = KeptRows { row: [[NONE; 2]; MI], direct };
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.t {
                // SAFETY: row < t and the map holds t entries (caller).
                let caller = if p.kept_map != 0 { unsafe { *(p.kept_map as *const u32).add(row as usize) } } else { row };
                if caller < p.kept_rows {
                    k.row[mi][h] = caller;
                }
            }
        });
    });
    k
}

/// The maximum raw logit of each 32-column group of this warp's columns of the tile in row
/// `(mi, h)`: `[g]` for the n8 tiles `4g..4g + 4` (`g < NI / 4`; the rest unused; the four lanes
/// of a quad hold a row's 32 columns of a group, their maxima merged by shuffles).
/// NaN-propagating, as the fold's maximum; `tmax` takes this thread's own maximum of the row
/// (the fold's, from the same values).
///
/// # Safety
/// The whole warp calls this converged (shuffles).
#[inline(always)]
pub(crate) unsafe fn group_max<const MI: usize, const NI: usize>(acc: &Acc<MI, NI>, mi: usize, h: usize, tmax: &mut f32) -> [f32; 8] {
    const { assert!(GROUP == 32 && (NI == 4 || NI == 8), "a group is 4 n8 tiles of one warp") };
    let mut gm = [f32::NEG_INFINITY; 8];
    unroll!(NI / 4, |g| {
        let mut x = f32::NEG_INFINITY;
        unroll!(4, |j| {
            x = max_nan(max_nan(x, acc[mi][4 * g + j][2 * h]), acc[mi][4 * g + j][2 * h + 1]);
        });
        *tmax = max_nan(*tmax, x);
        unroll!(2, |i| {
            // SAFETY: the whole warp executes these shuffles (caller).
            x = max_nan(x, unsafe { intrinsics::shfl_xor(x, 1 << i) });
        });
        gm[g] = x;
    });
    gm
}

/// Write the packed fp16 pair `q` (columns `c, c + 1` of the local vocab) of kept row `(mi, h)`;
/// nothing at or past `kept_stride`.
///
/// # Safety
/// `p.kept` holds the planes of `kept_rows` rows of stride `kept_stride` (`lmhead_core::kept`),
/// 16-byte aligned; `c` even.
#[inline(always)]
pub(crate) unsafe fn store_q<const MI: usize>(p: &LogitsParams, k: &KeptRows<MI>, mi: usize, h: usize, c: u32, q: u32) {
    let row = k.row[mi][h];
    if row != NONE && (c as u64) < p.kept_stride {
        let idx = row as u64 * p.kept_stride + c as u64;
        // SAFETY: row < kept_rows and c + 1 < kept_stride (both even): inside the q plane,
        // 4-byte aligned.
        unsafe { intrinsics::st_global_cs_b32((p.kept as *mut u16).add(idx as usize) as *mut u32, q) };
    }
}

/// Write the maximum `g2` (scaled, `y` units) of the group that begins at column `c` of kept row
/// `(mi, h)`; nothing at or past `kept_stride`.
///
/// # Safety
/// As for [`store_q`]; `c` a multiple of `GROUP`.
#[inline(always)]
pub(crate) unsafe fn store_group_max<const MI: usize>(p: &LogitsParams, k: &KeptRows<MI>, mi: usize, h: usize, c: u32, g2: f32) {
    let row = k.row[mi][h];
    let s = p.kept_stride;
    if row != NONE && (c as u64) < s {
        let off = max_plane(p.kept_rows as u64, s) / 4 + row as u64 * (s / GROUP as u64) + c as u64 / GROUP as u64;
        // SAFETY: c / GROUP < s / GROUP (c < s, s a multiple of GROUP): inside the maxima.
        unsafe { *(p.kept as *mut f32).add(off as usize) = g2 };
    }
}

/// Write the label's raw logit `raw` of kept row `(mi, h)`.
///
/// # Safety
/// As for [`store_q`].
#[inline(always)]
pub(crate) unsafe fn store_label<const MI: usize>(p: &LogitsParams, k: &KeptRows<MI>, mi: usize, h: usize, raw: f32) {
    let row = k.row[mi][h];
    if row != NONE {
        let off = label_plane(p.kept_rows as u64, p.kept_stride) / 4 + row as u64;
        // SAFETY: row < kept_rows: inside the label plane.
        unsafe { *(p.kept as *mut f32).add(off as usize) = raw };
    }
}
