//! The PTX the library JIT-compiles stands on its own: every per-entry module of
//! `lmhead::ptx::entry_modules` (what the driver gets when no cubin is embedded or
//! `LMHEAD_FORCE_JIT=1`) assembles with ptxas for sm_90a. Regression test for the split that
//! ended entries at the first column-0 `}` (an inline-asm scope), which the CUDA 13.0 driver's
//! JIT rejected ("Parsing error near ''") while the whole module assembled fine.

use std::path::PathBuf;
use std::process::Command;

fn ptxas() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LMHEAD_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let dir = std::env::var_os("LMHEAD_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join(".tools"));
    let p = dir.join("ptxas");
    p.exists().then_some(p)
}

#[test]
fn every_entry_module_assembles_on_its_own() {
    // The host's build installs ptxas (or fails); only a PTX-only build has none.
    let Some(ptxas) = ptxas() else {
        assert!(lmhead::ptx::CUBIN.is_empty(), "a cubin was embedded, so ptxas exists: set LMHEAD_PTXAS or LMHEAD_TOOLS_DIR");
        println!("SKIP ptx_modules: no ptxas (PTX-only build, LMHEAD_ALLOW_JIT=1)");
        return;
    };
    let mods = lmhead::ptx::entry_modules();
    assert!(mods.len() > 50, "only {} entry modules", mods.len());
    let dir = std::env::temp_dir().join(format!("lmhead-ptx-modules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let names: Vec<&String> = mods.keys().collect();
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = names
            .chunks(names.len().div_ceil(4))
            .map(|chunk| {
                let (dir, ptxas) = (&dir, &ptxas);
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for name in chunk {
                        let src = dir.join(format!("{name}.ptx"));
                        std::fs::write(&src, &mods[*name]).unwrap();
                        let out = Command::new(ptxas)
                            .arg("-arch=sm_90a")
                            .arg(&src)
                            .arg("-o")
                            .arg(dir.join(format!("{name}.cubin")))
                            .output()
                            .unwrap();
                        if !out.status.success() {
                            bad.push(format!(
                                "{name}: {}",
                                String::from_utf8_lossy(&out.stderr).lines().take(3).collect::<Vec<_>>().join(" | ")
                            ));
                        }
                    }
                    bad
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} of {} entry modules do not assemble on their own:\n{}",
        failures.len(),
        mods.len(),
        failures.join("\n")
    );
    println!("{} entry modules assemble on their own with {}", mods.len(), ptxas.display());
}
