//! End-to-end tests of `cargo xtask bench-report`: they run the built `xtask` binary on the
//! checked-in fixture and on synthetic results files, in a temporary directory (no GPU needed).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bench-sample.jsonl");

/// A fresh, empty directory under the system temp dir, unique to this process and test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xtask-bench-report-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `xtask bench-report <input> --out-dir <out>`.
fn bench_report(input: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).arg("bench-report").arg(input).arg("--out-dir").arg(out).output().expect("run xtask")
}

/// Asserts that `path` is a PNG file (8-byte signature) of a plausible size for a drawn chart.
fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    assert!(bytes.len() > 5_000, "{} is only {} bytes", path.display(), bytes.len());
}

/// One results line as `lmhead-bench` writes it. `ms` = (gemm, fwd, fwd_ent, fwd_bwd).
fn record(tuning: &str, timestamp: u64, model: &str, (t, v, d): (usize, usize, usize), ms: (f64, f64, f64, Option<f64>)) -> String {
    let timing = |x: f64| json!({"p20": x * 0.99, "p50": x, "p80": x * 1.01});
    json!({
        "gpu": "NVIDIA H200", "driver": 13000, "commit": "abc1234", "suite": "quick", "timestamp": timestamp, "tuning": tuning,
        "row": {
            "case": {"model": model, "tokens": t, "tp": 1, "cp": 1, "t": t, "v": v, "d": d, "backward": ms.3.is_some()},
            "gemm": timing(ms.0), "fwd": timing(ms.1), "fwd_ent": timing(ms.2), "fwd_bwd": ms.3.map(timing),
            "fwd_cfg": "", "fwd_ent_cfg": "", "bwd_cfg": "", "workspace_mib": 1.5, "check_max_abs": 1e-5,
        }
    })
    .to_string()
}

#[test]
fn fixture_report_and_ratio_plot() {
    let out = temp_dir("fixture");
    let o = bench_report(Path::new(FIXTURE), &out);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    for needle in [
        "- GPU: NVIDIA H200",
        "- Driver: 13000 (CUDA 13.0)",
        "- Commit(s): 4ce3e8d-dirty",
        "- Dates (UTC): 2026-11-29",
        "## Suite `quick`, tuning `auto` (4 shapes)",
        // GEMM 5.859 ms, fwd 12.760 ms = 2.18x, fwd+bwd 53.174 ms = 9.07x, 2·4096·128256·4096 FLOP / 12.760 ms.
        "| 1 | llama-3.1-8b/tok4k/tp1cp1 | 4096 | 128256 | 4096 | 5.859 | 12.760 (2.18x) | 12.783 (2.18x) | 53.174 (9.07x) | 337.3 | 128.5 |",
        "| 4 | qwen3.6-35b-a3b/tok16k/tp1cp1 | 16384 | 248320 | 2048 | 24.297 | 53.926 (2.22x) | 54.141 (2.23x) | - |",
        "No shape was measured both autotuned and with fixed configs",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(stdout.starts_with(&md), "stdout starts with the markdown");
    assert!(stdout.contains("ratio.png"));
    assert_png(&out.join("ratio.png"));
    assert!(!out.join("autotune.png").exists(), "no pairs, no autotune plot");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn autotuned_vs_fallback_summary() {
    let out = temp_dir("pairs");
    let (s0, s1, s2, s3) = ((4096, 1000, 256), (8192, 2000, 512), (8192, 3000, 512), (16384, 4000, 256));
    // Fallback: fwd 10 ms, fwd+ent 20 ms, fwd+bwd 100 ms everywhere.
    // Auto fwd 9, 8, 10.4, 5 → reductions 10, 20, −4, 50 %: mean 19, median (10+20)/2 = 15,
    // p90 = sorted[round(0.9·3)] = 50, max 50, 3 of 4 faster, worst −4 % on m2.
    // Auto fwd+ent 18 everywhere → 10 % each. Auto fwd+bwd 70, 90 (s0, s1 only) → 30, 10 %:
    // mean 20, median 20, p90 = sorted[round(0.9·1)] = 30, max 30.
    let lines = [
        // Superseded: an earlier fallback run of s0 with other numbers (older timestamp).
        record("fallback", 1_000, "m0", s0, (1.0, 99.0, 99.0, Some(999.0))),
        record("auto", 2_000, "m0", s0, (1.0, 9.0, 18.0, Some(70.0))),
        record("auto", 2_000, "m1", s1, (1.0, 8.0, 18.0, Some(90.0))),
        record("auto", 2_000, "m2", s2, (1.0, 10.4, 18.0, None)),
        record("auto", 2_000, "m3", s3, (1.0, 5.0, 18.0, None)),
        String::new(),
        record("fallback", 3_000, "m0", s0, (1.0, 10.0, 20.0, Some(100.0))),
        record("fallback", 3_000, "m1", s1, (1.0, 10.0, 20.0, Some(100.0))),
        record("fallback", 3_000, "m2", s2, (1.0, 10.0, 20.0, None)),
        record("fallback", 3_000, "m3", s3, (1.0, 10.0, 20.0, None)),
        // Later in the file but older: must not replace the auto run of s0.
        record("auto", 1_500, "m0", s0, (1.0, 1.0, 1.0, Some(1.0))),
    ];
    let input = out.join("results.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let o = bench_report(&input, &out);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    for needle in [
        "10 records, 8 after keeping the latest",
        "- Dates (UTC): 1970-01-01",
        "## Suite `quick`, tuning `auto` (4 shapes)",
        "## Suite `quick`, tuning `fallback` (4 shapes)",
        "### Suite `quick`: 4 shapes compared",
        "| fwd | 4 | 19.0% | 15.0% | 50.0% | 50.0% | 3/4 | -4.0% (m2/tok8k/tp1cp1) |",
        "| fwd+ent | 4 | 10.0% | 10.0% | 10.0% | 10.0% | 4/4 | none |",
        "| fwd+bwd | 2 | 20.0% | 20.0% | 30.0% | 30.0% | 2/2 | none |",
        "| 1 | m0/tok4k/tp1cp1 [vs fallback] | 4096 | 1000 | 256 | 9.000 / 10.000 (10.0%) | 18.000 / 20.000 (10.0%) | 70.000 / 100.000 (30.0%) |",
        "| 4 | m3/tok16k/tp1cp1 [vs fallback] | 16384 | 4000 | 256 | 5.000 / 10.000 (50.0%) | 18.000 / 20.000 (10.0%) | - |",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    assert_png(&out.join("ratio.png"));
    assert_png(&out.join("autotune.png"));
    assert!(stdout.contains(&format!("wrote {}", out.join("autotune.png").display())));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn malformed_line_is_an_error_naming_the_line() {
    let out = temp_dir("malformed");
    let fixture = std::fs::read_to_string(FIXTURE).unwrap();
    let good: Vec<&str> = fixture.lines().collect();
    let input = out.join("bad.jsonl");
    // Line 3 is blank (skipped); line 4 is cut short.
    std::fs::write(&input, format!("{}\n{}\n\n{}\n", good[0], good[1], &good[2][..40])).unwrap();
    let o = bench_report(&input, &out.join("report"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("line 4: malformed benchmark record"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.join("report").join("report.md").exists());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn usage_errors() {
    let o = Command::new(env!("CARGO_BIN_EXE_xtask")).arg("bench-report").output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage: cargo xtask bench-report"));
    let o = Command::new(env!("CARGO_BIN_EXE_xtask")).args(["bench-report", "/nonexistent/results.jsonl"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read /nonexistent/results.jsonl"));
}
