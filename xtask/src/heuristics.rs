//! `cargo xtask heuristics <records.jsonl>...`: the launch rules (`lmhead_core::heuristics`)
//! replayed against measurements, on the H200's limits (where they were measured). Needs no GPU.
//!
//! - **Exhaustive trial records** (`lmhead-bench exhaustive`; the older suite name `tune-table`
//!   reads the same): per family, how far the rule's pick is from the fastest candidate of each
//!   key (within 1%, 2%, 5%; geometric-mean slowdown; the largest gap), the portable rules the
//!   same among the `mma.sync` candidates, and a training step estimated per complete shape as
//!   `fwd_ent + ⌈v / chunk⌉ · (dlogits_ent + dh + dW)` at the rules' picks against the fastest
//!   ones. Records written before `dh`'s TMA-store configs existed time their register twins
//!   (the same tiles): the rule's `dh` pick is looked up as its twin there, and the count says
//!   how often.
//! - **Plan records** (`run-gpu.sh plans`: `lmhead-bench sweep` records with the library's plan
//!   and with forced ones, `plan_overrides` of exactly `LMHEAD_FWD_SPLITS` and
//!   `LMHEAD_FWD_RASTER`; only checked runs count): per forward family and shape, the mean time
//!   against cuBLAS of each plan, the rule's plan, and where the rule's plan was measured, how it
//!   compares with the library's and the best forced one.
//!
//! The comments of the rules quote this command's output for the files they cite.

use std::collections::BTreeMap;

use lmhead_core::config::{Family, TileConfig};
use lmhead_core::heuristics::{self, Device};
use lmhead_core::record::Row;
use lmhead_core::{Problem, TokenBucket};
use serde_json::Value;

/// Family, bucket, d, v.
type Key = (Family, u32, u32, u32);

/// A key's trial times, fastest first, and the shape (t) it was tuned at.
struct Trials {
    ts: u64,
    t: usize,
    ms: Vec<(TileConfig, f64)>,
}

/// What the trial records hold: every key's latest record and the complete shapes `(t, v, d)`.
#[derive(Default)]
struct Exhaustive {
    keys: BTreeMap<Key, Trials>,
    shapes: Vec<(usize, usize, usize)>,
}

fn read_exhaustive(texts: &[(String, String)]) -> Result<Exhaustive, String> {
    let mut out = Exhaustive::default();
    for (name, text) in texts {
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let r: Value = serde_json::from_str(line).map_err(|e| format!("{name}:{}: {e}", i + 1))?;
            if r["suite"] != "tune-table" && r["suite"] != "exhaustive" {
                continue;
            }
            let s = &r["shape"];
            let dim = |k: &str| s[k].as_u64().unwrap_or(0) as usize;
            if r.get("key").is_none() {
                let shape = (dim("t"), dim("v"), dim("d"));
                if r["complete"].as_bool() == Some(true) && !out.shapes.contains(&shape) {
                    out.shapes.push(shape);
                }
                continue;
            }
            let k = &r["key"];
            if k["tp"].as_bool() == Some(true) || k["dtype"] != "bf16" {
                continue;
            }
            let family: Family = serde_json::from_value(k["family"].clone()).map_err(|e| format!("{name}:{}: {e}", i + 1))?;
            let n = |f: &str| k[f].as_u64().unwrap_or(0) as u32;
            let key = (family, n("bucket"), n("d"), n("v"));
            let mut ms = Vec::new();
            for c in r["entry"]["candidates"].as_array().into_iter().flatten() {
                let (Some(cfg), Some(o)) = (c.get(0), c.get(1)) else { continue };
                let Ok(cfg) = serde_json::from_value::<TileConfig>(cfg.clone()) else { continue };
                if let (true, Some(t)) = (o["outcome"] == "timed", o["ms"].as_f64()) {
                    ms.push((cfg, t));
                }
            }
            let ts = r["timestamp"].as_u64().unwrap_or(0);
            if ms.is_empty() || out.keys.get(&key).is_some_and(|old| old.ts > ts) {
                continue;
            }
            ms.sort_by(|a, b| a.1.total_cmp(&b.1));
            out.keys.insert(key, Trials { ts, t: dim("t"), ms });
        }
    }
    Ok(out)
}

/// The time of `c` in `trials`, or of its register twin (a record older than the TMA-store
/// twins); whether the twin stood in.
fn time_of(trials: &Trials, c: TileConfig) -> Option<(f64, bool)> {
    if let Some(&(_, t)) = trials.ms.iter().find(|(x, _)| *x == c) {
        return Some((t, false));
    }
    let twin = c.register_twin();
    trials.ms.iter().find(|(x, _)| *x == twin && twin != c).map(|&(_, t)| (t, true))
}

/// Summary of slowdowns (time of the rule's pick over the fastest's), with the worst key.
struct Gaps {
    n: usize,
    within: [usize; 3],
    geomean: f64,
    worst: (f64, String),
    twins: usize,
}

fn gaps(xs: &[(f64, String, bool)]) -> Option<Gaps> {
    if xs.is_empty() {
        return None;
    }
    let n = xs.len();
    let within = [1.01, 1.02, 1.05].map(|lim| xs.iter().filter(|x| x.0 <= lim + 1e-12).count());
    let geomean = (xs.iter().map(|x| x.0.ln()).sum::<f64>() / n as f64).exp();
    let worst = xs.iter().max_by(|a, b| a.0.total_cmp(&b.0)).map(|x| (x.0, x.1.clone())).unwrap_or_default();
    Some(Gaps { n, within, geomean, worst, twins: xs.iter().filter(|x| x.2).count() })
}

fn gap_line(what: &str, g: &Gaps) -> String {
    format!(
        "| {what} | {} | {} | {} | {} | {:.4} | {:.1}% ({}) | {} |\n",
        g.n,
        g.within[0],
        g.within[1],
        g.within[2],
        g.geomean,
        100.0 * (g.worst.0 - 1.0),
        g.worst.1,
        g.twins
    )
}

/// The rules against the exhaustive trials: a markdown report.
fn report_exhaustive(x: &Exhaustive) -> String {
    let dev = Device::H200;
    let mut md = format!(
        "## The rules against exhaustive trials ({} keys, {} complete shapes)\n\nTrial time of the rule's pick over the fastest candidate's, per key:\n\n",
        x.keys.len(),
        x.shapes.len()
    );
    md.push_str("| rules, family | keys | within 1% | 2% | 5% | geomean | largest gap (t × v × d) | twins timed |\n|---|---:|---:|---:|---:|---:|---|---:|\n");
    for (rules, dev) in [("sm90", dev), ("sm80 (among mma.sync)", dev.portable())] {
        for f in Family::ALL {
            let mut xs = Vec::new();
            for (&(fam, _, d, v), trials) in x.keys.iter().filter(|(k, _)| k.0 == f) {
                let p = Problem::new(trials.t, v as usize, d as usize);
                let pick = heuristics::config(fam, p, &dev);
                let pool: Vec<&(TileConfig, f64)> = trials.ms.iter().filter(|(c, _)| c.is_sm90() == pick.is_sm90()).collect();
                let Some(best) = pool.iter().map(|x| x.1).reduce(f64::min) else { continue };
                let Some((t, twin)) = time_of(trials, pick) else { continue };
                xs.push((t / best, format!("{} × {v} × {d}", trials.t), twin));
            }
            if let Some(g) = gaps(&xs) {
                md.push_str(&gap_line(&format!("{rules}, {f:?}"), &g));
            }
        }
    }
    // The training step, per complete shape.
    let mut steps = Vec::new();
    let mut rows = String::new();
    for &(t, v, d) in &x.shapes {
        let bucket = TokenBucket::of(t).tokens();
        let Some(chunk) = x
            .keys
            .keys()
            .filter(|k| k.0 == Family::BwdDlogitsEnt && k.1 == bucket && k.2 == d as u32 && k.3 as usize <= v)
            .map(|k| k.3)
            .max()
        else {
            continue;
        };
        let n_chunks = v.div_ceil(chunk as usize) as f64;
        let (mut rule, mut best, mut ok) = (0.0, 0.0, true);
        for (f, fv, mult) in [
            (Family::FwdEnt, v as u32, 1.0),
            (Family::BwdDlogitsEnt, chunk, n_chunks),
            (Family::BwdDh, chunk, n_chunks),
            (Family::BwdDw, chunk, n_chunks),
        ] {
            let Some(trials) = x.keys.get(&(f, bucket, d as u32, fv)) else {
                ok = false;
                continue;
            };
            let pick = heuristics::config(f, Problem::new(t, fv as usize, d), &dev);
            match time_of(trials, pick) {
                Some((ms, _)) => {
                    rule += mult * ms;
                    best += mult * trials.ms[0].1;
                }
                None => ok = false,
            }
        }
        if ok {
            steps.push((rule / best, format!("{t} × {v} × {d}"), false));
            rows.push_str(&format!("| {t} × {v} × {d} | {best:.3} | {rule:.3} | {:+.2}% |\n", 100.0 * (rule / best - 1.0)));
        }
    }
    if let Some(g) = gaps(&steps) {
        let mean = 100.0 * (steps.iter().map(|s| s.0).sum::<f64>() / steps.len() as f64 - 1.0);
        let mut sorted: Vec<f64> = steps.iter().map(|s| s.0).collect();
        sorted.sort_by(f64::total_cmp);
        let median = 100.0 * (sorted[sorted.len() / 2] - 1.0);
        md.push_str(&format!(
            "\nTraining step (fwd_ent + chunks × (dlogits_ent + dh + dW)), the sm90 rules' picks against the fastest, trial times: {} shapes, within 0.5% at {}, within 1% at {}, mean +{mean:.2}%, median +{median:.2}%, largest +{:.2}% ({}).\n\n",
            g.n,
            steps.iter().filter(|s| s.0 <= 1.005).count(),
            g.within[0],
            100.0 * (g.worst.0 - 1.0),
            g.worst.1
        ));
        md.push_str("| local t × v × d | fastest ms | rules ms | gap |\n|---|---:|---:|---:|\n");
        md.push_str(&rows);
    }
    md
}

/// The plan a record ran: `Some(None)` without overrides, `Some(Some(..))` with exactly the
/// split and raster overrides, `None` with any other (not comparable).
fn forced_plan(rec: &Value) -> Option<Option<(u32, u32)>> {
    let Some(o) = rec.get("plan_overrides").and_then(Value::as_object) else { return Some(None) };
    let num = |k: &str| o.get(k)?.as_str()?.trim().parse::<u32>().ok();
    match (o.len(), num("LMHEAD_FWD_SPLITS"), num("LMHEAD_FWD_RASTER")) {
        (2, Some(s), Some(r)) if s >= 1 => Some(Some((s, r))),
        _ => None,
    }
}

/// Per (family, t, v, d, config): each plan's times against cuBLAS (`None`: the library's own,
/// with the plan it reported).
type PlanTimes = BTreeMap<(Family, usize, usize, usize, TileConfig), BTreeMap<Option<(u32, u32)>, (Vec<f64>, Option<(u32, u32)>)>>;

fn read_plans(texts: &[(String, String)]) -> Result<PlanTimes, String> {
    let mut out: PlanTimes = BTreeMap::new();
    for (name, text) in texts {
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let rec: Value = serde_json::from_str(line).map_err(|e| format!("{name}:{}: {e}", i + 1))?;
            if rec.get("row").is_none() || rec.get("bwd_chunk").is_some() || rec.get("dw_after_dh").is_some() {
                continue;
            }
            let Some(plan) = forced_plan(&rec) else { continue };
            let Ok(row) = serde_json::from_value::<Row>(rec["row"].clone()) else { continue };
            if row.check_max_abs.is_none() {
                continue;
            }
            let c = &row.case;
            for (family, cfg, t, ran) in
                [(Family::Fwd, &row.fwd_cfg, &row.fwd, row.fwd_plan), (Family::FwdEnt, &row.fwd_ent_cfg, &row.fwd_ent, row.fwd_ent_plan)]
            {
                let Some(cfg) = family.candidates().iter().copied().find(|x| x.suffix(family) == *cfg) else { continue };
                let e = out.entry((family, c.t, c.v, c.d, cfg)).or_default().entry(plan).or_default();
                e.0.push(t.p50 / row.gemm.p50);
                e.1 = ran.map(|r| (r.splits, r.raster));
            }
        }
    }
    Ok(out)
}

/// The rules' plans against the measured ones: a markdown report.
fn report_plans(plans: &PlanTimes) -> String {
    let mut md = String::from(
        "## The forward's plans: the rule against forced plans (× cuBLAS, means)\n\n| family, local t × v × d | library's plan | best forced | rule's plan | rule × cuBLAS | rule vs library | rule vs best |\n|---|---|---|---|---:|---:|---:|\n",
    );
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    for (&(family, t, v, d, cfg), by_plan) in plans {
        let p = Problem::new(t, v, d);
        let rule = heuristics::fwd_plan(cfg, p, &Device::H200, Device::H200.sm_count * heuristics::blocks_per_sm(cfg, &Device::H200));
        let rule = (rule.n_splits, rule.raster_group);
        let Some((lib_times, lib_plan)) = by_plan.get(&None) else { continue };
        let lib = mean(lib_times);
        let best = by_plan.iter().filter_map(|(p, x)| p.map(|p| (p, mean(&x.0)))).min_by(|a, b| a.1.total_cmp(&b.1));
        let rule_time = if Some(rule) == *lib_plan { Some(lib) } else { by_plan.get(&Some(rule)).map(|x| mean(&x.0)) };
        let fmt = |p: Option<(u32, u32)>| p.map_or("?".to_string(), |(s, g)| format!("{s} × {g}"));
        let (best_s, best_t) = best.map_or(("-".to_string(), f64::NAN), |(p, t)| (fmt(Some(p)), t));
        let cells = match rule_time {
            Some(r) => format!("{r:.3} | {:+.1}% | {:+.1}%", 100.0 * (r / lib - 1.0), 100.0 * (r / best_t.min(lib) - 1.0)),
            None => "not measured | | ".to_string(),
        };
        md.push_str(&format!(
            "| {family:?}, {t} × {v} × {d} | {} {lib:.3} | {best_s} {best_t:.3} | {} | {cells} |\n",
            fmt(*lib_plan),
            fmt(Some(rule))
        ));
    }
    md
}

pub fn run(args: &[String]) -> Result<(), String> {
    if args.is_empty() || args.iter().any(|a| a.starts_with('-')) {
        return Err("usage: cargo xtask heuristics <records.jsonl>... (exhaustive trial records and/or `run-gpu.sh plans` records)".into());
    }
    let texts = args
        .iter()
        .map(|f| Ok((f.clone(), std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"))?)))
        .collect::<Result<Vec<_>, String>>()?;
    let x = read_exhaustive(&texts)?;
    let plans = read_plans(&texts)?;
    if x.keys.is_empty() && plans.is_empty() {
        return Err("no exhaustive trial records and no plan records in those files".into());
    }
    let mut md = format!("# The launch rules against the records of {}\n\n", args.join(" "));
    if !x.keys.is_empty() {
        md.push_str(&report_exhaustive(&x));
    }
    if !plans.is_empty() {
        md.push('\n');
        md.push_str(&report_plans(&plans));
    }
    print!("{md}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmhead_core::config::{Mainloop, Store};

    /// The TMA-store twin of a register-epilogue Hopper config.
    fn tma_twin(c: TileConfig) -> TileConfig {
        match c.mainloop {
            Mainloop::Sm90 { .. } => TileConfig { mainloop: Mainloop::Sm90 { store: Store::Tma }, ..c },
            _ => c,
        }
    }

    fn rec(family: Family, t: usize, v: u32, d: u32, times: &[(TileConfig, f64)]) -> String {
        let cands: Vec<Value> = times.iter().map(|&(c, ms)| serde_json::json!([c, {"outcome": "timed", "ms": ms}])).collect();
        serde_json::json!({
            "suite": "exhaustive", "gpu": "G", "timestamp": 1, "shape": {"t": t, "v": v, "d": d},
            "key": {"family": family, "bucket": TokenBucket::of(t).tokens(), "d": d, "v": v, "dtype": "bf16", "tp": false},
            "entry": {"winner": times[0].0, "candidates": cands, "seconds": 0.1},
        })
        .to_string()
    }

    #[test]
    fn the_rules_pick_is_looked_up_and_its_register_twin_stands_in() {
        let p = Problem::new(8192, 32768, 4096);
        let dev = Device::H200;
        let fwd = heuristics::config(Family::Fwd, p, &dev);
        let other = *Family::Fwd.candidates().iter().find(|c| c.is_sm90() && **c != fwd).unwrap();
        let dh = heuristics::config(Family::BwdDh, p, &dev);
        assert_eq!(tma_twin(dh.register_twin()), dh, "the rule's dh pick is a TMA-store config");
        let lines = [
            rec(Family::Fwd, 8192, 32768, 4096, &[(other, 1.0), (fwd, 1.02)]),
            rec(Family::BwdDh, 8192, 32768, 4096, &[(dh.register_twin(), 2.0), (other, 2.2)]),
        ];
        let x = read_exhaustive(&[("r".into(), lines.join("\n"))]).unwrap();
        assert_eq!(x.keys.len(), 2);
        let fwd_trials = &x.keys[&(Family::Fwd, 8192, 4096, 32768)];
        assert_eq!(time_of(fwd_trials, fwd), Some((1.02, false)));
        let dh_trials = &x.keys[&(Family::BwdDh, 8192, 4096, 32768)];
        assert_eq!(time_of(dh_trials, dh), Some((2.0, true)), "the register twin's time");
        let md = report_exhaustive(&x);
        assert!(md.contains("| sm90, Fwd | 1 | 0 | 1 | 1 | 1.0200 |"), "{md}");
        assert!(md.contains("| sm90, BwdDh | 1 | 1 | 1 | 1 | 1.0000 |") && md.contains("| 1 |\n"), "{md}");
    }

    #[test]
    fn gaps_count_and_average() {
        let g = gaps(&[(1.0, "a".into(), false), (1.015, "b".into(), false), (1.10, "c".into(), true)]).unwrap();
        assert_eq!((g.n, g.within, g.twins), (3, [1, 2, 2], 1));
        assert!((g.geomean - (1.0f64 * 1.015 * 1.10).powf(1.0 / 3.0)).abs() < 1e-12);
        assert_eq!(g.worst.1, "c");
        assert!(gaps(&[]).is_none());
    }

    #[test]
    fn forced_plans_are_read_only_from_split_and_raster_overrides() {
        assert_eq!(forced_plan(&serde_json::json!({})), Some(None));
        assert_eq!(
            forced_plan(&serde_json::json!({"plan_overrides": {"LMHEAD_FWD_SPLITS": "12", "LMHEAD_FWD_RASTER": "11"}})),
            Some(Some((12, 11)))
        );
        assert_eq!(forced_plan(&serde_json::json!({"plan_overrides": {"LMHEAD_FWD_SPLITS": "12"}})), None);
    }
}
