//! Unit kernels of the Hopper mainloop, each against a host model: one TMA box copy (the
//! 128-byte swizzle the `wgmma` descriptors assume, zero fill out of bounds) and one `wgmma`
//! tile of each width (descriptors, instruction wrappers and the accumulator layout the
//! epilogues assume) against an f64 product, also with B stored MN-major (`imm-trans-b`, the
//! layout the backward GEMMs' in-place operands use); the `tma_store` d-logits epilogue
//! (`stmatrix` into swizzled boxes, TMA store, clipping at the tensor's edges). Outputs are
//! poisoned before each launch.

use lmhead::bf16;
use lmhead::cudarc::driver::CudaSlice;
use lmhead::launch::{dev_in, dev_out, unit_tma_copy, unit_tma_store, unit_wgmma, unit_wgmma_mn};
use lmhead::testing::{poison, upload_bf16};
use lmhead_reference::rng::Rng;
use lmhead_tests::{case_seed, gpu_or_skip, run_seed, skip_sm90_only};

/// Bit patterns of bf16 values uniform in [−2, 2), from the reference's replayable generator.
fn bf16_values(seed: u64, n: usize) -> Vec<u16> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| lmhead_reference::bf16::from_f32(((rng.uniform() - 0.5) * 4.0) as f32)).collect()
}

/// The `tma_store` epilogue: two calls store four 64 × 64 tiles into a 100 × 136 matrix, one call
/// wholly inside it and one across both edges; every element must hold its tile's pattern or,
/// where no tile covers it, still the poison.
#[test]
fn tma_store_writes_fragments_in_place_and_clips() {
    if skip_sm90_only("gpu_units::tma_store") {
        return;
    }
    let Some((head, stream)) = gpu_or_skip("gpu_units::tma_store") else { return };
    let (rows, cols) = (100usize, 136usize);
    let mut out: CudaSlice<bf16> = stream.alloc_zeros(rows * cols).unwrap();
    poison(&stream, &mut out).unwrap();
    let poisoned: Vec<u16> = stream.clone_dtoh(&out).unwrap().iter().map(|x| x.to_bits()).collect();
    let calls = [(0u32, 0u32), (64, 64)];
    for &origin in &calls {
        let o = dev_out(&mut out, &stream, "out").unwrap();
        unit_tma_store(head.gpu(), &stream, &o, (rows, cols), origin).unwrap();
    }
    let got: Vec<u16> = stream.clone_dtoh(&out).unwrap().iter().map(|x| x.to_bits()).collect();
    let mut bad = 0;
    for r in 0..rows {
        for c in 0..cols {
            // The tile (call, i) covering (r, c), if any: tile i of a call at (col0, row0) spans
            // columns col0 + 64i .. + 64 and rows row0 .. + 64.
            let mut want = poisoned[r * cols + c];
            for &(col0, row0) in &calls {
                for i in 0..2usize {
                    let (c0, r0) = (col0 as usize + 64 * i, row0 as usize);
                    if (c0..c0 + 64).contains(&c) && (r0..r0 + 64).contains(&r) {
                        want = (4096 * i + 64 * (r - r0) + (c - c0)) as u16;
                    }
                }
            }
            if got[r * cols + c] != want {
                bad += 1;
                if bad <= 5 {
                    eprintln!("({r},{c}): got {:#06x} want {want:#06x}", got[r * cols + c]);
                }
            }
        }
    }
    println!("[gpu_units::tma_store] {rows} x {cols}, tiles at {calls:?}: {bad} wrong of {}", rows * cols);
    assert_eq!(bad, 0);
}

#[test]
fn tma_box_lands_128b_swizzled_and_zero_filled() {
    if skip_sm90_only("gpu_units::tma") {
        return;
    }
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
    if skip_sm90_only("gpu_units::wgmma") {
        return;
    }
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

/// `wgmma` with B stored MN-major (`B[k][n]`, loaded by TMA as two 64-column slabs): the layout
/// `lmhead_core::wgmma::desc_mn_major_sw128` claims (leading offset = slab stride 8192 bytes,
/// stride offset = 1024 bytes between 8-row K atoms) must reproduce `A·B`; the two offsets
/// swapped are run too and reported, so that a wrong claim shows which reading the hardware has.
#[test]
fn wgmma_mn_major_b_matches_f64() {
    let test = "gpu_units::wgmma_mn";
    if skip_sm90_only(test) {
        return;
    }
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = case_seed(run_seed(test), 0);
    let (n, k) = (128usize, 64usize);
    let a = bf16_values(seed, 64 * k);
    let b = bf16_values(seed ^ 0x5EED, k * n);
    let (da, db) = (upload_bf16(&stream, &a).unwrap(), upload_bf16(&stream, &b).unwrap());
    let f = lmhead_reference::bf16::to_f64;
    let claimed = lmhead_core::wgmma::desc_mn_major_sw128(0, 8192);
    let claimed = (((claimed >> 16) & 0x3FFF) as u32 * 16, ((claimed >> 32) & 0x3FFF) as u32 * 16);
    let mut results = Vec::new();
    for offsets in [claimed, (claimed.1, claimed.0)] {
        let mut out: CudaSlice<f32> = stream.alloc_zeros(64 * n).unwrap();
        poison(&stream, &mut out).unwrap();
        {
            let (ia, ib) = (dev_in(&da, &stream, "a").unwrap(), dev_in(&db, &stream, "b").unwrap());
            let o = dev_out(&mut out, &stream, "out").unwrap();
            unit_wgmma_mn(head.gpu(), &stream, &ia, &ib, offsets, &o).unwrap();
        }
        let got = stream.clone_dtoh(&out).unwrap();
        let mut max_rel = 0.0f64;
        for i in 0..64 {
            for j in 0..n {
                let terms = (0..k).map(|kk| f(a[i * k + kk]) * f(b[kk * n + j]));
                let (want, scale) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                // NaN (the poison) counts as wrong.
                let rel =
                    ((got[i * n + j] as f64 - want).abs() / f64::max(scale, 1e-30)).max(if got[i * n + j].is_nan() { 1.0 } else { 0.0 });
                max_rel = max_rel.max(rel);
            }
        }
        println!("[{test}] seed {seed} MN-major B, (leading, stride) byte offsets {offsets:?}: max |err| / Σ|a·b| = {max_rel:.2e}");
        results.push(max_rel);
    }
    assert!(results[0] <= 1e-5, "the claimed MN-major layout {claimed:?} is wrong (swapped: {:.2e}; seed {seed})", results[1]);
}
