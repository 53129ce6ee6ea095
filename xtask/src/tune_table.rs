//! `cargo xtask tune-table <tune-table.jsonl>... [--out FILE] [--report FILE] [--ptx-hash H]
//! [--fixed-only FAMILY,...]` (families whose picks lost to the fixed config in the steady state:
//! table mode takes the fixed config for them at every key): merge the records
//! of `lmhead-bench tune-table` runs (by key; the latest record of a key wins), write the shipped
//! table of tuned configs (`host/tuned/<device>.json`, read by `host/src/tune/table.rs`), and
//! print the autotuned-vs-best-fixed report from the same records.
//!
//! Per key the table keeps the timed candidates within 25% of the fastest (at most 5), fastest
//! first, relative to the fastest. The
//! best fixed config of a family is the one timed at every key of the family with the smallest
//! geometric-mean slowdown (time / that key's best) over those keys: the fairest single config
//! (it is also the most frequent winner whenever one config dominates).
//!
//! The report compares, per shape, the autotuned winners with the best fixed configs on the
//! tuning trials' own times (median of 5 timed runs each; contenders' times include their
//! confirmation rounds): per family, and for a training step estimated as
//! `fwd_ent + ⌈v / chunk⌉ · (dlogits_ent + dh + dW)`.

use std::collections::BTreeMap;

use lmhead_core::config::{Family, TileConfig};
use serde_json::Value;

type Key = (Family, u32, u32, u32); // family, bucket, d, v

struct Rec {
    ts: u64,
    ms: Vec<(TileConfig, f64)>,
}

/// A complete shape: local t, v, d and the case name.
type Shape = (u32, u32, u32, String);

/// What the records hold: the GPU's name, every key's latest record, the complete shapes, the
/// PTX hashes of the kernels they timed, and their distinct per-family hashes.
type Records = (String, BTreeMap<Key, Rec>, Vec<Shape>, Vec<String>, Vec<Value>);

fn family(v: &Value) -> Option<Family> {
    serde_json::from_value(v.clone()).ok()
}

fn read(files: &[String]) -> Result<Records, String> {
    let mut keys: BTreeMap<Key, Rec> = BTreeMap::new();
    let mut shapes = Vec::new();
    let mut gpu = String::new();
    let mut hashes: Vec<String> = Vec::new();
    let mut family_hashes: Vec<Value> = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"))?;
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let r: Value = serde_json::from_str(line).map_err(|e| format!("{f}:{}: {e}", i + 1))?;
            if r["suite"] != "tune-table" {
                continue;
            }
            gpu = r["gpu"].as_str().unwrap_or_default().to_string();
            if let Some(h) = r["ptx_hash"].as_str() {
                if !hashes.iter().any(|x| x == h) {
                    hashes.push(h.to_string());
                }
            }
            if let Some(fh) = r.get("family_hashes") {
                if !family_hashes.contains(fh) {
                    family_hashes.push(fh.clone());
                }
            }
            let s = &r["shape"];
            if r.get("key").is_none() {
                if r["complete"].as_bool() == Some(true) {
                    let g = |k: &str| s[k].as_u64().unwrap_or(0) as u32;
                    let shape = (g("t"), g("v"), g("d"), s["case"].as_str().unwrap_or_default().to_string());
                    if !shapes.contains(&shape) {
                        shapes.push(shape);
                    }
                }
                continue;
            }
            let k = &r["key"];
            if k["tp"].as_bool() == Some(true) || k["dtype"] != "bf16" {
                continue;
            }
            let fam = family(&k["family"]).ok_or_else(|| format!("{f}:{}: unknown family {}", i + 1, k["family"]))?;
            let key =
                (fam, k["bucket"].as_u64().unwrap_or(0) as u32, k["d"].as_u64().unwrap_or(0) as u32, k["v"].as_u64().unwrap_or(0) as u32);
            let mut ms = Vec::new();
            for c in r["entry"]["candidates"].as_array().into_iter().flatten() {
                let (Some(cfg), Some(o)) = (c.get(0), c.get(1)) else { continue };
                let Ok(cfg) = serde_json::from_value::<TileConfig>(cfg.clone()) else { continue };
                if o["outcome"] == "timed" {
                    if let Some(t) = o["ms"].as_f64() {
                        ms.push((cfg, t));
                    }
                }
            }
            let ts = r["timestamp"].as_u64().unwrap_or(0);
            if ms.is_empty() || keys.get(&key).is_some_and(|old| old.ts > ts) {
                continue;
            }
            ms.sort_by(|a, b| a.1.total_cmp(&b.1));
            keys.insert(key, Rec { ts, ms });
        }
    }
    Ok((gpu, keys, shapes, hashes, family_hashes))
}

fn best_fixed(keys: &BTreeMap<Key, Rec>, fam: Family) -> Option<(TileConfig, f64)> {
    let ks: Vec<&Rec> = keys.iter().filter(|(k, _)| k.0 == fam).map(|(_, r)| r).collect();
    if ks.is_empty() {
        return None;
    }
    fam.candidates()
        .iter()
        .filter(|c| c.is_sm90())
        .filter_map(|&c| {
            let mut log = 0.0;
            for r in &ks {
                let t = r.ms.iter().find(|(x, _)| *x == c)?.1;
                log += (t / r.ms[0].1).ln();
            }
            Some((c, (log / ks.len() as f64).exp()))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mut files = Vec::new();
    let mut out = None;
    let mut report = None;
    let mut ptx_hash = None;
    let mut fixed_only: Vec<Family> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = Some(it.next().ok_or("--out needs a file")?.clone()),
            "--report" => report = Some(it.next().ok_or("--report needs a file")?.clone()),
            "--ptx-hash" => ptx_hash = Some(it.next().ok_or("--ptx-hash needs a value")?.clone()),
            "--fixed-only" => {
                for f in it.next().ok_or("--fixed-only needs families (e.g. BwdDlogits,BwdDlogitsEnt)")?.split(',') {
                    let fam: Family = serde_json::from_value(serde_json::Value::String(f.trim().into()))
                        .map_err(|_| format!("--fixed-only: unknown family {f}"))?;
                    fixed_only.push(fam);
                }
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            f => files.push(f.to_string()),
        }
    }
    if files.is_empty() {
        return Err(
            "usage: cargo xtask tune-table <tune-table.jsonl>... [--out host/tuned/<device>.json] [--report FILE.md] [--ptx-hash H] [--fixed-only FAMILY,...]".into(),
        );
    }
    let (gpu, keys, shapes, hashes, family_hashes) = read(&files)?;
    if keys.is_empty() {
        return Err("no tune-table records in those files".into());
    }
    // The kernels the records timed: from the records (written since the field exists), or
    // `--ptx-hash` (the `ptx_hash` in the header of the run's tune-cache.json) for older ones.
    let ptx_hash = match (hashes.as_slice(), ptx_hash) {
        ([], Some(h)) => h,
        ([h], None) => h.clone(),
        ([h], Some(x)) if *h == x => x,
        ([], None) => return Err("the records name no PTX hash: pass --ptx-hash (the tune cache header's ptx_hash)".into()),
        (hs, x) => return Err(format!("records of different kernels cannot make one table: {hs:?} (--ptx-hash {x:?})")),
    };
    let mut fixed = BTreeMap::new();
    let mut md = String::new();
    md.push_str(&format!(
        "# Autotuned vs best fixed config, {gpu}\n\nFrom `cargo xtask tune-table {}`: {} tuned keys, {} complete shapes.\n\n",
        files.join(" "),
        keys.len(),
        shapes.len()
    ));
    md.push_str("| family | keys | best fixed config | geomean slowdown | its wins |\n|---|---:|---|---:|---:|\n");
    for f in Family::ALL {
        let Some((c, g)) = best_fixed(&keys, f) else { continue };
        let n = keys.iter().filter(|(k, _)| k.0 == f).count();
        let wins = keys.iter().filter(|(k, r)| k.0 == f && r.ms[0].0 == c).count();
        md.push_str(&format!("| {f:?} | {n} | {} | {g:.4} | {wins}/{n} |\n", c.suffix(f)));
        fixed.insert(f, c);
    }
    // Per shape: the families' times, autotuned vs fixed.
    let time = |f: Family, bucket: u32, d: u32, v: u32, c: Option<TileConfig>| -> Option<f64> {
        let r = keys.get(&(f, bucket, d, v))?;
        match c {
            None => Some(r.ms[0].1),
            Some(c) => r.ms.iter().find(|(x, _)| *x == c).map(|x| x.1),
        }
    };
    let chunk_of = |f: Family, bucket: u32, d: u32, v: u32| -> Option<u32> {
        keys.keys().filter(|k| k.0 == f && k.1 == bucket && k.2 == d && k.3 <= v.max(1)).map(|k| k.3).max()
    };
    // Latency reductions in percent, with the shape they belong to (`report::summarize`'s input).
    let mut per_family: BTreeMap<Family, Vec<(f64, String)>> = BTreeMap::new();
    let mut step = Vec::new();
    let mut rows = String::new();
    for (t, v, d, case) in &shapes {
        let bucket = lmhead_core::TokenBucket::of(*t as usize).tokens();
        let mut auto_total = 0.0;
        let mut fixed_total = 0.0;
        let mut ok = true;
        let Some(chunk) = chunk_of(Family::BwdDlogitsEnt, bucket, *d, *v) else { continue };
        let n_chunks = v.div_ceil(chunk) as f64;
        for (f, fv, mult) in [
            (Family::Fwd, *v, 0.0),
            (Family::FwdEnt, *v, 1.0),
            (Family::BwdDlogits, chunk, 0.0),
            (Family::BwdDlogitsEnt, chunk, n_chunks),
            (Family::BwdDh, chunk, n_chunks),
            (Family::BwdDw, chunk, n_chunks),
        ] {
            match (time(f, bucket, *d, fv, None), fixed.get(&f).and_then(|&c| time(f, bucket, *d, fv, Some(c)))) {
                (Some(a), Some(x)) => {
                    per_family.entry(f).or_default().push((crate::report::reduction(x, a), case.clone()));
                    auto_total += mult * a;
                    fixed_total += mult * x;
                }
                _ => ok = false,
            }
        }
        if ok {
            let red = crate::report::reduction(fixed_total, auto_total);
            step.push((red, case.clone()));
            rows.push_str(&format!("| {t} × {v} × {d} | {case} | {fixed_total:.3} | {auto_total:.3} | {:+.2}% |\n", -red));
        }
    }
    md.push_str("\nLatency reduction of the autotuned pick against the best fixed config, per shape (trial times):\n\n");
    md.push_str("| what | shapes | mean | median | p90 | max | faster | worst regression |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    let line = |name: String, xs: &[(f64, String)]| -> String {
        let Some(m) = crate::report::summarize(xs) else { return String::new() };
        let worst = m.worst.map(|(x, _)| -x).unwrap_or(0.0);
        format!(
            "| {name} | {} | {:.2}% | {:.2}% | {:.2}% | {:.2}% | {}/{} | {worst:.2}% |\n",
            m.n, m.mean, m.median, m.p90, m.max, m.faster, m.n
        )
    };
    md.push_str(&line("training step (fwd_ent + chunks × (dlogits_ent + dh + dW))".into(), &step));
    for (f, xs) in &per_family {
        md.push_str(&line(format!("{f:?}"), xs));
    }
    md.push_str("\n| local t × v × d | case | fixed ms | autotuned ms | change |\n|---|---|---:|---:|---:|\n");
    md.push_str(&rows);
    print!("{md}");
    if let Some(r) = report {
        std::fs::write(&r, &md).map_err(|e| format!("{r}: {e}"))?;
    }
    if let Some(o) = out {
        let entries: Vec<Value> = keys
            .iter()
            .map(|((f, b, d, v), r)| {
                let best = r.ms[0].1;
                // What the tuner reads: the winner and the runners-up within 25% (at most 5).
                let ranking: Vec<Value> =
                    r.ms.iter()
                        .filter(|(_, t)| *t <= 1.25 * best)
                        .take(5)
                        .map(|(c, t)| serde_json::json!([c, (t / best * 1e4).round() / 1e4]))
                        .collect();
                serde_json::json!({"family": f, "bucket": b, "d": d, "v": v, "ranking": ranking})
            })
            .collect();
        let mut table = serde_json::json!({
            "format": 1, "device": gpu, "ptx_hash": ptx_hash,
            "source": format!("cargo xtask tune-table {}", files.iter().map(|f| f.rsplit('/').next().unwrap_or(f)).collect::<Vec<_>>().join(" ")),
            "fixed": fixed, "entries": entries,
        });
        if !fixed_only.is_empty() {
            table["fixed_only"] = serde_json::to_value(&fixed_only).map_err(|e| e.to_string())?;
        }
        // Per-family hashes (records written since the field exists): they let a later build
        // whose PTX changed elsewhere keep this table exact for the unchanged families.
        match family_hashes.as_slice() {
            [] => {}
            [fh] => table["family_hashes"] = fh.clone(),
            _ => return Err("records of different kernels cannot make one table: their family hashes differ".into()),
        }
        let mut text = serde_json::to_string(&table).map_err(|e| e.to_string())?;
        // One entry per line: reviewable diffs.
        text = text.replace("},{\"family\"", "},\n{\"family\"");
        // The table it replaces may hold forward plans (`cargo xtask table-plans`), which this
        // one does not: say so rather than drop them quietly.
        let old_plans = std::fs::read_to_string(&o).ok().map_or(0, |t| plan_count(&t));
        std::fs::write(&o, text + "\n").map_err(|e| format!("{o}: {e}"))?;
        eprintln!("wrote {o}: {} keys", keys.len());
        if old_plans > 0 {
            eprintln!("warning: the table replaced held {old_plans} forward plans, this one none: run `cargo xtask table-plans <plans records>` again");
        }
    }
    Ok(())
}

/// How many forward plans (`plans`) the table `text` holds (0 when it is not a table).
fn plan_count(text: &str) -> usize {
    serde_json::from_str::<Value>(text).ok().and_then(|t| t.get("plans")?.as_array().map(Vec::len)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_of_a_replaced_table_are_counted() {
        assert_eq!(plan_count(r#"{"format": 1, "entries": []}"#), 0);
        assert_eq!(plan_count(r#"{"format": 1, "entries": [], "plans": [{}, {}]}"#), 2);
        assert_eq!(plan_count("not json"), 0);
    }

    fn rec(family: &str, bucket: u32, times: &[(usize, f64)], ts: u64) -> String {
        let fam: Family = serde_json::from_value(serde_json::json!(family)).unwrap();
        let cands: Vec<Value> =
            times.iter().map(|&(i, ms)| serde_json::json!([fam.candidates()[i], {"outcome": "timed", "ms": ms}])).collect();
        serde_json::json!({
            "suite": "tune-table", "gpu": "G", "timestamp": ts, "shape": {"t": bucket, "v": 1000, "d": 64},
            "key": {"family": family, "bucket": bucket, "d": 64, "v": 1000, "dtype": "bf16", "tp": false},
            "entry": {"winner": fam.candidates()[times[0].0], "candidates": cands, "seconds": 0.1},
        })
        .to_string()
    }

    #[test]
    fn merges_by_key_and_picks_the_fairest_fixed_config() {
        let sm90: Vec<usize> = (0..Family::Fwd.candidates().len()).filter(|&i| Family::Fwd.candidates()[i].is_sm90()).collect();
        let (a, b) = (sm90[0], sm90[1]);
        let dir = std::env::temp_dir().join(format!("xtask-tt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("r.jsonl");
        // a wins narrowly at two keys, b wins by far at one: b's geomean slowdown is smaller.
        let lines = [
            rec("Fwd", 2048, &[(a, 1.00), (b, 1.02)], 1),
            rec("Fwd", 4096, &[(a, 1.00), (b, 1.02)], 1),
            rec("Fwd", 8192, &[(a, 2.00), (b, 1.00)], 1),
            // An older record of the 8192 key is ignored, a newer one replaces it.
            rec("Fwd", 8192, &[(a, 1.00), (b, 9.00)], 0),
        ];
        std::fs::write(&f, lines.join("\n")).unwrap();
        let (gpu, keys, _, _, family_hashes) = read(&[f.to_string_lossy().into()]).unwrap();
        assert_eq!(gpu, "G");
        assert!(family_hashes.is_empty());
        assert_eq!(keys.len(), 3);
        let k8 = &keys[&(Family::Fwd, 8192, 64, 1000)];
        assert_eq!(k8.ms[0].0, Family::Fwd.candidates()[b]);
        let (c, g) = best_fixed(&keys, Family::Fwd).unwrap();
        assert_eq!(c, Family::Fwd.candidates()[b]);
        assert!((g - (1.02f64 * 1.02).powf(1.0 / 3.0)).abs() < 1e-9, "{g}");
        let out = dir.join("t.json");
        assert!(run(&[f.to_string_lossy().into(), "--out".into(), out.to_string_lossy().into()]).is_err(), "no PTX hash");
        // The records in `f` into a table at `out`, read back.
        let make = || -> Result<Value, String> {
            run(&[
                f.to_string_lossy().into(),
                "--out".into(),
                out.to_string_lossy().into(),
                "--ptx-hash".into(),
                "0123456789abcdef".into(),
            ])?;
            Ok(serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap())
        };
        let t = make().unwrap();
        assert_eq!(t["entries"].as_array().unwrap().len(), 3);
        assert_eq!(t["fixed"]["Fwd"], serde_json::to_value(Family::Fwd.candidates()[b]).unwrap());
        assert!(t.get("family_hashes").is_none(), "records without family hashes: none in the table");
        // Records with family hashes pass them on; records of two kernel builds are refused.
        let with = |h: &str| {
            lines
                .iter()
                .map(|l| {
                    let mut v: Value = serde_json::from_str(l).unwrap();
                    v["family_hashes"] = serde_json::json!({ "Fwd": h });
                    v.to_string()
                })
                .collect::<Vec<_>>()
        };
        std::fs::write(&f, with("aaaa").join("\n")).unwrap();
        assert_eq!(make().unwrap()["family_hashes"], serde_json::json!({ "Fwd": "aaaa" }));
        let mut mixed = with("aaaa");
        mixed[0] = with("bbbb")[0].clone();
        std::fs::write(&f, mixed.join("\n")).unwrap();
        assert!(make().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
