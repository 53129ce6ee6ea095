//! Embeds the kernels: builds `kernels-gpu` with the nightly toolchain (through `lmhead-build`,
//! the same builder as `cargo xtask build-ptx`) into two modules, `$OUT_DIR/kernels.ptx` (Hopper,
//! sm_90a) and `$OUT_DIR/kernels_sm80.ptx` (portable, sm_80), and assembles each with the pinned
//! ptxas into `$OUT_DIR/kernels.cubin` and `$OUT_DIR/kernels_sm80.cubin`.
//!
//! The nightly is `LMHEAD_NIGHTLY` (default `nightly`); its `rust-src` and `llvm-tools`
//! components are installed if missing. `LMHEAD_PTX=<file>` (and `LMHEAD_PTX_SM80=<file>`)
//! embed prebuilt PTX instead.
//!
//! The cubins are not optional: the library loads machine code, not PTX, unless asked otherwise
//! (or on an architecture no cubin runs on: the portable PTX is JIT-compiled there).
//! ptxas is `LMHEAD_PTXAS`, else `.tools/ptxas`, else installed there on demand from the pinned
//! PyPI wheel (`lmhead_build::PTXAS_WHEEL`, as `cargo xtask setup` does). If none can be had or
//! it fails, the build fails and says how to fix it. `LMHEAD_ALLOW_JIT=1` is the explicit
//! opt-out: a PTX-only build (the driver JIT-compiles the kernels on first use), with a cargo
//! warning.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap().to_path_buf();
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let out_of = |m: lmhead_build::Module| out_dir.join(format!("{}.ptx", lmhead_build::stem("kernels", m)));
    for p in ["kernels-gpu/src", "kernels-gpu/Cargo.toml", "kernels-gpu/build.rs", "crates/lmhead-core/src", "crates/lmhead-build/src"] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    println!("cargo:rerun-if-env-changed=LMHEAD_PTX");
    println!("cargo:rerun-if-env-changed=LMHEAD_PTX_SM80");
    println!("cargo:rerun-if-env-changed=LMHEAD_NIGHTLY");
    println!("cargo:rerun-if-env-changed=LMHEAD_PTXAS");
    println!("cargo:rerun-if-env-changed=LMHEAD_TOOLS_DIR");
    let paths = lmhead_build::Paths::new(&root);
    println!("cargo:rerun-if-changed={}", paths.tools_dir().join("ptxas").display());
    if let Ok(prebuilt) = std::env::var("LMHEAD_PTX") {
        let sm80 = std::env::var("LMHEAD_PTX_SM80")
            .unwrap_or_else(|_| panic!("LMHEAD_PTX={prebuilt} needs LMHEAD_PTX_SM80 (the portable module's PTX) too"));
        for (m, file) in [(lmhead_build::Module::Hopper, prebuilt), (lmhead_build::Module::Portable, sm80)] {
            std::fs::copy(&file, out_of(m)).unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    } else {
        match lmhead_build::build_modules(&paths) {
            Ok(built) => {
                for m in lmhead_build::Module::ALL {
                    std::fs::write(out_of(m), built.ptx(m)).unwrap();
                }
            }
            Err(e) => panic!(
                "building the GPU kernels failed.\n{e}\n\nThe kernels need the nightly toolchain `{}` (set LMHEAD_NIGHTLY to use another) \
                 with rust-src and llvm-tools, or LMHEAD_PTX=<prebuilt kernels.ptx> and LMHEAD_PTX_SM80=<prebuilt kernels_sm80.ptx>.",
                lmhead_build::nightly()
            ),
        }
    }
    println!("cargo:rerun-if-env-changed=LMHEAD_ALLOW_JIT");
    if std::env::var("LMHEAD_ALLOW_JIT").is_ok_and(|v| v == "1") {
        println!(
            "cargo:warning=LMHEAD_ALLOW_JIT=1: no cubin embedded; the driver will JIT-compile the kernels from PTX on first use (slower first calls)"
        );
        for m in lmhead_build::Module::ALL {
            std::fs::write(out_of(m).with_extension("cubin"), []).unwrap();
        }
        return;
    }
    let fix = "Fix: let the build reach PyPI once (it installs the pinned ptxas into .tools/), or run `cargo xtask setup`, \
               or set LMHEAD_PTXAS=<path to ptxas 13.x>, or set LMHEAD_ALLOW_JIT=1 for a PTX-only build";
    let ptxas = match lmhead_build::ptxas(&paths, true) {
        Ok(Some(p)) => p,
        Ok(None) => panic!("no ptxas found to assemble the kernels.\n{fix}"),
        Err(e) => panic!("installing ptxas ({}) failed:\n{e}\n{fix}", lmhead_build::PTXAS_WHEEL),
    };
    for m in lmhead_build::Module::ALL {
        let out = out_of(m);
        let cubin = out.with_extension("cubin");
        if let Err(e) = lmhead_build::assemble(&ptxas, &out, &cubin, m) {
            panic!("ptxas ({}) failed on the {} kernels ({}):\n{e}\n{fix}", ptxas.display(), m.name(), m.arch());
        }
        let n = std::fs::metadata(&cubin).map(|m| m.len()).unwrap_or(0);
        if n == 0 {
            panic!("ptxas ({}) wrote an empty {} cubin.\n{fix}", ptxas.display(), m.name());
        }
    }
}
