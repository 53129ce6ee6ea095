//! Generates the tuned entry points from `lmhead_core`'s candidate tables: one `ptx-kernel`
//! function per (family, config), named by `lmhead_core::config::kernel_name`.

use lmhead_core::config::Mainloop::{MmaSync, Sm90};
use lmhead_core::config::{keep_kernel_name, kernel_name, Family, Store};
use std::fmt::Write;

fn main() {
    let mut out = String::new();
    for family in Family::ALL {
        for &c in family.candidates() {
            assert!(c.is_well_formed(), "{family:?} {c:?}");
            let name = kernel_name(family, c);
            let (mi, ni) = (c.warp_m() / 16, c.warp_n() / 8);
            let generics = format!("{}, {}, {}, {}, {}, {}, {mi}, {ni}", c.bm, c.bn, c.bk, c.stages, c.warps_m, c.warps_n);
            let wg = format!("{}, {}, {}, {}, {}", c.bm, c.bn, c.stages, c.warps_m / 4, c.bn / 128);
            // Every (family, mainloop) pair is named here: a new mainloop or family does not
            // compile until it says what each pair builds, and the invalid pairs are refused.
            let (params, call) = match (family, c.mainloop) {
                (Family::Fwd, MmaSync) => ("LogitsParams", format!("sm80::fwd::fwd::<{generics}, false, false>")),
                (Family::FwdEnt, MmaSync) => ("LogitsParams", format!("sm80::fwd::fwd::<{generics}, true, false>")),
                (Family::BwdDlogits, MmaSync) => {
                    ("LogitsParams", format!("body::dlogits::dlogits::<sm80::Sm80<{generics}, true, true>, {mi}, {ni}, false>"))
                }
                (Family::BwdDlogitsEnt, MmaSync) => {
                    ("LogitsParams", format!("body::dlogits::dlogits::<sm80::Sm80<{generics}, true, true>, {mi}, {ni}, true>"))
                }
                (Family::BwdDh, MmaSync) => ("GemmParams", format!("body::gemm::gemm::<sm80::Sm80<{generics}, true, false>, {mi}, {ni}>")),
                (Family::BwdDw, MmaSync) => ("GemmParams", format!("body::gemm::gemm::<sm80::Sm80<{generics}, false, false>, {mi}, {ni}>")),
                (Family::Fwd, Sm90 { store: Store::Registers }) => ("LogitsParams", format!("sm90::fwd::fwd_wg::<{wg}, false, false>")),
                (Family::FwdEnt, Sm90 { store: Store::Registers }) => ("LogitsParams", format!("sm90::fwd::fwd_wg::<{wg}, true, false>")),
                (Family::BwdDlogits, Sm90 { store: Store::Registers }) => {
                    ("LogitsParams", format!("body::dlogits::dlogits::<sm90::Sm90<{wg}, false, false>, 1, 8, false>"))
                }
                (Family::BwdDlogitsEnt, Sm90 { store: Store::Registers }) => {
                    ("LogitsParams", format!("body::dlogits::dlogits::<sm90::Sm90<{wg}, false, false>, 1, 8, true>"))
                }
                (Family::BwdDlogits, Sm90 { store: Store::Tma }) => {
                    ("LogitsParams", format!("sm90::dlogits::dlogits_tma_store::<{wg}, false>"))
                }
                (Family::BwdDlogitsEnt, Sm90 { store: Store::Tma }) => {
                    ("LogitsParams", format!("sm90::dlogits::dlogits_tma_store::<{wg}, true>"))
                }
                // dh: A (staging) K-major, B (`W` chunk) MN-major in place; dW: both in place.
                (Family::BwdDh, Sm90 { store: Store::Registers }) => {
                    ("GemmParams", format!("body::gemm::gemm::<sm90::Sm90<{wg}, false, true>, 1, 8>"))
                }
                (Family::BwdDw, Sm90 { store: Store::Registers }) => {
                    ("GemmParams", format!("body::gemm::gemm::<sm90::Sm90<{wg}, true, true>, 1, 8>"))
                }
                (Family::BwdDh, Sm90 { store: Store::Tma }) => ("GemmParams", format!("sm90::gemm::dh_tma_acc::<{wg}>")),
                (Family::Fwd | Family::FwdEnt | Family::BwdDw, Sm90 { store: Store::Tma }) => {
                    panic!("{family:?} {c:?}: only the d-logits and dh store their tile through TMA")
                }
            };
            let mut entry = |name: &str, call: &str| {
                writeln!(
                    out,
                    "/// # Safety\n/// See the kernel body.\n#[unsafe(no_mangle)]\npub unsafe extern \"ptx-kernel\" fn {name}(p: {params}) {{\n    // SAFETY: the host launches each entry with its config's threads, grid and shared memory\n    // and with buffers that satisfy the body's contract (host/src/launch/).\n    unsafe {{ {call}(&p) }}\n}}\n"
                )
                .unwrap()
            };
            entry(&name, &call);
            // The forward's `_keep` twin: the same body with the kept-logits store
            // (`lmhead_core::config::keep_kernel_name`), the last const generic set.
            if family.has_keep_twins() {
                let keep_call = call.replacen(", false>", ", true>", 1);
                assert!(keep_call.ends_with(", true>") && keep_call != call, "{call}");
                entry(&keep_kernel_name(family, c), &keep_call);
            }
        }
    }
    let path = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("entries.rs");
    std::fs::write(path, out).unwrap();
    println!("cargo:rerun-if-changed=build.rs");
}
