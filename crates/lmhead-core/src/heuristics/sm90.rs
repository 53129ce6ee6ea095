//! The Hopper rules (`Mainloop::Sm90`, compute capability 9.0), measured on one H200.
//!
//! **Configs.** The sm90 configs of a family are within a few percent of each other almost
//! everywhere, and the exhaustive trials (every candidate timed at the real shape, median of 5
//! with confirmation rounds: `docs/results/exhaustive-2026-11-30.jsonl`, `bash .gpu/run-gpu.sh
//! tune-table`, now `exhaustive`; 65 shapes of the sweep) pick among them by margins the steady
//! state does not keep: with those picks against one config per family, all 104 sweep shapes timed
//! on two heads in the same rounds (`docs/results/versus-fixed-2026-11-30.jsonl`,
//! `BENCH_ARGS="--versus-fixed --reps 3" bash .gpu/run-gpu.sh sweep`), the shapes where the picks
//! differed ran no faster than those where both heads ran the same configs (the order of the heads
//! in a round alone gave the first one 0.6–1.1%). So each family has one config, with one
//! exception that the steady state does keep (`dh` at d = 5120 and few tokens), and the
//! `mma.sync` configs never: 1.7–2.3× slower than the sm90 ones at every key of the trials.
//! Against those trials (`cargo xtask heuristics docs/results/exhaustive-2026-11-30.jsonl`) a
//! training step estimated from the trial times, `fwd_ent + chunks × (dlogits_ent + dh + dW)`,
//! takes the rules' picks within 0.5% of the fastest candidates' at 34 of the 65 shapes and
//! within 1% at 54: +0.61% mean, +0.47% median, +5.0% at most (16384 × 16032 × 4096, a `dW`
//! trial reading the steady state did not repeat, [`DW`]).
//!
//! **Plans.** The forward takes the L2 model's plan ([`split::plan_l2`]) except where forced
//! plans measured faster ([`measured_splits`]); the backward kernels take the L2 model over
//! their own grids.

use crate::config::{ts, tw, Family, TileConfig};
use crate::split::{self, SplitPlan};
use crate::Problem;

use super::{tiles, Device, Shortlist};

/// The forward's config, with and without entropy: 128 × 256 tiles, 3 stages.
///
/// Exhaustive trials (65 shapes): within 1% of the fastest candidate at 42 (log-prob) and 51
/// (entropy) of 65, within 2% at 51 and 55, geometric-mean slowdown 1.0121 and 1.0069; the
/// largest gap 18.9% (32768 × 19008 × 5120, where the 4-stage config won the trial). In the
/// steady state (`versus-fixed-2026-11-30.jsonl`), at the 28 (22) shapes whose trial winner
/// was another config, that winner ran the forward 0.995× (1.000× with entropy) the time of this
/// one, mean, against 0.989× (0.994×) at the shapes where both heads ran this one: no gain; the
/// n128 s6 winners ran 1.002× and 1.017×, slower.
pub const FWD: TileConfig = tw(256, 3);

/// The forward's alternates for the tuner: the 4-stage twin (geometric-mean slowdown 1.034 in the
/// trials, 17 wins of 65). The n128 s6 config (1.140, 11 wins) lost in the steady state where it
/// won its trials (above), so it is not proposed.
const FWD_ALTERNATES: [TileConfig; 1] = [tw(256, 4)];

/// The d-logits' config, with and without entropy: 128 × 256 tiles, 4 stages, the tile stored
/// through shared memory by TMA.
///
/// Exhaustive trials (30 keys each): within 1% of the fastest at 23 and 18, geometric-mean
/// slowdown 1.0052 and 1.0063, the largest gap 5.3% (8192 × 32064 × 4096, to n128 s6). The
/// trials' other picks (mostly n128 s6 at d = 2048, which won its trials by 0.6–2%) ran the
/// training step 1.5% slower on average than this config, up to 6.2% (65536 × 124160 × 2048:
/// 243.5 against 229.2 ms), over the 50 sweep shapes where they differed
/// (`b728f4d:docs/results/sweep-versus-fixed-2026-11-30.jsonl`, `BENCH_ARGS="--versus-fixed --reps 5"
/// bash .gpu/run-gpu.sh sweep`). The register-store configs ran 7–10% slower in the trials. So
/// the tuner gets no alternates: trials of these kernels pick wrong.
pub const DLOGITS: TileConfig = ts(256, 4);

/// The `dh` GEMM's config: 128 × 256 tiles, 4 stages, the f32 accumulator stored (first chunk) and
/// added (the others) by TMA. The TMA store ran the training step 2.8–5.3% faster than the same
/// tiles' register epilogue at five sweep shapes (`docs/results/dh-tma-ab-2026-12-01.jsonl`,
/// `run-gpu.sh plans` with the two builds' configs forced, A B B A).
pub const DH: TileConfig = ts(256, 4);

/// `dh` at few tokens and a hidden size that is not a power of two: 128 × 128 tiles, 6 stages
/// (TMA store). See [`dh`]: with it, the rule's `dh` pick is within 1% of the exhaustive trials'
/// fastest at 27 of 30 keys, geometric-mean slowdown 1.0029, the largest gap 2.7% (131072 ×
/// 8192 × 5120), the trials timing the register twins of the TMA-store configs.
pub const DH_NARROW: TileConfig = ts(128, 6);

/// The `dh` alternates for the tuner, after the rule's pick: the wide tile, its 3-stage twin
/// (trials 1.039, 5 wins of 30) and the narrow tile (1.076, 4 wins); two of them.
const DH_ALTERNATES: [TileConfig; 3] = [DH, ts(256, 3), DH_NARROW];

/// The `dW` GEMM's config: 128 × 256 tiles, 4 stages (register epilogue; `dW` has no TMA-store
/// variant).
///
/// Exhaustive trials (30 keys): within 1% of the fastest at 23, geometric-mean slowdown 1.0107,
/// the largest gap 19.2% (16384 × 16032 × 4096, to the 3-stage twin, a trial reading that the
/// steady state did not repeat: there the two ran the step within 0.2%). Over the 26 sweep shapes
/// where the trials' `dW` pick alone differed from this one, the step ran 1.0019× this one's
/// time, mean, against 0.9977× at the 55 shapes where all three backward configs were the same
/// (`versus-fixed-2026-11-30.jsonl`).
pub const DW: TileConfig = tw(256, 4);

/// The `dW` alternates for the tuner: the 3-stage twin (trials 1.018, 8 wins of 30; n128 s6:
/// 1.155).
const DW_ALTERNATES: [TileConfig; 1] = [tw(256, 3)];

/// The `dh` rule: [`DH_NARROW`] when `t ≤ 4096` and `d` is not a power of two (then the chunk
/// is 8192 columns wide, [`super::chunk_width`]), else [`DH`].
///
/// At d = 5120 the 128 × 256 tiles cut `dh [t][d]` into 20 columns of tiles, and at t ≤ 4096
/// into at most 640 tiles: 128 × 128 tiles won the exhaustive trials there by 9.8% (t = 2048)
/// and 12.9% (t = 4096), and the steady state kept it: the training step ran 0.948×, 0.946× and
/// 0.976× the fixed config's time at 2048 × 152064 × 5120, 4096 × 76032 × 5120 and
/// 4096 × 152064 × 5120 (`versus-fixed-2026-11-30.jsonl`), where no other config differed.
/// At t = 8192 (and beyond) the wide tile won again (by 19.6% at 8192 × 8192 × 5120). The
/// trials' other `dh` picks (at 16 shapes) ran the step 1.0067× the fixed config's time, mean:
/// not kept. Measured at d = 5120 only; other hidden sizes that are not powers of two take the
/// same rule by the same tile count argument, unmeasured.
pub const fn dh(p: Problem) -> TileConfig {
    if p.t <= 4096 && !p.d.is_power_of_two() {
        DH_NARROW
    } else {
        DH
    }
}

/// What the tuner may time for `family` at `p` (for the backward families `p.v` is the chunk),
/// the rule's pick first. Never an `mma.sync` config: 1.7–2.3× slower than the sm90 ones at
/// every key of the exhaustive trials.
pub fn shortlist(family: Family, p: Problem, dev: &Device) -> Shortlist {
    let mut ranked = [FWD; 1 + DH_ALTERNATES.len()];
    let n = match family {
        Family::Fwd | Family::FwdEnt => rank(&mut ranked, FWD, &FWD_ALTERNATES),
        Family::BwdDlogits | Family::BwdDlogitsEnt => rank(&mut ranked, DLOGITS, &[]),
        Family::BwdDh => rank(&mut ranked, dh(p), &DH_ALTERNATES),
        Family::BwdDw => rank(&mut ranked, DW, &DW_ALTERNATES),
    };
    let list = Shortlist::of(family, &ranked[..n], dev);
    if list.pick().is_sm90() {
        list
    } else {
        // None of the Hopper configs fits (a device with less shared memory per block than
        // sm_90's): the portable rules.
        super::sm80::shortlist(family, p, &dev.portable())
    }
}

/// `pick`, then `alternates` other than it, into `out`; how many.
fn rank(out: &mut [TileConfig], pick: TileConfig, alternates: &[TileConfig]) -> usize {
    out[0] = pick;
    let mut n = 1;
    for &c in alternates {
        if c != pick {
            out[n] = c;
            n += 1;
        }
    }
    n
}

/// The forward's split counts that forced plans measured faster than the L2 model's, by hidden
/// size: `(d, t above, vocab tiles of 256 at least, splits)`; the plan then takes raster groups
/// of `ceil(slots / splits)` token tiles, so that one wave of resident blocks covers every split
/// of a few rows of `h` (11 token tiles of 1 MiB at d = 4096, 9 of 1.25 MiB at d = 5120, 11 of
/// 2 MiB at d = 8192; the model's plans keep 27–34 MiB).
///
/// Measured (`docs/results/plans-2026-12-01.jsonl`: `PLAN_CASES=<file> bash .gpu/run-gpu.sh
/// plans`, each plan in a process of its own in the order planner, A, B, B, A, planner, `sweep
/// --filter <case> --reps 3`, the timed log-probs checked against the f64 reference), forward ×
/// GEMM, the model's plan → this one:
/// - d = 4096, t > 65536, v ≥ 128000: 1.076 → 1.026 (131072 × 128256), 1.092 → 1.031 (262144 ×
///   128256); with entropy 1.086 → 1.022, 1.085 → 1.017. At 65536 × 128256 (9 × 15 by the
///   model) 1.020 → 1.016: not taken there (below 3%).
/// - d = 5120, t > 65536, every vocab: 1.110 → 1.045 (131072 × 38016), 1.079 → 1.014 (× 76032),
///   1.080 → 1.023 (× 152064), 1.092 → 1.055 (262144 × 19008), 1.094 → 1.019 (× 38016),
///   1.095 → 1.024 (× 76032), 1.103 → 1.037 (× 152064); with entropy within −0.6% … −7% except
///   262144 × 19008 (0.999 → 0.958; 10 splits read 0.952). At 32768–65536 tokens the model's
///   plans were within 1% of 15 splits.
/// - d = 8192, t > 16384, v ≥ 128000: 1.048 → 1.012 (32768 × 131072), 1.058 → 1.013
///   (131072 × 131072), 1.076 → 1.018 (262144 × 131072); with entropy 1.048 → 1.021,
///   1.048 → 1.013, 1.106 → 1.026.
///
/// Two shapes of the sweep take a measured split count without having been measured themselves:
/// 131072 × 19008 × 5120 and 65536 × 131072 × 8192 (their neighbours in `t` gained 0.4–5.9%
/// from the same split counts, forward and forward with entropy).
/// At d = 2048 forced plans ran −2.2% … +3.0% against the model's (four shapes of 131072–262144
/// tokens): no rule. Other hidden sizes are unmeasured and keep the model's plan. Measured with
/// the 128 × 256 tiles of [`FWD`]; other tile widths keep the model's plan.
pub const MEASURED_SPLITS: [(usize, usize, u32, u32); 3] = [(4096, 65536, 500, 12), (5120, 65536, 0, 15), (8192, 16384, 500, 12)];

/// The measured split count for `cfg` at `p` ([`MEASURED_SPLITS`]), if any.
pub const fn measured_splits(cfg: TileConfig, p: Problem) -> Option<u32> {
    if cfg.bn != 256 {
        return None;
    }
    let v_tiles = p.v.div_ceil(256) as u32;
    let mut i = 0;
    while i < MEASURED_SPLITS.len() {
        let (d, above, min_tiles, splits) = MEASURED_SPLITS[i];
        if p.d == d && p.t > above && v_tiles >= min_tiles {
            return Some(splits);
        }
        i += 1;
    }
    None
}

/// The forward's plan for the Hopper config `cfg` at `p` with `slots` concurrent blocks: the
/// measured split count ([`measured_splits`]) in raster groups of `ceil(slots / splits)` token
/// tiles, else the L2 model's plan ([`split::plan_l2`]: the split count of least modelled
/// makespan whose resident rows of `h` fit [`split::L2_SHARE`] of the L2, in raster groups that
/// keep them resident; its measurements are in its docs).
pub fn fwd_plan(cfg: TileConfig, p: Problem, dev: &Device, slots: u32) -> SplitPlan {
    let (m_tiles, n_tiles) = tiles(cfg, p);
    let modelled = split::plan_l2(m_tiles, n_tiles, slots, split::L2Model::of(cfg.bm.into(), p.d as u64, dev.l2_bytes));
    match measured_splits(cfg, p) {
        Some(splits) => {
            let n = n_tiles.max(1);
            let per = n.div_ceil(splits.min(n));
            SplitPlan { tiles_per_split: per, n_splits: n.div_ceil(per), raster_group: slots.max(1).div_ceil(splits), fill: 0 }
        }
        None => modelled,
    }
}

/// How a Hopper backward kernel walks its `m_tiles × n_tiles` output tiles of depth `k`: the
/// forward's L2 planner with A's `BM × k` rows as the resident tile gives the consecutive n tiles
/// per block and the raster group, one block per SM. With one tile per block, as the `mma.sync`
/// kernels take them, every tile pays a pipeline fill and an exposed epilogue (measured on the
/// H200 at t = 8192, d = 4096, chunks of 8192: d-logits ≈ 1.5× and `dh` ≈ 1.3× the time per FLOP
/// of the whole-vocab cuBLAS GEMM, `lmhead-bench sweep` before and after).
pub fn bwd_plan(cfg: TileConfig, m_tiles: u32, n_tiles: u32, k: usize, dev: &Device) -> SplitPlan {
    split::plan_l2(m_tiles, n_tiles, dev.sm_count, split::L2Model::of(cfg.bm.into(), k as u64, dev.l2_bytes))
}
