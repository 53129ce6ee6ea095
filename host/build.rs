//! Embeds the kernels' PTX: builds `kernels-gpu` with the nightly toolchain (through
//! `lmhead-build`, the same builder as `cargo xtask build-ptx`) into `$OUT_DIR/kernels.ptx`.
//!
//! The nightly is `LMHEAD_NIGHTLY` (default `nightly`); its `rust-src` and `llvm-tools`
//! components are installed if missing. `LMHEAD_PTX=<file>` embeds a prebuilt PTX instead
//! (for machines without the nightly).
//!
//! When `ptxas` is available (`LMHEAD_PTXAS`, or `.tools/ptxas` as `cargo xtask setup` installs
//! it) the PTX is also assembled for sm_90a and the cubin embedded: the library then loads
//! machine code without any JIT (fast first calls; and the CUDA 13.0 driver's JIT rejects the
//! `wgmma` kernels that ptxas 13.5 assembles). Without ptxas, `$OUT_DIR/kernels.cubin` is empty
//! and the kernels are JIT-compiled from the PTX.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap().to_path_buf();
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("kernels.ptx");
    for p in ["kernels-gpu/src", "kernels-gpu/Cargo.toml", "kernels-gpu/build.rs", "crates/lmhead-core/src", "crates/lmhead-build/src"] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    println!("cargo:rerun-if-env-changed=LMHEAD_PTX");
    println!("cargo:rerun-if-env-changed=LMHEAD_NIGHTLY");
    println!("cargo:rerun-if-env-changed=LMHEAD_PTXAS");
    let paths = lmhead_build::Paths::new(&root);
    println!("cargo:rerun-if-changed={}", paths.tools_dir().join("ptxas").display());
    if let Ok(prebuilt) = std::env::var("LMHEAD_PTX") {
        std::fs::copy(&prebuilt, &out).unwrap_or_else(|e| panic!("LMHEAD_PTX={prebuilt}: {e}"));
    } else {
        match lmhead_build::build_ptx(&paths) {
            Ok(ptx) => std::fs::write(&out, ptx).unwrap(),
            Err(e) => panic!(
                "building the GPU kernels failed.\n{e}\n\nThe kernels need the nightly toolchain `{}` (set LMHEAD_NIGHTLY to use another) \
                 with rust-src and llvm-tools, or LMHEAD_PTX=<prebuilt kernels.ptx>.",
                lmhead_build::nightly()
            ),
        }
    }
    let cubin = out.with_extension("cubin");
    let assembled = match lmhead_build::ptxas(&paths, false) {
        Ok(Some(ptxas)) => match lmhead_build::assemble(&ptxas, &out, &cubin) {
            Ok(_) => true,
            Err(e) => {
                println!("cargo:warning=ptxas failed, embedding PTX only (kernels will be JIT-compiled): {e}");
                false
            }
        },
        _ => false,
    };
    if !assembled {
        std::fs::write(&cubin, []).unwrap();
    }
}
