//! Autotuning: the rules' short list timed per power-of-two token bucket, the winner cached.
//!
//! Every tuned kernel family has its candidates in `lmhead_core::config` (the PTX build
//! instantiates exactly those entry points, so an unbuilt config can never be chosen) and its
//! rules in `lmhead_core::heuristics`: a pick and a short list of at most three configs per
//! family, problem and device. A call whose config is [`Choice::Auto`] takes, by the tuner's
//! [`Policy`]:
//!
//! - **off** — the rule's pick, nothing timed or cached. The default on the device model the rules
//!   were measured on ([`MEASURED_ON`]): there the steady state showed no gain from per-shape
//!   picks (`lmhead_core::heuristics::sm90`), while timing costs the first call of every bucket
//!   up to 0.1 s per family at the probe's shapes (`docs/results/probe-2026-12-02.jsonl`, `run-gpu.sh
//!   probe`).
//! - **short list** — the default on every other device (and anywhere with `LMHEAD_AUTOTUNE=1`):
//!   on the first call of a [`TuneKey`] (family, token bucket, `d`, local `v`, dtype, tensor
//!   parallel or not) the short list is timed on the caller's whole shape, with one confirmation
//!   round, and the winner and every outcome are cached, also on disk ([`cache`]). A problem too
//!   large to time whole ([`CanTime::TooLarge`]) takes the rule's pick, cached: short trials on a
//!   slice of a problem picked worse than one config per family in the steady state (−1.7 to
//!   −2.2% on average at the forwards, `b728f4d:docs/results/sweep-versus-fixed-2026-11-30.jsonl`). A
//!   stream being captured into a CUDA graph ([`CanTime::Capturing`]) takes the rule's pick,
//!   not cached: a trial would be captured instead of run.
//! - **exhaustive** — for benches only ([`Tuner::new`] with [`Policy::Exhaustive`]): every
//!   candidate on the caller's real shape, two confirmation rounds.
//!
//! Trials prune on paper first (shared memory, divisibility), time with CUDA events (warm-up,
//! median of 5), write only to scratch buffers, and reject candidates that fail or disagree with
//! the first timed candidate's answer. If nothing on the short list runs (the Hopper kernels do
//! not load, say), the portable rules' short list is timed. A tuning whose trials all ran out of
//! scratch memory takes the rule's pick, not cached.

pub mod bench;
pub mod cache;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use lmhead_core::config::{Family, TileConfig};
use lmhead_core::heuristics;
use lmhead_core::{Problem, TokenBucket};
use serde::{Deserialize, Serialize};

use crate::device::DeviceInfo;
use crate::error::{Error, Result};

/// How a call chooses its tile config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    /// The tuner's config for the call's key (by its [`Policy`]).
    #[default]
    Auto,
    /// The family's fallback config (the portable `mma.sync` one every device runs).
    Fallback,
    /// This config (it must be one of the family's candidates).
    Fixed(TileConfig),
}

/// Everything that can change the winner.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TuneKey {
    pub family: Family,
    pub bucket: TokenBucket,
    pub d: u32,
    /// Local vocab rows (the shard under tensor parallelism; the chunk width for backward GEMMs).
    pub v: u32,
    pub dtype: String,
    pub tp: bool,
}

impl TuneKey {
    pub fn new(family: Family, p: Problem, tp: bool) -> Self {
        Self { family, bucket: TokenBucket::of(p.t), d: p.d as u32, v: p.v as u32, dtype: "bf16".into(), tp }
    }

    /// The problem the rules see for this key: the bucket's largest token count (every rule's
    /// token threshold is a bucket boundary, so every count of the bucket gets the same answer).
    pub fn problem(&self) -> Problem {
        Problem::new(self.bucket.tokens() as usize, self.v as usize, self.d as usize)
    }
}

/// One timed run of a candidate: its median time and a sample of its output for the agreement
/// check against the first timed candidate.
#[derive(Clone, Debug)]
pub struct Trial {
    pub ms: f64,
    pub check: Vec<f64>,
}

/// What happened to one candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Timed: median milliseconds (of the first pass and the confirmation rounds, if any).
    Timed {
        ms: f64,
        /// The confirmation rounds' times, for a contender (see [`CONFIRM_WITHIN`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        confirm: Vec<f64>,
    },
    /// Pruned before timing (reason).
    Pruned { reason: String },
    /// Failed to launch or run (reason).
    Failed { reason: String },
    /// Ran but disagreed with the reference (relative L2 difference).
    Wrong { rel_l2: f64 },
    /// Not timed: the rule's pick, for a problem too large to time whole or alone on its short
    /// list.
    Heuristic,
}

/// The tuning record of one key: the winner and every candidate's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub winner: TileConfig,
    pub candidates: Vec<(TileConfig, Outcome)>,
    /// Wall-clock seconds the tuning took (timing and JIT included).
    #[serde(default)]
    pub seconds: f64,
}

impl Entry {
    /// Candidates that ran in trials (timed, or rejected for a wrong answer); 0 for the rule's
    /// pick.
    pub fn timed(&self) -> usize {
        self.candidates.iter().filter(|(_, o)| matches!(o, Outcome::Timed { .. } | Outcome::Wrong { .. })).count()
    }
}

/// Largest relative L2 difference from the first timed candidate's output that still counts as
/// the same answer. f32 accumulation in another order moves log-probs by ~1e-6 relative; bf16
/// outputs (d-logits, gradients) by ~4e-3.
pub const AGREE_REL_L2: f64 = 1e-2;

/// Contenders: candidates whose first-pass time is within this factor of the best. They are timed
/// again in confirmation rounds that cycle through them (backward, then forward order), and each
/// one's time is the median of all its rounds. One short timing can be off by more than the gap
/// between the best few candidates: on an H200, a cp.async `wgmma` config once measured within 5%
/// of the best TMA config in tuning and then ran 1.35× slower in the benchmark's steady state,
/// doubling the time other ranks waited at the all-reduce.
pub const CONFIRM_WITHIN: f64 = 1.15;
/// Confirmation rounds of an exhaustive tuning (a short list's: one).
pub const CONFIRM_ROUNDS: usize = 2;

/// A tuning that takes longer than this is reported on stderr even without
/// `LMHEAD_TUNE_VERBOSE` (a first call that stalls should say why).
pub const REPORT_SLOW_S: f64 = 2.0;

/// The device models the rules were measured on, by `DeviceInfo::name`: tuning is off by default
/// there.
pub const MEASURED_ON: [&str; 1] = ["NVIDIA H200"];

/// How a cache miss is decided (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The rule's pick; nothing timed or cached.
    Off,
    /// The rule's short list timed on the whole problem when it can be; cached.
    Shortlist,
    /// Every candidate timed on the real shape (benches).
    Exhaustive,
}

impl Policy {
    /// The policy of a tuner on `device` with `LMHEAD_AUTOTUNE` at `autotune`: `0` off, `1` the
    /// short list, unset by the device ([`MEASURED_ON`]: off there, the short list elsewhere).
    pub fn for_device(device: &DeviceInfo, autotune: Option<&str>) -> Policy {
        match autotune.map(str::trim) {
            Some("0") => Policy::Off,
            Some("1") => Policy::Shortlist,
            other => {
                if let Some(v) = other {
                    eprintln!("lmhead: warning: LMHEAD_AUTOTUNE={v} is not 0 or 1; using the device's default");
                }
                if MEASURED_ON.contains(&device.name.as_str()) {
                    Policy::Off
                } else {
                    Policy::Shortlist
                }
            }
        }
    }
}

/// Whether a call's trials may run (the caller knows its problem and stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CanTime {
    Yes,
    /// The problem is too large to time whole within the cold-call budget.
    TooLarge,
    /// The call's stream is being captured into a CUDA graph.
    Capturing,
}

/// Whether a config's kernel loads on this device.
pub type Loads = Arc<dyn Fn(Family, TileConfig) -> bool + Send + Sync>;

/// The tuner: policy, the device's limits for the rules and for pruning, and the cache.
pub struct Tuner {
    policy: Policy,
    device: Option<DeviceInfo>,
    limits: heuristics::Device,
    loads: Option<Loads>,
    cache: Mutex<cache::Cache>,
    /// Print one line per tuning to stderr.
    pub verbose: bool,
}

impl Tuner {
    /// From the environment: `LMHEAD_AUTOTUNE` ([`Policy::for_device`]); the cache file is
    /// `LMHEAD_TUNE_CACHE` or `<user cache dir>/lmhead/<device fingerprint>.json`
    /// (`LMHEAD_TUNE_CACHE=off` keeps it in memory only); `LMHEAD_TUNE_VERBOSE=1` reports each
    /// tuning.
    pub fn from_env(device: &DeviceInfo) -> Self {
        let policy = Policy::for_device(device, std::env::var("LMHEAD_AUTOTUNE").ok().as_deref());
        for gone in ["LMHEAD_TUNE", "LMHEAD_BWD_OVERLAP"] {
            if std::env::var_os(gone).is_some() {
                eprintln!(
                    "lmhead: warning: {gone} is no longer read (exhaustive tuning is `lmhead-bench exhaustive`'s; dW beside dh is BwdOptions::dw_beside_dh)"
                );
            }
        }
        let path = cache::default_path(&device.fingerprint());
        let verbose = std::env::var("LMHEAD_TUNE_VERBOSE").map(|v| v != "0").unwrap_or(false);
        let mut t = Self::new(policy, Some(device.clone()), cache::Cache::open(path, &device.fingerprint()));
        t.verbose = verbose;
        t
    }

    /// A tuner with an explicit policy and cache (tests, benches). Without a device the rules
    /// take the H200's limits (`heuristics::Device::H200`).
    pub fn new(policy: Policy, device: Option<DeviceInfo>, cache: cache::Cache) -> Self {
        let limits = device.as_ref().map_or(heuristics::Device::H200, limits_of);
        Self { policy, device, limits, loads: None, cache: Mutex::new(cache), verbose: false }
    }

    /// Tell the tuner which configs load (the rule's picks are checked with it; `LmHead` sets it
    /// from its device).
    pub fn set_loads(&mut self, loads: Loads) {
        self.loads = Some(loads);
    }

    fn loads(&self, family: Family, c: TileConfig) -> bool {
        self.loads.as_ref().is_none_or(|f| f(family, c))
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The device's limits as the rules see them.
    pub fn limits(&self) -> &heuristics::Device {
        &self.limits
    }

    /// The rules' short list for `family` at `p` on this device (the portable rules' where the
    /// pick of the device's own does not load).
    pub fn shortlist(&self, family: Family, p: Problem) -> Vec<TileConfig> {
        let own = heuristics::shortlist(family, p, &self.limits);
        if self.loads(family, own.pick()) {
            return own.as_slice().to_vec();
        }
        heuristics::shortlist(family, p, &self.limits.portable()).as_slice().to_vec()
    }

    /// The config a call takes untimed: the rule's pick where its kernel loads, else the portable
    /// rules' pick, else the family's fallback.
    pub fn heuristic(&self, family: Family, p: Problem) -> TileConfig {
        let own = std::iter::once_with(|| heuristics::config(family, p, &self.limits));
        let portable = std::iter::once_with(|| heuristics::config(family, p, &self.limits.portable()));
        own.chain(portable).find(|&c| self.loads(family, c)).unwrap_or_else(|| family.fallback())
    }

    /// The cached record of `key`, if any.
    pub fn entry(&self, key: &TuneKey) -> Option<Entry> {
        self.cache.lock().unwrap().get(key)
    }

    /// Every cached record.
    pub fn entries(&self) -> BTreeMap<TuneKey, Entry> {
        self.cache.lock().unwrap().all()
    }

    /// Why each candidate of `family` would be pruned for `p` on this device (`Ok` = kept).
    pub fn prune(&self, family: Family, p: Problem) -> Vec<(TileConfig, std::result::Result<(), String>)> {
        family.candidates().iter().map(|&c| (c, can_implement(c, self.device.as_ref(), p))).collect()
    }

    /// Whether a call of `choice` at `key` would run trials now (to allocate their scratch only
    /// then).
    pub fn would_time(&self, key: &TuneKey, choice: Choice, can_time: CanTime) -> bool {
        let timed = match self.policy {
            Policy::Off => false,
            Policy::Shortlist => can_time == CanTime::Yes && self.shortlist(key.family, key.problem()).len() > 1,
            Policy::Exhaustive => can_time != CanTime::Capturing,
        };
        timed && choice == Choice::Auto && self.entry(key).is_none()
    }

    /// The config for `key` under `choice`; tunes with `trial` on a cache miss (tests drive it
    /// with fake trials), each trial on the whole problem, when `can_time` allows. See the
    /// module docs for the policies.
    pub fn pick(&self, key: &TuneKey, choice: Choice, can_time: CanTime, trial: &mut dyn FnMut(TileConfig) -> Result<Trial>) -> Result<TileConfig> {
        let family = key.family;
        let p = key.problem();
        match choice {
            Choice::Fixed(c) => {
                if !family.candidates().contains(&c) {
                    return Err(Error::Config(format!("{c:?} is not a compiled candidate of {family:?}")));
                }
                return Ok(c);
            }
            Choice::Fallback => return Ok(family.fallback()),
            Choice::Auto if self.policy == Policy::Off => return Ok(self.heuristic(family, p)),
            Choice::Auto => {}
        }
        if let Some(e) = self.cache.lock().unwrap().get(key) {
            return Ok(e.winner);
        }
        if can_time == CanTime::Capturing {
            return Ok(self.heuristic(family, p));
        }
        let start = std::time::Instant::now();
        let untimed = match self.policy {
            Policy::Shortlist if can_time == CanTime::TooLarge => Some("the rule's pick, too large to time"),
            Policy::Shortlist if self.shortlist(family, p).len() == 1 => Some("the rule's pick, alone on its short list"),
            _ => None,
        };
        if let Some(how) = untimed {
            let winner = self.heuristic(family, p);
            let entry = Entry { winner, candidates: vec![(winner, Outcome::Heuristic)], seconds: start.elapsed().as_secs_f64() };
            self.finish(key, entry, how);
            return Ok(winner);
        }
        let mut reference: Option<Vec<f64>> = None;
        // Trials that failed for want of scratch memory (not the kernel's fault).
        let mut oom = 0usize;
        let mut trial = |c: TileConfig| {
            let r = trial(c);
            oom += matches!(r, Err(Error::OutOfMemory { .. })) as usize;
            r
        };
        let (first, then): (Vec<TileConfig>, Vec<TileConfig>) = match self.policy {
            Policy::Exhaustive => (family.candidates().to_vec(), Vec::new()),
            _ => {
                let own = heuristics::shortlist(family, p, &self.limits).as_slice().to_vec();
                let portable = heuristics::shortlist(family, p, &self.limits.portable()).as_slice().to_vec();
                (own, portable)
            }
        };
        let mut outcomes: Vec<(TileConfig, Outcome)> = Vec::new();
        for list in [first, then] {
            if best_timed(&outcomes).is_some() {
                break;
            }
            for c in list {
                if outcomes.iter().any(|(x, _)| *x == c) {
                    continue;
                }
                let o = match can_implement(c, self.device.as_ref(), p) {
                    Err(reason) => Outcome::Pruned { reason },
                    Ok(()) => judge(trial(c), &mut reference),
                };
                outcomes.push((c, o));
            }
        }
        let rounds = if self.policy == Policy::Exhaustive { CONFIRM_ROUNDS } else { 1 };
        confirm(&mut outcomes, rounds, &mut trial, &mut reference);
        let failed = outcomes.iter().filter(|(_, o)| matches!(o, Outcome::Failed { .. })).count();
        let Some(winner) = best_timed(&outcomes) else {
            let pick = self.heuristic(family, p);
            if failed > 0 && oom == failed {
                // The tuning could not run (its scratch did not fit), not the kernels: the call
                // itself may still fit. Not cached: the next call in this bucket tries again.
                eprintln!(
                    "lmhead: warning: tuning {family:?} for {key:?} ran out of scratch memory; using the rule's pick {} untimed",
                    pick.suffix(family)
                );
                return Ok(pick);
            }
            return Err(Error::Config(format!("no candidate of {family:?} ran for {key:?}: {outcomes:?}")));
        };
        let entry = Entry { winner, candidates: outcomes, seconds: start.elapsed().as_secs_f64() };
        self.finish(key, entry, if self.policy == Policy::Exhaustive { "exhaustive" } else { "short list" });
        Ok(winner)
    }

    /// Cache `entry` and report it (always when it was slow).
    fn finish(&self, key: &TuneKey, entry: Entry, how: &str) {
        let family = key.family;
        if self.verbose || entry.seconds > REPORT_SLOW_S {
            let rounds: Vec<String> = entry
                .candidates
                .iter()
                .filter_map(|(c, o)| match o {
                    Outcome::Timed { ms, confirm } if !confirm.is_empty() => {
                        Some(format!("{} {ms:.3} ms (rounds {confirm:.3?})", c.suffix(family)))
                    }
                    _ => None,
                })
                .collect();
            let timed = entry.timed();
            eprintln!(
                "lmhead: tuned {family:?} for {} tokens, d = {}, v = {} in {:.2} s ({how}, {timed} timed): {}; contenders: {}",
                key.bucket.tokens(),
                key.d,
                key.v,
                entry.seconds,
                entry.winner.suffix(family),
                rounds.join(", ")
            );
        }
        self.cache.lock().unwrap().insert(key.clone(), entry);
    }

    /// Tune ahead of time: run `warm` for each expected token count (each distinct bucket once).
    pub fn warm_up(&self, token_counts: &[usize], mut warm: impl FnMut(usize) -> Result<()>) -> Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        for &t in token_counts {
            if seen.insert(TokenBucket::of(t)) {
                warm(t)?;
            }
        }
        Ok(())
    }
}

/// The rules' view of a device.
pub fn limits_of(d: &DeviceInfo) -> heuristics::Device {
    let dev = heuristics::Device::new(d.cc, d.sm_count, d.l2_bytes, d.max_smem_optin);
    match d.module {
        lmhead_core::config::Module::Hopper => dev,
        // The portable module holds no Hopper kernel: its rules alone, on any device.
        lmhead_core::config::Module::Portable => dev.portable(),
    }
}

/// Whether `c` can run `p` on `device` (`Err` names the first broken limit).
pub fn can_implement(c: TileConfig, device: Option<&DeviceInfo>, p: Problem) -> std::result::Result<(), String> {
    if !c.is_well_formed() {
        return Err("malformed config".into());
    }
    if let Some(d) = device {
        if c.smem_bytes() > d.max_smem_optin as usize {
            return Err(format!("needs {} B shared memory > {} B", c.smem_bytes(), d.max_smem_optin));
        }
    }
    if !p.d.is_multiple_of(8) {
        return Err(format!("d = {} is not a multiple of 8", p.d));
    }
    Ok(())
}

/// The fastest timed candidate.
fn best_timed(outcomes: &[(TileConfig, Outcome)]) -> Option<TileConfig> {
    outcomes
        .iter()
        .filter_map(|(c, o)| match o {
            Outcome::Timed { ms, .. } => Some((*c, *ms)),
            _ => None,
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, _)| c)
}

/// Confirmation rounds for the contenders (first-pass time within [`CONFIRM_WITHIN`] of the
/// best): each round times them again, cycling backward then forward; a contender's time
/// becomes the median of all its runs, and one that fails or disagrees when run again is out.
fn confirm(
    outcomes: &mut [(TileConfig, Outcome)],
    rounds: usize,
    trial: &mut dyn FnMut(TileConfig) -> Result<Trial>,
    reference: &mut Option<Vec<f64>>,
) {
    let first: Vec<(usize, f64)> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, (_, o))| match o {
            Outcome::Timed { ms, .. } => Some((i, *ms)),
            _ => None,
        })
        .collect();
    let best_first = first.iter().map(|&(_, ms)| ms).fold(f64::INFINITY, f64::min);
    let contenders: Vec<(usize, f64)> = first.into_iter().filter(|&(_, ms)| ms <= best_first * CONFIRM_WITHIN).collect();
    if contenders.len() < 2 {
        return;
    }
    for round in 0..rounds {
        let order: Vec<(usize, f64)> = if round % 2 == 0 { contenders.iter().rev().copied().collect() } else { contenders.clone() };
        for (i, first_ms) in order {
            let (c, o) = &mut outcomes[i];
            let Outcome::Timed { ms, confirm } = o else { continue };
            match judge(trial(*c), reference) {
                Outcome::Timed { ms: again, .. } => {
                    confirm.push(again);
                    let mut all: Vec<f64> = confirm.iter().copied().chain([first_ms]).collect();
                    *ms = bench::median(&mut all);
                }
                // Failed or wrong when run again: recorded as such, out of the running.
                other => *o = other,
            }
        }
    }
}

/// A trial's outcome: failed, timed, or wrong against the first timed candidate's answer (which
/// becomes the `reference`).
fn judge(trial: Result<Trial>, reference: &mut Option<Vec<f64>>) -> Outcome {
    match trial {
        Err(e) => Outcome::Failed { reason: e.to_string() },
        Ok(t) if !t.ms.is_finite() || t.ms <= 0.0 => Outcome::Failed { reason: format!("bad time {}", t.ms) },
        Ok(t) => match reference {
            None => {
                *reference = Some(t.check);
                Outcome::Timed { ms: t.ms, confirm: Vec::new() }
            }
            Some(r) => {
                let e = rel_l2(&t.check, r);
                if e.is_nan() || e > AGREE_REL_L2 {
                    Outcome::Wrong { rel_l2: e }
                } else {
                    Outcome::Timed { ms: t.ms, confirm: Vec::new() }
                }
            }
        },
    }
}

/// Relative L2 difference `‖x − r‖ / ‖r‖` over finite reference entries (NaN if shapes differ
/// or x is non-finite where r is finite).
pub fn rel_l2(x: &[f64], r: &[f64]) -> f64 {
    if x.len() != r.len() {
        return f64::NAN;
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (&a, &b) in x.iter().zip(r) {
        if !b.is_finite() {
            continue;
        }
        if !a.is_finite() {
            return f64::NAN;
        }
        num += (a - b) * (a - b);
        den += b * b;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
