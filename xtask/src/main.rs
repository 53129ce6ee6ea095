//! Project tasks (`cargo xtask <task>`, aliased in `.cargo/config.toml`):
//!
//! - `setup`: install what the build needs (nightly components, the ptxas wheel into `.tools/`).
//! - `build-ptx`: build the kernels, lower them into both modules (Hopper: sm_90a, every kernel;
//!   portable: sm_80, the `mma.sync` ones), assemble each with ptxas, print their resource
//!   tables (registers, shared memory, stack, spills); fail on any stack frame or spill that
//!   `lmhead_build::RESOURCE_ALLOWLIST` does not excuse.
//! - `test`: `setup`, `build-ptx`, then every test of the workspace (GPU tests skip with a
//!   printed reason when there is no CUDA driver), then the PyTorch package's suite
//!   (`bindings/python/ci.sh`: venv, torch, the wheel, pytest on CPU tensors; GPU tests skip).
//!   This is the command README and CI run. `LMHEAD_SKIP_PYTHON=1` leaves the Python suite out.
//! - `demo`: the main job: a fused LM-head forward and backward with a result check against the
//!   f64 reference, on the GPU if there is one, else on the CPU backend at a smaller shape.
//! - `bench [args]`: run `lmhead-bench` here (needs a GPU).
//! - `gpu-bundle`: build the release test and bench binaries and copy them, with `run-gpu.sh`,
//!   into `.gpu/` (git-ignored), ready to copy to a GPU machine without Rust.
//! - `bench-report <results.jsonl> [--out-dir DIR]`: turn `lmhead-bench` JSON lines into a
//!   markdown report (tables, autotuned vs fallback summary) and PNG plots, by default in
//!   `docs/bench/`; `bench-report --docs` regenerates the tables of README.md and
//!   docs/PERFORMANCE.md from the results files `docs/results/SUITES` lists, `--check` (CI)
//!   fails where they are stale (see `report/`). Needs no GPU.
//! - `heuristics <records.jsonl>...`: the launch rules (`lmhead_core::heuristics`) against
//!   exhaustive trial records (`lmhead-bench exhaustive`) and forced-plan records (`run-gpu.sh
//!   plans`): how close each rule comes to the fastest candidate and plan (see `heuristics.rs`).
//!   Needs no GPU.

mod heuristics;
mod report;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn status(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let s = cmd.status().map_err(|e| format!("could not run {cmd:?}: {e}"))?;
    if s.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed ({s})"))
    }
}

fn setup() -> Result<PathBuf, String> {
    let paths = lmhead_build::Paths::new(root());
    lmhead_build::ensure_toolchain()?;
    let ptxas = lmhead_build::ptxas(&paths, true)?.ok_or("ptxas could not be installed")?;
    Ok(ptxas)
}

fn build_ptx() -> Result<(), String> {
    let ptxas = setup()?;
    let paths = lmhead_build::Paths::new(root());
    let t0 = std::time::Instant::now();
    let built = lmhead_build::build_modules(&paths)?;
    let lowered = t0.elapsed().as_secs_f64();
    let mut bad = Vec::new();
    for module in lmhead_build::Module::ALL {
        let t1 = std::time::Instant::now();
        let stem = lmhead_build::stem("lmhead_kernels", module);
        let ptx = built.ptx(module);
        let ptx_path = paths.target_dir.join(format!("{stem}.ptx"));
        std::fs::write(&ptx_path, ptx).map_err(|e| e.to_string())?;
        let cubin = paths.target_dir.join(format!("{stem}.cubin"));
        let report = lmhead_build::assemble(&ptxas, &ptx_path, &cubin, module)?;
        let res = report.resources;
        let (table, module_bad) = lmhead_build::resource_table(&res, module);
        bad.extend(module_bad);
        bad.extend(report.perf_warnings.into_iter().map(|w| format!("{}: {w}", module.name())));
        println!("{} module ({}):\n{table}", module.name(), module.arch());
        println!(
            "{} module: {} entry points in {} ({} KiB of PTX), assembled for {} in {:.1} s",
            module.name(),
            res.values().filter(|r| r.is_entry).count(),
            ptx_path.display(),
            ptx.len() / 1024,
            module.arch(),
            t1.elapsed().as_secs_f64()
        );
    }
    println!("built and lowered both modules in {lowered:.1} s; {:.1} s in all", t0.elapsed().as_secs_f64());
    if !bad.is_empty() {
        return Err(format!(
            "resource check failed (0 stack, 0 spills and no ptxas performance-loss note is the norm; allowlist with a reason in lmhead-build):\n  {}",
            bad.join("\n  ")
        ));
    }
    println!("resource check: every kernel of both modules has 0 bytes of stack and no spills; ptxas noted no performance loss");
    Ok(())
}

fn test(extra: &[String]) -> Result<(), String> {
    build_ptx()?;
    // GPU tests decide for themselves (they skip without a driver and print why); say it once here.
    let has_driver = ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"]
        .iter()
        .any(|p| Path::new(p).exists());
    if !has_driver {
        eprintln!("xtask: no CUDA driver library found: GPU tests will be skipped (they print SKIP lines)");
    }
    status(cargo().current_dir(root()).args(["test", "--workspace", "--release"]).args(extra))?;
    if std::env::var("LMHEAD_SKIP_PYTHON").is_ok_and(|v| v == "1") {
        eprintln!("xtask: LMHEAD_SKIP_PYTHON=1: the PyTorch package's tests (bindings/python/ci.sh) are skipped");
        return Ok(());
    }
    status(Command::new("bash").arg(root().join("bindings/python/ci.sh")))
}

/// The test binaries that need a GPU (the rest run in CI).
const GPU_TESTS: [&str; 8] = ["gpu_fwd", "gpu_bwd", "gpu_active", "gpu_keep", "gpu_capture", "tp", "gpu_reliability", "gpu_units"];

fn bundle() -> Result<(), String> {
    let out = root().join(".gpu");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let dirty =
        Command::new("git").args(["status", "--porcelain"]).current_dir(root()).output().map(|o| !o.stdout.is_empty()).unwrap_or(false);
    let commit = format!("{commit}{}", if dirty { "-dirty" } else { "" });
    let msg = cargo()
        .current_dir(root())
        .env("LMHEAD_BUILD_COMMIT", &commit)
        .args(["test", "--release", "--no-run", "--message-format=json", "-p", "lmhead-tests"])
        .output()
        .map_err(|e| e.to_string())?;
    if !msg.status.success() {
        return Err(format!("building test binaries failed:\n{}", String::from_utf8_lossy(&msg.stderr)));
    }
    let mut copied = Vec::new();
    for line in String::from_utf8_lossy(&msg.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(name)) = (v["executable"].as_str(), v["target"]["name"].as_str()) else { continue };
        // Only the GPU test binaries go into the bundle (the CPU ones run in CI): each embeds the
        // PTX and the cubin, so every extra binary adds about 20 MiB.
        if v["profile"]["test"].as_bool() != Some(true) || !GPU_TESTS.contains(&name) {
            continue;
        }
        std::fs::copy(exe, out.join(name)).map_err(|e| e.to_string())?;
        copied.push(name.to_string());
    }
    status(cargo().current_dir(root()).env("LMHEAD_BUILD_COMMIT", &commit).args(["build", "--release", "-p", "lmhead-bench"]))?;
    std::fs::copy(root().join("target/release/lmhead-bench"), out.join("lmhead-bench")).map_err(|e| e.to_string())?;
    copied.push("lmhead-bench".into());
    for n in &copied {
        // Symbols are not needed there; `strip` may be missing, which only costs space.
        let _ = Command::new("strip").arg(out.join(n)).status();
    }
    std::fs::write(out.join("COMMIT"), &commit).map_err(|e| e.to_string())?;
    std::fs::copy(root().join("docs/run-gpu.sh"), out.join("run-gpu.sh")).map_err(|e| e.to_string())?;
    let size: u64 = copied.iter().map(|n| std::fs::metadata(out.join(n)).map(|m| m.len()).unwrap_or(0)).sum();
    println!("bundled {copied:?} ({:.1} MiB) for commit {commit} into {}", size as f64 / (1 << 20) as f64, out.display());
    // The binaries (≈ 20 MiB each, mostly the embedded PTX text) compress to about a fifth: the
    // one file to copy to the GPU machine is `.gpuz/bundle.tgz` (docs/GPU.md).
    let packed = root().join(".gpuz");
    let _ = std::fs::remove_dir_all(&packed);
    std::fs::create_dir_all(&packed).map_err(|e| e.to_string())?;
    status(Command::new("tar").arg("czf").arg(packed.join("bundle.tgz")).arg("-C").arg(&out).arg("."))?;
    let psize = std::fs::metadata(packed.join("bundle.tgz")).map(|m| m.len()).unwrap_or(0);
    println!("packed into .gpuz/bundle.tgz ({:.1} MiB)", psize as f64 / (1 << 20) as f64);
    println!("on the GPU machine: mkdir -p .gpu && tar xzf .gpuz/bundle.tgz -C .gpu && bash .gpu/run-gpu.sh [steps]   (see docs/GPU.md)");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("setup") => setup().map(|p| println!("ptxas: {}", p.display())),
        Some("build-ptx") => build_ptx(),
        Some("test") => test(&args[1..]),
        Some("demo") => status(
            cargo().current_dir(root()).args(["run", "--release", "-p", "lmhead-bench", "--bin", "lmhead-demo", "--"]).args(&args[1..]),
        ),
        Some("bench") => status(cargo().current_dir(root()).args(["run", "--release", "-p", "lmhead-bench", "--"]).args(&args[1..])),
        Some("gpu-bundle") => bundle(),
        Some("bench-report") => report::run(&args[1..]),
        Some("heuristics") => heuristics::run(&args[1..]),
        _ => Err("usage: cargo xtask <setup|build-ptx|test|demo|bench|gpu-bundle|bench-report <results.jsonl> [--out-dir DIR] | --docs | --check|heuristics <records.jsonl>...>".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
