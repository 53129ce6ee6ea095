//! The benchmark suites: `quick` (a handful of shapes, < 2 minutes of GPU time), `sweep` (public
//! LM-head configurations × token counts × every (TP, CP) with TP·CP ≤ 8, as rank-local shapes),
//! `entropy` (with vs without entropy) and `probe` (the autotuner's cold/warm costs).

use std::sync::Arc;
use std::time::Instant;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::{FwdInputs, FwdOptions, FwdOutputs, LmHead, Problem};

use crate::{Args, Case};

/// Public LM-head configurations: (name, hidden D, vocab V).
pub const MODELS: &[(&str, usize, usize)] = &[
    ("qwen3.6-35b-a3b", 2048, 248_320),
    ("llama-3.1-8b", 4096, 128_256),
    ("qwen2.5-14b", 5120, 152_064),
    ("h8192-v131072", 8192, 131_072),
];

/// Total token counts of the sweep.
pub const TOKENS: &[usize] = &[16_384, 32_768, 65_536, 131_072, 262_144];

pub enum Suite {
    Quick,
    Sweep,
    Entropy,
    Probe,
}

impl Suite {
    pub fn named(s: &str) -> Option<Self> {
        Some(match s {
            "quick" => Suite::Quick,
            "sweep" => Suite::Sweep,
            "entropy" => Suite::Entropy,
            "probe" => Suite::Probe,
            _ => return None,
        })
    }

    /// Every (TP, CP) in {1, 2, 4, 8}² with TP·CP ≤ 8.
    pub fn parallel_layouts() -> Vec<(usize, usize)> {
        let p = [1usize, 2, 4, 8];
        p.iter().flat_map(|&tp| p.iter().map(move |&cp| (tp, cp))).filter(|&(tp, cp)| tp * cp <= 8).collect()
    }

    fn logical(&self) -> Vec<Case> {
        match self {
            Suite::Quick => vec![
                case("llama-3.1-8b", 4096, 4096, 128_256, 1, 1, true),
                case("qwen-h4096-v151936", 8192, 4096, 151_936, 1, 1, true),
                case("h8192-v131072", 8192, 8192, 131_072, 1, 1, true),
                case("qwen3.6-35b-a3b", 16_384, 2048, 248_320, 1, 1, false),
            ],
            Suite::Entropy => MODELS.iter().map(|&(m, d, v)| case(m, 8192, d, v, 1, 1, false)).collect(),
            Suite::Sweep => {
                let mut out = Vec::new();
                for &(m, d, v) in MODELS {
                    for &tok in TOKENS {
                        for (tp, cp) in Self::parallel_layouts() {
                            out.push(case(m, tok, d, v, tp, cp, true));
                        }
                    }
                }
                out
            }
            Suite::Probe => Vec::new(),
        }
    }

    /// The suite's unique rank-local shapes (logical cases that map to the same local
    /// `(t, v, d)` are measured once). The sweep runs cheapest first, so that a time budget
    /// covers as many shapes as it can.
    pub fn cases(&self) -> Vec<Case> {
        let mut seen = std::collections::HashSet::new();
        let mut v: Vec<Case> = self.logical().into_iter().filter(|c| seen.insert((c.t, c.v, c.d))).collect();
        if matches!(self, Suite::Sweep) {
            v.sort_by_key(|c| (c.t as u128 * c.v as u128 * c.d as u128, c.name()));
        }
        v
    }

    /// (logical cases, unique local shapes).
    pub fn counts(&self) -> (usize, usize) {
        (self.logical().len(), self.cases().len())
    }
}

fn case(model: &str, tokens: usize, d: usize, v: usize, tp: usize, cp: usize, backward: bool) -> Case {
    Case { model: model.into(), tokens, tp, cp, t: tokens / cp, v: v.div_ceil(tp), d, backward }
}

/// The autotune probe: a cold first call in a new bucket (kernel JIT + tuning), an exact-length
/// neighbour in the same bucket, a call in the next bucket (retune), and a fresh process with the
/// cache on disk (no tuning at all).
pub fn probe(head: &LmHead, stream: &Arc<CudaStream>, _args: &Args) {
    let _ = head;
    let dir = std::env::temp_dir().join(format!("lmhead-probe-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let cache = dir.join("cache.json");
    let _ = std::fs::remove_file(&cache);
    // Read by LmHead::new in this process and inherited by the child.
    std::env::set_var("LMHEAD_TUNE_CACHE", &cache);
    std::env::set_var("LMHEAD_AUTOTUNE", "1");
    let fresh = LmHead::new(0).expect("device");
    let (d, v) = (4096, 128_256);
    println!("| step | tokens | bucket | wall ms |");
    println!("|---|---|---|---|");
    for (step, t) in [
        ("cold: JIT + tune (new bucket)", 20_000usize),
        ("same bucket, other length", 20_001),
        ("same bucket, again", 19_000),
        ("next bucket: retune", 40_000),
    ] {
        let ms = timed_call(&fresh, stream, t, v, d);
        println!("| {step} | {t} | {} | {ms:.1} |", lmhead::TokenBucket::of(t).tokens());
    }
    // A fresh process reading the cache from disk.
    let exe = std::env::current_exe().expect("current exe");
    let out = std::process::Command::new(exe).arg("probe-child").env("LMHEAD_TUNE_CACHE", &cache).output().expect("spawn child");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
}

/// Wall-clock milliseconds of one forward (with entropy) of `t` tokens, synchronised.
pub fn timed_call(head: &LmHead, stream: &Arc<CudaStream>, t: usize, v: usize, d: usize) -> f64 {
    let hs = crate::random_bf16(t * d, 4.0 / (d as f32).sqrt(), 1);
    let ws = crate::random_bf16(v * d, 0.5, 2);
    let labels: Vec<i32> = (0..t).map(|i| (i * 7919 % v) as i32).collect();
    let h = lmhead::testing::upload_bf16(stream, &hs).unwrap();
    let w = lmhead::testing::upload_bf16(stream, &ws).unwrap();
    let lab = lmhead::testing::upload(stream, &labels).unwrap();
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    stream.synchronize().unwrap();
    let start = Instant::now();
    head.forward(
        stream,
        &FwdInputs { h: &h, w: &w, labels: &lab, problem: Problem::new(t, v, d) },
        &FwdOptions::default(),
        FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
    )
    .unwrap();
    stream.synchronize().unwrap();
    start.elapsed().as_secs_f64() * 1e3
}
