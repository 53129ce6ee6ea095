//! The embedded kernel modules (built by `build.rs`): the Hopper one (sm_90a, every kernel) and
//! the portable one (sm_80, the `mma.sync` kernels), each as PTX and as a cubin; and the PTX's
//! split into one small module per entry point, so that a process JIT-compiles only the kernels
//! it launches.

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use lmhead_core::Family;

pub use lmhead_core::config::Module;

/// The Hopper module's PTX, as built.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// The Hopper module assembled for sm_90a by ptxas at build time (empty when ptxas was not
/// available; the kernels are then JIT-compiled from [`PTX`]).
pub const CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.cubin"));

/// The portable module's PTX (sm_80: JIT-compiled by the driver on any later architecture).
pub const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_sm80.ptx"));

/// The portable module assembled for sm_80 (runs on every compute capability 8.x device; empty
/// in a PTX-only build).
pub const CUBIN_SM80: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels_sm80.cubin"));

/// `module`'s PTX.
pub const fn ptx(module: Module) -> &'static str {
    match module {
        Module::Hopper => PTX,
        Module::Portable => PTX_SM80,
    }
}

/// `module`'s cubin (empty in a PTX-only build).
pub const fn cubin(module: Module) -> &'static [u8] {
    match module {
        Module::Hopper => CUBIN,
        Module::Portable => CUBIN_SM80,
    }
}

/// A short hash of both modules' PTX (part of the tuning-cache key: new kernels invalidate old
/// timings).
pub fn ptx_hash() -> String {
    use sha2::{Digest, Sha256};
    static H: OnceLock<String> = OnceLock::new();
    H.get_or_init(|| {
        let mut h = Sha256::new();
        for m in Module::ALL {
            h.update(ptx(m).as_bytes());
            h.update([0]);
        }
        short_hex(&h.finalize())
    })
    .clone()
}

/// Per family, a hash of its compiled candidates ([`family_hash_of`] over the embedded PTX), so
/// that a tuning table can tell which families' kernels are the ones it timed when the PTX as a
/// whole has changed (`tune::table`). Computed once per process.
pub fn family_hashes() -> &'static BTreeMap<Family, String> {
    static H: OnceLock<BTreeMap<Family, String>> = OnceLock::new();
    H.get_or_init(|| Family::ALL.iter().map(|&f| (f, family_hash_of(entry_modules(), f))).collect())
}

/// [`family_hashes`]' entry for `family`.
pub fn family_hash(family: Family) -> String {
    family_hashes()[&family].clone()
}

/// `sha256` over each of `family`'s candidates' name and entry module ([`split`]), comments
/// dropped and labels numbered by function made neutral (`neutral_labels`); first 16 hex
/// digits. A missing entry hashes as empty.
pub fn family_hash_of(mods: &HashMap<String, String>, family: Family) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for &c in family.candidates() {
        let name = lmhead_core::config::kernel_name(family, c);
        h.update(name.as_bytes());
        h.update([0]);
        h.update(neutral_labels(mods.get(&name).map_or("", |m| m.as_str())).as_bytes());
        h.update([0]);
    }
    short_hex(&h.finalize())
}

/// The first 16 hex digits of a digest.
pub(crate) fn short_hex(digest: &[u8]) -> String {
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// `text` without its `//` comments and blank lines, and with the function numbers in llc's labels
/// (`$L__BB60_7` → `$L__BB_7`, `$L_brx_3` → `$L_brx_`) dropped: they count the functions of the
/// module, so they change when another entry is added or removed (llc's loop comments,
/// `Header=BB63_36`, carry the same numbers).
fn neutral_labels(text: &str) -> String {
    let code: String =
        text.lines().map(|l| l.split("//").next().unwrap_or("").trim_end()).filter(|l| !l.is_empty()).flat_map(|l| [l, "\n"]).collect();
    let mut out = String::with_capacity(code.len());
    let mut rest = code.as_str();
    while let Some(i) = rest.find("$L_") {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let prefix = ["$L__BB", "$L_brx_"].into_iter().find(|p| rest.starts_with(p));
        match prefix {
            Some(p) => {
                out.push_str(p);
                rest = rest[p.len()..].trim_start_matches(|c: char| c.is_ascii_digit());
            }
            None => {
                out.push_str("$L_");
                rest = &rest[3..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The Hopper module's per-entry PTX modules ([`entry_modules_of`]).
pub fn entry_modules() -> &'static HashMap<String, String> {
    entry_modules_of(Module::Hopper)
}

/// `module`'s per-entry PTX modules: the header and module-level declarations, then one entry.
pub fn entry_modules_of(module: Module) -> &'static HashMap<String, String> {
    static MODS: [OnceLock<HashMap<String, String>>; 2] = [OnceLock::new(), OnceLock::new()];
    MODS[module as usize].get_or_init(|| split(ptx(module)))
}

/// Split a PTX module into one module per `.entry` (each with the shared prelude: `.version`,
/// `.target`, `.address_size` and global declarations such as the dynamic shared memory).
///
/// An entry ends where its braces balance, not at the first line that starts with `}`: llc
/// writes each inline-`asm!` scope (`{`, `.reg .pred p;`, …, `}`) at column 0 inside the
/// function body, so ending at the first `}` cut every such entry short and the driver's JIT
/// answered "Parsing error near '': syntax error" (regression test below; every split module is
/// also assembled by ptxas in `tests/ptx_modules.rs`). Braces inside `//` comments are ignored;
/// PTX has no string literals.
pub fn split(ptx: &str) -> HashMap<String, String> {
    let mut prelude = String::new();
    let mut out = HashMap::new();
    // (name, body, brace depth, whether the body's first `{` was seen)
    let mut cur: Option<(String, String, i64, bool)> = None;
    let mut in_entries = false;
    for line in ptx.lines() {
        if cur.is_none() {
            if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
                in_entries = true;
                let name = rest.split('(').next().unwrap_or("").trim().to_string();
                cur = Some((name, String::new(), 0, false));
            }
        }
        match cur.as_mut() {
            Some((_, body, depth, opened)) => {
                body.push_str(line);
                body.push('\n');
                let code = line.split("//").next().unwrap_or("");
                for ch in code.chars() {
                    match ch {
                        '{' => {
                            *depth += 1;
                            *opened = true;
                        }
                        '}' => *depth -= 1,
                        _ => {}
                    }
                }
                if *opened && *depth <= 0 {
                    let (name, body, _, _) = cur.take().unwrap();
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

    #[test]
    fn the_portable_module_holds_every_mma_sync_entry_and_no_sm90_one() {
        let mods = entry_modules_of(Module::Portable);
        for f in lmhead_core::Family::ALL {
            for &c in f.candidates() {
                let name = lmhead_core::config::kernel_name(f, c);
                assert_eq!(mods.contains_key(&name), !c.is_sm90(), "{name}");
                if let Some(m) = mods.get(&name) {
                    assert!(m.contains(".target sm_80"), "{name}");
                    assert!(!m.contains("wgmma") && !m.contains("cp.async.bulk") && !m.contains("setmaxnreg"), "{name}");
                }
            }
        }
        for name in Module::Portable.fixed() {
            assert!(mods.contains_key(*name), "{name}");
        }
        // The MmaSync entries with their `_keep` twins, and the portable fixed kernels.
        let mma_sync = lmhead_core::config::tuned_entries().into_iter().filter(|(_, c)| !c.is_sm90()).count();
        assert_eq!(mods.len(), mma_sync + lmhead_core::config::fixed::PORTABLE.len());
        assert!(!mods.keys().any(|n| n.starts_with("lm_head_unit")));
        // Both modules are embedded, each with a cubin unless this is a PTX-only build.
        for m in Module::ALL {
            assert!(!ptx(m).is_empty(), "{m:?}");
            assert_eq!(cubin(m).is_empty(), cubin(Module::Hopper).is_empty(), "{m:?}");
        }
    }

    #[test]
    fn family_hashes_ignore_function_numbers_only() {
        assert_eq!(neutral_labels("bra $L__BB60_7; $L_brx_26: x $L_other"), "bra $L__BB_7; $L_brx_: x $L_other\n");
        assert_eq!(neutral_labels("//\n$L__BB60_7:   // in Loop: Header=BB60_3\n\n  add; //x\n"), "$L__BB_7:\n  add;\n");
        let mods = entry_modules();
        for (&f, hash) in family_hashes() {
            assert_eq!(hash.len(), 16);
            assert_eq!(family_hash_of(mods, f), *hash, "{f:?}");
            // Renumbering the functions keeps the hash; changing one instruction changes it.
            let name = lmhead_core::config::kernel_name(f, f.candidates()[0]);
            let mut renumbered = mods.clone();
            let m = renumbered.get_mut(&name).unwrap();
            *m = m.replace("$L__BB", "$L__BB9");
            assert_eq!(family_hash_of(&renumbered, f), *hash, "{f:?}");
            let mut edited = mods.clone();
            let m = edited.get_mut(&name).unwrap();
            *m = m.replacen("ret;", "ret; ret;", 1);
            assert_ne!(family_hash_of(&edited, f), *hash, "{f:?}");
        }
    }

    /// Regression: llc puts the braces of inline-`asm!` scopes at column 0 inside an entry; the
    /// split used to end the entry at the first of them, and the driver's JIT rejected the
    /// truncated module ("Parsing error near ''").
    #[test]
    fn an_entry_ends_where_its_braces_balance() {
        let ptx = ".version 8.0\n.target sm_90a\n.address_size 64\n\n.visible .entry a(\n\t.param .u64 a_param_0\n)\n{\n\t.reg .b32 %r<2>;\n\t// begin inline asm\n{\n.reg .pred p; // {\n}\n\t// end inline asm\n\tret;\n\n}\n\t// .globl b\n.visible .entry b(\n)\n{\n\tret;\n}\n";
        let mods = split(ptx);
        assert_eq!(mods.len(), 2);
        let a = &mods["a"];
        assert!(a.contains(".reg .pred p;") && a.contains("\tret;"), "{a}");
        assert!(a.trim_end().ends_with("ret;\n\n}"), "the entry's own closing brace ends it: {a}");
        assert!(!a.contains(".entry b"));
        assert!(mods["b"].contains(".entry b") && mods["b"].starts_with(".version 8.0"));
        // Every real entry module balances its braces and ends with the entry's closing brace.
        for (name, m) in entry_modules() {
            let code: String = m.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
            assert_eq!(code.matches('{').count(), code.matches('}').count(), "{name}");
            assert!(m.trim_end().ends_with('}'), "{name}");
        }
    }
}
