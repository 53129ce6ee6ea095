//! The shipped table of tuned configs: what exhaustive tuning picked, per device model, family,
//! token bucket, `d` and local `v`, at the sweep's shapes (`lmhead-bench tune-table`, turned into
//! `host/tuned/<device>.json` by `cargo xtask tune-table`), and the best fixed config per family.
//!
//! The tuner uses it three ways (see [`super::Tuner::pick`]):
//! - an exact key on the device model the table was measured on: the table's winner, no trials
//!   (it was timed against every candidate at that key and agreed with the reference there);
//! - any other key (or another sm90 device): the table's best few configs at the nearest keys
//!   are the shortlist that is timed, instead of every candidate;
//! - tuning off (`LMHEAD_AUTOTUNE=0`), or a tuning whose trials all failed: the family's best
//!   fixed config, the one with the smallest geometric-mean slowdown over every key of the table;
//!   so do, in table mode, the families the table lists as `fixed_only` (their picks lost to the
//!   fixed config in the steady state) and keys beyond the table whose trials would be sliced.
//!
//! Configs the build does not compile (a table older than the candidate lists) are dropped on
//! load, so a stale table can only be less useful, never wrong.

use std::collections::BTreeMap;

use lmhead_core::config::{Family, TileConfig};
use lmhead_core::{Problem, TokenBucket};
use serde::{Deserialize, Serialize};

use super::TuneKey;
use crate::device::DeviceInfo;

/// Current table format.
pub const FORMAT: u32 = 1;

/// The tables compiled into the library: (file name, contents).
const SHIPPED: &[(&str, &str)] = &[("NVIDIA-H200.json", include_str!("../../tuned/NVIDIA-H200.json"))];

/// One key's ranking: every timed candidate, fastest first, with its time relative to the
/// fastest (1.0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    pub family: Family,
    /// The token bucket (its upper bound).
    pub bucket: u32,
    pub d: u32,
    pub v: u32,
    pub ranking: Vec<(TileConfig, f64)>,
}

/// A forward launch plan that the steady state measured faster than the planner's at one key
/// with one config (`cargo xtask table-plans`): `splits` vocab splits in raster groups of `raster`
/// token tiles, in place of [`lmhead_core::split::plan_l2`]'s (fillers are still added).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanEntry {
    /// `Fwd` or `FwdEnt`.
    pub family: Family,
    /// The token bucket (its upper bound).
    pub bucket: u32,
    pub d: u32,
    pub v: u32,
    /// The config it was measured with; another config keeps the planner's plan.
    pub config: TileConfig,
    pub splits: u32,
    pub raster: u32,
    /// Time against the planner's plan in that measurement (< 1).
    pub ratio: f64,
}

/// A table file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Table {
    pub format: u32,
    /// `DeviceInfo::name` of the GPU it was measured on.
    pub device: String,
    /// How it was made (command and results files).
    pub source: String,
    /// The `ptx_hash` (`crate::ptx::ptx_hash`, in the tune cache header) of the kernels it
    /// timed: other kernels use it as a prior only (per family, see `family_hashes`).
    #[serde(default)]
    pub ptx_hash: String,
    /// Per family, the hash of the kernels it timed (`ptx::family_hash`): with other PTX as a
    /// whole, a family whose candidates are unchanged keeps the table's measurements.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub family_hashes: BTreeMap<Family, String>,
    /// Per family, the best fixed config (smallest geometric-mean slowdown over the table's keys).
    pub fixed: BTreeMap<Family, TileConfig>,
    /// Families whose table picks lost to their fixed config in the steady state (`lmhead-bench
    /// sweep --versus-fixed`): table mode takes the fixed config for them at every key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fixed_only: Vec<Family>,
    pub entries: Vec<TableEntry>,
    /// Forward plans measured faster than the planner's (see [`PlanEntry`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plans: Vec<PlanEntry>,
}

/// How far a table's measurements carry to this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Measured on this device model with these kernels: exact keys need no trials.
    Exact,
    /// Measured on this device model, with other kernels as a whole but these kernels for the
    /// families in the mask (bit `i`: `Family::ALL[i]`): exact for those, a prior for the rest.
    Families(u8),
    /// Another device of the same architecture, or other kernels (a table older than the
    /// build): a prior for the shortlist only.
    Prior,
}

impl Fit {
    /// Whether the table's picks for `family` need no trials.
    pub fn exact_for(self, family: Family) -> bool {
        match self {
            Fit::Exact => true,
            Fit::Families(mask) => Family::ALL.iter().position(|&f| f == family).is_some_and(|i| mask & (1 << i) != 0),
            Fit::Prior => false,
        }
    }

    /// The fit of a table of this device model that timed other PTX: exact for the families
    /// whose hashes match (`hash_of`), a prior if none does.
    pub fn of_families(table: &BTreeMap<Family, String>, hash_of: impl Fn(Family) -> String) -> Fit {
        let mask = Family::ALL
            .iter()
            .enumerate()
            .filter(|(_, &f)| table.get(&f).is_some_and(|h| *h == hash_of(f)))
            .fold(0u8, |m, (i, _)| m | (1 << i));
        if mask == 0 {
            Fit::Prior
        } else {
            Fit::Families(mask)
        }
    }
}

impl Table {
    /// Parse a table, dropping configs that are not compiled candidates of their family (and
    /// entries left empty).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut t: Table = serde_json::from_str(text).map_err(|e| format!("not a tuning table: {e}"))?;
        if t.format != FORMAT {
            return Err(format!("table format {} (this build reads {FORMAT})", t.format));
        }
        t.fixed.retain(|f, c| f.candidates().contains(c));
        for e in &mut t.entries {
            e.ranking.retain(|(c, r)| e.family.candidates().contains(c) && r.is_finite());
        }
        t.entries.retain(|e| !e.ranking.is_empty());
        t.plans.retain(|p| matches!(p.family, Family::Fwd | Family::FwdEnt) && p.family.candidates().contains(&p.config) && p.splits >= 1);
        Ok(t)
    }

    /// The shipped table for `device`: its own model's (`Fit::Exact` when it timed these
    /// kernels, `Fit::Families` when it timed some families' kernels as they are, else
    /// `Fit::Prior`), else, on another sm90 device, the first shipped table as a
    /// prior; none before sm90 (only the `mma.sync` configs run there, and the tables do not
    /// rank them).
    pub fn shipped(device: &DeviceInfo) -> Option<(Table, Fit)> {
        if device.cc.0 != 9 {
            return None;
        }
        let tables: Vec<Table> = SHIPPED.iter().filter_map(|(_, text)| Table::parse(text).ok()).collect();
        if let Some(t) = tables.iter().find(|t| t.device == device.name) {
            let fit =
                if t.ptx_hash == crate::ptx::ptx_hash() { Fit::Exact } else { Fit::of_families(&t.family_hashes, crate::ptx::family_hash) };
            return Some((t.clone(), fit));
        }
        tables.into_iter().next().map(|t| (t, Fit::Prior))
    }

    /// The entry measured at exactly `key`'s family, bucket, `d` and `v`.
    pub fn exact(&self, key: &TuneKey) -> Option<&TableEntry> {
        self.entries.iter().find(|e| e.family == key.family && e.bucket == key.bucket.tokens() && e.d == key.d && e.v == key.v)
    }

    /// Up to `n` entries of `key`'s family, nearest first: distance
    /// `|log₂ Δbucket| + 2·|log₂ Δd| + |log₂ Δv|` (d changes the tile economics most).
    pub fn nearest(&self, key: &TuneKey, n: usize) -> Vec<&TableEntry> {
        let l = |a: u32, b: u32| ((a.max(1) as f64) / (b.max(1) as f64)).log2().abs();
        let mut es: Vec<(f64, &TableEntry)> = self
            .entries
            .iter()
            .filter(|e| e.family == key.family)
            .map(|e| (l(e.bucket, key.bucket.tokens()) + 2.0 * l(e.d, key.d) + l(e.v, key.v), e))
            .collect();
        es.sort_by(|a, b| a.0.total_cmp(&b.0));
        es.into_iter().take(n).map(|(_, e)| e).collect()
    }

    /// The shortlist for `key`: the configs within `within` of the best at the `n` nearest
    /// entries (at most `cap`, in order of first appearance: nearest entry's best first).
    pub fn shortlist(&self, key: &TuneKey, n: usize, within: f64, cap: usize) -> Vec<TileConfig> {
        let mut out: Vec<TileConfig> = Vec::new();
        for e in self.nearest(key, n) {
            for &(c, r) in &e.ranking {
                if r <= within && !out.contains(&c) && out.len() < cap {
                    out.push(c);
                }
            }
        }
        out
    }

    /// The plan measured for `family` at `p`'s key (its token bucket, `d`, `v`) with `config`, if
    /// any. Asked on every forward call, so it builds no [`TuneKey`].
    pub fn plan(&self, family: Family, p: Problem, config: TileConfig) -> Option<&PlanEntry> {
        let bucket = TokenBucket::of(p.t).tokens();
        self.plans
            .iter()
            .find(|e| e.family == family && e.bucket == bucket && e.d as usize == p.d && e.v as usize == p.v && e.config == config)
    }

    /// The family's best fixed config, if the table has one.
    pub fn fixed(&self, family: Family) -> Option<TileConfig> {
        self.fixed.get(&family).copied()
    }

    /// Whether table mode takes `family`'s fixed config at every key (see [`Table::fixed_only`]).
    pub fn fixed_only(&self, family: Family) -> bool {
        self.fixed_only.contains(&family)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmhead_core::{Problem, TokenBucket};

    fn key(family: Family, t: usize, v: usize, d: usize) -> TuneKey {
        TuneKey::new(family, Problem::new(t, v, d), false)
    }

    #[test]
    fn the_shipped_tables_parse_and_name_only_compiled_candidates() {
        for (name, text) in SHIPPED {
            let t = Table::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let raw: Table = serde_json::from_str(text).unwrap();
            assert_eq!(t, raw, "{name} names configs this build does not compile");
            assert!(!t.entries.is_empty(), "{name}");
            for f in Family::ALL {
                assert!(t.fixed(f).is_some_and(|c| c.is_sm90()), "{name}: no sm90 fixed config for {f:?}");
            }
            assert_eq!(t.ptx_hash.len(), 16, "{name}: no PTX hash");
            // The steady-state sweep's finding (docs/PERFORMANCE.md): the d-logits picks lost.
            assert!(t.fixed_only(Family::BwdDlogits) && t.fixed_only(Family::BwdDlogitsEnt), "{name}");
            let now = crate::ptx::family_hashes();
            if t.ptx_hash == crate::ptx::ptx_hash() {
                // Stamped for these kernels: its family hashes must be these kernels' too.
                assert_eq!(&t.family_hashes, now, "{name}: family hashes of other kernels");
            } else {
                // Not an error: the table then serves as a prior (shortlists are timed), exact
                // for the families whose kernels are unchanged. A new `lmhead-bench tune-table`
                // run on the GPU brings back zero-trial picks.
                let fit = Fit::of_families(&t.family_hashes, |f| now[&f].clone());
                println!("note: {name} timed other kernels ({} ≠ {}): {fit:?}", t.ptx_hash, crate::ptx::ptx_hash());
            }
            for e in &t.entries {
                assert!((e.ranking[0].1 - 1.0).abs() < 1e-9, "{name}: {e:?} does not start at 1.0");
                assert!(e.ranking.windows(2).all(|w| w[0].1 <= w[1].1), "{name}: {e:?} not sorted");
                assert!(TokenBucket::of(e.bucket as usize).tokens() == e.bucket, "{name}: bucket {}", e.bucket);
            }
        }
    }

    #[test]
    fn a_fit_is_exact_for_the_families_whose_kernels_match() {
        let hash = |f: Family| format!("{f:?}-now");
        let mut t: BTreeMap<Family, String> = BTreeMap::new();
        assert_eq!(Fit::of_families(&t, hash), Fit::Prior);
        t.insert(Family::Fwd, hash(Family::Fwd));
        t.insert(Family::BwdDh, "other".into());
        let fit = Fit::of_families(&t, hash);
        assert!(matches!(fit, Fit::Families(_)), "{fit:?}");
        for f in Family::ALL {
            assert_eq!(fit.exact_for(f), f == Family::Fwd, "{f:?}");
            assert!(Fit::Exact.exact_for(f) && !Fit::Prior.exact_for(f));
        }
    }

    #[test]
    fn exact_nearest_and_shortlist() {
        let c = Family::Fwd.candidates();
        let entry = |bucket, d, v, ranking: Vec<(TileConfig, f64)>| TableEntry { family: Family::Fwd, bucket, d, v, ranking };
        let t = Table {
            format: FORMAT,
            device: "X".into(),
            source: String::new(),
            ptx_hash: String::new(),
            family_hashes: BTreeMap::new(),
            fixed: BTreeMap::new(),
            fixed_only: Vec::new(),
            plans: Vec::new(),
            entries: vec![
                entry(2048, 2048, 248_320, vec![(c[7], 1.0), (c[8], 1.01), (c[9], 1.2)]),
                entry(4096, 4096, 128_256, vec![(c[9], 1.0), (c[8], 1.03)]),
            ],
        };
        assert_eq!(t.exact(&key(Family::Fwd, 2000, 248_320, 2048)).unwrap().ranking[0].0, c[7]);
        assert!(t.exact(&key(Family::Fwd, 2000, 248_000, 2048)).is_none());
        assert!(t.exact(&key(Family::FwdEnt, 2000, 248_320, 2048)).is_none());
        // d = 4096 at bucket 2048: the d = 4096 entry is nearer (d weighs double).
        let near = t.nearest(&key(Family::Fwd, 2048, 248_320, 4096), 2);
        assert_eq!(near[0].d, 4096);
        assert_eq!(t.shortlist(&key(Family::Fwd, 2048, 248_320, 4096), 2, 1.05, 4), vec![c[9], c[8], c[7]]);
        assert_eq!(t.shortlist(&key(Family::Fwd, 2048, 248_320, 4096), 2, 1.05, 2), vec![c[9], c[8]]);
    }

    #[test]
    fn plans_match_family_bucket_shape_and_config_and_bad_ones_are_dropped() {
        let (c, e) = (Family::Fwd.candidates(), Family::FwdEnt.candidates());
        let other = *Family::BwdDh.candidates().iter().find(|x| !c.contains(x)).expect("a dh-only config");
        let plan = |family, config, splits| serde_json::json!({"family": family, "bucket": 131072, "d": 4096, "v": 128256, "config": config, "splits": splits, "raster": 11, "ratio": 0.94});
        let text = serde_json::json!({
            "format": FORMAT, "device": "X", "source": "", "fixed": {}, "entries": [],
            "plans": [plan(Family::Fwd, c[9], 12), plan(Family::FwdEnt, e[9], 12),
                      // not a forward family, a config of another family, no splits
                      plan(Family::BwdDh, c[9], 12), plan(Family::Fwd, other, 12), plan(Family::Fwd, c[8], 0)],
        });
        let t = Table::parse(&text.to_string()).unwrap();
        assert_eq!(t.plans.len(), 2, "{:?}", t.plans);
        let p = t.plan(Family::Fwd, Problem::new(100_000, 128_256, 4096), c[9]).expect("same bucket, shape and config");
        assert_eq!((p.splits, p.raster), (12, 11));
        assert!(t.plan(Family::FwdEnt, Problem::new(131_072, 128_256, 4096), e[9]).is_some());
        assert!(t.plan(Family::Fwd, Problem::new(131_072, 128_256, 4096), c[8]).is_none(), "another config");
        assert!(t.plan(Family::Fwd, Problem::new(262_144, 128_256, 4096), c[9]).is_none(), "another bucket");
        assert!(t.plan(Family::Fwd, Problem::new(131_072, 64_128, 4096), c[9]).is_none(), "another vocab");
        assert!(t.plan(Family::Fwd, Problem::new(131_072, 128_256, 5120), c[9]).is_none(), "another d");
        // A table without plans reads as before and writes no `plans` field.
        let t = Table { plans: Vec::new(), ..t };
        assert!(!serde_json::to_string(&t).unwrap().contains("plans"));
    }

    #[test]
    fn stale_configs_are_dropped() {
        let good = Family::Fwd.candidates()[7];
        let bad = TileConfig { bm: 8, ..good };
        let text = serde_json::json!({
            "format": FORMAT, "device": "X", "source": "",
            "fixed": {"Fwd": bad, "FwdEnt": good},
            "entries": [{"family": "Fwd", "bucket": 2048, "d": 64, "v": 64, "ranking": [[bad, 1.0]]},
                        {"family": "FwdEnt", "bucket": 2048, "d": 64, "v": 64, "ranking": [[bad, 1.0], [good, 1.1]]}],
        })
        .to_string();
        let t = Table::parse(&text).unwrap();
        assert_eq!(t.fixed(Family::Fwd), None);
        assert_eq!(t.fixed(Family::FwdEnt), Some(good));
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.entries[0].ranking, vec![(good, 1.1)]);
        assert!(Table::parse("{}").is_err());
    }
}
