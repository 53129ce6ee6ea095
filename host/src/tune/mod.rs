//! Autotuning: enumerate, prune, bucket, time, cache, explain.
//!
//! Every tuned kernel family has a candidate table in `lmhead_core::config` (the PTX build
//! instantiates exactly those entry points, so an unbuilt config can never be chosen). On the
//! first call of a [`TuneKey`] — family, power-of-two token bucket, `d`, local `v`, dtype, tensor
//! parallel or not — the tuner decides ([`Tuner::pick`]):
//!
//! - **table** (the default, `LMHEAD_TUNE=table`): with the shipped table of tuned configs
//!   ([`table`]) measured on this device model, a key the table holds takes the table's winner
//!   without trials, except for the families the table lists as `fixed_only` (on the H200 the
//!   d-logits families: where their picks differed, training steps ran 1.5% slower on average
//!   than with the fixed config, up to 6%, in the steady-state sweep), which take the fixed
//!   config. For any other key:
//!   - when a trial would see only a slice of the problem (more than 32768 rows, or a forward
//!     of more than ~2⁴⁰ multiply-adds), the family's best fixed config from the table, without
//!     trials: in the steady state it beat the slice trials' picks (see [`Tuner::pick_sliced`]);
//!   - otherwise a shortlist is timed on the whole problem, with one confirmation round: the
//!     table's best configs at the nearest keys plus the best fixed config (on sm90 the
//!     `mma.sync` configs are left out: 1.7–2.3× slower at every key of the table). If nothing
//!     on the shortlist runs, the rest is timed.
//! - **exhaustive** (`LMHEAD_TUNE=exhaustive`; how the table is made): every candidate on the
//!   caller's real shape, two confirmation rounds.
//!
//! Trials prune on paper first (shared memory, divisibility), time with CUDA events (warm-up,
//! median of 5), write only to scratch buffers, and reject candidates that fail or disagree
//! with the first timed candidate's answer. The winner *and every outcome* go into the cache,
//! which persists across processes ([`cache`]). `LMHEAD_AUTOTUNE=0` uses each family's best
//! fixed config from the table (or the `mma.sync` fallback where the table's kernels do not
//! load), as does a tuning whose trials all ran out of scratch memory (not cached).

pub mod bench;
pub mod cache;
pub mod table;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

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
    /// Ran but disagreed with the reference (relative L2 difference).
    Wrong { rel_l2: f64 },
    /// Not timed here: taken from the shipped table (time relative to the table's winner).
    Table { rel: f64 },
    /// Not timed: the family's best fixed config from the shipped table, taken for a key the
    /// table does not hold when a trial could only run on a slice of the problem (see
    /// [`Tuner::pick_sliced`]).
    Fixed,
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
    /// Candidates that ran in trials (timed, or rejected for a wrong answer); 0 for a table pick.
    pub fn timed(&self) -> usize {
        self.candidates.iter().filter(|(_, o)| matches!(o, Outcome::Timed { .. } | Outcome::Wrong { .. })).count()
    }
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

/// Shortlists (table mode): the configs within this factor of the best at the nearest
/// [`SHORTLIST_KEYS`] keys of the table, at most [`SHORTLIST_CAP`], plus the family's best
/// fixed config; one confirmation round.
pub const SHORTLIST_WITHIN: f64 = 1.05;
pub const SHORTLIST_KEYS: usize = 2;
pub const SHORTLIST_CAP: usize = 3;

/// A tuning that takes longer than this is reported on stderr even without
/// `LMHEAD_TUNE_VERBOSE` (a first call that stalls should say why).
pub const REPORT_SLOW_S: f64 = 2.0;

/// How a cache miss is tuned (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Table,
    Exhaustive,
}

/// Whether a config's kernel loads on this device.
pub type Loads = Arc<dyn Fn(Family, TileConfig) -> bool + Send + Sync>;

/// The tuner: enabled flag, mode and table, device limits for pruning, and the cache.
pub struct Tuner {
    enabled: bool,
    mode: Mode,
    table: Option<(table::Table, table::Fit)>,
    loads: Option<Loads>,
    device: Option<DeviceInfo>,
    cache: Mutex<cache::Cache>,
    /// Print one line per tuning to stderr.
    pub verbose: bool,
}

impl Tuner {
    /// From the environment: `LMHEAD_AUTOTUNE=0` disables tuning; `LMHEAD_TUNE=exhaustive`
    /// times every candidate (default `table`); the cache file is `LMHEAD_TUNE_CACHE` or
    /// `<user cache dir>/lmhead/<device fingerprint>.json` (`LMHEAD_TUNE_CACHE=off` keeps it in
    /// memory only).
    pub fn from_env(device: &DeviceInfo) -> Self {
        let enabled = std::env::var("LMHEAD_AUTOTUNE").map(|v| v != "0").unwrap_or(true);
        let mode = match std::env::var("LMHEAD_TUNE").as_deref() {
            Ok("exhaustive") => Mode::Exhaustive,
            Ok("table") | Err(_) => Mode::Table,
            Ok(other) => {
                eprintln!("lmhead: warning: LMHEAD_TUNE={other} is not `table` or `exhaustive`; using `table`");
                Mode::Table
            }
        };
        let path = cache::default_path(&device.fingerprint());
        let verbose = std::env::var("LMHEAD_TUNE_VERBOSE").map(|v| v != "0").unwrap_or(false);
        Self::new(enabled, Some(device.clone()), cache::Cache::open(path, &device.fingerprint()))
            .with_table(table::Table::shipped(device), mode)
            .verbose(verbose)
    }

    /// A tuner with an explicit cache (tests, the probe): exhaustive, no table.
    pub fn new(enabled: bool, device: Option<DeviceInfo>, cache: cache::Cache) -> Self {
        Self { enabled, mode: Mode::Exhaustive, table: None, loads: None, device, cache: Mutex::new(cache), verbose: false }
    }

    /// Use `table` (with how well it fits this device) in `mode`.
    pub fn with_table(mut self, table: Option<(table::Table, table::Fit)>, mode: Mode) -> Self {
        self.table = table;
        self.mode = mode;
        self
    }

    fn verbose(mut self, on: bool) -> Self {
        self.verbose = on;
        self
    }

    /// Tell the tuner which configs load (table picks and fixed configs are checked with it;
    /// `LmHead` sets it from its device).
    pub fn set_loads(&mut self, loads: Loads) {
        self.loads = Some(loads);
    }

    fn loads(&self, family: Family, c: TileConfig) -> bool {
        self.loads.as_ref().is_none_or(|f| f(family, c))
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn table(&self) -> Option<&(table::Table, table::Fit)> {
        self.table.as_ref()
    }

    /// The config used without tuning: the table's best fixed config when it loads, else the
    /// family's `mma.sync` fallback.
    pub fn untuned(&self, family: Family) -> TileConfig {
        self.table_fixed(family).unwrap_or_else(|| family.fallback())
    }

    /// The table's best fixed config of `family`, when there is a table and its kernel loads.
    fn table_fixed(&self, family: Family) -> Option<TileConfig> {
        self.table.as_ref().and_then(|(t, _)| t.fixed(family)).filter(|&c| self.loads(family, c))
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
    /// with fake trials), trials that run the whole problem. See the module docs for the modes.
    pub fn pick(&self, key: &TuneKey, choice: Choice, trial: &mut dyn FnMut(TileConfig) -> Result<Trial>) -> Result<TileConfig> {
        self.pick_sliced(key, choice, false, trial)
    }

    /// [`Tuner::pick`] where `sliced` says that `trial` would run only a slice of the problem
    /// (table mode's trials on large shapes). In table mode a family the table lists as
    /// `fixed_only` takes its best fixed config at every key, and so does a key the table does
    /// not hold when `sliced`, without trials: on the H200, over the sweep's 38
    /// shapes beyond the table, the slice trials' picks ran 1.7–2.2% slower on average in the
    /// steady state than that fixed config (up to 11% slower), while the table's exhaustive picks
    /// at its own 65 shapes ran 0.7–1.3% faster (`docs/PERFORMANCE.md`).
    pub fn pick_sliced(
        &self,
        key: &TuneKey,
        choice: Choice,
        sliced: bool,
        trial: &mut dyn FnMut(TileConfig) -> Result<Trial>,
    ) -> Result<TileConfig> {
        let family = key.family;
        match choice {
            Choice::Fixed(c) => {
                if !family.candidates().contains(&c) {
                    return Err(Error::Config(format!("{c:?} is not a compiled candidate of {family:?}")));
                }
                return Ok(c);
            }
            Choice::Fallback => return Ok(family.fallback()),
            Choice::Auto if !self.enabled => return Ok(self.untuned(family)),
            Choice::Auto => {}
        }
        if let Some(e) = self.cache.lock().unwrap().get(key) {
            return Ok(e.winner);
        }
        let start = std::time::Instant::now();
        let fixed_only = self.mode == Mode::Table && self.table.as_ref().is_some_and(|(t, _)| t.fixed_only(family));
        if let Some(entry) = self.table_pick(key).filter(|_| !fixed_only) {
            let winner = entry.winner;
            self.finish(key, entry, "table");
            return Ok(winner);
        }
        if self.mode == Mode::Table && (sliced || fixed_only) {
            if let Some(fixed) = self.table_fixed(family) {
                let entry = Entry { winner: fixed, candidates: vec![(fixed, Outcome::Fixed)], seconds: start.elapsed().as_secs_f64() };
                self.finish(key, entry, "fixed");
                return Ok(fixed);
            }
        }
        let p = Problem::new(key.bucket.tokens() as usize, key.v as usize, key.d as usize);
        let mut reference: Option<Vec<f64>> = None;
        // Trials that failed for want of scratch memory (not the kernel's fault).
        let mut oom = 0usize;
        let mut trial = |c: TileConfig| {
            let r = trial(c);
            oom += matches!(r, Err(Error::OutOfMemory { .. })) as usize;
            r
        };
        // First pass: the shortlist (table mode) or everything (exhaustive); deferred candidates
        // are recorded as pruned with the reason, and timed only if nothing on the shortlist ran.
        let plan = self.first_pass(key, p);
        let mut outcomes: Vec<(TileConfig, Outcome)> = plan
            .iter()
            .map(|(c, step)| match step {
                Step::Time => (*c, judge(trial(*c), &mut reference)),
                Step::Defer(reason) | Step::Prune(reason) => (*c, Outcome::Pruned { reason: reason.clone() }),
            })
            .collect();
        if best_timed(&outcomes).is_none() {
            for ((c, step), (_, o)) in plan.iter().zip(outcomes.iter_mut()) {
                if matches!(step, Step::Defer(_)) {
                    *o = judge(trial(*c), &mut reference);
                }
            }
        }
        let rounds = if self.mode == Mode::Table { 1 } else { CONFIRM_ROUNDS };
        confirm(&mut outcomes, rounds, &mut trial, &mut reference);
        let failed = outcomes.iter().filter(|(_, o)| matches!(o, Outcome::Failed { .. })).count();
        let Some(winner) = best_timed(&outcomes) else {
            let fixed = self.untuned(family);
            if failed > 0 && oom == failed && self.loads(family, fixed) {
                // The tuning could not run (its scratch did not fit), not the kernels: the call
                // itself may still fit. Not cached: the next call in this bucket tries again.
                eprintln!(
                    "lmhead: warning: tuning {family:?} for {key:?} ran out of scratch memory; using the fixed config {} untuned",
                    fixed.suffix(family)
                );
                return Ok(fixed);
            }
            return Err(Error::Config(format!("no candidate of {family:?} ran for {key:?}: {outcomes:?}")));
        };
        let entry = Entry { winner, candidates: outcomes, seconds: start.elapsed().as_secs_f64() };
        self.finish(key, entry, if self.mode == Mode::Table { "shortlist" } else { "exhaustive" });
        Ok(winner)
    }

    /// Table mode, a key the table holds, measured on this device model: the table's winner
    /// (when its kernel loads), without trials.
    fn table_pick(&self, key: &TuneKey) -> Option<Entry> {
        let start = std::time::Instant::now();
        let (t, fit) = self.table.as_ref()?;
        if self.mode != Mode::Table || !fit.exact_for(key.family) {
            return None;
        }
        let e = t.exact(key)?;
        let winner = e.ranking[0].0;
        if !self.loads(key.family, winner) {
            return None;
        }
        let candidates = e.ranking.iter().map(|&(c, rel)| (c, Outcome::Table { rel })).collect();
        Some(Entry { winner, candidates, seconds: start.elapsed().as_secs_f64() })
    }

    /// What the first pass does with each candidate, shortlist first (its order is the table's:
    /// the nearest key's winner is the reference).
    fn first_pass(&self, key: &TuneKey, p: Problem) -> Vec<(TileConfig, Step)> {
        let family = key.family;
        let sm90 = self.device.as_ref().is_some_and(|d| d.cc.0 == 9);
        // In table mode the family's best fixed config runs in every race: a pick must beat it.
        let shortlist: Vec<TileConfig> = match (&self.table, self.mode) {
            (Some((t, _)), Mode::Table) => {
                let mut s = t.shortlist(key, SHORTLIST_KEYS, SHORTLIST_WITHIN, SHORTLIST_CAP);
                if let Some(f) = t.fixed(family).filter(|f| !s.is_empty() && !s.contains(f)) {
                    s.push(f);
                }
                s
            }
            _ => Vec::new(),
        };
        let order = shortlist.iter().copied().chain(family.candidates().iter().copied().filter(|c| !shortlist.contains(c)));
        order
            .map(|c| {
                let step = if let Err(reason) = can_implement(c, self.device.as_ref(), p) {
                    Step::Prune(reason)
                } else if self.mode == Mode::Exhaustive {
                    Step::Time
                } else if sm90 && !c.is_sm90() {
                    Step::Defer("mma.sync on sm_90: 1.7-2.3x slower than the sm90 configs at every key of the table; timed only if none of the shortlist runs".into())
                } else if !shortlist.is_empty() && !shortlist.contains(&c) {
                    Step::Defer("not on the table's shortlist for the nearest keys; timed only if none of the shortlist runs".into())
                } else {
                    Step::Time
                };
                (c, step)
            })
            .collect()
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

/// What the first pass does with a candidate.
enum Step {
    Time,
    /// Not in the first pass; timed only if nothing in it runs (the reason is recorded).
    Defer(String),
    /// Cannot run this problem (the reason is recorded).
    Prune(String),
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
