//! `docs/run-gpu.sh plans` (forward launch plans side by side on the GPU machine) with a stand-in
//! for `lmhead-bench` that only records how it was called: the cache-filling run, then the
//! planner's plan and each forced plan in the order planner, A, B, B, A, planner, each with its
//! own `LMHEAD_FWD_SPLITS` / `LMHEAD_FWD_RASTER` (or, for a `chunk=<N>` variant, `--bwd-chunk N`;
//! for `dw-after-dh`, `--dw-after-dh`; for `LMHEAD_<NAME>=<value>,…`, those variables) and the
//! log-prob check on. Needs `bash`; without it the test prints why it skips.

use std::path::Path;
use std::process::Command;

#[test]
fn plans_step_runs_each_plan_in_mirrored_order() {
    let dir = std::env::temp_dir().join(format!("run-gpu-plans-{}", std::process::id()));
    let (gpu, out) = (dir.join(".gpu"), dir.join("out"));
    std::fs::create_dir_all(&gpu).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/run-gpu.sh");
    std::fs::copy(&script, gpu.join("run-gpu.sh")).unwrap();
    let calls = dir.join("calls.txt");
    let fake = format!(
        "#!/usr/bin/env bash\necho \"${{LMHEAD_BWD_FILL:+fill=$LMHEAD_BWD_FILL }}${{LMHEAD_BWD_TILES:+tiles=$LMHEAD_BWD_TILES }}${{LMHEAD_FWD_SPLITS:--}}x${{LMHEAD_FWD_RASTER:--}} $*\" >> '{}'\n",
        calls.display()
    );
    std::fs::write(gpu.join("lmhead-bench"), fake).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(gpu.join("lmhead-bench"), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let cases = dir.join("plan-cases.txt");
    std::fs::write(
        &cases,
        "llama-3.1-8b/tok128k/tp1cp1 8x17 12x11\n\nqwen2.5-14b/tok64k/tp4cp1 15x9\nqwen2.5-14b/tok64k/tp2cp1 chunk=8448 12x11\nllama-3.1-8b/tok16k/tp1cp1 dw-after-dh LMHEAD_BWD_FILL=1,LMHEAD_BWD_TILES=2\n",
    )
    .unwrap();
    let run = Command::new("bash")
        .arg(gpu.join("run-gpu.sh"))
        .arg("plans")
        .current_dir(&dir)
        .env("OUT", &out)
        .env("PLAN_CASES", &cases)
        .env("LMHEAD_TUNE_CACHE", "off")
        .env_remove("LMHEAD_FWD_SPLITS")
        .env_remove("LMHEAD_FWD_RASTER")
        .env_remove("LMHEAD_BWD_TILES")
        .env_remove("LMHEAD_BWD_FILL")
        .env_remove("BUDGET")
        .output();
    let run = match run {
        Ok(run) => run,
        Err(e) => {
            println!("SKIP: bash did not run ({e})");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "run-gpu.sh plans failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let got = std::fs::read_to_string(&calls).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let res = out.join("plans.jsonl");
    let timed = |case: &str, plan: &str| format!("{plan} sweep --filter {case} --reps 3 --out {}", res.display());
    let fill = |case: &str| format!("-x- sweep --filter {case} --reps 1 --no-check --out /dev/null");
    let chunked = |case: &str, chunk: u32| format!("-x- sweep --filter {case} --reps 3 --bwd-chunk {chunk} --out {}", res.display());
    let after = |case: &str| format!("-x- sweep --filter {case} --reps 3 --dw-after-dh --out {}", res.display());
    let (a, b, c, d) =
        ("llama-3.1-8b/tok128k/tp1cp1", "qwen2.5-14b/tok64k/tp4cp1", "qwen2.5-14b/tok64k/tp2cp1", "llama-3.1-8b/tok16k/tp1cp1");
    let want = [
        fill(a),
        timed(a, "-x-"),
        timed(a, "8x17"),
        timed(a, "12x11"),
        timed(a, "12x11"),
        timed(a, "8x17"),
        timed(a, "-x-"),
        fill(b),
        timed(b, "-x-"),
        timed(b, "15x9"),
        timed(b, "15x9"),
        timed(b, "-x-"),
        fill(c),
        timed(c, "-x-"),
        chunked(c, 8448),
        timed(c, "12x11"),
        timed(c, "12x11"),
        chunked(c, 8448),
        timed(c, "-x-"),
        fill(d),
        timed(d, "-x-"),
        after(d),
        timed(d, "fill=1 tiles=2 -x-"),
        timed(d, "fill=1 tiles=2 -x-"),
        after(d),
        timed(d, "-x-"),
    ];
    assert_eq!(got.lines().collect::<Vec<_>>(), want, "stdout:\n{stdout}");
}
