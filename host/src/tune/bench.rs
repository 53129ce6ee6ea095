//! Timing with CUDA events: one warm-up run, then `REPS` runs each between two events; the
//! median is reported (robust to one slow outlier, e.g. a clock ramp).

use cudarc::driver::CudaStream;

use crate::error::{Context as _, Result};

/// Timed repetitions per candidate.
pub const REPS: usize = 5;

/// Median milliseconds of `f` on `stream` (after one warm-up call).
pub fn time_ms(stream: &CudaStream, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    time_ms_reps(stream, 1, REPS, &mut f)
}

/// Median milliseconds over `reps` timed runs after `warmup` untimed ones.
pub fn time_ms_reps(stream: &CudaStream, warmup: usize, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let ctx = stream.context();
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let a = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).during(|| "creating a timing event".into())?;
        let b = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).during(|| "creating a timing event".into())?;
        a.record(stream).during(|| "recording a timing event".into())?;
        f()?;
        b.record(stream).during(|| "recording a timing event".into())?;
        b.synchronize().during(|| "waiting for a timed run".into())?;
        times.push(a.elapsed_ms(&b).during(|| "reading a timing event".into())? as f64);
    }
    Ok(median(&mut times))
}

/// Median of `xs` (sorts in place); NaN for an empty slice.
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

/// Percentile `q` in `[0, 1]` (nearest rank) of `xs` (sorts in place).
pub fn percentile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    let i = ((xs.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round() as usize;
    xs[i]
}
