//! Shared by the tests of `bench/scripts/`: run a script with `python3`, look for a line.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

/// `bench/scripts/<script>`'s standard output for `args` (run from the bench crate's directory),
/// or `None` (the reason printed) without `python3`. A failing script fails the test.
pub fn run_script<S: AsRef<OsStr>>(script: &str, args: &[S]) -> Option<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = match Command::new("python3").arg("-B").arg(dir.join("scripts").join(script)).args(args).current_dir(dir).output() {
        Ok(out) => out,
        Err(e) => {
            println!("SKIP: python3 did not run ({e})");
            return None;
        }
    };
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8(out.stdout).expect("utf-8 output"))
}

/// Fails unless `text` has the line `line`.
pub fn has(text: &str, line: &str) {
    assert!(text.lines().any(|l| l == line), "no line\n{line}\nin\n{text}");
}
