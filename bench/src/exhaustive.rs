//! The `exhaustive` suite: exhaustive tuning of every tuned family at each of the sweep's unique
//! rank-local shapes (cheapest first, within `--budget-s`), one JSON line per tuned key with
//! every candidate's trial time. Its files are what `cargo xtask heuristics` replays the rules
//! against (`lmhead_core::heuristics`: how close each rule comes to the fastest candidate), and
//! what a rule's ranking of candidates is read from. (Records before this suite's name were
//! written by the `tune-table` suite, in the same format.)
//!
//! Resumable and mergeable: `--resume FILE` (repeatable) skips the shapes whose records a
//! previous run's file already holds; records are keyed by their `TuneKey`, so files from
//! several runs (or sessions) are simply read together.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::time::Instant;

use lmhead::tune::cache::{default_path, Cache};
use lmhead::tune::{Policy, TuneKey, Tuner};
use lmhead::{Gpu, LmHead};

use crate::suites::Suite;
use crate::Args;

/// The `(t, v, d)` shapes whose records `files` hold.
fn done_shapes(files: &[String]) -> BTreeSet<(usize, usize, usize)> {
    let mut done = BTreeSet::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(f) else {
            eprintln!("lmhead-bench: --resume {f}: cannot read it; nothing skipped for it");
            continue;
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(r) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let s = &r["shape"];
            if let (Some(t), Some(v), Some(d)) = (s["t"].as_u64(), s["v"].as_u64(), s["d"].as_u64()) {
                if r["complete"].as_bool() == Some(true) {
                    done.insert((t as usize, v as usize, d as usize));
                }
            }
        }
    }
    done
}

/// A head on device 0 that tunes every candidate on the real shape (its cache where
/// `LmHead::new`'s would be).
pub fn head() -> lmhead::Result<LmHead> {
    let gpu = Gpu::new(0)?;
    let info = gpu.info().clone();
    let cache = Cache::open(default_path(&info.fingerprint()), &info.fingerprint());
    Ok(LmHead::with_tuner(gpu, Tuner::new(Policy::Exhaustive, Some(info), cache)))
}

pub fn run(head: &LmHead, args: &Args, gpu: &str, commit: &str) {
    let done = done_shapes(&args.resume);
    let cases: Vec<_> = Suite::Sweep
        .cases()
        .into_iter()
        .filter(|c| args.filter.as_ref().is_none_or(|f| c.name().contains(f.as_str())))
        .filter(|c| !done.contains(&(c.t, c.v, c.d)))
        .skip(args.skip)
        .collect();
    println!(
        "# lmhead-bench exhaustive on {gpu}, commit {commit}: {} shapes to tune ({} already in --resume files), every candidate, cheapest first",
        cases.len(),
        done.len()
    );
    println!("| local t × v × d | keys | tuning s | wall s |");
    println!("|---|---:|---:|---:|");
    let start = Instant::now();
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).expect("open --out");
    for (n_done, c) in cases.iter().enumerate() {
        if start.elapsed().as_secs_f64() > args.budget_s {
            println!("(budget of {} s spent: {n_done} of {} shapes tuned; resume with --resume {})", args.budget_s, cases.len(), args.out);
            break;
        }
        let before: BTreeSet<TuneKey> = head.tuner().entries().into_keys().collect();
        let t0 = Instant::now();
        let mut failed = None;
        for entropy in [false, true] {
            if let Err(e) = head.warm_up(&[c.t], c.v, c.d, entropy, true) {
                failed = Some(e.to_string());
                break;
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        let new: Vec<_> = head.tuner().entries().into_iter().filter(|(k, _)| !before.contains(k)).collect();
        let tuning: f64 = new.iter().map(|(_, e)| e.seconds).sum();
        for (key, entry) in &new {
            let rec = serde_json::json!({
                "suite": "exhaustive", "gpu": gpu, "commit": commit,
                "timestamp": crate::unix_now(),
                "shape": {"t": c.t, "v": c.v, "d": c.d, "case": c.name()},
                "complete": false, "key": key, "entry": entry,
            });
            writeln!(out, "{rec}").expect("write --out");
        }
        // A marker that every family of this shape was tuned (what --resume skips on).
        let marker = serde_json::json!({
            "suite": "exhaustive", "gpu": gpu, "commit": commit,
            "shape": {"t": c.t, "v": c.v, "d": c.d, "case": c.name()},
            "complete": failed.is_none(), "error": failed, "keys": new.len(), "tuning_s": tuning, "wall_s": wall,
        });
        writeln!(out, "{marker}").expect("write --out");
        out.flush().expect("flush --out");
        match &failed {
            None => println!("| {} × {} × {} | {} | {tuning:.1} | {wall:.1} |", c.t, c.v, c.d, new.len()),
            Some(e) => println!("| {} × {} × {} | {} | failed: {e} | {wall:.1} |", c.t, c.v, c.d, new.len()),
        }
    }
}
