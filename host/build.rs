//! Embeds the kernels' PTX: builds `kernels-gpu` with the nightly toolchain (through
//! `lmhead-build`, the same builder as `cargo xtask build-ptx`) into `$OUT_DIR/kernels.ptx`.
//!
//! The nightly is `LMHEAD_NIGHTLY` (default `nightly`); its `rust-src` and `llvm-tools`
//! components are installed if missing. `LMHEAD_PTX=<file>` embeds a prebuilt PTX instead
//! (for machines without the nightly).

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
    if let Ok(prebuilt) = std::env::var("LMHEAD_PTX") {
        std::fs::copy(&prebuilt, &out).unwrap_or_else(|e| panic!("LMHEAD_PTX={prebuilt}: {e}"));
        return;
    }
    match lmhead_build::build_ptx(&lmhead_build::Paths::new(&root)) {
        Ok(ptx) => std::fs::write(&out, ptx).unwrap(),
        Err(e) => panic!(
            "building the GPU kernels failed.\n{e}\n\nThe kernels need the nightly toolchain `{}` (set LMHEAD_NIGHTLY to use another) \
             with rust-src and llvm-tools, or LMHEAD_PTX=<prebuilt kernels.ptx>.",
            lmhead_build::nightly()
        ),
    }
}
