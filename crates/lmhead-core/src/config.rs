//! Tile configurations and the candidate tables: one definition for the PTX build (which
//! instantiates exactly these entry points) and the host (which may choose only among them).
//!
//! A config is a value on the host and a set of const generics on the device. Each kernel family
//! has a named fallback config (no `Default`): its portable `mma.sync` config, which every device
//! runs. Which config a call runs is decided by the rules in [`crate::heuristics`].

/// The tuned kernel families. Each (family, config) pair is one PTX entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub enum Family {
    /// Forward mainloop, log-prob only: writes per-split `(m, s, t = 0, label logit)` partials.
    Fwd,
    /// Forward mainloop with the entropy sums.
    FwdEnt,
    /// Backward: recompute a logits chunk and write bf16 d-logits (log-prob gradient only).
    BwdDlogits,
    /// Backward d-logits with the entropy gradient term.
    BwdDlogitsEnt,
    /// Backward `dh (+)= dlogits · W_chunk` (A K-major, B N-major, f32 accumulator).
    BwdDh,
    /// Backward `dW_chunk = dlogitsᵀ · h` (A M-major, B N-major).
    BwdDw,
}

impl Family {
    pub const ALL: [Family; 6] = [Family::Fwd, Family::FwdEnt, Family::BwdDlogits, Family::BwdDlogitsEnt, Family::BwdDh, Family::BwdDw];

    /// The stem of the entry-point names of this family.
    pub const fn stem(self) -> &'static str {
        match self {
            Family::Fwd => "lm_head_fwd",
            Family::FwdEnt => "lm_head_fwd_ent",
            Family::BwdDlogits => "lm_head_bwd_dlogits",
            Family::BwdDlogitsEnt => "lm_head_bwd_dlogits_ent",
            Family::BwdDh => "lm_head_bwd_dh",
            Family::BwdDw => "lm_head_bwd_dw",
        }
    }

    /// Whether this family's tile dims are named after the LM head (`t`, `v`, `d`) or a GEMM
    /// (`m`, `n`, `k`) in entry names.
    pub const fn lm_dims(self) -> bool {
        matches!(self, Family::Fwd | Family::FwdEnt | Family::BwdDlogits | Family::BwdDlogitsEnt)
    }

    /// The candidates compiled for this family, known-good first; index 0 is the fallback.
    pub const fn candidates(self) -> &'static [TileConfig] {
        match self {
            Family::Fwd | Family::FwdEnt => FWD_CANDIDATES,
            Family::BwdDlogits | Family::BwdDlogitsEnt => LOGITS_CANDIDATES,
            Family::BwdDh => DH_CANDIDATES,
            Family::BwdDw => GEMM_CANDIDATES,
        }
    }

    /// Whether each candidate also has a `_keep` twin ([`keep_kernel_name`]): the forward's,
    /// which also store the logits tiles they fold (`FwdOptions::keep_logits`).
    pub const fn has_keep_twins(self) -> bool {
        matches!(self, Family::Fwd | Family::FwdEnt)
    }

    /// The family's portable config (index 0 of its candidates): what `Choice::Fallback` runs,
    /// and the rules' answer where nothing else fits the device.
    pub const fn fallback(self) -> TileConfig {
        self.candidates()[0]
    }
}

/// How a kernel computes its tiles: the axis of the tuning space besides the tile shape. Each
/// variant is a device module of its own (`kernels-gpu/src/sm80/`, `kernels-gpu/src/sm90/`),
/// and `kernels-gpu/build.rs` matches exhaustively on (family, mainloop), so only valid pairs
/// can be compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "std", serde(rename_all = "snake_case"))]
pub enum Mainloop {
    /// The portable mainloop: a block-wide `cp.async` ring, `ldmatrix` and `mma.sync.m16n8k16`
    /// (XOR-swizzled shared memory; K-major and MN-major operands). Runs on sm_80 and later.
    MmaSync,
    /// The Hopper (sm_90a) mainloop: a producer warpgroup loads 64-deep stages with the tensor
    /// memory accelerator into an mbarrier ring; two consumer warpgroups (128 rows) issue
    /// `wgmma`s and run the epilogue. The backward GEMMs read their operands as stored
    /// (MN-major where they are, with `wgmma`'s transpose bits).
    Sm90 {
        /// How the output tile leaves the consumers.
        store: Store,
    },
}

/// How an sm90 kernel's output tile is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "std", serde(rename_all = "snake_case"))]
pub enum Store {
    /// Straight from the accumulator fragments (4-byte stores, or the fold into row states).
    Registers,
    /// d-logits and `dh` only: each consumer warpgroup writes its tile into two shared-memory
    /// boxes with the 128-byte swizzle (after the ring, [`TMA_STORE_BYTES`] for the block), in
    /// turn, and the tensor memory accelerator writes each box out: the d-logits' bf16 tile
    /// (64 × 64 boxes, by `stmatrix`), `dh`'s f32 accumulator (64 × 32 boxes, stored for the
    /// first vocab chunk and added in place for the others).
    Tma,
}

impl Mainloop {
    pub const fn is_sm90(self) -> bool {
        matches!(self, Mainloop::Sm90 { .. })
    }

    pub const fn tma_store(self) -> bool {
        matches!(self, Mainloop::Sm90 { store: Store::Tma })
    }
}

/// One point of the tuning space. `T≙M, V≙N, D≙K` for the logits kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct TileConfig {
    /// Rows of the output tile (tokens for the logits kernels).
    pub bm: u16,
    /// Columns of the output tile (vocab for the logits kernels).
    pub bn: u16,
    /// Depth of one pipeline stage along the reduction dimension.
    pub bk: u16,
    /// Shared-memory pipeline stages.
    pub stages: u8,
    /// Warps along M (the consumer warps of an sm90 config: 4 per warpgroup).
    pub warps_m: u8,
    /// Warps along N.
    pub warps_n: u8,
    pub mainloop: Mainloop,
}

/// Shared memory of a `tma_store` config's output boxes: two 8 KiB boxes per consumer warpgroup
/// (64 × 64 bf16 for the d-logits, 64 × 32 f32 for `dh`). They start [`TMA_STORE_GAP`] bytes after the ring.
pub const TMA_STORE_BYTES: usize = 2 * 2 * 64 * 64 * 2;

/// Bytes between the end of a `tma_store` config's ring and its output boxes: the mbarriers
/// (`16 · stages` ≤ 128 bytes) sit there, and the boxes stay 1024-byte aligned as the 128-byte
/// swizzle needs.
pub const TMA_STORE_GAP: usize = 1024;

pub(crate) const fn tc(bm: u16, bn: u16, bk: u16, stages: u8, warps_m: u8, warps_n: u8) -> TileConfig {
    TileConfig { bm, bn, bk, stages, warps_m, warps_n, mainloop: Mainloop::MmaSync }
}

/// An sm90 config: two consumer warpgroups (128 rows) and the producer warpgroup, `bn` columns
/// (128 or 256), `stages` 64-deep stages.
pub(crate) const fn tw(bn: u16, stages: u8) -> TileConfig {
    TileConfig { bm: 128, bn, bk: 64, stages, warps_m: 8, warps_n: 1, mainloop: Mainloop::Sm90 { store: Store::Registers } }
}

/// An sm90 d-logits or `dh` config whose epilogue writes through shared memory by TMA.
pub(crate) const fn ts(bn: u16, stages: u8) -> TileConfig {
    TileConfig { mainloop: Mainloop::Sm90 { store: Store::Tma }, ..tw(bn, stages) }
}

/// Candidates of the forward: the `mma.sync` mainloop's and the sm90 mainloop's.
pub const FWD_CANDIDATES: &[TileConfig] = &[
    tc(128, 128, 32, 4, 2, 4),
    tc(128, 128, 64, 3, 2, 4),
    tc(128, 256, 32, 3, 2, 4),
    tc(256, 128, 32, 3, 4, 2),
    tc(64, 128, 64, 3, 2, 2),
    tc(128, 64, 64, 3, 2, 2),
    tc(64, 64, 64, 4, 2, 2),
    tw(256, 4),
    tw(128, 6),
    tw(256, 3),
];

/// Candidates of the backward d-logits mainloop.
pub const LOGITS_CANDIDATES: &[TileConfig] = &[
    tc(128, 128, 32, 4, 2, 4),
    tc(128, 128, 64, 3, 2, 4),
    tc(128, 256, 32, 3, 2, 4),
    tc(256, 128, 32, 3, 4, 2),
    tc(64, 128, 64, 3, 2, 2),
    tc(128, 64, 64, 3, 2, 2),
    tc(64, 64, 64, 4, 2, 2),
    tw(256, 4),
    tw(128, 6),
    tw(256, 3),
    ts(256, 4),
    ts(128, 6),
];

/// Candidates of the backward GEMMs (the sm90 ones read their operands in place).
pub const GEMM_CANDIDATES: &[TileConfig] = &GEMM_LIST;

const GEMM_LIST: [TileConfig; 9] = [
    tc(128, 128, 32, 4, 2, 4),
    tc(128, 256, 32, 3, 2, 4),
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 128, 64, 3, 2, 4),
    tc(64, 128, 32, 4, 2, 2),
    tc(64, 64, 64, 4, 2, 2),
    tw(256, 4),
    tw(128, 6),
    tw(256, 3),
];

/// Candidates of the backward `dh` GEMM: the GEMMs', then each sm90 one again with the f32
/// accumulator written through shared memory by TMA (stored, or added in place), in the same
/// order.
pub const DH_CANDIDATES: &[TileConfig] = &DH_LIST;

const DH_LIST: [TileConfig; 12] = with_tma_twins(GEMM_LIST);

/// `base`, then the `Store::Tma` twin of each of its sm90 configs; `M` must be `N` plus their
/// count (checked at compile time).
const fn with_tma_twins<const N: usize, const M: usize>(base: [TileConfig; N]) -> [TileConfig; M] {
    let mut out = [base[0]; M];
    let mut i = 0;
    while i < N {
        out[i] = base[i];
        i += 1;
    }
    let (mut j, mut k) = (0, N);
    while j < N {
        if base[j].mainloop.is_sm90() {
            out[k] = TileConfig { mainloop: Mainloop::Sm90 { store: Store::Tma }, ..base[j] };
            k += 1;
        }
        j += 1;
    }
    assert!(k == M, "M must be N plus the sm90 configs of base");
    out
}

/// The shared memory an H200 block may use at most (227 KiB).
pub const MAX_SMEM_PER_BLOCK: usize = 227 * 1024;

impl TileConfig {
    pub const fn warps(self) -> u32 {
        self.warps_m as u32 * self.warps_n as u32
    }

    /// Threads per block: the MMA warps, plus the producer warpgroup of an sm90 config.
    pub const fn threads(self) -> u32 {
        32 * self.warps() + if self.mainloop.is_sm90() { 128 } else { 0 }
    }

    pub const fn is_sm90(self) -> bool {
        self.mainloop.is_sm90()
    }

    /// Rows of one warp's tile.
    pub const fn warp_m(self) -> usize {
        self.bm as usize / self.warps_m as usize
    }

    /// Columns of one warp's tile.
    pub const fn warp_n(self) -> usize {
        self.bn as usize / self.warps_n as usize
    }

    /// Shared memory of the operand ring: `(bm + bn) · bk · stages` bf16 elements.
    pub const fn ring_bytes(self) -> usize {
        (self.bm as usize + self.bn as usize) * self.bk as usize * self.stages as usize * 2
    }

    /// Shared memory the forward's final cross-warp reduction needs: one `(m, s, t, z)` f32x4 per
    /// (warp along N, row).
    pub const fn reduce_bytes(self) -> usize {
        self.warps_n as usize * self.bm as usize * 16
    }

    /// Dynamic shared memory a launch of this config asks for (the ring is reused for the
    /// reduction after the mainloop; an sm90 config keeps its `2 · stages` mbarriers after the
    /// ring, and a TMA-store one its output boxes after those).
    pub const fn smem_bytes(self) -> usize {
        let a = match self.mainloop {
            Mainloop::Sm90 { store: Store::Tma } => self.ring_bytes() + TMA_STORE_GAP + TMA_STORE_BYTES,
            Mainloop::Sm90 { store: Store::Registers } => self.ring_bytes() + 16 * self.stages as usize,
            Mainloop::MmaSync => self.ring_bytes(),
        };
        let b = self.reduce_bytes();
        if a > b {
            a
        } else {
            b
        }
    }

    /// Dynamic shared memory a launch of this config's `_keep` twin asks for
    /// ([`Family::has_keep_twins`]): an sm90 forward's twin also has the output boxes of a
    /// `tma_store` config after its ring (the kept logits leave through them); an `mma.sync`
    /// one's stores from registers and asks for [`Self::smem_bytes`].
    pub const fn keep_smem_bytes(self) -> usize {
        match self.mainloop {
            Mainloop::Sm90 { .. } => TileConfig { mainloop: Mainloop::Sm90 { store: Store::Tma }, ..self }.smem_bytes(),
            Mainloop::MmaSync => self.smem_bytes(),
        }
    }

    /// The same tile with the register epilogue: a `tma_store` config's twin (itself for any
    /// other config). The host runs a `tma_store` `dh` on its twin where the TMA accumulator
    /// does not apply.
    pub const fn register_twin(self) -> TileConfig {
        match self.mainloop {
            Mainloop::Sm90 { store: Store::Tma } => TileConfig { mainloop: Mainloop::Sm90 { store: Store::Registers }, ..self },
            _ => self,
        }
    }

    /// Whether the const generics satisfy every structural rule of the device mainloop. The
    /// device asserts the same rules at compile time; this lets the host and the tests check the
    /// tables without building PTX.
    pub const fn is_well_formed(self) -> bool {
        if self.mainloop.is_sm90() {
            return self.bk == 64
                && self.warps_n == 1
                && self.warps_m == 8
                && self.bm == 128
                && (self.bn == 128 || self.bn == 256)
                && self.stages >= 2
                && self.stages <= 8
                && self.smem_bytes() <= MAX_SMEM_PER_BLOCK;
        }
        let (wm, wn) = (self.warp_m(), self.warp_n());
        self.warps_m > 0
            && self.warps_n > 0
            && (self.bm as usize).is_multiple_of(self.warps_m as usize)
            && (self.bn as usize).is_multiple_of(self.warps_n as usize)
            // Warp tiles are whole m16 and (pairs of) n8 MMA tiles.
            && wm % 16 == 0
            && wn % 16 == 0
            // ldmatrix reads 16-byte rows; the swizzle needs 32- or 64-element deep stages.
            && (self.bk == 32 || self.bk == 64)
            // Loads of the ring: every thread moves whole 16-byte chunks in each stage.
            && (self.bm as usize * self.bk as usize / 8).is_multiple_of(self.threads() as usize)
            && (self.bn as usize * self.bk as usize / 8).is_multiple_of(self.threads() as usize)
            // M-major operands: bm (bn) columns of 16-byte chunks spread evenly too.
            && self.bm.is_multiple_of(64)
            && self.bn.is_multiple_of(64)
            && self.stages >= 2
            && self.smem_bytes() <= MAX_SMEM_PER_BLOCK
    }

    /// The part of an entry name after the family stem, e.g. `t128_v128_d32_s4_w2x4`.
    #[cfg(feature = "std")]
    pub fn suffix(self, family: Family) -> std::string::String {
        let (m, n, k) = if family.lm_dims() { ("t", "v", "d") } else { ("m", "n", "k") };
        // The sm90 GEMMs read their operands in place (`_mn`); the names are part of the
        // tuning cache and the PTX boundary.
        let wg = match (self.mainloop, family) {
            (Mainloop::MmaSync, _) => "",
            (Mainloop::Sm90 { store: Store::Tma }, Family::BwdDh) => "_tma_mn_st",
            (Mainloop::Sm90 { store: Store::Tma }, _) => "_tma_st",
            (Mainloop::Sm90 { store: Store::Registers }, Family::BwdDh | Family::BwdDw) => "_tma_mn",
            (Mainloop::Sm90 { store: Store::Registers }, _) => "_tma",
        };
        std::format!("{m}{}_{n}{}_{k}{}_s{}_w{}x{}{wg}", self.bm, self.bn, self.bk, self.stages, self.warps_m, self.warps_n)
    }
}

/// The PTX entry name of `family` at `cfg`: the one function that names kernels, for the PTX
/// build and for the host.
#[cfg(feature = "std")]
pub fn kernel_name(family: Family, cfg: TileConfig) -> std::string::String {
    std::format!("{}_{}", family.stem(), cfg.suffix(family))
}

/// The PTX entry name of the `_keep` twin of `family` at `cfg` (a forward that also writes
/// the logits it folds into the kept buffer; [`Family::has_keep_twins`]).
#[cfg(feature = "std")]
pub fn keep_kernel_name(family: Family, cfg: TileConfig) -> std::string::String {
    std::format!("{}_keep", kernel_name(family, cfg))
}

/// Every tuned entry point (candidates and their `_keep` twins) with its config.
#[cfg(feature = "std")]
pub fn tuned_entries() -> std::vec::Vec<(std::string::String, TileConfig)> {
    let mut out = std::vec::Vec::new();
    for f in Family::ALL {
        for &c in f.candidates() {
            out.push((kernel_name(f, c), c));
            if f.has_keep_twins() {
                out.push((keep_kernel_name(f, c), c));
            }
        }
    }
    out
}

/// Dynamic shared memory of the tuned entry point `name` (a candidate's or its `_keep`
/// twin's), as the host launches it; `None` for any other name.
#[cfg(feature = "std")]
pub fn entry_smem_bytes(name: &str) -> Option<usize> {
    for f in Family::ALL {
        for &c in f.candidates() {
            if kernel_name(f, c) == name {
                return Some(c.smem_bytes());
            }
            if f.has_keep_twins() && keep_kernel_name(f, c) == name {
                return Some(c.keep_smem_bytes());
            }
        }
    }
    None
}

/// Entry points that are not tuned: their names and the threads per block they are built for.
pub mod fixed {
    /// Merges the per-split forward partials into lse, log-prob and entropy.
    pub const FWD_MERGE: &str = "lm_head_fwd_merge";
    /// Merges per-split partials into one `(m, s, t, z)` row state (tensor-parallel path).
    pub const FWD_ROW_STATE: &str = "lm_head_fwd_row_state";
    /// Moves row states to the all-reduced maximum (tensor-parallel path).
    pub const FWD_RESCALE: &str = "lm_head_fwd_rescale";
    /// Turns reduced row states into lse, log-prob and entropy (tensor-parallel path).
    pub const FWD_FINISH: &str = "lm_head_fwd_finish";
    /// Checks every label against `[0, v_total)` and `ignore_index` before a forward runs.
    pub const CHECK_LABELS: &str = "lm_head_check_labels";
    /// Writes a bf16 copy of an f32 buffer.
    pub const CAST_F32_BF16: &str = "lm_head_cast_f32_bf16";
    /// Level 00 of the ladder: one block per token, plain f32 dot products, no tensor cores.
    pub const NAIVE_FWD: &str = "lm_head_naive_fwd";
    /// Counts the active rows per block of [`crate::compact::ROWS_PER_BLOCK`] and in all (or
    /// writes their flags; [`crate::params::CompactParams`]).
    pub const ACTIVE_COUNT: &str = "lm_head_active_count";
    /// Writes the active rows' compact index list and row → slot map in row order, and gathers
    /// their per-row values.
    pub const ACTIVE_PLACE: &str = "lm_head_active_place";
    /// Copies rows of 16-byte chunks through a row map (the gather of `h`, the scatter of `dh`).
    pub const COPY_ROWS: &str = "lm_head_copy_rows";
    /// Copies f32 values of up to three arrays through a row map (the forward's outputs).
    pub const MAP_VALUES: &str = "lm_head_map_values";
    /// Unit kernel: one TMA box (the first tensor map of its params) copied to shared memory and
    /// written back byte for byte, so a test can check the 128-byte swizzle the mainloop assumes.
    pub const UNIT_TMA_COPY: &str = "lm_head_unit_tma_copy";
    /// Unit kernel: one warpgroup multiplies a 64 × 64 A tile by a 128-row B tile
    /// (`m64n128k16`) and writes the f32 accumulators in their documented positions.
    pub const UNIT_WGMMA_N128: &str = "lm_head_unit_wgmma_n128";
    /// Unit kernel: as `UNIT_WGMMA_N128` with a 256-row B tile (one `m64n256k16` per k16).
    pub const UNIT_WGMMA_N256: &str = "lm_head_unit_wgmma_n256";
    /// Unit kernel: as `UNIT_WGMMA_N128` with B stored MN-major (`imm-trans-b`), descriptor
    /// offsets from the params.
    pub const UNIT_WGMMA_MN_N128: &str = "lm_head_unit_wgmma_mn_n128";
    /// Unit kernel: one warpgroup stores two 64 × 64 tiles of known 16-bit patterns through the
    /// `tma_store` d-logits epilogue (`stmatrix` into 128B-swizzled boxes, TMA store), so a test
    /// can check the fragment layout, the swizzle and the clipping at the tensor's edges.
    pub const UNIT_TMA_STORE: &str = "lm_head_unit_tma_store";
    /// The backward d-logits of the kept rows of a vocab chunk, from the kept logits instead of
    /// a recomputed tile (log-prob gradient only): one block per (row, 2048 columns).
    pub const DLOGITS_KEPT: &str = "lm_head_dlogits_kept";
    /// As [`DLOGITS_KEPT`] with the entropy gradient term.
    pub const DLOGITS_KEPT_ENT: &str = "lm_head_dlogits_kept_ent";
    /// Threads per block of the fixed kernels (the unit kernels run one warpgroup of them).
    pub const THREADS: u32 = 256;
    /// The fixed entry points of the portable module ([`super::Module::Portable`]): all but the
    /// `Sm90` unit kernels (TMA, `wgmma`, `stmatrix`).
    pub const PORTABLE: [&str; 13] = [
        CHECK_LABELS,
        ACTIVE_COUNT,
        ACTIVE_PLACE,
        COPY_ROWS,
        MAP_VALUES,
        FWD_MERGE,
        FWD_ROW_STATE,
        FWD_RESCALE,
        FWD_FINISH,
        CAST_F32_BF16,
        NAIVE_FWD,
        DLOGITS_KEPT,
        DLOGITS_KEPT_ENT,
    ];
    /// The `Sm90` unit kernels, in the Hopper module only.
    pub const SM90_UNITS: [&str; 5] = [UNIT_TMA_COPY, UNIT_WGMMA_N128, UNIT_WGMMA_N256, UNIT_WGMMA_MN_N128, UNIT_TMA_STORE];
    /// All fixed entry points (the Hopper module's): [`PORTABLE`], then [`SM90_UNITS`].
    pub const ALL: [&str; 18] = concat(PORTABLE, SM90_UNITS);

    /// `a` then `b` (`C` must be `A + B`: checked when the constant is evaluated).
    const fn concat<const A: usize, const B: usize, const C: usize>(a: [&'static str; A], b: [&'static str; B]) -> [&'static str; C] {
        assert!(A + B == C, "the lists' lengths do not add up");
        let mut out = [""; C];
        let mut i = 0;
        while i < A {
            out[i] = a[i];
            i += 1;
        }
        while i < C {
            out[i] = b[i - A];
            i += 1;
        }
        out
    }
}

/// The embedded kernel modules, one per architecture the kernels are lowered and assembled for
/// (one rustc build, two `llc` lowerings; `lmhead-build`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "std", serde(rename_all = "snake_case"))]
pub enum Module {
    /// sm_90a (H100, H200, H20, GH200): every kernel, both mainloops. Its PTX uses the `a`
    /// features (`wgmma`, `setmaxnreg`), so it runs on compute capability 9.0 only.
    #[default]
    Hopper,
    /// sm_80: the `MmaSync` kernels and the fixed kernels but the `Sm90` units. Its cubin runs on
    /// every 8.x device (A100, A10, L4, L40S, RTX 30/40); its PTX is JIT-compiled by the driver
    /// on any later architecture (Blackwell 10.x and 12.x; 9.0 when a test forces it).
    Portable,
}

impl Module {
    pub const ALL: [Module; 2] = [Module::Hopper, Module::Portable];

    /// The `llc -mcpu` / `ptxas -arch` target.
    pub const fn arch(self) -> &'static str {
        match self {
            Module::Hopper => "sm_90a",
            Module::Portable => "sm_80",
        }
    }

    /// Its name in reports and in `LMHEAD_TEST_MODULE`.
    pub const fn name(self) -> &'static str {
        match self {
            Module::Hopper => "hopper",
            Module::Portable => "portable",
        }
    }

    /// The module a device of compute capability `cc` loads (`None`: below 8.0, unsupported).
    pub const fn for_device(cc: (i32, i32)) -> Option<Module> {
        match cc {
            (9, 0) => Some(Module::Hopper),
            (major, _) if major >= 8 => Some(Module::Portable),
            _ => None,
        }
    }

    /// Whether this module holds the kernels of `mainloop`.
    pub const fn holds(self, mainloop: Mainloop) -> bool {
        match self {
            Module::Hopper => true,
            Module::Portable => matches!(mainloop, Mainloop::MmaSync),
        }
    }

    /// The fixed entry points it holds.
    pub const fn fixed(self) -> &'static [&'static str] {
        match self {
            Module::Hopper => &fixed::ALL,
            Module::Portable => &fixed::PORTABLE,
        }
    }
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_candidate_is_well_formed_and_named_uniquely() {
        let mut names = HashSet::new();
        for f in Family::ALL {
            assert!(!f.candidates().is_empty());
            for &c in f.candidates() {
                assert!(c.is_well_formed(), "{f:?} {c:?}");
                assert!(names.insert(kernel_name(f, c)), "duplicate name {}", kernel_name(f, c));
                if f.has_keep_twins() {
                    assert!(names.insert(keep_kernel_name(f, c)));
                    // The twin's boxes fit beside the ring, 1024-byte aligned.
                    assert!(c.keep_smem_bytes() <= MAX_SMEM_PER_BLOCK, "{f:?} {c:?}: {} B", c.keep_smem_bytes());
                    assert!(c.ring_bytes() % 1024 == 0 || !c.is_sm90());
                    assert_eq!(entry_smem_bytes(&keep_kernel_name(f, c)), Some(c.keep_smem_bytes()));
                }
                assert_eq!(entry_smem_bytes(&kernel_name(f, c)), Some(c.smem_bytes()));
            }
        }
        for n in fixed::ALL {
            assert!(names.insert(n.into()));
        }
    }

    #[test]
    fn names_encode_the_config() {
        assert_eq!(kernel_name(Family::FwdEnt, tc(128, 128, 32, 4, 2, 4)), "lm_head_fwd_ent_t128_v128_d32_s4_w2x4");
        assert_eq!(kernel_name(Family::BwdDw, tc(64, 64, 64, 4, 2, 2)), "lm_head_bwd_dw_m64_n64_k64_s4_w2x2");
        assert_eq!(kernel_name(Family::Fwd, tw(256, 4)), "lm_head_fwd_t128_v256_d64_s4_w8x1_tma");
        assert_eq!(kernel_name(Family::BwdDh, tw(256, 4)), "lm_head_bwd_dh_m128_n256_k64_s4_w8x1_tma_mn");
        assert_eq!(kernel_name(Family::BwdDw, tw(256, 4)), "lm_head_bwd_dw_m128_n256_k64_s4_w8x1_tma_mn");
        assert_eq!(kernel_name(Family::BwdDlogitsEnt, ts(256, 4)), "lm_head_bwd_dlogits_ent_t128_v256_d64_s4_w8x1_tma_st");
        assert_eq!(kernel_name(Family::BwdDh, ts(256, 4)), "lm_head_bwd_dh_m128_n256_k64_s4_w8x1_tma_mn_st");
        assert_eq!(&DH_CANDIDATES[..9], GEMM_CANDIDATES);
        assert_eq!(&DH_CANDIDATES[9..], &[ts(256, 4), ts(128, 6), ts(256, 3)]);
    }

    #[test]
    fn tma_store_is_a_dlogits_and_dh_option_that_fits_beside_the_ring() {
        for c in [ts(256, 4), ts(128, 6), ts(256, 3)] {
            assert!(c.is_well_formed(), "{c:?}");
            assert_eq!(c.smem_bytes(), c.ring_bytes() + TMA_STORE_GAP + TMA_STORE_BYTES, "ring, barriers in the gap, then the boxes");
            assert!(16 * c.stages as usize <= TMA_STORE_GAP && TMA_STORE_GAP.is_multiple_of(1024));
            assert!(c.ring_bytes() % 1024 == 0, "the boxes must start 1024-byte aligned");
        }
        for f in Family::ALL {
            let has = f.candidates().iter().any(|c| c.mainloop.tma_store());
            assert_eq!(has, matches!(f, Family::BwdDlogits | Family::BwdDlogitsEnt | Family::BwdDh), "{f:?}: only the d-logits and dh");
        }
        // A `tma_store` dh config falls back to its register twin (same tile, same candidates
        // list) when the accumulator is not 16-byte aligned (`host/src/launch/tiles.rs`).
        for &c in Family::BwdDh.candidates().iter().filter(|c| c.mainloop.tma_store()) {
            assert!(Family::BwdDh.candidates().contains(&c.register_twin()), "{c:?}");
            assert!(Family::BwdDw.candidates().contains(&c.register_twin()), "{c:?}");
        }
    }

    #[test]
    fn sm90_configs_add_a_producer_warpgroup_and_their_barriers() {
        let c = tw(256, 4);
        assert!(c.is_well_formed());
        assert_eq!(c.threads(), 384, "two consumer warpgroups and one producer");
        assert_eq!(c.smem_bytes(), 4 * (128 + 256) * 128 + 2 * 4 * 8, "ring, then full and empty mbarriers");
        assert!(!tw(256, 5).is_well_formed(), "5 stages of 48 KiB exceed shared memory");
        assert!(!TileConfig { warps_m: 16, bm: 256, ..tw(128, 4) }.is_well_formed(), "sm90 configs have two consumer warpgroups");
        assert!(!TileConfig { bk: 32, ..tw(128, 4) }.is_well_formed(), "64-deep stages (one 128-byte line per row)");
        // Every family offers at least one sm90 and one mma.sync config (the fallback, index 0).
        for f in Family::ALL {
            assert!(f.candidates().iter().any(|c| c.is_sm90()), "{f:?}");
            assert_eq!(f.fallback().mainloop, Mainloop::MmaSync, "{f:?}");
        }
    }

    #[test]
    fn malformed_configs_are_rejected() {
        assert!(!tc(128, 128, 48, 3, 2, 4).is_well_formed());
        assert!(!tc(128, 128, 32, 1, 2, 4).is_well_formed());
        assert!(!tc(48, 128, 32, 3, 1, 4).is_well_formed());
        assert!(!tc(256, 256, 64, 4, 2, 4).is_well_formed(), "ring too large for shared memory");
        assert!(!tw(192, 4).is_well_formed());
        assert!(!tw(256, 9).is_well_formed());
    }
}
