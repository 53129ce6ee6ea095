//! Repository hygiene, checked as a test: every Rust file starts with a `//!` header; every
//! `unsafe` block carries a `// SAFETY:` comment (the device crate is not linted by clippy, so
//! this covers it); `asm!` appears only under `kernels-gpu/src/intrinsics/`; kernels are launched
//! only from `host/src/launch/mod.rs` (the one `launch` function every launch goes through).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rust_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = ["crates", "kernels-gpu", "host", "xtask", "tests", "bench"].iter().map(|d| root().join(d)).collect();
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n == "target") {
                    continue;
                }
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") && !p.ends_with("tests/tidy.rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_file_has_a_header() {
    let bad: Vec<_> = rust_files().into_iter().filter(|p| !std::fs::read_to_string(p).unwrap().trim_start().starts_with("//!")).collect();
    assert!(bad.is_empty(), "files without a `//!` header: {bad:?}");
}

#[test]
fn every_unsafe_block_has_a_safety_comment() {
    let mut bad = Vec::new();
    for p in rust_files() {
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let code = l.split("//").next().unwrap_or("");
            if !(code.contains("unsafe {") || code.contains("unsafe impl")) {
                continue;
            }
            // The comment may sit up to a few lines above (multi-line comments, attributes).
            let from = i.saturating_sub(6);
            let has = lines[from..=i].iter().any(|x| x.contains("SAFETY:"));
            if !has {
                bad.push(format!("{}:{}", p.display(), i + 1));
            }
        }
    }
    assert!(bad.is_empty(), "unsafe without `// SAFETY:`: {bad:#?}");
}

#[test]
fn asm_and_launches_stay_in_their_modules() {
    for p in rust_files() {
        let text = std::fs::read_to_string(&p).unwrap();
        let rel = p.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
        let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        if code.contains("asm!(") {
            assert!(rel.starts_with("kernels-gpu/src/intrinsics/"), "asm! outside kernels-gpu/src/intrinsics/: {rel}");
        }
        if code.contains(".launch(") {
            assert_eq!(rel, "host/src/launch/mod.rs", "a kernel launch outside launch/mod.rs");
        }
    }
}
