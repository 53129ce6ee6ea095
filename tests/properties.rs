//! Property tests (CPU, CI): random shapes and options through the host-side validation and the
//! reference. Each property runs a few hundred cases from the printed run seed
//! (`LMHEAD_SEED` replays).
//!
//! - valid inputs: the CPU backend succeeds, log-probs are ≤ 0, 0 ≤ entropy ≤ ln v, ignored rows
//!   report 0, and the vocab-sharded merge (tensor parallelism's math) agrees with it;
//! - invalid inputs: exactly the expected typed error, never a panic;
//! - the GPU entry points answer `NoDriver` (not a panic) on a machine without a driver.

use lmhead::{bf16, cpu, Error, FwdOptions, Problem};
use lmhead_core::ShapeError;
use lmhead_reference::rng::Rng;
use lmhead_reference::{merge_shards, shard_partials, Case, Structure, IGNORE_INDEX};
use lmhead_tests::run_seed;

fn to_bf16(x: &[u16]) -> Vec<bf16> {
    x.iter().map(|&b| bf16::from_bits(b)).collect()
}

#[test]
fn valid_inputs_give_consistent_results() {
    let seed = run_seed("properties::valid_inputs");
    let mut rng = Rng::new(seed);
    for case_no in 0..150 {
        let t = 1 + rng.below(12) as usize;
        let v = 1 + rng.below(90) as usize;
        let d = 8 * (1 + rng.below(6) as usize);
        let s = Structure {
            logit_std: 0.05 + rng.uniform() * 6.0,
            planted: rng.uniform() * 0.5,
            all_negative: rng.uniform() * 0.2,
            huge: rng.uniform() * 0.2,
            ignored: rng.uniform() * 0.5,
            temperature: 0.25 + rng.uniform() * 3.0,
        };
        let c = Case::generate(rng.next_u64(), t, v, d, &s);
        let what = format!("case {case_no}: t={t} v={v} d={d} {s:?} (run seed {seed})");
        let opts = FwdOptions { temperature: s.temperature as f32, ..Default::default() };
        let f = cpu::forward(
            &cpu::CpuInputs { h: &to_bf16(&c.h), w: &to_bf16(&c.w), labels: &c.labels, problem: Problem::new(t, v, d) },
            &opts,
            true,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let ent = f.entropy.as_ref().unwrap();
        let pieces = 1 + rng.below(4) as usize;
        let bounds: Vec<usize> = (0..=pieces).map(|k| k * v / pieces).collect();
        let shards: Vec<_> = bounds.windows(2).filter(|b| b[1] > b[0]).map(|b| shard_partials(&c.shard(b[0], b[1]))).collect();
        let m = merge_shards(&shards, &c.labels, v as i64, IGNORE_INDEX);
        for i in 0..t {
            if c.labels[i] == IGNORE_INDEX {
                assert_eq!((f.logprob[i], ent[i]), (0.0, 0.0), "{what}: ignored row {i}");
                continue;
            }
            assert!(f.logprob[i] <= 1e-6, "{what}: log-prob {} > 0", f.logprob[i]);
            assert!(ent[i] >= -1e-6 && ent[i] as f64 <= (v as f64).ln() + 1e-4, "{what}: entropy {}", ent[i]);
            let scale = f.lse[i].abs().max(1.0) as f64;
            assert!((f.logprob[i] as f64 - m.logprob[i]).abs() <= 1e-5 * scale, "{what}: merge disagrees on row {i}");
            assert!((ent[i] as f64 - m.entropy[i]).abs() <= 1e-5 * scale, "{what}: merge entropy disagrees on row {i}");
        }
    }
}

#[test]
fn invalid_inputs_give_the_expected_typed_error() {
    let seed = run_seed("properties::invalid_inputs");
    let mut rng = Rng::new(seed);
    for case_no in 0..300 {
        let t = rng.below(6) as usize;
        let v = rng.below(20) as usize;
        let d = rng.below(40) as usize;
        // Lengths: usually matching the shape, sometimes off by one.
        let jitter = |n: usize, rng: &mut Rng| if rng.below(4) == 0 { n + 1 } else { n };
        let (hn, wn, ln) = (jitter(t * d, &mut rng), jitter(v * d, &mut rng), jitter(t, &mut rng));
        let h = vec![bf16::from_f32(0.01); hn];
        let w = vec![bf16::from_f32(0.02); wn];
        let mut labels: Vec<i64> = (0..ln).map(|i| (i % v.max(1)) as i64).collect();
        let bad_label = ln > 0 && rng.below(5) == 0;
        if bad_label {
            labels[0] = v as i64 + rng.below(3) as i64;
        }
        let temperature = match rng.below(6) {
            0 => 0.0,
            1 => -1.0,
            2 => f32::NAN,
            _ => 0.5 + rng.uniform() as f32,
        };
        let opts = FwdOptions { temperature, ..Default::default() };
        let entropy = rng.below(2) == 0;
        let r = std::panic::catch_unwind(|| {
            cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &labels, problem: Problem::new(t, v, d) }, &opts, entropy)
        });
        let what = format!("case {case_no}: t={t} v={v} d={d} lens=({hn},{wn},{ln}) temp={temperature} (run seed {seed})");
        let r = r.unwrap_or_else(|_| panic!("{what}: panicked instead of returning an error"));
        // The first failing check, in the order validation runs.
        let expected = if t == 0 {
            Some("NoTokens")
        } else if v == 0 {
            Some("NoVocab")
        } else if d == 0 || !d.is_multiple_of(8) {
            Some("Hidden")
        } else if !(temperature.is_finite() && temperature > 0.0) {
            Some("Temperature")
        } else if hn != t * d {
            Some("Length { what: \"h\"")
        } else if wn != v * d {
            Some("Length { what: \"W\"")
        } else if ln != t {
            Some("Length { what: \"labels\"")
        } else if bad_label {
            Some("BadLabel")
        } else {
            None
        };
        match (expected, &r) {
            (None, Ok(_)) => {}
            (Some(want), Err(e)) => assert!(format!("{e:?}").contains(want), "{what}: expected {want}, got {e:?}"),
            (want, got) => panic!("{what}: expected {want:?}, got {got:?}"),
        }
    }
}

#[test]
fn gpu_entry_points_report_a_missing_driver() {
    if lmhead::driver_present() {
        println!("SKIP properties::gpu_entry_points_report_a_missing_driver: a CUDA driver is present");
        return;
    }
    assert!(matches!(lmhead::LmHead::new(0), Err(Error::NoDriver)));
    assert!(matches!(lmhead::Gpu::new(0), Err(Error::NoDriver)));
    let _ = ShapeError::NoTokens;
}
