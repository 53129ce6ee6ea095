//! The label helpers every pass shares: a row's label as stored (i32 or i64, [`load_label`]) and
//! its local column in this vocab shard ([`local_column`]). Read by both mainloops' forward and
//! d-logits epilogues, the merges, the active-row compaction and the naive forward.

use lmhead_core::params::{LogitsParams, LABELS_I64};

/// The label of row `row` (global vocab id, or `ignore_index`).
///
/// # Safety
/// `labels` holds more than `row` labels of kind `kind` ([`LABELS_I32`](lmhead_core::params::LABELS_I32)
/// or [`LABELS_I64`]).
#[inline(always)]
pub unsafe fn load_label(labels: u64, kind: u32, row: u32) -> i64 {
    // SAFETY: the caller guarantees `row` is inside `labels`.
    unsafe {
        if kind == LABELS_I64 {
            *(labels as *const i64).add(row as usize)
        } else {
            *(labels as *const i32).add(row as usize) as i64
        }
    }
}

/// Local column (in `[0, v)`) of `label`, or −1 when it is `ignore_index` or outside this shard.
#[inline(always)]
pub fn local_column(p: &LogitsParams, label: i64) -> i32 {
    let local = label.wrapping_sub(p.v_begin);
    if label == p.ignore_index || local < 0 || local >= p.v as i64 {
        -1
    } else {
        local as i32
    }
}
