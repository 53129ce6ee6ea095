//! `lmhead-bench`: the fused kernels side by side with a cuBLAS bf16 GEMM of the same shape, in
//! the same run. Prints a markdown table, appends JSON lines to a results file.
//!
//! ```text
//! lmhead-bench [quick|peers|sweep|probe|entropy|tp|active|keep|exhaustive|dh-probe|config-probe]
//!              [--filter SUBSTR] [--budget-s N]
//!              [--reps N] [--out results.jsonl] [--fallback | --fixed | --versus-fixed]
//!              [--no-check] [--skip N]
//!              [--bwd-chunk N] [--dw-after-dh] [--check-labels] [--fixed-order] [--resume FILE]
//! ```
//!
//! Suites (`suites.rs`): `quick`, `peers` (the seven shapes of the comparison with the public
//! fused LM-head kernels), `sweep`, `entropy`, `probe` (what tuning costs), `tp` (`tp.rs`).
//! `--fixed` runs without tuning (`LMHEAD_AUTOTUNE=0`: the rules' picks; on the H200 also the
//! default); `--versus-fixed` times a head that tunes (`LMHEAD_AUTOTUNE=1`: the rules' short
//! lists timed) and one that does not, in the same rounds on the same inputs (the steady-state
//! comparison; two records per shape, `auto` and `fixed`); `--fallback` runs the `mma.sync`
//! fallback configs.
//!
//! `exhaustive` tunes every candidate of every tuned family at every sweep shape not in the
//! `--resume` files and records every candidate's trial time (`exhaustive.rs`); `cargo xtask
//! heuristics` replays the rules against such records.
//!
//! `dh-probe --filter T,K,D` times one `dh` chunk per epilogue (`dh_probe.rs`); `config-probe
//! --filter T,V,D[;T,V,D…]` each sm90 forward and `dh` candidate in the steady state
//! (`config_probe.rs`).
//!
//! `active` times masked batches against the dense call and the compacted ideal (`active.rs`).
//! `keep` times the training step with the kept-logits mode on and off against one GEMM (`keep.rs`).
//!
//! `--check-labels` times the forwards with `FwdOptions::check_labels` on (the label check
//! kernel and its synchronous 8-byte read before each forward); by default it is off, so the
//! forward's times are the kernels' alone. `--dw-after-dh` runs the backward with
//! `BwdOptions::dw_beside_dh` off. The launch plans' measurement overrides
//! (`lmhead::testing::PLAN_OVERRIDE_VARS`) are read from the environment and set for the run;
//! records name those set (`plan_overrides`).
//!
//! Measurement hygiene (`measure.rs`): random inputs (never zeros); tuning and warm-up of every
//! operation before any timing; then `--reps` rounds, each timing cuBLAS, the forward, the
//! forward with entropy and (first 5 rounds) forward+backward once in turn with CUDA events, in
//! orders that spread what runs right before each operation over the others (`rounds.rs`;
//! `--fixed-order`: always in that order, which measured the forwards 0.2–1.6% faster against
//! cuBLAS than shuffled rounds, docs/PERFORMANCE.md), so that all see the same clock and
//! temperature (the H200 runs these shapes at its power limit) and none always follows the same
//! one; the median of the rounds (p20/p80 kept); operands are not rotated, but `W` is at least
//! twice the 60 MB L2 at every suite shape; and a check of the timed runs' log-probs on sampled
//! rows against the f64 reference, so a fast wrong kernel cannot win. Records name the forwards'
//! launch plans (`fwd_plan`, `fwd_ent_plan`). FLOPs: one logits GEMM is `2·t·v·d`;
//! forward+backward does four (logits, recompute, dh, dW).

mod active;
mod args;
mod config_probe;
mod cublas;
mod decisions;
mod dh_probe;
mod exhaustive;
mod keep;
mod measure;
mod rounds;
mod suites;
mod tp;

use std::io::Write as _;
use std::sync::Arc;
use std::time::Instant;

use lmhead::cudarc::driver::CudaStream;
use lmhead::LmHead;
use serde_json::json;

pub use args::{plan_overrides, Args};
pub use lmhead_core::record::{Case, Plan, Row, Timing};
pub use measure::{check_sampled_logprobs, random_bf16, sample, timing};
pub use rounds::RoundOrders;
pub use suites::Suite;

/// Seconds since the Unix epoch (the records' `timestamp`).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn commit() -> String {
    std::env::var("LMHEAD_COMMIT").unwrap_or_else(|_| option_env!("LMHEAD_BUILD_COMMIT").unwrap_or("unknown").to_string())
}

fn main() {
    let args = match args::parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\n{}", args::USAGE);
            std::process::exit(2);
        }
    };
    if args.fixed {
        // Read by LmHead::new: no tuning, the rules' picks.
        std::env::set_var("LMHEAD_AUTOTUNE", "0");
    }
    if args.versus_fixed {
        // Read by LmHead::new: the first head times the rules' short lists.
        std::env::set_var("LMHEAD_AUTOTUNE", "1");
    }
    // The launch plans' measurement overrides, for `run-gpu.sh plans` (the library reads none).
    lmhead::testing::set_plan_overrides(lmhead::testing::PlanOverrides::from_env());
    if !lmhead::driver_present() {
        eprintln!("lmhead-bench: no CUDA driver on this machine; the benchmark needs an H100/H200 (see docs/PERFORMANCE.md)");
        std::process::exit(1);
    }
    let head = if args.suite == "exhaustive" { exhaustive::head() } else { LmHead::new(0) };
    let head = head.unwrap_or_else(|e| {
        eprintln!("lmhead-bench: {e}");
        std::process::exit(1)
    });
    let stream = head.gpu().context().default_stream();
    // `--versus-fixed`: a second head on the rules' picks, untuned (read by LmHead::new).
    let fixed_head = args.versus_fixed.then(|| {
        std::env::set_var("LMHEAD_AUTOTUNE", "0");
        let f = LmHead::new(0).unwrap_or_else(|e| {
            eprintln!("lmhead-bench: {e}");
            std::process::exit(1)
        });
        std::env::remove_var("LMHEAD_AUTOTUNE");
        f
    });
    let info = head.gpu().info().clone();
    let report = (args.suite != "probe-child").then(|| head.kernel_report());
    if let Some(r) = report.as_ref().filter(|r| !r.cubin) {
        eprintln!("lmhead-bench: warning: the kernels are JIT-compiled ({}): first calls are slower", r.source);
    }
    if args.suite == "probe-child" {
        suites::probe_child(&head, &stream, args.filter.as_deref().unwrap_or_default());
        return;
    }
    if args.suite == "tp" {
        tp::run(&args, &info.name, &commit());
        return;
    }
    if args.suite == "active" {
        active::run(&head, &stream, &args, &info);
        return;
    }
    if args.suite == "keep" {
        keep::run(&head, &stream, &args, &info);
        return;
    }
    if args.suite == "exhaustive" {
        exhaustive::run(&head, &args, &info.name, &commit());
        return;
    }
    // The single-kernel probes: one shape from `--filter`, a report on stdout.
    type Probe = fn(&LmHead, &Arc<CudaStream>, &Args) -> lmhead::Result<()>;
    let probe: Option<Probe> = match args.suite.as_str() {
        "config-probe" => Some(config_probe::run),
        "dh-probe" => Some(dh_probe::run),
        _ => None,
    };
    if let Some(run) = probe {
        if let Err(e) = run(&head, &stream, &args) {
            eprintln!("lmhead-bench {}: {e}", args.suite);
            std::process::exit(1);
        }
        return;
    }
    let suite = Suite::named(&args.suite).unwrap_or_else(|| {
        eprintln!(
            "unknown suite `{}` (quick, peers, sweep, probe, entropy, tp, active, keep, exhaustive, dh-probe, config-probe)",
            args.suite
        );
        std::process::exit(2)
    });
    if let Suite::Probe = suite {
        suites::probe(&head, &stream, &args);
        return;
    }
    let cases: Vec<Case> =
        suite.cases().into_iter().filter(|c| args.filter.as_ref().is_none_or(|f| c.name().contains(f.as_str()))).skip(args.skip).collect();
    let (logical, unique) = suite.counts();
    println!(
        "# lmhead-bench {} on {} (driver {}), commit {}: {} shapes ({} logical cases → {} unique local shapes in the suite)",
        args.suite,
        info.name,
        info.driver_version,
        commit(),
        cases.len(),
        logical,
        unique
    );
    if let Some(r) = &report {
        println!("\n{r}");
    }
    println!();
    println!(
        "| case | T | V | D | GEMM ms | fwd ms (x GEMM) | fwd+ent ms (x GEMM) | fwd+bwd ms (x GEMM) | fwd TFLOP/s | ws MiB | configs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).ok();
    let start = Instant::now();
    for (i, c) in cases.iter().enumerate() {
        if start.elapsed().as_secs_f64() > args.budget_s {
            eprintln!("budget of {} s reached after {i} of {} shapes", args.budget_s, cases.len());
            break;
        }
        eprintln!("[{}/{}] {} ({:.0} s elapsed)", i + 1, cases.len(), c.name(), start.elapsed().as_secs_f64());
        let heads: Vec<(&LmHead, &str)> = match &fixed_head {
            Some(f) => vec![(&head, "auto"), (f, "fixed")],
            None => vec![(
                &head,
                if args.fallback {
                    "fallback"
                } else if args.fixed {
                    "fixed"
                } else {
                    "auto"
                },
            )],
        };
        let hs: Vec<&LmHead> = heads.iter().map(|h| h.0).collect();
        let seed = 0x5EED ^ i as u64;
        let measured = match measure::measure(&hs, &stream, c, &args, seed) {
            // Two heads' workspaces beside cuBLAS's logits may not fit where one does: then one
            // head at a time (same inputs, no longer in the same rounds).
            Err(lmhead::Error::OutOfMemory { .. }) if hs.len() > 1 => {
                eprintln!("{}: out of memory with both heads; measuring them one after the other", c.name());
                hs.iter()
                    .map(|&h| {
                        h.release_workspace();
                        let r = measure::measure(&[h], &stream, c, &args, seed).map(|mut v| v.remove(0));
                        h.release_workspace();
                        r
                    })
                    .collect::<lmhead::Result<Vec<Row>>>()
            }
            r => r,
        };
        match measured {
            Ok(rows) => {
                for (r, (_, tuning)) in rows.iter().zip(&heads) {
                    let f = 2.0 * c.t as f64 * c.v as f64 * c.d as f64;
                    let fb = r.fwd_bwd.as_ref().map(|t| format!("{:.2} ({:.2}x)", t.p50, t.p50 / r.gemm.p50)).unwrap_or_else(|| "-".into());
                    let name = if heads.len() > 1 { format!("{} ({tuning})", c.name()) } else { c.name() };
                    println!(
                        "| {} | {} | {} | {} | {:.3} | {:.3} ({:.2}x) | {:.3} ({:.2}x) | {} | {:.0} | {:.0} | {} / {} / {} |",
                        name,
                        c.t,
                        c.v,
                        c.d,
                        r.gemm.p50,
                        r.fwd.p50,
                        r.fwd.p50 / r.gemm.p50,
                        r.fwd_ent.p50,
                        r.fwd_ent.p50 / r.gemm.p50,
                        fb,
                        measure::tflops(f, r.fwd.p50),
                        r.workspace_mib,
                        r.fwd_cfg,
                        r.fwd_ent_cfg,
                        r.bwd_cfg
                    );
                    if let Some(o) = out.as_mut() {
                        let mut rec = json!({
                            "gpu": info.name, "driver": info.driver_version, "commit": commit(), "suite": args.suite,
                            "timestamp": crate::unix_now(),
                            "tuning": tuning,
                            "row": r,
                        });
                        rec["order"] = json!(if args.balanced { "balanced" } else { "fixed" });
                        if let Some(o) = plan_overrides(|k| std::env::var(k).ok()) {
                            rec["plan_overrides"] = o;
                        }
                        if let Some(chunk) = args.bwd_chunk {
                            rec["bwd_chunk"] = json!(chunk);
                        }
                        if args.dw_after_dh {
                            rec["dw_after_dh"] = json!(true);
                        }
                        let _ = writeln!(o, "{rec}");
                    }
                }
            }
            Err(e) => println!("| {} | {} | {} | {} | error: {e} |", c.name(), c.t, c.v, c.d),
        }
        for (h, _) in &heads {
            h.release_workspace();
        }
    }
}
