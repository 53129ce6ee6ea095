//! The tuner's logic against fake trials (no GPU): its policies (off, the rules' short list,
//! exhaustive), slow, failing and wrong candidates, problems too large to time, streams being
//! captured; the persistent cache's round trip, corruption, staleness, unwritable directories
//! and concurrent writers.

use std::collections::BTreeMap;

use lmhead::tune::cache::{Cache, Header};
use lmhead::tune::{CanTime, Choice, Outcome, Policy, Trial, TuneKey, Tuner};
use lmhead::{DeviceInfo, Error, Family, Problem, TileConfig};
use lmhead_core::heuristics;

fn key(t: usize) -> TuneKey {
    TuneKey::new(Family::Fwd, Problem::new(t, 32000, 4096), false)
}

fn h200() -> DeviceInfo {
    DeviceInfo {
        name: "NVIDIA H200".into(),
        cc: (9, 0),
        sm_count: 132,
        max_smem_optin: 232_448,
        driver_version: 13_000,
        l2_bytes: 60 << 20,
        module: lmhead::ptx::Module::Hopper,
    }
}

fn h100() -> DeviceInfo {
    DeviceInfo { name: "NVIDIA H100 80GB HBM3".into(), sm_count: 132, l2_bytes: 50 << 20, ..h200() }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lmhead-tuner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tuner(policy: Policy) -> Tuner {
    Tuner::new(policy, Some(h200()), Cache::open(None, "fake"))
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

/// Counts trials per candidate; sm90 configs take 1 ms + 0.01 × their index, mma.sync 10 ms.
fn counting(calls: &mut BTreeMap<String, usize>) -> impl FnMut(TileConfig) -> lmhead::Result<Trial> + '_ {
    move |c| {
        *calls.entry(c.suffix(Family::Fwd)).or_default() += 1;
        let i = Family::Fwd.candidates().iter().position(|&x| x == c).unwrap() as f64;
        Ok(Trial { ms: if c.is_sm90() { 1.0 + 0.01 * i } else { 10.0 }, check: vec![1.0] })
    }
}

fn never(_: TileConfig) -> lmhead::Result<Trial> {
    panic!("no trial may run here")
}

// ---------------------------------------------------------------------------------------------
// Exhaustive (benches): every candidate, judged
// ---------------------------------------------------------------------------------------------

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
    let tuner = Tuner::new(Policy::Exhaustive, None, Cache::open(None, "fake"));
    let w = tuner.pick(&key(3000), Choice::Auto, CanTime::Yes, &mut fake(times, answers)).unwrap();
    assert_eq!(w, Family::Fwd.candidates()[3]);
    let e = tuner.entry(&key(3000)).unwrap();
    assert!(matches!(e.candidates[1].1, Outcome::Wrong { .. }), "{:?}", e.candidates[1]);
    assert!(matches!(e.candidates[2].1, Outcome::Failed { .. }));
    assert!(matches!(e.candidates[3].1, Outcome::Timed { ms, .. } if ms == 3.0));
    // Same bucket: no new trials.
    let again = tuner.pick(&key(4000), Choice::Auto, CanTime::Yes, &mut never).unwrap();
    assert_eq!(again, w);
    // Next bucket: tunes again, whatever the trial's size (benches time the real shape).
    let mut calls = 0;
    tuner
        .pick(&key(4097), Choice::Auto, CanTime::TooLarge, &mut |c| {
            calls += 1;
            let i = Family::Fwd.candidates().iter().position(|&x| x == c).unwrap();
            Ok(Trial { ms: 1.0 + 10.0 * i as f64, check: vec![1.0] })
        })
        .unwrap();
    assert_eq!(calls, n, "every candidate once (one contender, no rounds)");
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
    let tuner = Tuner::new(Policy::Exhaustive, None, Cache::open(None, "fake"));
    let w = tuner
        .pick(&key(3000), Choice::Auto, CanTime::Yes, &mut |c| {
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
fn every_candidate_failing_is_an_error_not_a_panic() {
    for policy in [Policy::Exhaustive, Policy::Shortlist] {
        let r = tuner(policy).pick(&key(10), Choice::Auto, CanTime::Yes, &mut |_| Err(Error::Config("broken".into())));
        assert!(matches!(r, Err(Error::Config(_))), "{policy:?}: {r:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Off (the default where the rules were measured): the rule's pick
// ---------------------------------------------------------------------------------------------

#[test]
fn off_takes_the_rule_and_caches_nothing() {
    let t = tuner(Policy::Off);
    let rule = heuristics::config(Family::Fwd, key(10).problem(), &heuristics::Device::H200);
    assert_eq!(t.pick(&key(10), Choice::Auto, CanTime::Yes, &mut never).unwrap(), rule);
    assert!(rule.is_sm90());
    assert!(t.entries().is_empty(), "nothing cached");
    assert_eq!(t.pick(&key(10), Choice::Fallback, CanTime::Yes, &mut never).unwrap(), Family::Fwd.fallback());
    let c = Family::Fwd.candidates()[2];
    assert_eq!(t.pick(&key(10), Choice::Fixed(c), CanTime::Yes, &mut never).unwrap(), c);
    let bogus = TileConfig { bm: 48, bn: 48, bk: 48, stages: 1, warps_m: 1, warps_n: 1, mainloop: lmhead::Mainloop::MmaSync };
    assert!(matches!(t.pick(&key(10), Choice::Fixed(bogus), CanTime::Yes, &mut never), Err(Error::Config(_))));
}

#[test]
fn where_the_hopper_kernels_do_not_load_the_portable_rules_pick() {
    let mut t = tuner(Policy::Off);
    t.set_loads(std::sync::Arc::new(|_, c: TileConfig| !c.is_sm90()));
    let p = key(10).problem();
    let want = heuristics::config(Family::Fwd, p, &heuristics::Device::H200.portable());
    assert_eq!(t.pick(&key(10), Choice::Auto, CanTime::Yes, &mut never).unwrap(), want);
    assert!(!want.is_sm90());
    assert_eq!(t.shortlist(Family::Fwd, p), heuristics::shortlist(Family::Fwd, p, &heuristics::Device::H200.portable()).as_slice());
    // Nothing loads: the family's fallback (whose launch then reports why).
    t.set_loads(std::sync::Arc::new(|_, _| false));
    assert_eq!(t.heuristic(Family::Fwd, p), Family::Fwd.fallback());
}

#[test]
fn the_default_policy_is_off_on_the_measured_device_only() {
    assert_eq!(Policy::for_device(&h200(), None), Policy::Off);
    assert_eq!(Policy::for_device(&h100(), None), Policy::Shortlist);
    assert_eq!(Policy::for_device(&h200(), Some("1")), Policy::Shortlist);
    assert_eq!(Policy::for_device(&h100(), Some(" 0 ")), Policy::Off);
    assert_eq!(Policy::for_device(&h100(), Some("yes")), Policy::Shortlist, "a bad value: the device's default");
}

// ---------------------------------------------------------------------------------------------
// The short list (the default elsewhere)
// ---------------------------------------------------------------------------------------------

#[test]
fn the_short_list_is_timed_and_never_mma_sync_on_sm90() {
    let t = tuner(Policy::Shortlist);
    let mut calls = BTreeMap::new();
    let w = t.pick(&key(9000), Choice::Auto, CanTime::Yes, &mut counting(&mut calls)).unwrap();
    let list = heuristics::shortlist(Family::Fwd, key(9000).problem(), &heuristics::Device::H200);
    let names: Vec<String> = list.as_slice().iter().map(|c| c.suffix(Family::Fwd)).collect();
    assert_eq!(calls.keys().cloned().collect::<Vec<_>>().len(), names.len(), "only the short list: {calls:?}");
    assert!(names.iter().all(|n| calls.contains_key(n)), "{calls:?}");
    assert!(calls.keys().all(|n| n.contains("tma")), "no mma.sync trial: {calls:?}");
    assert!(list.as_slice().contains(&w), "{w:?}");
    let e = t.entry(&key(9000)).unwrap();
    assert_eq!(e.candidates.len(), list.as_slice().len(), "{e:?}");
    assert!(e.timed() >= 1);
}

#[test]
fn a_short_list_that_does_not_run_falls_back_to_the_portable_one() {
    let t = tuner(Policy::Shortlist);
    let p = key(9000).problem();
    let portable = heuristics::shortlist(Family::Fwd, p, &heuristics::Device::H200.portable());
    let mut tried = Vec::new();
    let w = t
        .pick(&key(9000), Choice::Auto, CanTime::Yes, &mut |c| {
            tried.push(c);
            if c.is_sm90() {
                Err(Error::Config("does not launch".into()))
            } else {
                Ok(Trial { ms: 5.0 + c.bm as f64 / 100.0, check: vec![1.0] })
            }
        })
        .unwrap();
    assert!(portable.as_slice().contains(&w), "{w:?}");
    let distinct: std::collections::BTreeSet<_> = tried.iter().collect();
    let own = heuristics::shortlist(Family::Fwd, p, &heuristics::Device::H200);
    assert_eq!(distinct.len(), own.as_slice().len() + portable.as_slice().len(), "both short lists, never the whole list: {tried:?}");
    assert!(distinct.len() < Family::Fwd.candidates().len());
}

#[test]
fn a_problem_too_large_to_time_takes_the_rule_cached() {
    let t = tuner(Policy::Shortlist);
    let k = key(60_000);
    let w = t.pick(&k, Choice::Auto, CanTime::TooLarge, &mut never).unwrap();
    assert_eq!(w, heuristics::config(Family::Fwd, k.problem(), &heuristics::Device::H200));
    let e = t.entry(&k).unwrap();
    assert_eq!(e.candidates, vec![(w, Outcome::Heuristic)], "cached, and says why");
    assert_eq!(e.timed(), 0);
}

#[test]
fn a_stream_being_captured_runs_no_trial_and_caches_nothing() {
    let t = tuner(Policy::Shortlist);
    let w = t.pick(&key(3000), Choice::Auto, CanTime::Capturing, &mut never).unwrap();
    assert_eq!(w, heuristics::config(Family::Fwd, key(3000).problem(), &heuristics::Device::H200));
    assert!(t.entry(&key(3000)).is_none(), "the rule's pick under capture is not cached");
    assert!(!t.would_time(&key(3000), Choice::Auto, CanTime::Capturing));
    assert!(t.would_time(&key(3000), Choice::Auto, CanTime::Yes));
    // A key tuned before the capture answers from the cache.
    let mut calls = BTreeMap::new();
    let tuned = t.pick(&key(3000), Choice::Auto, CanTime::Yes, &mut counting(&mut calls)).unwrap();
    assert_eq!(t.pick(&key(3000), Choice::Auto, CanTime::Capturing, &mut never).unwrap(), tuned);
    // Benches' exhaustive tuning does not time under capture either.
    let x = Tuner::new(Policy::Exhaustive, None, Cache::open(None, "fake"));
    x.pick(&key(3000), Choice::Auto, CanTime::Capturing, &mut never).unwrap();
    assert!(x.entries().is_empty());
}

#[test]
fn a_short_list_of_one_is_not_timed() {
    let t = tuner(Policy::Shortlist);
    let k = TuneKey::new(Family::BwdDlogitsEnt, Problem::new(8192, 32768, 4096), false);
    assert_eq!(heuristics::shortlist(k.family, k.problem(), &heuristics::Device::H200).as_slice().len(), 1);
    let w = t.pick(&k, Choice::Auto, CanTime::Yes, &mut never).unwrap();
    assert_eq!(t.entry(&k).unwrap().candidates, vec![(w, Outcome::Heuristic)]);
}

#[test]
fn a_tuning_without_scratch_memory_uses_the_rule_uncached() {
    let t = tuner(Policy::Shortlist);
    let oom = |_: TileConfig| -> lmhead::Result<Trial> { Err(Error::OutOfMemory { what: "tuning partials", bytes: 1 << 40 }) };
    let w = t.pick(&key(9000), Choice::Auto, CanTime::Yes, &mut { oom }).unwrap();
    assert_eq!(w, heuristics::config(Family::Fwd, key(9000).problem(), &heuristics::Device::H200));
    assert!(t.entry(&key(9000)).is_none(), "not cached");
    // A kernel failure is still an error.
    let broken = |_: TileConfig| -> lmhead::Result<Trial> { Err(Error::Config("broken".into())) };
    assert!(matches!(t.pick(&key(9000), Choice::Auto, CanTime::Yes, &mut { broken }), Err(Error::Config(_))));
}

// ---------------------------------------------------------------------------------------------
// The persistent cache
// ---------------------------------------------------------------------------------------------

#[test]
fn cache_round_trip_across_instances() {
    let dir = tmpdir("roundtrip");
    let path = dir.join("dev.json");
    let t1 = Tuner::new(Policy::Exhaustive, None, Cache::open(Some(path.clone()), "dev"));
    let n = Family::Fwd.candidates().len();
    let w = t1
        .pick(&key(100), Choice::Auto, CanTime::Yes, &mut fake((0..n).map(|i| 5.0 - i as f64 * 0.1).collect(), vec![Some(1.0); n]))
        .unwrap();
    // A new process (a new cache instance) reads the winner without timing anything, under
    // either policy that caches.
    for policy in [Policy::Exhaustive, Policy::Shortlist] {
        let t2 = Tuner::new(policy, None, Cache::open(Some(path.clone()), "dev"));
        assert_eq!(t2.pick(&key(100), Choice::Auto, CanTime::Yes, &mut never).unwrap(), w);
        assert_eq!(t2.entry(&key(100)).unwrap().candidates.len(), n, "every timing is kept");
    }
}

#[test]
fn corrupt_truncated_and_stale_files_are_retuned() {
    let dir = tmpdir("corrupt");
    let path = dir.join("dev.json");
    let n = Family::Fwd.candidates().len();
    let t = Tuner::new(Policy::Exhaustive, None, Cache::open(Some(path.clone()), "dev"));
    t.pick(&key(100), Choice::Auto, CanTime::Yes, &mut fake(vec![1.0; n], vec![Some(1.0); n])).unwrap();
    let good = std::fs::read_to_string(&path).unwrap();
    for bad in [good[..good.len() / 2].to_string(), "not json at all".to_string(), String::new()] {
        std::fs::write(&path, &bad).unwrap();
        let c = Cache::open(Some(path.clone()), "dev");
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        let t = Tuner::new(Policy::Shortlist, None, c);
        let mut calls = 0;
        t.pick(&key(100), Choice::Auto, CanTime::Yes, &mut |_| {
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
    // A file of the previous format (written while a shipped table decided): stale, retuned.
    let v1 = good.replacen(&format!("\"format\": {}", lmhead::tune::cache::FORMAT), "\"format\": 1", 1);
    assert_ne!(v1, good);
    std::fs::write(&path, &v1).unwrap();
    let c = Cache::open(Some(path.clone()), "dev");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.get(&key(100)).is_none());
}

#[test]
fn unwritable_directory_keeps_results_in_memory() {
    let dir = tmpdir("ro");
    let blocker = dir.join("file");
    std::fs::write(&blocker, "x").unwrap();
    // A path whose parent is a regular file cannot be created.
    let c = Cache::open(Some(blocker.join("sub").join("dev.json")), "dev");
    let t = Tuner::new(Policy::Shortlist, None, c);
    let w = t.pick(&key(100), Choice::Auto, CanTime::Yes, &mut |_| Ok(Trial { ms: 1.0, check: vec![1.0] })).unwrap();
    assert_eq!(t.pick(&key(100), Choice::Auto, CanTime::Yes, &mut never).unwrap(), w);
}

#[test]
fn concurrent_writers_keep_both_results() {
    let dir = tmpdir("concurrent");
    let path = dir.join("dev.json");
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let path = path.clone();
            std::thread::spawn(move || {
                let t = Tuner::new(Policy::Shortlist, None, Cache::open(Some(path), "dev"));
                for j in 0..5 {
                    let k = key(1usize << (8 + (i * 5 + j) % 14));
                    t.pick(&k, Choice::Auto, CanTime::Yes, &mut |_| Ok(Trial { ms: 1.0, check: vec![1.0] })).unwrap();
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
    let t = tuner(Policy::Shortlist);
    let table = t.prune(Family::FwdEnt, Problem::new(4096, 128256, 4096));
    assert_eq!(table.len(), Family::FwdEnt.candidates().len());
    for (c, r) in table {
        println!("{:<40} {}", lmhead_core::config::kernel_name(Family::FwdEnt, c), r.map(|_| "kept".to_string()).unwrap_or_else(|e| e));
    }
}
