//! Kernel parameter structs: the device ABI. Each kernel takes one of these by value; the host
//! fills it in `host/src/launch/`. Pointers are raw device addresses (`u64`), lengths and
//! strides are in elements. Changing a field here changes both sides at once; a host test checks
//! `size_of`/`align_of` so that an accidental change is noticed.
//!
//! Conventions: `t` tokens (rows of `h`), `v` vocab rows of the local `W` shard, `d` hidden size.
//! Token labels are global vocab ids; the local shard holds `[v_begin, v_begin + v)`.

/// Labels are `i32` (`LABELS_I32`) or `i64` (`LABELS_I64`) in device memory.
pub const LABELS_I32: u32 = 0;
pub const LABELS_I64: u32 = 1;

/// One forward partial: the `(m, s, t)` state of a (row, vocab split) in base-2 units and the
/// label's logit (natural units, 0 when the label is not in the split). Layout `[split][row]`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Partial {
    pub m: f32,
    pub s: f32,
    pub t: f32,
    pub z_label: f32,
}

/// Parameters of the logits mainloop kernels (forward and backward d-logits).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogitsParams {
    /// `h`: bf16 `[t, d]`, row stride `h_row_stride`.
    pub h: u64,
    /// `W` shard: bf16 `[v, d]`, row stride `w_row_stride`.
    pub w: u64,
    /// Labels `[t]`, `i32` or `i64` (`label_kind`).
    pub labels: u64,
    /// Forward: `Partial [n_splits][t]`. Backward: unused.
    pub partials: u64,
    /// Backward: saved `lse [t]` (natural units, f32).
    pub lse: u64,
    /// Backward: upstream gradient of log-prob `[t]` (f32), 0 = absent.
    pub grad_logprob: u64,
    /// Backward: upstream gradient of entropy `[t]` (f32), used by the `Ent` family only.
    pub grad_entropy: u64,
    /// Backward: saved entropy `[t]` (f32), used by the `Ent` family only.
    pub entropy: u64,
    /// Backward: bf16 d-logits staging `[t, staging_stride]`, columns `[0, v_chunk)` of this chunk.
    pub staging: u64,
    pub h_row_stride: u64,
    pub w_row_stride: u64,
    pub staging_stride: u64,
    /// Global vocab id of local row 0 (tensor parallelism; 0 otherwise).
    pub v_begin: i64,
    pub ignore_index: i64,
    pub t: u32,
    pub v: u32,
    pub d: u32,
    pub label_kind: u32,
    /// Vocab tiles handled by one block (forward), so `n_splits = ceil(v_tiles / tiles_per_split)`.
    /// Hopper d-logits: consecutive chunk column tiles one block walks (0 is read as 1).
    pub tiles_per_split: u32,
    /// Backward: first local vocab row of this chunk, and the chunk's width.
    pub v_chunk_begin: u32,
    pub v_chunk: u32,
    /// Forward: token tiles per raster group (0 = plain order). Blocks are taken in launch
    /// order group by group, each group covering `raster_group` token tiles × every split, so
    /// that the blocks resident together share fewer distinct `h` rows (see `split`). Hopper
    /// d-logits: the same order over (token tiles × column groups of `tiles_per_split`).
    pub raster_group: u32,
    /// Hopper forward and d-logits: tiles cut from the end of every split (column group) into a
    /// filler block launched after the others, grid `y` doubled; 0 = none
    /// ([`crate::split::block_work`]). The forward's filler of split `s` writes partial slot
    /// `n_splits + s`.
    pub fill: u32,
    pub _pad: u32,
    /// `1 / temperature`.
    pub inv_temp: f32,
    /// `log2(e) / temperature`.
    pub scale2: f32,
    /// TMA configs: device address of two tensor maps (A = `h`, then B = `W`; 128 bytes each,
    /// 64-byte aligned) the host encoded for this launch. 0 otherwise.
    pub tmaps: u64,
    /// Kept logits (`FwdOptions::keep_logits`) of the rows `< kept_rows` (rows of the caller's
    /// call: a compacted call maps its rows through `kept_map`), in the planes of
    /// [`crate::kept`]. Written by the forward's `_keep` entries, read by `DLOGITS_KEPT`;
    /// 0 = none.
    pub kept: u64,
    /// u32 `[t]`: this launch's row → the caller's row (`kept`'s row), 0 = the identity.
    pub kept_map: u64,
    /// Row stride of `kept`'s planes in columns ([`crate::kept::stride`] of `v`).
    pub kept_stride: u64,
    /// Rows `kept` holds (caller's rows).
    pub kept_rows: u32,
    pub _pad2: u32,
}

/// Parameters of the backward GEMMs `C[m, n] (+)= Σ_k A · B`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GemmParams {
    /// A: bf16; `dh`: K-major `[m][k]`; `dW`: M-major `[k][m]`.
    pub a: u64,
    /// B: bf16, N-major `[k][n]`.
    pub b: u64,
    /// f32 accumulator `[m][n]` (row stride `c_stride`): read when `accumulate`, written when
    /// `write_acc`. 0 when neither.
    pub c_acc: u64,
    /// Output `[m][n]` (row stride `c_stride`), bf16 or f32 (`out_f32`); 0 = not written.
    pub c_out: u64,
    pub a_stride: u64,
    pub b_stride: u64,
    pub c_stride: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub accumulate: u32,
    pub write_acc: u32,
    pub out_f32: u32,
    /// TMA configs: device address of two tensor maps (A, then B; 128 bytes each, 64-byte
    /// aligned) of the K-major operands. 0 otherwise.
    pub tmaps: u64,
    /// Hopper GEMMs: launch order ([`crate::split::raster`] over `(m tiles, n groups)`): groups
    /// of `raster_group` m tiles × every n group; 0 = plain (`x` = m tile).
    pub raster_group: u32,
    /// Hopper GEMMs: consecutive n tiles one block walks (its pipeline runs on from one tile
    /// into the next, hiding the fill and the epilogue); grid `y` = `ceil(n tiles / this)`.
    /// 0 is read as 1. The `cp.async` GEMMs take one tile per block and ignore it.
    pub tiles_per_block: u32,
    /// Hopper GEMMs: tiles cut from the end of every n group into a filler block launched after
    /// the others, grid `y` doubled; 0 = none ([`crate::split::block_work`]).
    pub fill: u32,
    pub _pad: u32,
}

/// Parameters of the forward merge kernels (`FWD_MERGE`, `FWD_ROW_STATE`, `FWD_FINISH`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    /// `Partial [n_splits][t]` from the mainloop.
    pub partials: u64,
    /// Row states `Partial [t]` (tensor-parallel path: written by `FWD_ROW_STATE`, read by `FWD_FINISH`).
    pub row_state: u64,
    pub labels: u64,
    /// Outputs, f32 `[t]`; `entropy` may be 0 (not requested).
    pub logprob: u64,
    pub entropy: u64,
    pub lse: u64,
    /// u32 flags word: bit 0 is set when some label was neither in `[0, v_total)` nor ignore_index.
    pub status: u64,
    pub ignore_index: i64,
    /// Global vocab size (for label validation) and the shard's first id.
    pub v_total: i64,
    pub v_begin: i64,
    pub t: u32,
    pub n_splits: u32,
    pub label_kind: u32,
    pub _pad: u32,
}

/// Parameters of `CAST_F32_BF16`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CastParams {
    pub src: u64,
    pub dst: u64,
    pub n: u64,
}

/// Parameters of the naive forward (`NAIVE_FWD`): one block per token.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NaiveParams {
    pub h: u64,
    pub w: u64,
    pub labels: u64,
    pub logprob: u64,
    pub entropy: u64,
    pub lse: u64,
    pub ignore_index: i64,
    pub t: u32,
    pub v: u32,
    pub d: u32,
    pub label_kind: u32,
    pub inv_temp: f32,
    pub _pad: u32,
}

/// Parameters of the unit kernels (`fixed::UNIT_*`), which check single instructions of the
/// Hopper mainloop against the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UnitParams {
    /// Tensor maps in device memory: A (and, for the `wgmma` units, B after it), 128 bytes each.
    pub tmaps: u64,
    /// Output: the copied box's bytes (TMA unit) or f32 `[64][n]` (wgmma units).
    pub out: u64,
    /// Box coordinates of the TMA unit: K element and row.
    pub k0: u32,
    pub row0: u32,
    /// Rows of the TMA unit's box.
    pub rows: u32,
    pub _pad: u32,
}

/// Bits of the status word.
pub const STATUS_BAD_LABEL: u32 = 1;

/// Parameters of the active-row kernels (`fixed::ACTIVE_COUNT`, `fixed::ACTIVE_PLACE`; see
/// [`crate::compact`]). A row `r < t` is active when `flags_mode` is [`FLAGS_READ`] and
/// `flags[r] > 0`, else when its label is not `ignore_index` and, where either upstream gradient
/// is given (non-zero address), at least one given gradient is non-zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompactParams {
    /// Labels `[t]`, `i32` or `i64` (`label_kind`).
    pub labels: u64,
    /// Upstream gradients `[t]` (f32), 0 = not given.
    pub grad_logprob: u64,
    pub grad_entropy: u64,
    /// f32 `[t]`: written (1 active, 0 not) by `ACTIVE_COUNT` in [`FLAGS_WRITE`] mode, read in
    /// [`FLAGS_READ`] mode (tensor parallelism: MAX-reduced across the ranks in between).
    pub flags: u64,
    /// u32 `[ceil(t / ROWS_PER_BLOCK)]`: each block's active rows (`ACTIVE_COUNT` writes,
    /// `ACTIVE_PLACE` reads).
    pub block_counts: u64,
    /// u32: the total count, added to by `ACTIVE_COUNT` (the host zeroes it first).
    pub count: u64,
    /// u32 `[n]`: compact slot → row (`ACTIVE_PLACE`).
    pub idx: u64,
    /// u32 `[t]`: row → compact slot, `u32::MAX` for an inactive row (`ACTIVE_PLACE`).
    pub slot: u64,
    /// Labels `[n]` of the active rows, in `label_kind` (`ACTIVE_PLACE`; 0 = not gathered).
    pub labels_out: u64,
    /// f32 `[t]` values gathered into `values_out[i]` `[n]` by `ACTIVE_PLACE` (0 = none).
    pub values: [u64; 4],
    pub values_out: [u64; 4],
    pub ignore_index: i64,
    pub t: u32,
    pub label_kind: u32,
    /// [`FLAGS_NONE`], [`FLAGS_WRITE`] or [`FLAGS_READ`].
    pub flags_mode: u32,
    /// `ACTIVE_PLACE`: the length of `idx` and of the gather outputs (the count the host read);
    /// a slot at or above it is not written (only a concurrent write to the labels or gradients
    /// between the two kernels could make more rows active).
    pub n: u32,
}

/// `CompactParams::flags_mode`: activity from the labels and gradients, counted.
pub const FLAGS_NONE: u32 = 0;
/// `CompactParams::flags_mode`: activity from the labels and gradients, written to `flags`
/// (nothing counted).
pub const FLAGS_WRITE: u32 = 1;
/// `CompactParams::flags_mode`: activity read from `flags`, counted.
pub const FLAGS_READ: u32 = 2;

/// Parameters of the row-map kernels (`fixed::COPY_ROWS`, `fixed::MAP_VALUES`): for every
/// destination row `i < n`, `dst[i] = src[map[i]]`, or `fill` where `map[i]` is `u32::MAX`.
/// `COPY_ROWS` moves rows of `row_chunks` chunks of `chunk_bytes` (16, or 4 for rows not
/// 16-byte aligned) from `src[0]` to `dst[0]`, zeros where there is no source row; `MAP_VALUES`
/// moves single f32 values of up to three arrays (`src[j]` → `dst[j]` with `fill[j]`; a zero
/// `dst[j]` is skipped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowMapParams {
    /// u32 `[n]`.
    pub map: u64,
    pub src: [u64; 3],
    pub dst: [u64; 3],
    pub fill: [f32; 3],
    pub n: u32,
    pub row_chunks: u32,
    /// Rows (`COPY_ROWS`) or values (`MAP_VALUES`) of each source: a map entry at or above it
    /// reads as [`crate::compact::NO_SLOT`].
    pub src_rows: u32,
    /// `COPY_ROWS`: 16 or 4.
    pub chunk_bytes: u32,
    pub _pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    /// The device reads these structs at fixed offsets; a size change must be deliberate.
    #[test]
    fn abi_sizes() {
        assert_eq!(size_of::<Partial>(), 16);
        assert_eq!(align_of::<Partial>(), 16);
        assert_eq!(size_of::<LogitsParams>(), 200);
        assert_eq!(align_of::<LogitsParams>(), 8);
        assert_eq!(size_of::<GemmParams>(), 104);
        assert_eq!(size_of::<MergeParams>(), 96);
        assert_eq!(size_of::<CastParams>(), 24);
        assert_eq!(size_of::<NaiveParams>(), 80);
        assert_eq!(size_of::<UnitParams>(), 32);
        assert_eq!(size_of::<CompactParams>(), 160);
        assert_eq!(size_of::<RowMapParams>(), 88);
    }
}
