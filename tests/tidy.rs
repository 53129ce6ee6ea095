//! Repository hygiene, checked as a test: every Rust file starts with a `//!` header; every
//! `unsafe` block carries a `// SAFETY:` comment (the device crate is not linted by clippy, so
//! this covers it); `asm!` appears only under `kernels-gpu/src/intrinsics/`; kernels are launched
//! only from `host/src/launch/mod.rs` (the one `launch` function every launch goes through); no
//! source file over 650 lines without a written reason (a `// tidy: long file:` line), and at
//! most 5 `too_many_arguments` allowances in the whole project.

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

#[test]
fn size_rules() {
    let mut files = rust_files();
    let bindings = root().join("bindings/python/src");
    for e in std::fs::read_dir(&bindings).into_iter().flatten().flatten() {
        if e.path().extension().is_some_and(|x| x == "rs") {
            files.push(e.path());
        }
    }
    let (mut long, mut allows) = (Vec::new(), Vec::new());
    for p in &files {
        let text = std::fs::read_to_string(p).unwrap();
        if text.lines().count() > 650 && !text.contains("// tidy: long file:") {
            long.push((p.strip_prefix(root()).unwrap().to_path_buf(), text.lines().count()));
        }
        let allow = concat!("allow(clippy::", "too_many_arguments)");
        allows.extend(std::iter::repeat_n(p.strip_prefix(root()).unwrap().to_path_buf(), text.matches(allow).count()));
    }
    assert!(long.is_empty(), "files over 650 lines without a `// tidy: long file:` reason: {long:?}");
    assert!(allows.len() <= 5, "{} too_many_arguments allowances (at most 5): {allows:?}", allows.len());
}
