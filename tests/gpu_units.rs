//! Unit kernels of the Hopper mainloop, each against a host model: one TMA box copy (the
//! 128-byte swizzle the `wgmma` descriptors assume, zero fill out of bounds) and one `wgmma`
//! tile of each width (descriptors, instruction wrappers and the accumulator layout the
//! epilogues assume) against an f64 product. Outputs are poisoned before each launch.

use lmhead::bf16;
use lmhead::cudarc::driver::CudaSlice;
use lmhead::launch::{dev_in, dev_out, unit_tma_copy, unit_wgmma};
use lmhead::testing::{poison, upload_bf16};
use lmhead_reference::rng::Rng;
use lmhead_tests::{case_seed, gpu_or_skip, run_seed};

/// Bit patterns of bf16 values uniform in [−2, 2), from the reference's replayable generator.
fn bf16_values(seed: u64, n: usize) -> Vec<u16> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| lmhead_reference::bf16::from_f32(((rng.uniform() - 0.5) * 4.0) as f32)).collect()
}

#[test]
fn tma_box_lands_128b_swizzled_and_zero_filled() {
    let Some((head, stream)) = gpu_or_skip("gpu_units::tma") else { return };
    let seed = case_seed(run_seed("gpu_units::tma"), 0);
    // A 300 × 136 matrix (stride 144): the box at (k0 = 64, row0 = 256) of 64 rows crosses both
    // the row bound (rows 300..320) and the column bound (136..128+64).
    let (rows, k, stride) = (300usize, 136usize, 144usize);
    let src = bf16_values(seed, rows * stride);
    let d_src = upload_bf16(&stream, &src).unwrap();
    for &(k0, row0, box_rows) in &[(0u32, 0u32, 64u32), (64, 256, 64), (128, 8, 256), (0, 160, 128)] {
        let mut out: CudaSlice<bf16> = stream.alloc_zeros(box_rows as usize * 64).unwrap();
        poison(&stream, &mut out).unwrap();
        {
            let s = dev_in(&d_src, &stream, "src").unwrap();
            let o = dev_out(&mut out, &stream, "out").unwrap();
            unit_tma_copy(head.gpu(), &stream, (&s, rows, k, stride), (k0, row0, box_rows), &o).unwrap();
        }
        let got: Vec<u16> = stream.clone_dtoh(&out).unwrap().iter().map(|x| x.to_bits()).collect();
        let mut bad = 0;
        for r in 0..box_rows as usize {
            for c in 0..64usize {
                // Element (r, c) of the box: row r is one 128-byte line, 16-byte chunk c / 8 sits
                // at chunk (c / 8) ^ (r % 8).
                let pos = r * 64 + (((c / 8) ^ (r % 8)) * 8) + c % 8;
                let (gr, gc) = (row0 as usize + r, k0 as usize + c);
                let want = if gr < rows && gc < k { src[gr * stride + gc] } else { 0 };
                if got[pos] != want {
                    bad += 1;
                    if bad <= 5 {
                        eprintln!("box ({k0},{row0}) elem ({r},{c}) at {pos}: got {:#06x} want {want:#06x}", got[pos]);
                    }
                }
            }
        }
        println!("[gpu_units::tma] seed {seed} box (k0 {k0}, row0 {row0}, {box_rows} rows): {bad} wrong of {}", box_rows * 64);
        assert_eq!(bad, 0);
    }
}

#[test]
fn wgmma_tiles_match_f64() {
    let Some((head, stream)) = gpu_or_skip("gpu_units::wgmma") else { return };
    let seed = case_seed(run_seed("gpu_units::wgmma"), 0);
    for n in [128usize, 256] {
        let a = bf16_values(seed, 64 * 64);
        let b = bf16_values(seed ^ 0xABCD, n * 64);
        let (da, db) = (upload_bf16(&stream, &a).unwrap(), upload_bf16(&stream, &b).unwrap());
        let mut out: CudaSlice<f32> = stream.alloc_zeros(64 * n).unwrap();
        poison(&stream, &mut out).unwrap();
        {
            let (ia, ib) = (dev_in(&da, &stream, "a").unwrap(), dev_in(&db, &stream, "b").unwrap());
            let o = dev_out(&mut out, &stream, "out").unwrap();
            unit_wgmma(head.gpu(), &stream, &ia, &ib, n, &o).unwrap();
        }
        let got = stream.clone_dtoh(&out).unwrap();
        let f = lmhead_reference::bf16::to_f64;
        let mut max_rel = 0.0f64;
        for i in 0..64 {
            for j in 0..n {
                let want = lmhead_reference::bf16::dot(&a[i * 64..(i + 1) * 64], &b[j * 64..(j + 1) * 64]);
                let g = got[i * n + j] as f64;
                // Products of bf16 are exact in f32; 64 terms of |x| ≤ 2 accumulate ≤ 1e-5
                // relative to the row's scale (NaN from the poison fails the comparison).
                let scale = (0..64).map(|k| (f(a[i * 64 + k]) * f(b[j * 64 + k])).abs()).sum::<f64>().max(1e-30);
                let rel = (g - want).abs() / scale;
                assert!(rel <= 1e-5, "n{n} ({i},{j}): got {g} want {want} (seed {seed})");
                max_rel = max_rel.max(rel);
            }
        }
        println!("[gpu_units::wgmma] seed {seed} m64n{n}k64: max |err| / Σ|a·b| = {max_rel:.2e}");
    }
}
