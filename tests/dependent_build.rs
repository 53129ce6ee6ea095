//! A crate that depends on `lmhead` gets both cubins (sm_90a, sm_80) from a plain `cargo build`, with no
//! ptxas installed beforehand: this test builds such a crate in a fresh target directory with an
//! empty ptxas cache (`LMHEAD_TOOLS_DIR`), so the host's build script must install the pinned
//! ptxas itself, and runs it to read the embedded cubin's size. (The kernels' own nvptx build is
//! shared with the workspace under `target/kernels`; what is fresh is everything a dependent
//! crate's build decides: the host crate, its build script, the ptxas install.)
//!
//! Needs the network to PyPI (the ptxas wheel) and crates.io, as the project's set-up does; it
//! takes a few minutes on two cores. `LMHEAD_SKIP_DEPENDENT_BUILD=1` skips it (with a message).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn a_dependent_crate_embeds_the_cubin() {
    if std::env::var("LMHEAD_SKIP_DEPENDENT_BUILD").is_ok_and(|v| v == "1") {
        println!("SKIP dependent_build: LMHEAD_SKIP_DEPENDENT_BUILD=1");
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let dir = std::env::temp_dir().join(format!("lmhead-dependent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"lmhead-dependent\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[dependencies]\nlmhead = {{ path = {:?}, features = [\"testing\"] }}\n\n[workspace]\n",
            root.join("host")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("src/main.rs"),
        "fn main() {\n    println!(\"cubin {} {}\", lmhead::ptx::CUBIN.len(), lmhead::ptx::CUBIN_SM80.len());\n}\n",
    )
    .unwrap();
    // The workspace's lock file pins the same dependency versions (cargo drops unused entries).
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let tools = dir.join("tools");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(&dir)
        .args(["run", "--quiet"])
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env("LMHEAD_TOOLS_DIR", &tools)
        .env_remove("LMHEAD_PTXAS")
        .env_remove("LMHEAD_ALLOW_JIT")
        .env_remove("LMHEAD_PTX")
        .env_remove("LMHEAD_PTX_SM80");
    // Keep the outer cargo's build settings (profile, rustflags of the test run) out.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if (k.starts_with("CARGO_") && k != "CARGO_HOME") || k.starts_with("RUSTC") || k == "RUSTFLAGS" {
            cmd.env_remove(&k);
        }
    }
    let t0 = std::time::Instant::now();
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "building the dependent crate failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let sizes: Vec<usize> =
        stdout.trim().strip_prefix("cubin ").map(|s| s.split(' ').filter_map(|x| x.parse().ok()).collect()).unwrap_or_default();
    let [n, n_sm80] = sizes[..] else { panic!("unexpected output {stdout:?}") };
    assert!(n > 1 << 20, "the dependent crate embedded a Hopper cubin of {n} bytes");
    assert!(n_sm80 > 1 << 20, "the dependent crate embedded a portable cubin of {n_sm80} bytes");
    assert!(tools.join("ptxas").exists(), "the build did not install ptxas into LMHEAD_TOOLS_DIR");
    println!(
        "dependent crate built in {:.0} s with a fresh ptxas install; embedded cubins {n} (sm_90a) and {n_sm80} (sm_80) bytes",
        t0.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
