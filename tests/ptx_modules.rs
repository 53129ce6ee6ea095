//! The PTX the library JIT-compiles stands on its own: every per-entry module of both embedded
//! modules (`lmhead::ptx::entry_modules_of`: what the driver gets when no cubin is embedded, when
//! `LMHEAD_FORCE_JIT=1`, and for the portable module on any architecture after 8.x) assembles
//! with ptxas for its module's architecture (sm_90a, sm_80). Regression test for the split that
//! ended entries at the first column-0 `}` (an inline-asm scope), which the CUDA 13.0 driver's
//! JIT rejected ("Parsing error near ''") while the whole module assembled fine.
//!
//! And the portable module's PTX assembles, whole, for the architectures whose driver JIT
//! compiles it: sm_90 (the H200 under `LMHEAD_TEST_MODULE=portable`), sm_100 and sm_120
//! (Blackwell), with ptxas's resource report printed (the pinned ptxas stands in for the
//! driver's JIT, which is the same compiler of its own CUDA version).

use std::path::{Path, PathBuf};
use std::process::Command;

use lmhead::ptx::Module;

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
    for module in Module::ALL {
        assemble_each(&ptxas, module);
    }
}

fn assemble_each(ptxas: &Path, module: Module) {
    let mods = lmhead::ptx::entry_modules_of(module);
    assert!(mods.len() > 40, "only {} entry modules in the {} module", mods.len(), module.name());
    let dir = std::env::temp_dir().join(format!("lmhead-ptx-modules-{}-{}", module.name(), std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let names: Vec<&String> = mods.keys().collect();
    let arch = format!("-arch={}", module.arch());
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = names
            .chunks(names.len().div_ceil(4))
            .map(|chunk| {
                let (dir, ptxas, arch) = (&dir, &ptxas, &arch);
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for name in chunk {
                        let src = dir.join(format!("{name}.ptx"));
                        std::fs::write(&src, &mods[*name]).unwrap();
                        let out =
                            Command::new(ptxas).arg(arch).arg(&src).arg("-o").arg(dir.join(format!("{name}.cubin"))).output().unwrap();
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
        "{} of {} entry modules of the {} module do not assemble on their own:\n{}",
        failures.len(),
        mods.len(),
        module.name(),
        failures.join("\n")
    );
    println!(
        "{} entry modules of the {} module assemble on their own for {} with {}",
        mods.len(),
        module.name(),
        module.arch(),
        ptxas.display()
    );
}

/// The portable PTX, whole, for the architectures the driver JIT-compiles it for.
#[test]
fn the_portable_ptx_assembles_for_the_jit_targets() {
    let Some(ptxas) = ptxas() else {
        println!("SKIP ptx_modules: no ptxas (PTX-only build, LMHEAD_ALLOW_JIT=1)");
        return;
    };
    assert!(lmhead::ptx::PTX_SM80.contains(".target sm_80"));
    let dir = std::env::temp_dir().join(format!("lmhead-ptx-portable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("portable.ptx");
    std::fs::write(&src, lmhead::ptx::PTX_SM80).unwrap();
    let results: Vec<(String, Result<String, String>)> = std::thread::scope(|s| {
        let workers: Vec<_> = ["sm_90", "sm_100", "sm_120"]
            .into_iter()
            .map(|arch| {
                let (dir, src, ptxas) = (&dir, &src, &ptxas);
                s.spawn(move || {
                    let out = Command::new(ptxas)
                        .arg(format!("-arch={arch}"))
                        .arg("-v")
                        .arg(src)
                        .arg("-o")
                        .arg(dir.join(format!("{arch}.cubin")))
                        .output()
                        .unwrap();
                    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                    (
                        arch.to_string(),
                        if out.status.success() { Ok(text) } else { Err(text.lines().take(5).collect::<Vec<_>>().join(" | ")) },
                    )
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    for (arch, r) in &results {
        match r {
            Ok(text) => {
                let entries = text.matches("Compiling entry function").count();
                let stack =
                    text.lines().filter(|l| l.contains("bytes stack frame") && !l.trim_start().starts_with("0 bytes stack frame")).count();
                let spills =
                    text.lines().filter(|l| l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")).count();
                println!("portable PTX for {arch}: {entries} entries; {stack} with a stack frame, {spills} with spills");
                assert_eq!(entries, lmhead::ptx::entry_modules_of(Module::Portable).len(), "{arch}");
            }
            Err(e) => panic!("the portable PTX does not assemble for {arch}: {e}"),
        }
    }
}
