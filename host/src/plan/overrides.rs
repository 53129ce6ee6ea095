//! Measurement overrides of the launch plans: the forward without the L2 model, a forced split
//! count, raster group or fill of the forward, forced tiles per block, raster group or fill of the
//! Hopper backward kernels. The library never reads them by itself: a bench or a test sets them
//! for its process (`lmhead::testing::set_plan_overrides`, with the `testing` feature), usually
//! from the environment variables of [`PLAN_OVERRIDE_VARS`] ([`PlanOverrides::from_env`]), so
//! that `run-gpu.sh plans` and `fills` can force plans on the bundled binaries. Without the
//! `testing` feature there are none.

use lmhead_core::split::PlanOverride;

/// Every override; `Default` is "none".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOverrides {
    /// The forward's plain makespan plan (`LMHEAD_FWD_L2=0`): no L2 model, no measured splits.
    pub fwd_l2_off: bool,
    /// The forward's split count, raster group and fill (`LMHEAD_FWD_SPLITS`, `_RASTER`, `_FILL`).
    pub fwd: PlanOverride,
    /// The Hopper backward kernels' n tiles per block, raster group and fill (`LMHEAD_BWD_TILES`,
    /// `_RASTER`, `_FILL`).
    pub bwd: PlanOverride,
}

/// The overrides in force.
#[cfg(feature = "testing")]
pub(crate) fn current() -> PlanOverrides {
    *SET.read().unwrap_or_else(|e| e.into_inner())
}

/// The overrides in force: none without the `testing` feature.
#[cfg(not(feature = "testing"))]
pub(crate) fn current() -> PlanOverrides {
    PlanOverrides::default()
}

#[cfg(feature = "testing")]
static SET: std::sync::RwLock<PlanOverrides> =
    std::sync::RwLock::new(PlanOverrides { fwd_l2_off: false, fwd: PlanOverride::NONE, bwd: PlanOverride::NONE });

/// Make `o` the overrides of every later launch plan in this process.
#[cfg(feature = "testing")]
pub fn set_plan_overrides(o: PlanOverrides) {
    *SET.write().unwrap_or_else(|e| e.into_inner()) = o;
}

/// The environment variables [`PlanOverrides::from_env`] reads, in one list for whoever records
/// which were set (the bench's records).
#[cfg(feature = "testing")]
pub const PLAN_OVERRIDE_VARS: [&str; 7] = [
    "LMHEAD_FWD_L2",
    "LMHEAD_FWD_SPLITS",
    "LMHEAD_FWD_RASTER",
    "LMHEAD_FWD_FILL",
    "LMHEAD_BWD_TILES",
    "LMHEAD_BWD_RASTER",
    "LMHEAD_BWD_FILL",
];

#[cfg(feature = "testing")]
impl PlanOverrides {
    /// From the environment (a value that does not parse is reported on stderr and ignored):
    /// `LMHEAD_FWD_L2=0`, `LMHEAD_FWD_SPLITS` / `LMHEAD_FWD_RASTER` / `LMHEAD_FWD_FILL` (forward
    /// split count / raster group of token tiles / tiles per filler, 0 = none),
    /// `LMHEAD_BWD_TILES` / `LMHEAD_BWD_RASTER` / `LMHEAD_BWD_FILL` (n tiles per block / raster
    /// group / tiles per filler of the Hopper backward kernels).
    pub fn from_env() -> PlanOverrides {
        let (o, bad) = Self::parse(|k| std::env::var(k).ok());
        for (k, v) in bad {
            eprintln!("lmhead: ignoring {k}={v:?} (expected a non-negative integer)");
        }
        o
    }

    /// The overrides from `lookup`, and the `(variable, value)` pairs that did not parse.
    pub fn parse(lookup: impl Fn(&str) -> Option<String>) -> (PlanOverrides, Vec<(&'static str, String)>) {
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
        (PlanOverrides { fwd_l2_off, fwd, bwd }, bad)
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> (PlanOverrides, Vec<(&'static str, String)>) {
        PlanOverrides::parse(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn none_set_is_default() {
        assert_eq!(parse(&[]), (PlanOverrides::default(), vec![]));
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
        ]);
        assert!(bad.is_empty());
        assert!(o.fwd_l2_off);
        assert_eq!(o.fwd, PlanOverride { splits: Some(8), tiles: None, raster: Some(16), fill: Some(0) });
        assert_eq!(o.bwd, PlanOverride { splits: None, tiles: Some(3), raster: Some(0), fill: Some(2) });
    }

    #[test]
    fn the_listed_variables_are_the_ones_read() {
        for var in PLAN_OVERRIDE_VARS {
            assert_ne!(parse(&[(var, "0")]).0, PlanOverrides::default(), "{var} is listed but not read");
        }
        // And every variable read is listed.
        let asked = std::cell::RefCell::new(Vec::new());
        PlanOverrides::parse(|k| {
            asked.borrow_mut().push(k.to_string());
            None
        });
        for k in asked.into_inner() {
            assert!(PLAN_OVERRIDE_VARS.contains(&k.as_str()), "{k} is read but not listed");
        }
    }

    #[test]
    fn bad_values_are_reported_and_ignored() {
        let (o, bad) = parse(&[("LMHEAD_FWD_SPLITS", "eight"), ("LMHEAD_BWD_TILES", "-1"), ("LMHEAD_FWD_L2", "1")]);
        assert_eq!(o, PlanOverrides::default());
        assert_eq!(bad, vec![("LMHEAD_FWD_SPLITS", "eight".to_string()), ("LMHEAD_BWD_TILES", "-1".to_string())]);
    }
}
