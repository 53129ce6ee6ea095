//! Autotuning: enumerate, prune, bucket, time, cache, explain.
//!
//! Every tuned kernel family has a candidate table in `lmhead_core::config` (the PTX build
//! instantiates exactly those entry points, so an unbuilt config can never be chosen). On the
//! first call of a [`TuneKey`] — family, power-of-two token bucket, `d`, local `v`, dtype, tensor
//! parallel or not — the tuner prunes the table on paper (shared memory, divisibility), times
//! every survivor on the caller's real shapes (warm-up, CUDA events, median) writing only to
//! scratch buffers, rejects candidates that fail or disagree with the fallback's answer, and
//! records the winner *and every timing and rejection* in the cache, which persists across
//! processes ([`cache`]). `LMHEAD_AUTOTUNE=0` uses each family's fallback config instead.

pub mod bench;
pub mod cache;

use std::collections::BTreeMap;
use std::sync::Mutex;

use lmhead_core::config::{Family, TileConfig};
use lmhead_core::{Problem, TokenBucket};
use serde::{Deserialize, Serialize};

use crate::device::DeviceInfo;
use crate::error::{Error, Result};

/// How a call chooses its tile config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    /// The tuned config for the call's key (tuning on first use, when tuning is enabled).
    #[default]
    Auto,
    /// The family's fallback config.
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
}

/// One timed run of a candidate: its median time and a sample of its output for the agreement
/// check against the fallback.
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
    /// Ran but disagreed with the fallback (relative L2 difference).
    Wrong { rel_l2: f64 },
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

/// Largest relative L2 difference from the fallback's output that still counts as the same
/// answer. f32 accumulation in another order moves log-probs by ~1e-6 relative; bf16 outputs
/// (d-logits, gradients) by ~4e-3.
pub const AGREE_REL_L2: f64 = 1e-2;

/// Contenders: candidates whose first-pass time is within this factor of the best. They are timed
/// again in [`CONFIRM_ROUNDS`] rounds that cycle through them (backward, then forward order), and
/// each one's time is the median of all its rounds. One short timing can be off by more than the
/// gap between the best few candidates: on an H200, a cp.async `wgmma` config once measured
/// within 5% of the best TMA config in tuning and then ran 1.35× slower in the benchmark's steady
/// state, doubling the time other ranks waited at the all-reduce.
pub const CONFIRM_WITHIN: f64 = 1.15;
pub const CONFIRM_ROUNDS: usize = 2;

/// The tuner: enabled flag, device limits for pruning, and the cache.
pub struct Tuner {
    enabled: bool,
    device: Option<DeviceInfo>,
    cache: Mutex<cache::Cache>,
    /// Print one line per tuning to stderr.
    pub verbose: bool,
}

impl Tuner {
    /// From the environment: `LMHEAD_AUTOTUNE=0` disables tuning; the cache file is
    /// `LMHEAD_TUNE_CACHE` or `<user cache dir>/lmhead/<device fingerprint>.json`
    /// (`LMHEAD_TUNE_CACHE=off` keeps it in memory only).
    pub fn from_env(device: &DeviceInfo) -> Self {
        let enabled = std::env::var("LMHEAD_AUTOTUNE").map(|v| v != "0").unwrap_or(true);
        let path = cache::default_path(&device.fingerprint());
        let verbose = std::env::var("LMHEAD_TUNE_VERBOSE").map(|v| v != "0").unwrap_or(false);
        Self { enabled, device: Some(device.clone()), cache: Mutex::new(cache::Cache::open(path, &device.fingerprint())), verbose }
    }

    /// A tuner with an explicit cache (tests, the probe).
    pub fn new(enabled: bool, device: Option<DeviceInfo>, cache: cache::Cache) -> Self {
        Self { enabled, device, cache: Mutex::new(cache), verbose: false }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
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

    /// The config for `key` under `choice`; tunes with `trial` on a cache miss (tests drive it
    /// with fake trials).
    pub fn pick(&self, key: &TuneKey, choice: Choice, trial: &mut dyn FnMut(TileConfig) -> Result<Trial>) -> Result<TileConfig> {
        let family = key.family;
        match choice {
            Choice::Fixed(c) => {
                if !family.candidates().contains(&c) {
                    return Err(Error::Config(format!("{c:?} is not a compiled candidate of {family:?}")));
                }
                return Ok(c);
            }
            Choice::Fallback => return Ok(family.fallback()),
            Choice::Auto if !self.enabled => return Ok(family.fallback()),
            Choice::Auto => {}
        }
        if let Some(e) = self.cache.lock().unwrap().get(key) {
            return Ok(e.winner);
        }
        let start = std::time::Instant::now();
        let p = Problem::new(key.bucket.tokens() as usize, key.v as usize, key.d as usize);
        let mut outcomes = Vec::new();
        let mut reference: Option<Vec<f64>> = None;
        for &c in family.candidates() {
            if let Err(reason) = can_implement(c, self.device.as_ref(), p) {
                outcomes.push((c, Outcome::Pruned { reason }));
                continue;
            }
            let o = judge(trial(c), &mut reference);
            outcomes.push((c, o));
        }
        let times = |outcomes: &[(TileConfig, Outcome)]| -> Vec<(usize, f64)> {
            outcomes
                .iter()
                .enumerate()
                .filter_map(|(i, (_, o))| match o {
                    Outcome::Timed { ms, .. } => Some((i, *ms)),
                    _ => None,
                })
                .collect()
        };
        // Confirmation rounds for the contenders.
        let first = times(&outcomes);
        let best_first = first.iter().map(|&(_, ms)| ms).fold(f64::INFINITY, f64::min);
        let contenders: Vec<(usize, f64)> = first.into_iter().filter(|&(_, ms)| ms <= best_first * CONFIRM_WITHIN).collect();
        if contenders.len() > 1 {
            for round in 0..CONFIRM_ROUNDS {
                let order: Vec<(usize, f64)> = if round % 2 == 0 { contenders.iter().rev().copied().collect() } else { contenders.clone() };
                for (i, first_ms) in order {
                    let (c, o) = &mut outcomes[i];
                    let Outcome::Timed { ms, confirm } = o else { continue };
                    match judge(trial(*c), &mut reference) {
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
        let best = times(&outcomes).into_iter().min_by(|a, b| a.1.total_cmp(&b.1)).map(|(i, _)| outcomes[i].0);
        let Some(winner) = best else {
            return Err(Error::Config(format!("no candidate of {family:?} ran for {key:?}: {outcomes:?}")));
        };
        let entry = Entry { winner, candidates: outcomes, seconds: start.elapsed().as_secs_f64() };
        if self.verbose {
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
            eprintln!("lmhead: tuned {key:?} in {:.2}s: {winner:?}; contenders: {}", entry.seconds, rounds.join(", "));
        }
        self.cache.lock().unwrap().insert(key.clone(), entry);
        Ok(winner)
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
