//! The forward's kept logits (`FwdOptions::keep_logits`): each finished logits tile's raw dot
//! products written, before the fold, into the kept buffer `[kept_rows][kept_stride]` f32 at the
//! caller's row of each row (a compacted launch maps its rows through `kept_map`). The backward
//! reads them back in `crate::kept` instead of recomputing the tile.
//!
//! Stores are `st.global.cs.v2.f32` straight from the `m16n8` fragments: the four lanes of a
//! quad write one 32-byte sector of a row, so every sector is written whole; `.cs` marks the
//! lines evict-first, so the gigabytes written do not push the operands out of L2.

use super::{Acc, WarpPos};
use crate::intrinsics;
use lmhead_core::params::LogitsParams;

/// No kept row.
const NONE: u32 = u32::MAX;

/// The caller's row of each of this thread's rows that the kept buffer holds (else `NONE`).
pub(crate) struct KeptRows<const MI: usize> {
    row: [[u32; 2]; MI],
}

impl<const MI: usize> KeptRows<MI> {
    /// No row kept (what a forward without the mode would hold; never read there).
    #[inline(always)]
    pub(crate) fn none() -> Self {
        Self { row: [[NONE; 2]; MI] }
    }
}

/// This thread's kept rows (`w.row(mi, h)` of the tile at `m0`).
///
/// # Safety
/// `p.kept_map` is 0 or holds `t` u32.
#[inline(always)]
pub(crate) unsafe fn kept_rows<const MI: usize>(p: &LogitsParams, w: &WarpPos, m0: u32) -> KeptRows<MI> {
    let mut k = KeptRows { row: [[NONE; 2]; MI] };
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

/// Write the raw logits of one finished tile (`acc`, columns `n0 + w.col(..)` of the local
/// vocab) of this thread's kept rows; columns at or past `kept_stride` are not written (those
/// past `v` and below the stride hold whatever the tile holds there, and are never read).
///
/// # Safety
/// `p.kept` holds `kept_rows · kept_stride` f32, 16-byte aligned; `kept_stride` even.
#[inline(always)]
pub(crate) unsafe fn store_kept<const MI: usize, const NI: usize>(
    p: &LogitsParams,
    w: &WarpPos,
    n0: u32,
    acc: &Acc<MI, NI>,
    k: &KeptRows<MI>,
) {
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = k.row[mi][h];
            if row != NONE {
                let base = (p.kept as *mut f32).wrapping_add(row as usize * p.kept_stride as usize);
                unroll!(NI, |ni| {
                    let c = n0 + w.col(ni, 0);
                    if (c as u64) < p.kept_stride {
                        // SAFETY: row < kept_rows and c + 1 < kept_stride (c and the stride are
                        // even): inside the buffer; 8-byte aligned for the same reason.
                        unsafe { intrinsics::st_global_cs_v2(base.add(c as usize), acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]) };
                    }
                });
            }
        });
    });
}
