//! The benchmark suites: `quick` (a handful of shapes, < 2 minutes of GPU time), `peers` (the seven
//! shapes of the comparison with the public fused LM-head kernels), `sweep` (public LM-head
//! configurations × token counts × every (TP, CP) with TP·CP ≤ 8, as rank-local shapes),
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

/// The peers' seven shapes: (name, tokens, hidden D, local vocab V).
pub const PEERS: &[(&str, usize, usize, usize)] = &[
    ("qwen7b-like", 8192, 4096, 151_936),
    ("qwen14b-like", 16_384, 5120, 152_064),
    ("nemotron-like", 8192, 8192, 131_072),
    ("llama2-7b-like", 4096, 4096, 32_000),
    ("qwen-tp8-slice", 32_768, 4096, 18_992),
    ("skyrl-q3.6-35b-tp4", 32_768, 2048, 62_080),
    ("skyrl-q3.6-35b-tp1", 32_768, 2048, 248_320),
];

/// Total token counts of the sweep.
pub const TOKENS: &[usize] = &[16_384, 32_768, 65_536, 131_072, 262_144];

pub enum Suite {
    Quick,
    Peers,
    Sweep,
    Entropy,
    Probe,
}

impl Suite {
    pub fn named(s: &str) -> Option<Self> {
        Some(match s {
            "quick" => Suite::Quick,
            "peers" => Suite::Peers,
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
            // The seven shapes at which lmhead is compared with the public fused LM-head kernels
            // (Liger-Kernel's CuTe-DSL SM90 kernel, Liger's Triton FLCE, Cut Cross-Entropy,
            // SkyRL/verl's Triton kernel, torch eager): t × d × local v.
            Suite::Peers => PEERS.iter().map(|&(m, t, d, v)| case(m, t, d, v, 1, 1, true)).collect(),
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

/// The autotune probe, per public LM head of [`MODELS`] (each with its own empty cache): a cold
/// first call in a new bucket (forward with entropy and backward: six tuned families), an
/// exact-length neighbour in the same bucket, a call in the next bucket (retune), and a fresh
/// process with the cache on disk (no tuning), with tuning on (`LMHEAD_AUTOTUNE=1`, also where it
/// is off by default). Prints wall times and, per tuned family, the seconds its tuning took and
/// how (`rule`: the rule's pick, too large to time or alone on its short list; `N timed`).
pub fn probe(head: &LmHead, _stream: &Arc<CudaStream>, args: &Args) {
    let _ = head;
    let dir = std::env::temp_dir().join(format!("lmhead-probe-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    std::env::set_var("LMHEAD_AUTOTUNE", "1");
    println!("| model | step | tokens | bucket | wall ms | tuning: family s (how) |");
    println!("|---|---|---:|---:|---:|---|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).expect("open --out");
    for &(model, d, v) in MODELS.iter().filter(|m| args.filter.as_ref().is_none_or(|f| m.0.contains(f.as_str()))) {
        let cache = dir.join(format!("{model}.json"));
        let _ = std::fs::remove_file(&cache);
        // Read by LmHead::new in this process and inherited by the child.
        std::env::set_var("LMHEAD_TUNE_CACHE", &cache);
        let fresh = LmHead::new(0).expect("device");
        let stream = fresh.gpu().context().default_stream();
        for (step, t) in [("cold: new bucket", 20_000usize), ("same bucket, other length", 20_001), ("next bucket", 40_000)] {
            let before: std::collections::BTreeSet<_> = fresh.tuner().entries().into_keys().collect();
            let ms = timed_step(&fresh, &stream, t, v, d);
            let tuned: Vec<(String, f64, String)> = fresh
                .tuner()
                .entries()
                .into_iter()
                .filter(|(k, _)| !before.contains(k))
                .map(|(k, e)| {
                    let timed = e.timed();
                    let how = match timed {
                        0 => "rule".to_string(),
                        n => format!("{n} timed"),
                    };
                    (format!("{:?}", k.family), e.seconds, how)
                })
                .collect();
            let cells: Vec<String> = tuned.iter().map(|(f, s, how)| format!("{f} {s:.3} ({how})")).collect();
            println!("| {model} | {step} | {t} | {} | {ms:.1} | {} |", lmhead::TokenBucket::of(t).tokens(), cells.join(", "));
            let rec = serde_json::json!({
                "suite": "probe", "gpu": fresh.gpu().info().name, "commit": crate::commit(),
                "timestamp": crate::unix_now(),
                "model": model, "d": d, "v": v, "step": step, "tokens": t, "wall_ms": ms,
                "tuning": tuned.iter().map(|(f, s, how)| serde_json::json!({"family": f, "seconds": s, "how": how})).collect::<Vec<_>>(),
            });
            use std::io::Write as _;
            writeln!(out, "{rec}").expect("write --out");
        }
        // A fresh process reading the cache from disk.
        let exe = std::env::current_exe().expect("current exe");
        let o = std::process::Command::new(exe)
            .args(["probe-child", "--filter", &t_v_d(20_000, v, d)])
            .env("LMHEAD_TUNE_CACHE", &cache)
            .output()
            .expect("spawn child");
        let child = String::from_utf8_lossy(&o.stdout);
        println!("| {model} | fresh process, cache on disk | 20000 | 32768 | {} | none |", child.trim());
        eprint!("{}", String::from_utf8_lossy(&o.stderr));
    }
}

fn t_v_d(t: usize, v: usize, d: usize) -> String {
    format!("{t}x{v}x{d}")
}

/// The probe child: one step of the shape `TxVxD` (passed as `--filter`).
pub fn probe_child(head: &LmHead, stream: &Arc<CudaStream>, shape: &str) {
    let n: Vec<usize> = shape.split('x').filter_map(|x| x.parse().ok()).collect();
    let ms = timed_step(head, stream, n[0], n[1], n[2]);
    println!("{ms:.1}");
}

/// Wall-clock milliseconds of one training step of `t` tokens — forward with entropy, then the
/// backward of both outputs — synchronised (tuning included when the bucket is new).
pub fn timed_step(head: &LmHead, stream: &Arc<CudaStream>, t: usize, v: usize, d: usize) -> f64 {
    use lmhead::{BwdInputs, BwdOptions, GradOut};
    let h = lmhead::testing::random_bf16_tiled(stream, t * d, 4.0 / (d as f64).sqrt(), 1).unwrap();
    let w = lmhead::testing::random_bf16_tiled(stream, v * d, 0.5, 2).unwrap();
    let labels: Vec<i32> = (0..t).map(|i| (i * 7919 % v) as i32).collect();
    let lab = lmhead::testing::upload(stream, &labels).unwrap();
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let g = lmhead::testing::upload(stream, &vec![1.0f32; t]).unwrap();
    let mut dh: CudaSlice<lmhead::bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<lmhead::bf16> = stream.alloc_zeros(v * d).unwrap();
    stream.synchronize().unwrap();
    let start = Instant::now();
    let p = Problem::new(t, v, d);
    head.forward(
        stream,
        &FwdInputs { h: &h, w: &w, labels: &lab, problem: p },
        &FwdOptions::default(),
        FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
    )
    .unwrap();
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &lab,
        lse: &lse,
        entropy: Some(&ent as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_logprob: Some(&g),
        grad_entropy: Some(&g as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        problem: p,
    };
    head.backward(stream, &bx, &BwdOptions::default(), GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
    stream.synchronize().unwrap();
    start.elapsed().as_secs_f64() * 1e3
}
