//! Generates the tuned entry points from `lmhead_core`'s candidate tables: one `ptx-kernel`
//! function per (family, config), named by `lmhead_core::config::kernel_name`.

use lmhead_core::config::{kernel_name, Family};
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
            let (tma, mn) = (c.tma, c.mn);
            assert!(!mn || matches!(family, Family::BwdDh | Family::BwdDw), "{family:?} {c:?}: only the GEMMs read operands in place");
            let st = c.tma_store;
            assert!(
                !st || matches!(family, Family::BwdDlogits | Family::BwdDlogitsEnt),
                "{family:?} {c:?}: only the d-logits store through TMA"
            );
            let (params, call) = match family {
                Family::Fwd if c.wgmma => ("LogitsParams", format!("hopper::fwd_wg::<{wg}, false, {tma}>")),
                Family::FwdEnt if c.wgmma => ("LogitsParams", format!("hopper::fwd_wg::<{wg}, true, {tma}>")),
                Family::BwdDlogits if c.wgmma => ("LogitsParams", format!("hopper::dlogits_wg::<{wg}, false, {tma}, {st}>")),
                Family::BwdDlogitsEnt if c.wgmma => ("LogitsParams", format!("hopper::dlogits_wg::<{wg}, true, {tma}, {st}>")),
                // dh: A (staging) K-major, B (`W` chunk) MN-major in place; dW: both in place.
                Family::BwdDh if c.wgmma => ("GemmParams", format!("hopper::gemm_wg::<{wg}, {tma}, false, {mn}>")),
                Family::BwdDw if c.wgmma => ("GemmParams", format!("hopper::gemm_wg::<{wg}, {tma}, {mn}, {mn}>")),
                Family::Fwd => ("LogitsParams", format!("fwd::fwd::<{generics}, false>")),
                Family::FwdEnt => ("LogitsParams", format!("fwd::fwd::<{generics}, true>")),
                Family::BwdDlogits => ("LogitsParams", format!("bwd::dlogits::<{generics}, false>")),
                Family::BwdDlogitsEnt => ("LogitsParams", format!("bwd::dlogits::<{generics}, true>")),
                Family::BwdDh => ("GemmParams", format!("bwd::gemm::<{generics}, true>")),
                Family::BwdDw => ("GemmParams", format!("bwd::gemm::<{generics}, false>")),
            };
            writeln!(
                out,
                "/// # Safety\n/// See the kernel body.\n#[unsafe(no_mangle)]\npub unsafe extern \"ptx-kernel\" fn {name}(p: {params}) {{\n    // SAFETY: the host launches each entry with its config's threads, grid and shared memory\n    // and with buffers that satisfy the body's contract (host/src/launch.rs).\n    unsafe {{ {call}(&p) }}\n}}\n"
            )
            .unwrap();
        }
    }
    let path = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("entries.rs");
    std::fs::write(path, out).unwrap();
    println!("cargo:rerun-if-changed=build.rs");
}
