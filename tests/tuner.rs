//! The tuner's logic against fake trials (no GPU): slow, failing and wrong candidates; the
//! persistent cache's round trip, corruption, staleness, unwritable directories and concurrent
//! writers.

use lmhead::tune::cache::{Cache, Header};
use lmhead::tune::{Choice, Outcome, Trial, TuneKey, Tuner};
use lmhead::{Error, Family, Problem, TileConfig};

fn key(t: usize) -> TuneKey {
    TuneKey::new(Family::Fwd, Problem::new(t, 32000, 4096), false)
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lmhead-tuner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A fake launcher: candidate i takes `times[i]` ms and answers `answers[i]`; `None` fails.
fn fake(times: Vec<f64>, answers: Vec<Option<f64>>) -> impl FnMut(TileConfig) -> lmhead::Result<Trial> {
    move |c| {
        let i = Family::Fwd.candidates().iter().position(|&x| x == c).unwrap();
        match answers[i] {
            None => Err(Error::Config(format!("candidate {i} failed to launch"))),
            Some(a) => Ok(Trial { ms: times[i], check: vec![a, 1.0, 2.0] }),
        }
    }
}

#[test]
fn picks_the_fastest_correct_candidate_and_records_why() {
    let n = Family::Fwd.candidates().len();
    assert!(n >= 4);
    let mut times: Vec<f64> = (0..n).map(|i| 10.0 + i as f64).collect();
    let mut answers: Vec<Option<f64>> = vec![Some(1.0); n];
    times[1] = 1.0; // fastest but wrong
    answers[1] = Some(5.0);
    times[2] = 2.0; // second fastest but fails
    answers[2] = None;
    times[3] = 3.0; // the winner
    let tuner = Tuner::new(true, None, Cache::open(None, "fake"));
    let w = tuner.pick(&key(3000), Choice::Auto, &mut fake(times, answers)).unwrap();
    assert_eq!(w, Family::Fwd.candidates()[3]);
    let e = tuner.entry(&key(3000)).unwrap();
    assert!(matches!(e.candidates[1].1, Outcome::Wrong { .. }), "{:?}", e.candidates[1]);
    assert!(matches!(e.candidates[2].1, Outcome::Failed { .. }));
    assert!(matches!(e.candidates[3].1, Outcome::Timed { ms, .. } if ms == 3.0));
    // Same bucket: no new trials.
    let again = tuner.pick(&key(4000), Choice::Auto, &mut |_| panic!("same bucket must not retune")).unwrap();
    assert_eq!(again, w);
    // Next bucket: tunes again.
    let mut calls = 0;
    tuner
        .pick(&key(4097), Choice::Auto, &mut |c| {
            calls += 1;
            Ok(Trial { ms: 1.0 + c.bm as f64, check: vec![1.0] })
        })
        .unwrap();
    assert!(calls > 0);
}

/// A candidate that is fast only in its first timing (a transient) loses to a steadily fast
/// one in the confirmation rounds; a contender that fails when run again is out of the running;
/// candidates far behind are timed once.
#[test]
fn confirmation_rounds_overrule_a_lucky_first_timing() {
    use lmhead::tune::{CONFIRM_ROUNDS, CONFIRM_WITHIN};
    let cands = Family::Fwd.candidates();
    let n = cands.len();
    assert!(n >= 4);
    let mut calls = vec![0usize; n];
    let tuner = Tuner::new(true, None, Cache::open(None, "fake"));
    let w = tuner
        .pick(&key(3000), Choice::Auto, &mut |c| {
            let i = cands.iter().position(|&x| x == c).unwrap();
            calls[i] += 1;
            let ms = match (i, calls[i]) {
                (0, 1) => 0.95, // lucky once
                (0, _) => 1.3,
                (1, _) => 1.0,  // steady
                (2, 1) => 1.05, // a contender that breaks on its second run
                (2, _) => return Err(Error::Config("launch failed".into())),
                _ => 10.0 + i as f64,
            };
            Ok(Trial { ms, check: vec![1.0, 2.0] })
        })
        .unwrap();
    assert_eq!(w, cands[1], "the steadily fast candidate wins");
    const { assert!(1.05 <= 0.95 * CONFIRM_WITHIN && 1.0 <= 0.95 * CONFIRM_WITHIN) };
    assert_eq!(calls[0], 1 + CONFIRM_ROUNDS);
    assert_eq!(calls[1], 1 + CONFIRM_ROUNDS);
    assert_eq!(calls[2], 2, "no more rounds once it failed");
    assert!(calls[3..].iter().all(|&k| k == 1), "far-behind candidates timed once: {calls:?}");
    let e = tuner.entry(&key(3000)).unwrap();
    assert!(matches!(&e.candidates[0].1, Outcome::Timed { ms, confirm } if *ms == 1.3 && confirm.len() == CONFIRM_ROUNDS));
    assert!(matches!(&e.candidates[2].1, Outcome::Failed { .. }), "{:?}", e.candidates[2]);
}

#[test]
fn disabled_fallback_and_fixed() {
    let tuner = Tuner::new(false, None, Cache::open(None, "fake"));
    let mut never = |_: TileConfig| -> lmhead::Result<Trial> { panic!("tuning is disabled") };
    assert_eq!(tuner.pick(&key(10), Choice::Auto, &mut never).unwrap(), Family::Fwd.fallback());
    assert_eq!(tuner.pick(&key(10), Choice::Fallback, &mut never).unwrap(), Family::Fwd.fallback());
    let c = Family::Fwd.candidates()[2];
    assert_eq!(tuner.pick(&key(10), Choice::Fixed(c), &mut never).unwrap(), c);
    let bogus = TileConfig { bm: 48, bn: 48, bk: 48, stages: 1, warps_m: 1, warps_n: 1, mainloop: lmhead::Mainloop::MmaSync };
    assert!(matches!(tuner.pick(&key(10), Choice::Fixed(bogus), &mut never), Err(Error::Config(_))));
}

#[test]
fn every_candidate_failing_is_an_error_not_a_panic() {
    let tuner = Tuner::new(true, None, Cache::open(None, "fake"));
    let r = tuner.pick(&key(10), Choice::Auto, &mut |_| Err(Error::Config("broken".into())));
    assert!(matches!(r, Err(Error::Config(_))));
}

#[test]
fn cache_round_trip_across_instances() {
    let dir = tmpdir("roundtrip");
    let path = dir.join("dev.json");
    let t1 = Tuner::new(true, None, Cache::open(Some(path.clone()), "dev"));
    let n = Family::Fwd.candidates().len();
    let w = t1.pick(&key(100), Choice::Auto, &mut fake((0..n).map(|i| 5.0 - i as f64 * 0.1).collect(), vec![Some(1.0); n])).unwrap();
    // A new process (a new cache instance) reads the winner without timing anything.
    let t2 = Tuner::new(true, None, Cache::open(Some(path.clone()), "dev"));
    assert_eq!(t2.pick(&key(100), Choice::Auto, &mut |_| panic!("cached")).unwrap(), w);
    assert_eq!(t2.entry(&key(100)).unwrap().candidates.len(), n, "every timing is kept");
}

#[test]
fn corrupt_truncated_and_stale_files_are_retuned() {
    let dir = tmpdir("corrupt");
    let path = dir.join("dev.json");
    let n = Family::Fwd.candidates().len();
    let t = Tuner::new(true, None, Cache::open(Some(path.clone()), "dev"));
    t.pick(&key(100), Choice::Auto, &mut fake(vec![1.0; n], vec![Some(1.0); n])).unwrap();
    let good = std::fs::read_to_string(&path).unwrap();
    for bad in [good[..good.len() / 2].to_string(), "not json at all".to_string(), String::new()] {
        std::fs::write(&path, &bad).unwrap();
        let c = Cache::open(Some(path.clone()), "dev");
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        let t = Tuner::new(true, None, c);
        let mut calls = 0;
        t.pick(&key(100), Choice::Auto, &mut |_| {
            calls += 1;
            Ok(Trial { ms: 1.0, check: vec![1.0] })
        })
        .unwrap();
        assert!(calls > 0, "a corrupt cache must be retuned");
    }
    // Another build's kernels (different PTX hash): stale, retuned.
    std::fs::write(&path, &good).unwrap();
    let other = Header { ptx_hash: "0000".into(), ..Header::current("dev") };
    let c = Cache::open_with_header(Some(path.clone()), other);
    assert_eq!(c.warnings.len(), 1);
    assert!(c.get(&key(100)).is_none());
}

#[test]
fn unwritable_directory_keeps_results_in_memory() {
    let dir = tmpdir("ro");
    let blocker = dir.join("file");
    std::fs::write(&blocker, "x").unwrap();
    // A path whose parent is a regular file cannot be created.
    let c = Cache::open(Some(blocker.join("sub").join("dev.json")), "dev");
    let t = Tuner::new(true, None, c);
    let w = t.pick(&key(100), Choice::Auto, &mut |_| Ok(Trial { ms: 1.0, check: vec![1.0] })).unwrap();
    assert_eq!(t.pick(&key(100), Choice::Auto, &mut |_| panic!("in memory")).unwrap(), w);
}

#[test]
fn concurrent_writers_keep_both_results() {
    let dir = tmpdir("concurrent");
    let path = dir.join("dev.json");
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let path = path.clone();
            std::thread::spawn(move || {
                let t = Tuner::new(true, None, Cache::open(Some(path), "dev"));
                for j in 0..5 {
                    let k = key(1usize << (8 + (i * 5 + j) % 14));
                    t.pick(&k, Choice::Auto, &mut |_| Ok(Trial { ms: 1.0, check: vec![1.0] })).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let c = Cache::open(Some(path), "dev");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let buckets: std::collections::BTreeSet<_> = c.all().keys().map(|k| k.bucket).collect();
    assert_eq!(buckets.len(), 14, "every writer's keys survive: {buckets:?}");
}

#[test]
fn pruning_table_is_printable() {
    let t = Tuner::new(true, None, Cache::open(None, "fake"));
    let table = t.prune(Family::FwdEnt, Problem::new(4096, 128256, 4096));
    assert_eq!(table.len(), Family::FwdEnt.candidates().len());
    for (c, r) in table {
        println!("{:<40} {}", lmhead_core::config::kernel_name(Family::FwdEnt, c), r.map(|_| "kept".to_string()).unwrap_or_else(|e| e));
    }
}

// ---------------------------------------------------------------------------------------------
// Table mode (the shipped table of tuned configs)
// ---------------------------------------------------------------------------------------------

mod table_mode {
    use super::*;
    use lmhead::tune::table::{Fit, Table, TableEntry};
    use lmhead::tune::{Mode, SHORTLIST_CAP};
    use lmhead::DeviceInfo;
    use std::collections::BTreeMap;

    fn h200() -> DeviceInfo {
        DeviceInfo {
            name: "NVIDIA H200".into(),
            cc: (9, 0),
            sm_count: 132,
            max_smem_optin: 232_448,
            driver_version: 13_000,
            l2_bytes: 60 << 20,
        }
    }

    fn sm90() -> Vec<TileConfig> {
        Family::Fwd.candidates().iter().copied().filter(|c| c.is_sm90()).collect()
    }

    /// A table with one Fwd key (t bucket 4096, v 32000, d 4096): sm90[1] wins, sm90[0] 2% behind
    /// (and is the best fixed config).
    fn table() -> Table {
        table_with_fixed(sm90()[0])
    }

    fn table_with_fixed(f: TileConfig) -> Table {
        let s = sm90();
        let mut fixed = BTreeMap::new();
        fixed.insert(Family::Fwd, f);
        Table {
            format: lmhead::tune::table::FORMAT,
            device: "NVIDIA H200".into(),
            source: "test".into(),
            ptx_hash: String::new(),
            family_hashes: Default::default(),
            fixed,
            fixed_only: Vec::new(),
            plans: Vec::new(),
            entries: vec![TableEntry { family: Family::Fwd, bucket: 4096, d: 4096, v: 32000, ranking: vec![(s[1], 1.0), (s[0], 1.02)] }],
        }
    }

    fn tuner(enabled: bool, fit: Fit, mode: Mode) -> Tuner {
        Tuner::new(enabled, Some(h200()), Cache::open(None, "fake")).with_table(Some((table(), fit)), mode)
    }

    /// Counts trials per candidate; sm90 configs take 1 ms + their index, mma.sync 10 ms.
    fn counting(calls: &mut BTreeMap<String, usize>) -> impl FnMut(TileConfig) -> lmhead::Result<Trial> + '_ {
        move |c| {
            *calls.entry(c.suffix(Family::Fwd)).or_default() += 1;
            let i = Family::Fwd.candidates().iter().position(|&x| x == c).unwrap() as f64;
            Ok(Trial { ms: if c.is_sm90() { 1.0 + 0.01 * i } else { 10.0 }, check: vec![1.0] })
        }
    }

    #[test]
    fn an_exact_key_on_the_measured_device_takes_the_table_winner_without_trials() {
        let t = tuner(true, Fit::Exact, Mode::Table);
        let w = t.pick(&key(3000), Choice::Auto, &mut |_| panic!("a table hit must not time anything")).unwrap();
        assert_eq!(w, sm90()[1]);
        let e = t.entry(&key(3000)).unwrap();
        assert!(e.candidates.iter().all(|(_, o)| matches!(o, Outcome::Table { .. })), "{e:?}");
        // As a prior only (another device model): the shortlist is timed.
        let t = tuner(true, Fit::Prior, Mode::Table);
        let mut calls = BTreeMap::new();
        t.pick(&key(3000), Choice::Auto, &mut counting(&mut calls)).unwrap();
        assert!(!calls.is_empty());
    }

    /// A table whose PTX differs as a whole but whose Fwd kernels are the ones it timed
    /// (`Fit::Families`): exact for Fwd, a prior for any other family.
    #[test]
    fn a_family_whose_kernels_are_unchanged_keeps_the_table_exact() {
        // The build's hashes: "now" for every family; the table timed these Fwd kernels only.
        let only = |family: Family| Fit::of_families(&BTreeMap::from([(family, "now".to_string())]), |_| "now".into());
        let t = tuner(true, only(Family::Fwd), Mode::Table);
        let w = t.pick(&key(3000), Choice::Auto, &mut |_| panic!("an exact family must not time anything")).unwrap();
        assert_eq!(w, sm90()[1]);
        let t = tuner(true, only(Family::BwdDh), Mode::Table);
        let mut calls = BTreeMap::new();
        t.pick(&key(3000), Choice::Auto, &mut counting(&mut calls)).unwrap();
        assert!(!calls.is_empty(), "Fwd's kernels changed: its shortlist is timed");
    }

    #[test]
    fn another_key_times_only_the_shortlist_and_never_mma_sync_on_sm90() {
        let t = tuner(true, Fit::Exact, Mode::Table);
        let mut calls = BTreeMap::new();
        let k = key(9000); // bucket 16384: not in the table
        let w = t.pick(&k, Choice::Auto, &mut counting(&mut calls)).unwrap();
        let s = sm90();
        assert_eq!(w, s[0], "the faster of the shortlist by the fake times");
        let timed: Vec<&String> = calls.keys().collect();
        assert_eq!(timed.len(), 2.min(SHORTLIST_CAP), "only the table's two configs within 5%: {calls:?}");
        assert!(calls.keys().all(|n| n.contains("tma")), "no mma.sync trial: {calls:?}");
        let e = t.entry(&k).unwrap();
        let pruned = e.candidates.iter().filter(|(_, o)| matches!(o, Outcome::Pruned { .. })).count();
        assert_eq!(pruned, Family::Fwd.candidates().len() - 2, "{e:?}");
    }

    #[test]
    fn a_shortlist_that_does_not_run_falls_back_to_the_rest() {
        let t = tuner(true, Fit::Exact, Mode::Table);
        let s = sm90();
        let short = [s[0], s[1]];
        let mut tried = Vec::new();
        let w = t
            .pick(&key(9000), Choice::Auto, &mut |c| {
                tried.push(c);
                if short.contains(&c) {
                    Err(Error::Config("does not launch".into()))
                } else {
                    Ok(Trial { ms: if c.is_sm90() { 1.0 } else { 5.0 }, check: vec![1.0] })
                }
            })
            .unwrap();
        assert!(!short.contains(&w) && w.is_sm90(), "{w:?}");
        // (Configs within the confirmation margin of the best are timed again: count each once.)
        let distinct: std::collections::BTreeSet<_> = tried.iter().collect();
        assert_eq!(distinct.len(), Family::Fwd.candidates().len(), "every candidate tried once the shortlist failed");
    }

    #[test]
    fn untuned_calls_use_the_best_fixed_config_when_it_loads() {
        let mut t = tuner(false, Fit::Exact, Mode::Table);
        let mut never = |_: TileConfig| -> lmhead::Result<Trial> { panic!("tuning is disabled") };
        assert_eq!(t.pick(&key(10), Choice::Auto, &mut never).unwrap(), sm90()[0]);
        assert_eq!(t.pick(&key(10), Choice::Fallback, &mut never).unwrap(), Family::Fwd.fallback());
        // Where the sm90 kernels do not load (a JIT that rejects them): the mma.sync fallback.
        t.set_loads(std::sync::Arc::new(|_, c: TileConfig| !c.is_sm90()));
        assert_eq!(t.pick(&key(10), Choice::Auto, &mut never).unwrap(), Family::Fwd.fallback());
    }

    #[test]
    fn a_tuning_without_scratch_memory_uses_the_fixed_config_uncached() {
        let t = tuner(true, Fit::Exact, Mode::Table);
        let oom = |_: TileConfig| -> lmhead::Result<Trial> { Err(Error::OutOfMemory { what: "tuning partials", bytes: 1 << 40 }) };
        assert_eq!(t.pick(&key(9000), Choice::Auto, &mut { oom }).unwrap(), sm90()[0]);
        assert!(t.entry(&key(9000)).is_none(), "not cached");
        // A kernel failure is still an error.
        let broken = |_: TileConfig| -> lmhead::Result<Trial> { Err(Error::Config("broken".into())) };
        assert!(matches!(t.pick(&key(9000), Choice::Auto, &mut { broken }), Err(Error::Config(_))));
    }

    #[test]
    fn exhaustive_mode_times_every_candidate() {
        let t = tuner(true, Fit::Exact, Mode::Exhaustive);
        let mut calls = BTreeMap::new();
        t.pick(&key(3000), Choice::Auto, &mut counting(&mut calls)).unwrap();
        assert_eq!(calls.len(), Family::Fwd.candidates().len(), "{calls:?}");
    }

    #[test]
    fn a_key_beyond_the_table_whose_trials_would_be_sliced_takes_the_fixed_config_untimed() {
        let t = tuner(true, Fit::Exact, Mode::Table);
        let k = key(9000);
        let w = t.pick_sliced(&k, Choice::Auto, true, &mut |_| panic!("no trial on a slice")).unwrap();
        assert_eq!(w, sm90()[0], "the table's best fixed config");
        let e = t.entry(&k).unwrap();
        assert_eq!(e.candidates, vec![(w, Outcome::Fixed)], "cached, and says why");
        assert_eq!(e.timed(), 0);
        // A key the table holds still takes the table's winner.
        assert_eq!(t.pick_sliced(&key(3000), Choice::Auto, true, &mut |_| panic!("table hit")).unwrap(), sm90()[1]);
        // Exhaustive mode times every candidate whatever the trial's size.
        let t = tuner(true, Fit::Exact, Mode::Exhaustive);
        let mut calls = BTreeMap::new();
        t.pick_sliced(&k, Choice::Auto, true, &mut counting(&mut calls)).unwrap();
        assert_eq!(calls.len(), Family::Fwd.candidates().len());
    }

    #[test]
    fn the_best_fixed_config_runs_in_every_shortlist() {
        let s = sm90();
        let f = s[2];
        let t = Tuner::new(true, Some(h200()), Cache::open(None, "fake")).with_table(Some((table_with_fixed(f), Fit::Exact)), Mode::Table);
        let mut calls = BTreeMap::new();
        t.pick(&key(9000), Choice::Auto, &mut counting(&mut calls)).unwrap();
        assert!(calls.contains_key(&f.suffix(Family::Fwd)), "the fixed config was timed: {calls:?}");
        assert_eq!(calls.len(), 3, "the two shortlisted configs and the fixed one: {calls:?}");
    }

    #[test]
    fn a_fixed_only_family_takes_its_fixed_config_even_at_a_key_the_table_holds() {
        let s = sm90();
        let mut table = table();
        table.fixed_only = vec![Family::Fwd];
        let t = Tuner::new(true, Some(h200()), Cache::open(None, "fake")).with_table(Some((table, Fit::Exact)), Mode::Table);
        let w = t.pick(&key(3000), Choice::Auto, &mut |_| panic!("no trial for a fixed-only family")).unwrap();
        assert_eq!(w, s[0], "the fixed config, not the table's winner s[1]");
        assert_eq!(t.entry(&key(3000)).unwrap().candidates, vec![(s[0], Outcome::Fixed)]);
        assert_eq!(t.pick(&key(9000), Choice::Auto, &mut |_| panic!("none beyond the table either")).unwrap(), s[0]);
    }
}
