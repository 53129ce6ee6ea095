//! The rules on the CPU: every proposed config is a compiled candidate that fits its device,
//! the Hopper rules never propose `mma.sync`, each rule's boundaries, and the plans and chunks
//! cover what they must.

use std::vec::Vec;

use super::*;
use crate::config::{Mainloop, Store};

/// Devices of each kind the rules serve: (name, device).
fn devices() -> [(&'static str, Device); 6] {
    [
        ("H200", Device::H200),
        ("H100 PCIe", Device::new((9, 0), 114, 50 << 20, 232_448)),
        ("A100", Device::new((8, 0), 108, 40 << 20, 166_912)),
        ("RTX 3090 (sm_86)", Device::new((8, 6), 82, 6 << 20, 101_376)),
        ("L40 (sm_89)", Device::new((8, 9), 142, 96 << 20, 101_376)),
        ("RTX 5090 (sm_120)", Device::new((12, 0), 170, 96 << 20, 101_376)),
    ]
}

/// Problems over the rules' boundaries: tokens around every bucket edge they use, hidden sizes
/// powers of two and not, vocab chunks and vocabularies around the measured tile counts.
fn problems() -> Vec<Problem> {
    let mut out = Vec::new();
    for t in [1usize, 127, 2048, 4096, 4097, 8192, 16384, 16385, 65536, 65537, 131072, 262144] {
        for d in [64usize, 2048, 3072, 4096, 5120, 8192] {
            for v in [8usize, 8192, 18992, 32768, 127_744, 128_000, 131_072, 248_320] {
                out.push(Problem::new(t, v, d));
            }
        }
    }
    out
}

#[test]
fn every_proposal_is_a_candidate_that_fits_its_device() {
    for (name, dev) in devices() {
        for p in problems() {
            for f in Family::ALL {
                let s = shortlist(f, p, &dev);
                assert!(!s.as_slice().is_empty() && s.as_slice().len() <= SHORTLIST_MAX);
                for &c in s.as_slice() {
                    assert!(f.candidates().contains(&c), "{name} {f:?} {p:?}: {c:?} is not a compiled candidate");
                    assert!(c.is_well_formed() && dev.fits(c), "{name} {f:?} {p:?}: {c:?} does not fit");
                    assert_eq!(c.is_sm90(), dev.arch == Arch::Sm90, "{name} {f:?} {p:?}: {c:?} of the wrong mainloop");
                }
                let distinct: std::collections::BTreeSet<_> = s.as_slice().iter().collect();
                assert_eq!(distinct.len(), s.as_slice().len(), "{name} {f:?}: a config twice");
            }
        }
    }
}

#[test]
fn the_hopper_rules_never_propose_mma_sync_and_the_portable_ones_nothing_else() {
    for p in problems() {
        for f in Family::ALL {
            assert!(shortlist(f, p, &Device::H200).as_slice().iter().all(|c| c.is_sm90()), "{f:?} {p:?}");
            assert!(shortlist(f, p, &Device::H200.portable()).as_slice().iter().all(|c| c.mainloop == Mainloop::MmaSync), "{f:?} {p:?}");
        }
    }
    // The Hopper rules' picks, one config per family but `dh`.
    let p = Problem::new(16384, 128_256, 4096);
    assert_eq!(config(Family::Fwd, p, &Device::H200), sm90::FWD);
    assert_eq!(config(Family::FwdEnt, p, &Device::H200), sm90::FWD);
    assert_eq!(config(Family::BwdDlogits, p, &Device::H200), sm90::DLOGITS);
    assert_eq!(config(Family::BwdDlogitsEnt, p, &Device::H200), sm90::DLOGITS);
    assert_eq!(config(Family::BwdDw, p, &Device::H200), sm90::DW);
    assert_eq!(sm90::DLOGITS.mainloop, Mainloop::Sm90 { store: Store::Tma });
    assert_eq!(sm90::DH.mainloop, Mainloop::Sm90 { store: Store::Tma });
    // The d-logits' trials pick wrong in the steady state: nothing to time.
    assert_eq!(shortlist(Family::BwdDlogitsEnt, p, &Device::H200).as_slice(), &[sm90::DLOGITS]);
}

#[test]
fn dh_takes_the_narrow_tile_at_few_tokens_and_a_hidden_size_not_a_power_of_two() {
    let h = &Device::H200;
    for (t, d, narrow) in [
        (2048, 5120, true),
        (4096, 5120, true),
        (4097, 5120, false),
        (8192, 5120, false),
        (4096, 4096, false),
        (2048, 8192, false),
        (1, 3072, true),
    ] {
        let p = Problem::new(t, 8192, d);
        let want = if narrow { sm90::DH_NARROW } else { sm90::DH };
        assert_eq!(config(Family::BwdDh, p, h), want, "t {t} d {d}");
        assert_eq!(shortlist(Family::BwdDh, p, h).as_slice().len(), 3, "the pick and both alternates");
    }
}

#[test]
fn the_portable_rankings_hold_every_mma_sync_candidate_once() {
    for f in Family::ALL {
        for t in [1, sm80::FEW_TOKENS, sm80::FEW_TOKENS + 1] {
            let r = sm80::ranking(f, t);
            let mma: Vec<TileConfig> = f.candidates().iter().copied().filter(|c| c.mainloop == Mainloop::MmaSync).collect();
            assert_eq!(r.len(), mma.len(), "{f:?}");
            assert!(mma.iter().all(|c| r.contains(c)), "{f:?} t {t}: a candidate missing from the ranking");
        }
    }
    // The boundary of the token regimes: the d-logits and `dh` rankings change there.
    let a100 = devices()[2].1;
    let few = config(Family::BwdDlogitsEnt, Problem::new(sm80::FEW_TOKENS, 8192, 4096), &a100);
    let many = config(Family::BwdDlogitsEnt, Problem::new(sm80::FEW_TOKENS + 1, 8192, 4096), &a100);
    assert_eq!((few, many), (sm80::DLOGITS_FEW[0], sm80::DLOGITS_MANY[0]));
    assert_ne!(
        config(Family::BwdDh, Problem::new(16384, 8192, 4096), &a100),
        config(Family::BwdDh, Problem::new(16385, 8192, 4096), &a100)
    );
}

#[test]
fn the_portable_rules_choose_by_the_shared_memory_limit() {
    // Every ranked config fits 99 KiB (sm_86) and 163 KiB (sm_80): the same picks on both.
    let p = Problem::new(4096, 32000, 4096);
    let (a100, sm86) = (devices()[2].1, devices()[3].1);
    for f in Family::ALL {
        assert_eq!(shortlist(f, p, &a100), shortlist(f, p, &sm86), "{f:?}");
        assert!(sm80::ranking(f, p.t).iter().all(|c| c.smem_bytes() <= 96 * 1024), "{f:?}");
    }
    // A device with less: the first configs of the ranking that fit, the fallback if none does.
    let small = Device { max_smem_per_block: 64 * 1024, ..sm86 };
    for f in Family::ALL {
        let s = shortlist(f, p, &small);
        let fitting: Vec<TileConfig> =
            sm80::ranking(f, p.t).iter().copied().filter(|c| c.smem_bytes() <= 64 * 1024).take(SHORTLIST_MAX).collect();
        assert_eq!(s.as_slice(), &fitting[..], "{f:?}");
        assert!(s.as_slice().iter().all(|c| c.smem_bytes() <= 64 * 1024));
    }
    let tiny = Device { max_smem_per_block: 16 * 1024, ..sm86 };
    assert_eq!(
        shortlist(Family::Fwd, p, &tiny).as_slice(),
        &[Family::Fwd.fallback()],
        "nothing fits: the fallback, which the launch refuses"
    );
    // An sm_90 device without sm_90's shared memory: the portable rules.
    let odd = Device { max_smem_per_block: 101_376, ..Device::H200 };
    assert!(shortlist(Family::Fwd, p, &odd).as_slice().iter().all(|c| !c.is_sm90()));
}

#[test]
fn every_device_from_8_0_gets_a_module_and_the_portable_rules_off_9_0() {
    use crate::config::Module;
    for (name, dev) in devices() {
        let expect = if name.starts_with('H') { Arch::Sm90 } else { Arch::Sm80 };
        assert_eq!(dev.arch, expect, "{name}");
    }
    assert_eq!(Module::for_device((9, 0)), Some(Module::Hopper));
    for cc in [(8, 0), (8, 6), (8, 7), (8, 9), (10, 0), (10, 3), (12, 0), (12, 1)] {
        assert_eq!(Module::for_device(cc), Some(Module::Portable), "{cc:?}");
        assert_eq!(Device::new(cc, 100, 50 << 20, 101_376).arch, Arch::Sm80, "{cc:?}");
    }
    for cc in [(7, 5), (7, 0), (6, 1)] {
        assert_eq!(Module::for_device(cc), None, "{cc:?}");
    }
    // A Blackwell data-centre part (sm_100: 227 KiB per block) runs the portable rules with
    // every ranked config fitting; a consumer one (sm_120) with 99 KiB.
    let b200 = Device::new((10, 0), 148, 126 << 20, 232_448);
    let p = Problem::new(8192, 32000, 4096);
    for f in Family::ALL {
        let s = shortlist(f, p, &b200);
        assert!(s.as_slice().iter().all(|c| c.mainloop == Mainloop::MmaSync && b200.fits(*c)), "{f:?}");
        assert_eq!(s.pick(), sm80::ranking(f, p.t)[0], "{f:?}");
    }
}

#[test]
fn every_portable_candidate_fits_the_register_file() {
    for f in Family::ALL {
        for &c in f.candidates().iter().filter(|c| c.mainloop == Mainloop::MmaSync) {
            assert!(sm80::fits_registers(c), "{f:?} {c:?}");
            assert!(c.threads() * sm80::MAX_REGISTERS_PER_THREAD <= sm80::REGISTERS_PER_BLOCK, "{f:?} {c:?}: {} threads", c.threads());
        }
    }
    // The rules drop a block the register file cannot hold (none of today's candidates).
    for (_, dev) in devices() {
        for f in Family::ALL {
            let p = Problem::new(4096, 32000, 4096);
            assert!(sm80::shortlist(f, p, &dev).as_slice().iter().all(|&c| sm80::fits_registers(c)), "{f:?}");
        }
    }
}

#[test]
fn measured_splits_apply_where_they_were_measured() {
    let at = |t, v, d| measured_splits_of(Problem::new(t, v, d));
    // d = 4096: above 65536 tokens, with ≥ 500 vocab tiles (v > 127744).
    assert_eq!(at(131_072, 128_256, 4096), Some(12));
    assert_eq!(at(65_537, 127_745, 4096), Some(12));
    assert_eq!(at(65_537, 127_744, 4096), None, "499 vocab tiles");
    assert_eq!(at(65_536, 128_256, 4096), None, "the 65536 bucket: within 1% of the model's plan");
    assert_eq!(at(262_144, 64_128, 4096), None, "unmeasured");
    // d = 5120: above 65536 tokens, every vocab.
    assert_eq!(at(65_537, 19_008, 5120), Some(15));
    assert_eq!(at(65_536, 152_064, 5120), None);
    // d = 8192: above 16384 tokens, with ≥ 500 vocab tiles.
    assert_eq!(at(16_385, 131_072, 8192), Some(12));
    assert_eq!(at(16_384, 131_072, 8192), None);
    assert_eq!(at(131_072, 65_536, 8192), None);
    // Other hidden sizes, and other tile widths, keep the model's plan.
    assert_eq!(at(262_144, 248_320, 2048), None);
    assert_eq!(at(262_144, 248_320, 6144), None);
    assert_eq!(sm90::measured_splits(crate::config::tw(128, 6), Problem::new(131_072, 128_256, 4096)), None);
}

fn measured_splits_of(p: Problem) -> Option<u32> {
    sm90::measured_splits(sm90::FWD, p)
}

#[test]
fn the_measured_plans_are_the_ones_the_table_held() {
    // The shipped table's plans (splits × raster group of token tiles) on the H200, 132 slots.
    for (t, v, d, splits, raster) in [
        (131_072, 128_256, 4096, 12, 11),
        (262_144, 128_256, 4096, 12, 11),
        (131_072, 152_064, 5120, 15, 9),
        (262_144, 19_008, 5120, 15, 9),
        (131_072, 131_072, 8192, 12, 11),
        (32_768, 131_072, 8192, 12, 11),
    ] {
        let p = Problem::new(t, v, d);
        let plan = fwd_plan(sm90::FWD, p, &Device::H200, 132);
        assert_eq!((plan.n_splits, plan.raster_group, plan.fill), (splits, raster, 0), "{p:?}");
        let (_, n) = tiles(sm90::FWD, p);
        assert_eq!(n.div_ceil(plan.tiles_per_split), plan.n_splits, "{p:?}: every tile covered");
    }
    // Elsewhere the L2 model's plan; a portable config the plain makespan plan.
    let p = Problem::new(16384, 248_320, 2048);
    let (m, n) = tiles(sm90::FWD, p);
    assert_eq!(fwd_plan(sm90::FWD, p, &Device::H200, 132), split::plan_l2(m, n, 132, split::L2Model::of(128, 2048, 60 << 20)));
    let c = sm80::FWD[0];
    let (m, n) = tiles(c, p);
    assert_eq!(fwd_plan(c, p, &Device::H200, 264), split::plan(m, n, 264));
    assert!(!fills(c) && fills(sm90::FWD));
}

#[test]
fn plans_cover_every_tile_on_every_device() {
    let problems = [1usize, 4097, 65537, 262_144]
        .iter()
        .flat_map(|&t| [2048usize, 5120, 8192].into_iter().flat_map(move |d| [8192usize, 128_000, 248_320].map(|v| Problem::new(t, v, d))));
    let problems: Vec<Problem> = problems.collect();
    for (name, dev) in devices() {
        for &p in &problems {
            for f in [Family::Fwd, Family::BwdDh] {
                let c = config(f, p, &dev);
                let slots = dev.sm_count * blocks_per_sm(c, &dev);
                let (m, n) = tiles(c, p);
                let plan = if f == Family::Fwd { fwd_plan(c, p, &dev, slots) } else { bwd_plan(c, m, n, p.d, &dev) };
                let plan = with_fill(c, plan, m, n, slots, p.d);
                assert!(plan.tiles_per_split >= 1 && n.div_ceil(plan.tiles_per_split) == plan.n_splits, "{name} {p:?}: {plan:?}");
                assert!(plan.fill == 0 || (c.is_sm90() && plan.fill < split::last_split_len(plan, n)), "{name} {p:?}: {plan:?}");
                assert!(c.is_sm90() || plan.raster_group == 0 || f == Family::Fwd, "{name} {p:?}: {plan:?}");
            }
        }
    }
}

#[test]
fn automatic_chunk_fits_the_staging_budget_within_its_bounds() {
    let d = 4096;
    assert_eq!(chunk_width(0, d), MAX_AUTO_CHUNK);
    assert_eq!(chunk_width(1, d), MAX_AUTO_CHUNK);
    assert_eq!(chunk_width(4096, d), 32768);
    assert_eq!(chunk_width(8192, d), 32768, "512 MiB of staging at t = 8192");
    assert_eq!(chunk_width(8193, d), 16384);
    assert_eq!(chunk_width(16384, d), 16384);
    assert_eq!(chunk_width(32768, d), 8192);
    assert_eq!(chunk_width(1 << 20, d), MIN_AUTO_CHUNK, "never narrower than the minimum");
    for t in [1, 100, 5000, 8192, 12345, 16384, 20000] {
        let s = chunk_width(t, d);
        assert!(s.is_power_of_two() && (MIN_AUTO_CHUNK..=MAX_AUTO_CHUNK).contains(&s));
        assert!(2 * t * s <= STAGING_BUDGET_BYTES || s == MIN_AUTO_CHUNK, "t {t}: {s}");
    }
    // Hidden sizes other than powers of two keep the narrow chunk (measured faster at 5120).
    for d in [5120, 3072, 1000] {
        assert_eq!(chunk_width(8192, d), MIN_AUTO_CHUNK, "d {d}");
    }
    assert_eq!(chunk_width(8192, 2048), 32768);
    assert_eq!(chunk_width(8192, 8192), 32768);
}

#[test]
fn balanced_chunks_are_as_many_and_nearly_equal() {
    assert_eq!(balanced_chunk(19008, 8192), 6400, "8192 + 8192 + 2624 → 6400 + 6400 + 6208");
    assert_eq!(balanced_chunk(38016, 8192), 7680);
    assert_eq!(balanced_chunk(4 * 8192, 8192), 8192);
    assert_eq!(balanced_chunk(5000, 8192), 5000);
    assert_eq!(chunk(Problem::new(131_072, 19_008, 5120)), 6400);
    assert_eq!(chunk(Problem::new(4096, 5000, 4096)), 5000, "a vocab below the width is one chunk");
    for width in [8192, 16384, 32768] {
        for v in (1..400_000).step_by(997) {
            let c = balanced_chunk(v, width);
            assert!(c <= width && c <= v, "v {v} width {width}: {c}");
            assert_eq!(v.div_ceil(c), v.div_ceil(width), "v {v} width {width}: {c}");
            let last = v - (v.div_ceil(c) - 1) * c;
            assert!(v <= width || last + 256 * v.div_ceil(c) > c, "v {v} width {width}: last {last} of {c}");
        }
    }
}

#[test]
fn decisions_on_paper() {
    let d = decide(Problem::new(8192, 151_936, 4096), &Device::H200);
    assert_eq!((d.fwd.config, d.fwd_ent.config, d.dlogits, d.dh, d.dw), (sm90::FWD, sm90::FWD, sm90::DLOGITS, sm90::DH, sm90::DW));
    assert_eq!((d.chunk, d.chunks), (30_464, 5), "32768 spread over five chunks");
    assert!(d.dw_beside_dh);
    let d = decide(Problem::new(2048, 152_064, 5120), &Device::H200);
    assert_eq!((d.dh, d.chunk, d.chunks), (sm90::DH_NARROW, 8192, 19));
    let d = decide(Problem::new(131_072, 128_256, 4096), &Device::H200);
    assert_eq!((d.fwd.plan.n_splits, d.fwd.plan.raster_group), (12, 11));
    assert_eq!(blocks_per_sm(sm90::FWD, &Device::H200), 1);
}
