//! `cargo xtask table-plans [--table FILE] [--margin M] [--replace] <records.jsonl>...`: the forward launch
//! plans of the shipped tuning table (`plans` of `host/tuned/<device>.json`, read by
//! `host/src/tune/table.rs`) from `lmhead-bench` records of the same shapes timed with the
//! library's own plan and with forced ones (`run-gpu.sh plans`: records whose `plan_overrides`
//! are exactly `LMHEAD_FWD_SPLITS` and `LMHEAD_FWD_RASTER`, and records without overrides).
//! Only records whose timed log-probs were checked against the f64 reference (`check_max_abs`;
//! the bench writes no record for a run that fails the check) count: a plan is never shipped
//! from `--no-check` runs.
//!
//! Per forward family (the forward, and the forward with entropy), token bucket, `d`, `v` and
//! config: the mean time against cuBLAS of each plan over its records. A forced plan at least
//! `margin` (default 0.03, about the bench's run-to-run spread) faster than the library's becomes
//! the table's plan for that key. The table's other plans stay: those of keys the records do not
//! time, and those of keys where no forced plan won (there the library's runs took the table's
//! plan, when it held one). `--replace` drops every plan the records do not give. Prints every
//! key's verdict.

use std::collections::BTreeMap;

use lmhead_core::config::{Family, TileConfig};
use lmhead_core::record::Row;
use lmhead_core::TokenBucket;
use serde_json::Value;

/// Family, bucket, d, v, config.
type Key = (Family, u32, u32, u32, TileConfig);

/// The library's own plan (`None`) or `(splits, raster group)` forced.
type Plan = Option<(u32, u32)>;

/// The plan a record ran: `Some(None)` without overrides, `Some(Some(..))` with exactly the
/// split and raster overrides, `None` with any other (not comparable).
fn plan_of(rec: &Value) -> Option<Plan> {
    let Some(o) = rec.get("plan_overrides").and_then(Value::as_object) else { return Some(None) };
    let num = |k: &str| o.get(k)?.as_str()?.trim().parse::<u32>().ok();
    match (o.len(), num("LMHEAD_FWD_SPLITS"), num("LMHEAD_FWD_RASTER")) {
        (2, Some(s), Some(r)) if s >= 1 => Some(Some((s, r))),
        _ => None,
    }
}

/// The config whose record suffix is `suffix` among `family`'s candidates.
fn config(family: Family, suffix: &str) -> Option<TileConfig> {
    family.candidates().iter().copied().find(|c| c.suffix(family) == suffix)
}

/// Every key's ratios (time / cuBLAS) per plan, from the checked records in `texts`.
struct Collected {
    keys: BTreeMap<Key, BTreeMap<Plan, Vec<f64>>>,
    /// The plan the library's own runs of each key took (`fwd_plan` / `fwd_ent_plan`), for the
    /// verdict lines: the L2 model's, or the table's where it held one.
    library: BTreeMap<Key, (u32, u32)>,
    /// Records of a comparable plan left out because their run was not checked.
    unchecked: usize,
}

fn collect(texts: &[(String, String)]) -> Result<Collected, String> {
    let mut keys: BTreeMap<Key, BTreeMap<Plan, Vec<f64>>> = BTreeMap::new();
    let mut library = BTreeMap::new();
    let mut unchecked = 0;
    for (name, text) in texts {
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let rec: Value = serde_json::from_str(line).map_err(|e| format!("{name}:{}: {e}", i + 1))?;
            let Some(plan) = plan_of(&rec) else { continue };
            let Ok(row) = serde_json::from_value::<Row>(rec["row"].clone()) else { continue };
            if row.check_max_abs.is_none() {
                unchecked += 1;
                continue;
            }
            let c = &row.case;
            let bucket = TokenBucket::of(c.t).tokens();
            let runs =
                [(Family::Fwd, &row.fwd_cfg, &row.fwd, row.fwd_plan), (Family::FwdEnt, &row.fwd_ent_cfg, &row.fwd_ent, row.fwd_ent_plan)];
            for (family, cfg, t, ran) in runs {
                let Some(cfg) = config(family, cfg) else { continue };
                let key = (family, bucket, c.d as u32, c.v as u32, cfg);
                keys.entry(key).or_default().entry(plan).or_default().push(t.p50 / row.gemm.p50);
                if let (None, Some(ran)) = (plan, ran) {
                    library.insert(key, (ran.splits, ran.raster));
                }
            }
        }
    }
    Ok(Collected { keys, library, unchecked })
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// The table's plan entries (JSON, as `host/src/tune/table.rs` reads them) and a verdict line
/// per key.
fn decide(c: &Collected, margin: f64) -> (Vec<Value>, Vec<String>) {
    let (mut plans, mut lines) = (Vec::new(), Vec::new());
    for (key, by_plan) in &c.keys {
        let &(family, bucket, d, v, cfg) = key;
        let name = format!("{family:?} bucket {bucket} d {d} v {v} {}", cfg.suffix(family));
        let Some(lib) = by_plan.get(&None).map(|x| mean(x)) else {
            lines.push(format!("{name}: no run with the library's plan, skipped"));
            continue;
        };
        let best = by_plan.iter().filter_map(|(p, x)| p.map(|p| (p, mean(x)))).min_by(|a, b| a.1.total_cmp(&b.1));
        let Some(((splits, raster), t)) = best else {
            lines.push(format!("{name}: no forced plan, skipped"));
            continue;
        };
        let ratio = t / lib;
        let keep = ratio <= 1.0 - margin;
        let ran = c.library.get(key).map_or(String::new(), |(s, g)| format!(" ({s} × {g})"));
        lines.push(format!(
            "{name}: library{ran} {lib:.3}, best forced {splits} × {raster} {t:.3} ({:+.1}%){}",
            100.0 * (ratio - 1.0),
            if keep { " -> table" } else { "" }
        ));
        if keep {
            plans.push(serde_json::json!({
                "family": family, "bucket": bucket, "d": d, "v": v, "config": cfg,
                "splits": splits, "raster": raster, "ratio": (ratio * 1e4).round() / 1e4,
            }));
        }
    }
    (plans, lines)
}

/// The identity of a plan entry: family, bucket, d, v, config (as the table reads them).
fn entry_key(e: &Value) -> [String; 5] {
    ["family", "bucket", "d", "v", "config"].map(|k| e.get(k).map_or(String::new(), Value::to_string))
}

/// What [`merge`] did to the table's plans.
#[derive(Debug, PartialEq)]
struct Merged {
    /// Plans the records gave again exactly as the table held them.
    same: usize,
    /// Plans the records gave for a key the table held with another plan.
    changed: usize,
    /// Plans for keys the table did not hold.
    added: usize,
    /// The table's plans for keys the records did not give, kept (0 with `replace`).
    kept: usize,
}

/// `old` with `new` in place of the entries of the same keys (all of `old` dropped when
/// `replace`), sorted by key; and what changed against `old`.
fn merge(old: &[Value], new: Vec<Value>, replace: bool) -> (Vec<Value>, Merged) {
    let mut by_key: BTreeMap<[String; 5], Value> = old.iter().map(|e| (entry_key(e), e.clone())).collect();
    let mut m = Merged { same: 0, changed: 0, added: 0, kept: 0 };
    let mut given = BTreeMap::new();
    for e in new {
        match by_key.get(&entry_key(&e)) {
            Some(o) if *o == e => m.same += 1,
            Some(_) => m.changed += 1,
            None => m.added += 1,
        }
        given.insert(entry_key(&e), e);
    }
    if replace {
        by_key.clear();
    } else {
        m.kept = by_key.keys().filter(|k| !given.contains_key(*k)).count();
    }
    by_key.extend(given);
    (by_key.into_values().collect(), m)
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mut table = "host/tuned/NVIDIA-H200.json".to_string();
    let mut margin = 0.03;
    let mut replace = false;
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--table" => table = it.next().ok_or("--table needs a file")?.clone(),
            "--replace" => replace = true,
            "--margin" => {
                margin = it.next().ok_or("--margin needs a value")?.parse().map_err(|e| format!("--margin: {e}"))?;
                if !(0.0..1.0).contains(&margin) {
                    return Err(format!("--margin {margin}: expected 0 ≤ margin < 1"));
                }
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            f => files.push(f.to_string()),
        }
    }
    if files.is_empty() {
        return Err("usage: cargo xtask table-plans [--table FILE] [--margin M] [--replace] <records.jsonl>...".into());
    }
    let texts = files
        .iter()
        .map(|f| Ok((f.clone(), std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"))?)))
        .collect::<Result<Vec<_>, String>>()?;
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&table).map_err(|e| format!("{table}: {e}"))?)
        .map_err(|e| format!("{table}: not a tuning table: {e}"))?;
    let collected = collect(&texts)?;
    if collected.unchecked > 0 {
        println!("{} records without the log-prob check (run with --no-check) left out", collected.unchecked);
    }
    let (plans, lines) = decide(&collected, margin);
    for l in &lines {
        println!("{l}");
    }
    let obj = doc.as_object_mut().ok_or_else(|| format!("{table}: not a tuning table"))?;
    let old = obj.get("plans").and_then(Value::as_array).cloned().unwrap_or_default();
    let (plans, m) = merge(&old, plans, replace);
    let n = plans.len();
    if plans.is_empty() {
        obj.remove("plans");
    } else {
        obj.insert("plans".into(), Value::Array(plans));
    }
    let text = serde_json::to_string(&doc).map_err(|e| e.to_string())?;
    std::fs::write(&table, text).map_err(|e| format!("{table}: {e}"))?;
    eprintln!(
        "wrote {table}: {n} plans ({} as the table held them, {} changed, {} added; {} of its {} kept without a record{})",
        m.same,
        m.changed,
        m.added,
        m.kept,
        old.len(),
        if replace { ", --replace" } else { "" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep record of 131072 × 128256 × 4096 with the forward at `fwd` and the forward with
    /// entropy at `ent` times the GEMM, run with `overrides`.
    fn rec(fwd: f64, ent: f64, overrides: Option<Value>) -> String {
        let cfg = Family::Fwd.candidates().iter().find(|c| c.is_sm90()).unwrap().suffix(Family::Fwd);
        let ent_cfg = Family::FwdEnt.candidates().iter().find(|c| c.is_sm90()).unwrap().suffix(Family::FwdEnt);
        let t = |x: f64| serde_json::json!({"p50": x});
        let mut r = serde_json::json!({
            "suite": "sweep",
            "row": {
                "case": {"model": "m", "tokens": 131072, "tp": 1, "cp": 1, "t": 131072, "v": 128256, "d": 4096, "backward": true},
                "gemm": t(100.0), "fwd": t(100.0 * fwd), "fwd_ent": t(100.0 * ent), "fwd_bwd": t(430.0),
                "fwd_cfg": cfg, "fwd_ent_cfg": ent_cfg, "workspace_mib": 1.0, "check_max_abs": 2e-5,
            },
        });
        match overrides {
            Some(o) => r["plan_overrides"] = o,
            None => {
                let modelled = serde_json::json!({"splits": 5, "raster": 27, "fill": 0});
                r["row"]["fwd_plan"] = modelled.clone();
                r["row"]["fwd_ent_plan"] = modelled;
            }
        }
        r.to_string()
    }

    fn forced(s: &str, r: &str) -> Option<Value> {
        Some(serde_json::json!({"LMHEAD_FWD_SPLITS": s, "LMHEAD_FWD_RASTER": r}))
    }

    #[test]
    fn a_forced_plan_past_the_margin_goes_to_the_table() {
        let text = [
            rec(1.07, 1.08, None),
            rec(1.01, 1.07, forced("12", "11")),
            rec(1.04, 1.02, forced("8", "17")),
            rec(1.01, 1.06, forced("12", "11")),
            rec(1.07, 1.09, None),
            // another override, or a fill forced too: not comparable, ignored
            rec(0.50, 0.50, Some(serde_json::json!({"LMHEAD_BWD_TILES": "2"}))),
            rec(0.50, 0.50, Some(serde_json::json!({"LMHEAD_FWD_SPLITS": "4", "LMHEAD_FWD_RASTER": "33", "LMHEAD_FWD_FILL": "0"}))),
        ]
        .join("\n");
        let keys = collect(&[("r".into(), text)]).unwrap();
        let (plans, lines) = decide(&keys, 0.03);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines.iter().all(|l| l.contains("library (5 × 27) ")), "{lines:?}");
        // The forward: 12 × 11 at 1.01 against 1.07 (−5.6%); with entropy: 8 × 17 at 1.02 against 1.085.
        assert_eq!(plans.len(), 2, "{lines:?}");
        assert_eq!(
            (plans[0]["family"].as_str(), plans[0]["splits"].as_u64(), plans[0]["raster"].as_u64()),
            (Some("Fwd"), Some(12), Some(11))
        );
        assert_eq!(plans[0]["bucket"].as_u64(), Some(131072));
        assert_eq!(
            (plans[1]["family"].as_str(), plans[1]["splits"].as_u64(), plans[1]["raster"].as_u64()),
            (Some("FwdEnt"), Some(8), Some(17))
        );
        assert!((plans[0]["ratio"].as_f64().unwrap() - 1.01 / 1.07).abs() < 1e-3);
        // Within the margin: nothing.
        let text = [rec(1.07, 1.08, None), rec(1.05, 1.07, forced("12", "11"))].join("\n");
        let (plans, lines) = decide(&collect(&[("r".into(), text)]).unwrap(), 0.03);
        assert!(plans.is_empty(), "{lines:?}");
        // Without a run of the library's plan: nothing to compare with.
        let (plans, lines) = decide(&collect(&[("r".into(), rec(1.0, 1.0, forced("12", "11")))]).unwrap(), 0.03);
        assert!(plans.is_empty() && lines[0].contains("skipped"), "{lines:?}");
    }

    #[test]
    fn unchecked_records_do_not_count() {
        // The forced plan's only fast record was run with --no-check: no plan, one record counted out.
        let mut fast = serde_json::from_str::<Value>(&rec(1.01, 1.02, forced("12", "11"))).unwrap();
        fast["row"]["check_max_abs"] = Value::Null;
        let text = [rec(1.07, 1.08, None), fast.to_string(), rec(1.06, 1.08, forced("12", "11"))].join("\n");
        let c = collect(&[("r".into(), text)]).unwrap();
        assert_eq!(c.unchecked, 1);
        let (plans, lines) = decide(&c, 0.03);
        assert!(plans.is_empty(), "{lines:?}");
    }

    #[test]
    fn new_plans_replace_their_keys_and_the_others_stay() {
        let e = |family: &str, v: u64, splits: u64| serde_json::json!({"family": family, "bucket": 131072, "d": 4096, "v": v, "config": {"bm": 128}, "splits": splits, "raster": 11});
        let old = [e("Fwd", 128256, 12), e("FwdEnt", 128256, 12), e("Fwd", 64128, 8)];
        let (merged, m) = merge(&old, vec![e("Fwd", 128256, 15), e("Fwd", 32064, 9), e("Fwd", 64128, 8)], false);
        assert_eq!(m, Merged { same: 1, changed: 1, added: 1, kept: 1 });
        assert_eq!(merged.len(), 4, "{merged:?}");
        let splits = |f: &str, v: u64| merged.iter().find(|x| x["family"] == f && x["v"] == v).map(|x| x["splits"].as_u64().unwrap());
        assert_eq!(
            (splits("Fwd", 128256), splits("FwdEnt", 128256), splits("Fwd", 64128), splits("Fwd", 32064)),
            (Some(15), Some(12), Some(8), Some(9))
        );
        // Another config is another key.
        let mut other = e("Fwd", 128256, 4);
        other["config"] = serde_json::json!({"bm": 256});
        assert_eq!(merge(&old, vec![other], false).0.len(), 4);
        // --replace: only what the records give.
        let (merged, m) = merge(&old, vec![e("Fwd", 32064, 9)], true);
        assert_eq!((merged.len(), m), (1, Merged { same: 0, changed: 0, added: 1, kept: 0 }));
    }

    #[test]
    fn entries_carry_the_key_and_the_config_as_the_table_reads_them() {
        let text = [rec(1.07, 1.08, None), rec(1.01, 1.02, forced("12", "11"))].join("\n");
        let (plans, _) = decide(&collect(&[("r".into(), text)]).unwrap(), 0.03);
        let cfg = Family::Fwd.candidates().iter().copied().find(|c| c.is_sm90()).unwrap();
        let p = &plans[0];
        assert_eq!(serde_json::from_value::<TileConfig>(p["config"].clone()).unwrap(), cfg);
        assert_eq!(p["d"].as_u64(), Some(4096));
        assert_eq!(p["v"].as_u64(), Some(128256));
    }
}
