//! Measurement overrides of the launch plans, read from the environment once per process (the
//! first forward or backward call): `LMHEAD_FWD_L2=0` (forward plan without the L2 model),
//! `LMHEAD_FWD_SPLITS` / `LMHEAD_FWD_RASTER` / `LMHEAD_FWD_FILL` (forward split count / raster
//! group of token tiles / tiles per filler, 0 = none), `LMHEAD_BWD_TILES` / `LMHEAD_BWD_RASTER` /
//! `LMHEAD_BWD_FILL` (n tiles per block / raster group / tiles per filler of the Hopper backward
//! kernels), `LMHEAD_BWD_OVERLAP=0` / `1` (each chunk's `dW` GEMM after its `dh` GEMM on the
//! call's stream, or, the default, on a second stream beside it). A value that does not parse is
//! reported once on stderr and ignored.

use std::sync::OnceLock;

use lmhead_core::split::PlanOverride;

/// The environment variables the launch plans read (`Overrides`), in one list for whoever
/// records which were set (the bench's records).
pub const PLAN_OVERRIDE_VARS: [&str; 8] = [
    "LMHEAD_FWD_L2",
    "LMHEAD_FWD_SPLITS",
    "LMHEAD_FWD_RASTER",
    "LMHEAD_FWD_FILL",
    "LMHEAD_BWD_TILES",
    "LMHEAD_BWD_RASTER",
    "LMHEAD_BWD_FILL",
    "LMHEAD_BWD_OVERLAP",
];

/// The variables of [`PLAN_OVERRIDE_VARS`] that take `0` or `1` (the others a non-negative
/// integer, except `LMHEAD_FWD_L2`, which only `0` sets).
const FLAG_VARS: [&str; 1] = ["LMHEAD_BWD_OVERLAP"];

/// Every override; `Default` is "none".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Overrides {
    /// `LMHEAD_FWD_L2=0`: the forward's plain makespan plan.
    pub fwd_l2_off: bool,
    pub fwd: PlanOverride,
    pub bwd: PlanOverride,
    /// `LMHEAD_BWD_OVERLAP`: `Some(false)` runs each chunk's `dW` GEMM after its `dh` GEMM on
    /// the call's stream; `Some(true)` or unset (the default) on a second stream beside it.
    pub bwd_overlap: Option<bool>,
}

impl Overrides {
    /// The process's overrides (read on first use).
    pub(crate) fn get() -> &'static Overrides {
        static O: OnceLock<Overrides> = OnceLock::new();
        O.get_or_init(|| {
            let (o, bad) = Self::parse(|k| std::env::var(k).ok());
            for (k, v) in bad {
                let want = if FLAG_VARS.contains(&k) { "0 or 1" } else { "a non-negative integer" };
                eprintln!("lmhead: ignoring {k}={v:?} (expected {want})");
            }
            o
        })
    }

    /// The overrides from `lookup`, and the `(variable, value)` pairs that did not parse.
    pub(crate) fn parse(lookup: impl Fn(&str) -> Option<String>) -> (Overrides, Vec<(&'static str, String)>) {
        let mut bad = Vec::new();
        let mut num = |k: &'static str| -> Option<u32> {
            let v = lookup(k)?;
            v.trim().parse::<u32>().map_err(|_| bad.push((k, v))).ok()
        };
        let fwd =
            PlanOverride { splits: num("LMHEAD_FWD_SPLITS"), tiles: None, raster: num("LMHEAD_FWD_RASTER"), fill: num("LMHEAD_FWD_FILL") };
        let bwd =
            PlanOverride { splits: None, tiles: num("LMHEAD_BWD_TILES"), raster: num("LMHEAD_BWD_RASTER"), fill: num("LMHEAD_BWD_FILL") };
        let fwd_l2_off = lookup("LMHEAD_FWD_L2").is_some_and(|v| v.trim() == "0");
        let mut flag = |k: &'static str| {
            lookup(k).and_then(|v| match v.trim() {
                "1" => Some(true),
                "0" => Some(false),
                _ => {
                    bad.push((k, v));
                    None
                }
            })
        };
        let bwd_overlap = flag(FLAG_VARS[0]);
        (Overrides { fwd_l2_off, fwd, bwd, bwd_overlap }, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> (Overrides, Vec<(&'static str, String)>) {
        Overrides::parse(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn none_set_is_default() {
        assert_eq!(parse(&[]), (Overrides::default(), vec![]));
    }

    #[test]
    fn every_variable_lands_in_its_field() {
        let (o, bad) = parse(&[
            ("LMHEAD_FWD_L2", "0"),
            ("LMHEAD_FWD_SPLITS", "8"),
            ("LMHEAD_FWD_RASTER", " 16 "),
            ("LMHEAD_BWD_TILES", "3"),
            ("LMHEAD_BWD_RASTER", "0"),
            ("LMHEAD_FWD_FILL", "0"),
            ("LMHEAD_BWD_FILL", "2"),
            ("LMHEAD_BWD_OVERLAP", " 0"),
        ]);
        assert!(bad.is_empty());
        assert_eq!(o.bwd_overlap, Some(false));
        assert!(o.fwd_l2_off);
        assert_eq!(o.fwd, PlanOverride { splits: Some(8), tiles: None, raster: Some(16), fill: Some(0) });
        assert_eq!(o.bwd, PlanOverride { splits: None, tiles: Some(3), raster: Some(0), fill: Some(2) });
    }

    #[test]
    fn the_listed_variables_are_the_ones_read() {
        for var in PLAN_OVERRIDE_VARS {
            assert_ne!(parse(&[(var, "0")]).0, Overrides::default(), "{var} is listed but not read");
        }
        // And every variable read is listed.
        let asked = std::cell::RefCell::new(Vec::new());
        Overrides::parse(|k| {
            asked.borrow_mut().push(k.to_string());
            None
        });
        for k in asked.into_inner() {
            assert!(PLAN_OVERRIDE_VARS.contains(&k.as_str()), "{k} is read but not listed");
        }
    }

    #[test]
    fn bad_values_are_reported_and_ignored() {
        let (o, bad) =
            parse(&[("LMHEAD_FWD_SPLITS", "eight"), ("LMHEAD_BWD_TILES", "-1"), ("LMHEAD_FWD_L2", "1"), ("LMHEAD_BWD_OVERLAP", "yes")]);
        assert_eq!(o, Overrides::default());
        assert_eq!(
            bad,
            vec![
                ("LMHEAD_FWD_SPLITS", "eight".to_string()),
                ("LMHEAD_BWD_TILES", "-1".to_string()),
                ("LMHEAD_BWD_OVERLAP", "yes".to_string())
            ]
        );
    }
}
