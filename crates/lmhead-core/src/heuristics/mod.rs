//! Every launch decision, as a function of the problem and the device's limits: the tile config of
//! each kernel family, the forward's vocab splits, raster order and fillers, the backward kernels'
//! plans, the backward's vocab chunk width, and whether `dW` runs beside `dh`. One file per
//! architecture — [`sm90`] (the Hopper mainloop, `Mainloop::Sm90`) and [`sm80`] (the portable
//! `mma.sync` mainloop, for every other device) — and here the device description, the dispatch
//! and the rules both share.
//!
//! Each rule cites the measurement it rests on: a results file (`docs/results/…`; those no longer
//! in that folder are in the git history, all of them at commit b728f4d) and the command that
//! made it. `cargo xtask heuristics <records.jsonl>…` replays the rules against exhaustive trial
//! records (`lmhead-bench exhaustive`, formerly `tune-table`) and forced-plan records
//! (`run-gpu.sh plans`) and prints how close they come; the numbers in the comments are its
//! output for the files cited.
//!
//! Nothing here depends on the kernels' bytes or names: refactoring a kernel invalidates no
//! decision. The tuner (in the host) may time the [`Shortlist`] a rule proposes; the first
//! config of it is the rule's pick, what runs when nothing is timed.

pub mod sm80;
pub mod sm90;

use crate::config::{Family, TileConfig};
use crate::split::{self, SplitPlan};
use crate::Problem;

/// Which mainloop's rules apply on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Compute capability 9.0 (H100, H200, H20, GH200): the Hopper kernels (`Mainloop::Sm90`).
    Sm90,
    /// Any other device of compute capability 8.0 or later (A100 and A10, L40, RTX 30/40/50):
    /// the portable `mma.sync` kernels only. Also the rules a compute-capability-9.0 device falls
    /// back to when its Hopper kernels do not load.
    Sm80,
}

/// What the rules read of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    pub arch: Arch,
    pub sm_count: u32,
    /// L2 cache bytes (0 if unknown: the forward's plan then ignores L2).
    pub l2_bytes: u64,
    /// Dynamic shared memory one block may opt into (bytes): 227 KiB on sm_90, 163 KiB on
    /// sm_80, 99 KiB on sm_86, sm_89 and sm_120.
    pub max_smem_per_block: u32,
}

impl Device {
    /// The device of compute capability `cc` with these limits.
    pub const fn new(cc: (i32, i32), sm_count: u32, l2_bytes: u64, max_smem_per_block: u32) -> Device {
        let arch = if cc.0 == 9 && cc.1 == 0 { Arch::Sm90 } else { Arch::Sm80 };
        Device { arch, sm_count, l2_bytes, max_smem_per_block }
    }

    /// The H200 the rules were measured on (132 SMs, 60 MiB of L2, 227 KiB per block).
    pub const H200: Device = Device { arch: Arch::Sm90, sm_count: 132, l2_bytes: 60 << 20, max_smem_per_block: 232_448 };

    /// The same device under the portable rules (its Hopper kernels did not load).
    pub const fn portable(self) -> Device {
        Device { arch: Arch::Sm80, ..self }
    }

    /// Whether `c` can run here: well formed, within the block's shared memory, and a Hopper
    /// config only on an sm_90 device.
    pub const fn fits(&self, c: TileConfig) -> bool {
        c.is_well_formed() && c.smem_bytes() <= self.max_smem_per_block as usize && (!c.is_sm90() || matches!(self.arch, Arch::Sm90))
    }
}

/// The longest list a rule proposes for the tuner.
pub const SHORTLIST_MAX: usize = 3;

/// Up to [`SHORTLIST_MAX`] candidates of one family for one problem, the rule's pick first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortlist {
    len: usize,
    configs: [TileConfig; SHORTLIST_MAX],
}

impl Shortlist {
    /// The configs of `ranked` that fit `dev`, in order, at most [`SHORTLIST_MAX`]; the
    /// family's fallback (its portable config, index 0 of its candidates) when none does (the
    /// launch then reports the limit it breaks).
    pub fn of(family: Family, ranked: &[TileConfig], dev: &Device) -> Shortlist {
        let mut s = Shortlist { len: 0, configs: [family.fallback(); SHORTLIST_MAX] };
        for &c in ranked {
            if s.len < SHORTLIST_MAX && dev.fits(c) && !s.as_slice().contains(&c) {
                s.configs[s.len] = c;
                s.len += 1;
            }
        }
        if s.len == 0 {
            s.len = 1;
        }
        s
    }

    /// The rule's pick: what runs untimed.
    pub const fn pick(&self) -> TileConfig {
        self.configs[0]
    }

    pub fn as_slice(&self) -> &[TileConfig] {
        &self.configs[..self.len]
    }
}

/// What the tuner may time for `family` at `p` on `dev`, the rule's pick first. For the
/// backward families `p.v` is the chunk width ([`chunk`]).
pub fn shortlist(family: Family, p: Problem, dev: &Device) -> Shortlist {
    match dev.arch {
        Arch::Sm90 => sm90::shortlist(family, p, dev),
        Arch::Sm80 => sm80::shortlist(family, p, dev),
    }
}

/// The rule's config for `family` at `p` on `dev` ([`shortlist`]'s first).
pub fn config(family: Family, p: Problem, dev: &Device) -> TileConfig {
    shortlist(family, p, dev).pick()
}

/// Token tiles and vocab tiles of `cfg` over `p`.
pub const fn tiles(cfg: TileConfig, p: Problem) -> (u32, u32) {
    (p.t.div_ceil(cfg.bm as usize) as u32, p.v.div_ceil(cfg.bn as usize) as u32)
}

/// The forward's split of the vocab tiles and its launch order for `cfg` at `p` with `slots`
/// concurrent blocks (SMs × blocks per SM, as the driver's occupancy calculator gives them),
/// before fillers ([`fills`]). A Hopper config takes [`sm90::fwd_plan`] (the L2 model, or the
/// measured split counts); a portable one the plain makespan plan ([`split::plan`]), whose
/// kernels read neither a raster order nor fillers.
pub fn fwd_plan(cfg: TileConfig, p: Problem, dev: &Device, slots: u32) -> SplitPlan {
    let (m_tiles, n_tiles) = tiles(cfg, p);
    if cfg.is_sm90() && dev.l2_bytes > 0 {
        sm90::fwd_plan(cfg, p, dev, slots)
    } else {
        split::plan(m_tiles, n_tiles, slots)
    }
}

/// How the backward kernel of `cfg` walks its grid of `m_tiles × n_tiles` output tiles of depth
/// `k`, before fillers: a Hopper kernel by [`sm90::bwd_plan`], a portable one one tile per block.
pub fn bwd_plan(cfg: TileConfig, m_tiles: u32, n_tiles: u32, k: usize, dev: &Device) -> SplitPlan {
    if cfg.is_sm90() {
        sm90::bwd_plan(cfg, m_tiles, n_tiles, k, dev)
    } else {
        SplitPlan::new(1, n_tiles)
    }
}

/// Whether plans of `cfg` take fillers ([`split::with_fill`], where its launch-order model says
/// they shorten the makespan): the Hopper kernels read them (measured in the sweep with and
/// without fillers, `docs/results/fill-ab-2026-12-01.jsonl` and
/// `docs/results/sweep-fillers-2026-12-01.jsonl`, `run-gpu.sh sweep`; under ncu the forward's
/// idle-SM factor fell from up to 1.04 to 0.999–1.011); the portable kernels do not.
pub const fn fills(cfg: TileConfig) -> bool {
    cfg.is_sm90()
}

/// 64-deep K steps of a `k`-deep tile, the unit of [`split::makespan_k_steps`].
pub const fn k_steps(k: usize) -> u32 {
    k.div_ceil(64) as u32
}

/// [`split::with_fill`] where [`fills`] says so (`plan` unchanged otherwise): `plan` over
/// `m_tiles × n_tiles` tiles of depth `k` on `slots` concurrent blocks.
#[cfg(feature = "std")]
pub fn with_fill(cfg: TileConfig, plan: SplitPlan, m_tiles: u32, n_tiles: u32, slots: u32, k: usize) -> SplitPlan {
    if fills(cfg) {
        split::with_fill(plan, m_tiles, n_tiles, slots, k_steps(k))
    } else {
        SplitPlan { fill: 0, ..plan }
    }
}

// ---------------------------------------------------------------------------------------------
// The backward's vocab chunks (both architectures; measured on the H200)
// ---------------------------------------------------------------------------------------------

/// The staging buffer the automatic chunk width aims for: `t · S` bf16 within 512 MiB.
pub const STAGING_BUDGET_BYTES: usize = 512 << 20;
/// The narrowest automatic chunk: below it the chunk's launches and `dh` accumulator passes
/// cost more than a few percent, so long sequences go over the budget rather than below this
/// (`t · 16 KiB`: 1 GiB at t = 65536).
pub const MIN_AUTO_CHUNK: usize = 8192;
/// The widest automatic chunk (32768 columns: fwd+bwd 4–9% faster than 8192 at t ≤ 8192 in the
/// bench; 65536, measured once at t = 4096, landed within the spread of the 32768 runs).
pub const MAX_AUTO_CHUNK: usize = 32768;

/// The nominal chunk width of a backward of `t` tokens and hidden size `d` (the width the
/// tuning keys name; [`chunk`] spreads it over the vocab). For `d` a power of two: the widest
/// power of two whose staging fits [`STAGING_BUDGET_BYTES`], clamped to [`MIN_AUTO_CHUNK`] ..=
/// [`MAX_AUTO_CHUNK`] (32768 up to t = 8192, 16384 at 16384, 8192 from 32768 tokens on): fewer,
/// wider chunks mean fewer passes over `dh`'s f32 accumulator and larger GEMMs per launch. For
/// any other `d`: 8192.
///
/// Measured on the H200 with fwd+bwd in the bench (`lmhead-bench sweep --filter <case>
/// --bwd-chunk N`, `run-gpu.sh plans` with `chunk=<N>` variants): the wide chunk ran 4–9%
/// faster than 8192 at d = 4096 and 8192, but 11–15% slower at d = 5120 (t = 8192, local
/// v = 38016: 5.25× and 5.31× a GEMM against 4.45–4.62×; t = 16384: 4.76–4.93× against
/// 4.54–4.65×), for a reason not found. Choosing the width by the tuner's kernel timings was tried
/// and measured wrong (short trials run at burst clocks and favour the narrow width).
pub const fn chunk_width(t: usize, d: usize) -> usize {
    if !d.is_power_of_two() {
        return MIN_AUTO_CHUNK;
    }
    let t = if t == 0 { 1 } else { t };
    let fit = STAGING_BUDGET_BYTES / (2 * t);
    let pow2 = if fit == 0 { 1 } else { 1usize << fit.ilog2() };
    if pow2 < MIN_AUTO_CHUNK {
        MIN_AUTO_CHUNK
    } else if pow2 > MAX_AUTO_CHUNK {
        MAX_AUTO_CHUNK
    } else {
        pow2
    }
}

/// `width` spread over the `v` columns: the `ceil(v / width)` chunks it needs, made equal up to a
/// multiple of 256 columns (the widest tile), never wider than `width`. A narrow last chunk runs
/// its GEMMs as a short tail: at 131072 × 19008 × 5120, chunks of 8192, 8192 and 2624 columns
/// took the training step 177 ms, three of 6400 160 ms (`run-gpu.sh plans` with `chunk=<N>`
/// variants; `docs/results/balanced-chunk-ab-2026-12-01.jsonl`: 5.2× → 4.35× a GEMM there, two
/// other shapes whose width it changes within ±1%).
pub const fn balanced_chunk(v: usize, width: usize) -> usize {
    if v <= width {
        return v;
    }
    let per = v.div_ceil(v.div_ceil(width)).next_multiple_of(256);
    if per < width {
        per
    } else {
        width
    }
}

/// The nominal chunk width of a backward of `p`: [`chunk_width`], at most `v` (the width its
/// configs are chosen and tuned at).
pub const fn nominal_chunk(p: Problem) -> usize {
    let width = chunk_width(p.t, p.d);
    if width < p.v {
        width
    } else {
        p.v
    }
}

/// The chunk width a backward of `p` runs with when the caller gives none: [`nominal_chunk`]
/// spread by [`balanced_chunk`].
pub const fn chunk(p: Problem) -> usize {
    balanced_chunk(p.v, nominal_chunk(p))
}

/// Whether each chunk's `dW` GEMM runs on a side stream beside its `dh` GEMM (the default of
/// `BwdOptions::dw_beside_dh`). Both only read the chunk's staging buffer and write disjoint
/// outputs, and the block scheduler hands the SMs `dW`'s last wave leaves to `dh`'s blocks. On the
/// H200, turning it off made every training step slower: +1.1% median (+0.3% … +2.5%) at four
/// shapes (`docs/results/bwd-overlap-priority-ab-2026-12-01.jsonl`), −0.5% median (−1.4% …
/// +0.3%, 10 of 11 faster) with it at eleven (`docs/results/bwd-overlap-ab-2026-12-01.jsonl`;
/// both `run-gpu.sh plans`, the library against the variant, A B B A).
pub const DW_BESIDE_DH: bool = true;

// ---------------------------------------------------------------------------------------------
// Every decision at once, on paper
// ---------------------------------------------------------------------------------------------

/// Blocks per SM of `cfg` on paper (the host asks the driver's occupancy calculator instead):
/// one for every Hopper config (each takes ≥ 144 KiB of the SM's 228 KiB of shared memory and
/// 384 threads), else what shared memory and 2048 threads per SM allow.
pub const fn blocks_per_sm(cfg: TileConfig, dev: &Device) -> u32 {
    if cfg.is_sm90() {
        return 1;
    }
    let by_smem = (dev.max_smem_per_block as usize + 1024) / (cfg.smem_bytes() + 1024);
    let by_threads = 2048 / cfg.threads() as usize;
    let n = if by_smem < by_threads { by_smem } else { by_threads };
    if n == 0 {
        1
    } else {
        n as u32
    }
}

/// A forward's decisions: its config and plan (fillers included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwdDecision {
    pub config: TileConfig,
    pub plan: SplitPlan,
}

/// Every decision for one problem: both forwards, and the backward with entropy (d-logits, `dh`,
/// `dW`, the chunk width and how many chunks), as the rules make them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decisions {
    pub fwd: FwdDecision,
    pub fwd_ent: FwdDecision,
    pub dlogits: TileConfig,
    pub dh: TileConfig,
    pub dw: TileConfig,
    pub chunk: usize,
    pub chunks: usize,
    pub dw_beside_dh: bool,
}

/// Every decision the rules make for `p` on `dev`, with [`blocks_per_sm`] for the occupancy: the
/// tests' and `cargo xtask heuristics`' view of what a call runs untuned.
#[cfg(feature = "std")]
pub fn decide(p: Problem, dev: &Device) -> Decisions {
    let fwd = |family: Family| {
        let config = config(family, p, dev);
        let slots = dev.sm_count * blocks_per_sm(config, dev);
        let (m_tiles, n_tiles) = tiles(config, p);
        let plan = with_fill(config, fwd_plan(config, p, dev, slots), m_tiles, n_tiles, slots, p.d);
        FwdDecision { config, plan }
    };
    let keyed = Problem::new(p.t, nominal_chunk(p), p.d);
    let chunk = chunk(p);
    Decisions {
        fwd: fwd(Family::Fwd),
        fwd_ent: fwd(Family::FwdEnt),
        dlogits: config(Family::BwdDlogitsEnt, keyed, dev),
        dh: config(Family::BwdDh, keyed, dev),
        dw: config(Family::BwdDw, keyed, dev),
        chunk,
        chunks: p.v.div_ceil(chunk),
        dw_beside_dh: DW_BESIDE_DH,
    }
}

#[cfg(all(test, feature = "std"))]
mod tests;
