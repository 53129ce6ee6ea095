//! The embedded PTX (built by `build.rs`) and its split into one small module per entry point,
//! so that a process JIT-compiles only the kernels it launches.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The whole PTX module, as built.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// The same module assembled for sm_90a by ptxas at build time (empty when ptxas was not
/// available; the kernels are then JIT-compiled from [`PTX`]).
pub const CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.cubin"));

/// A short hash of the PTX (part of the tuning-cache key: new kernels invalidate old timings).
pub fn ptx_hash() -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(PTX.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Per-entry PTX modules: the header and module-level declarations, then one entry.
pub fn entry_modules() -> &'static HashMap<String, String> {
    static MODS: OnceLock<HashMap<String, String>> = OnceLock::new();
    MODS.get_or_init(|| split(PTX))
}

/// Split a PTX module into one module per `.entry` (each with the shared prelude: `.version`,
/// `.target`, `.address_size` and global declarations such as the dynamic shared memory).
pub fn split(ptx: &str) -> HashMap<String, String> {
    let mut prelude = String::new();
    let mut out = HashMap::new();
    let mut cur: Option<(String, String)> = None;
    let mut in_entries = false;
    for line in ptx.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
            in_entries = true;
            let name = rest.split('(').next().unwrap_or("").trim().to_string();
            cur = Some((name, String::new()));
        }
        match cur.as_mut() {
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
                if line.starts_with('}') {
                    let (name, body) = cur.take().unwrap();
                    out.insert(name, format!("{prelude}\n{body}"));
                }
            }
            None if !in_entries => {
                prelude.push_str(line);
                prelude.push('\n');
            }
            None => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_split_out_with_the_prelude() {
        let mods = entry_modules();
        for f in lmhead_core::Family::ALL {
            for &c in f.candidates() {
                let name = lmhead_core::config::kernel_name(f, c);
                let m = mods.get(&name).unwrap_or_else(|| panic!("{name} missing from the PTX"));
                assert!(m.contains(".target sm_90a"));
                assert!(m.contains("lmhead_smem"));
                assert_eq!(m.matches(".entry").count(), 1);
            }
        }
        for name in lmhead_core::config::fixed::ALL {
            assert!(mods.contains_key(name), "{name}");
        }
    }
}
