//! The command line of `lmhead-bench` (see the crate docs for what each option does).

/// The usage line printed on a bad command line.
pub const USAGE: &str = "usage: lmhead-bench [quick|peers|sweep|probe|entropy|tp|active|keep|exhaustive|dh-probe|config-probe] [--filter S] [--budget-s N] [--reps N] [--out FILE] [--fallback | --fixed | --versus-fixed] [--no-check] [--skip N] [--bwd-chunk N] [--dw-after-dh] [--check-labels] [--fixed-order] [--resume FILE]";

/// Command-line options.
#[derive(Clone, Debug)]
pub struct Args {
    pub suite: String,
    pub filter: Option<String>,
    pub budget_s: f64,
    pub reps: usize,
    pub out: String,
    pub fallback: bool,
    /// `--fixed`: no tuning, the rules' picks (`LMHEAD_AUTOTUNE=0`; on the H200 that is also
    /// the default).
    pub fixed: bool,
    /// `--versus-fixed`: every shape on a head that tunes (`LMHEAD_AUTOTUNE=1`: the rules' short
    /// list timed) and on one with the rules' picks untimed, in the same rounds (two records per
    /// shape: `auto` and `fixed`).
    pub versus_fixed: bool,
    pub check: bool,
    /// Skip the suite's first `skip` shapes (the sweep runs cheapest first: resume a budgeted run).
    pub skip: usize,
    /// The backward's vocab chunk width (`BwdOptions::chunk`); `None`: the library's default.
    pub bwd_chunk: Option<usize>,
    /// Time the forwards with the label check on.
    pub check_labels: bool,
    /// Each round times cuBLAS and the fused operations in an order of its own
    /// ([`crate::rounds::RoundOrders`]); `--fixed-order` turns it off (always cuBLAS,
    /// then each head's forward, entropy and step), as the records before 2026-12-01 were
    /// measured.
    pub balanced: bool,
    /// `exhaustive`: result files of earlier runs whose shapes are skipped.
    pub resume: Vec<String>,
    /// `--dw-after-dh`: the backward with `BwdOptions::dw_beside_dh` off (records carry
    /// `dw_after_dh`).
    pub dw_after_dh: bool,
}

pub fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        suite: "quick".into(),
        filter: None,
        budget_s: f64::INFINITY,
        reps: 10,
        out: "bench-results.jsonl".into(),
        fallback: false,
        fixed: false,
        versus_fixed: false,
        check: true,
        skip: 0,
        bwd_chunk: None,
        check_labels: false,
        balanced: true,
        resume: Vec::new(),
        dw_after_dh: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--filter" => a.filter = Some(it.next().ok_or("--filter needs a value")?),
            "--budget-s" => a.budget_s = it.next().ok_or("--budget-s needs a value")?.parse().map_err(|e| format!("--budget-s: {e}"))?,
            "--reps" => a.reps = it.next().ok_or("--reps needs a value")?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--out" => a.out = it.next().ok_or("--out needs a value")?,
            "--fallback" => a.fallback = true,
            "--fixed" => a.fixed = true,
            "--versus-fixed" => a.versus_fixed = true,
            "--no-check" => a.check = false,
            "--check-labels" => a.check_labels = true,
            "--fixed-order" => a.balanced = false,
            // The default rounds (once shuffled, now balanced); kept so that older commands still run.
            "--shuffle" => a.balanced = true,
            "--bwd-chunk" => {
                a.bwd_chunk = Some(it.next().ok_or("--bwd-chunk needs a value")?.parse().map_err(|e| format!("--bwd-chunk: {e}"))?)
            }
            "--resume" => a.resume.push(it.next().ok_or("--resume needs a file")?),
            "--dw-after-dh" => a.dw_after_dh = true,
            "--skip" => a.skip = it.next().ok_or("--skip needs a value")?.parse().map_err(|e| format!("--skip: {e}"))?,
            "-h" | "--help" => return Err(String::new()),
            s if !s.starts_with('-') => a.suite = s.to_string(),
            s => return Err(format!("unknown option {s}")),
        }
    }
    if [a.fallback, a.fixed, a.versus_fixed].iter().filter(|&&x| x).count() > 1 {
        return Err("--fallback, --fixed and --versus-fixed exclude each other".into());
    }
    Ok(a)
}

/// The launch-plan overrides ([`lmhead::testing::PLAN_OVERRIDE_VARS`]) that `lookup` finds set,
/// as a record's `plan_overrides`; `None` when the library chose every plan itself.
pub fn plan_overrides(lookup: impl Fn(&str) -> Option<String>) -> Option<serde_json::Value> {
    let set: serde_json::Map<String, serde_json::Value> = lmhead::testing::PLAN_OVERRIDE_VARS
        .iter()
        .filter_map(|&k| lookup(k).map(|v| (k.to_string(), serde_json::json!(v.trim()))))
        .collect();
    (!set.is_empty()).then_some(serde_json::Value::Object(set))
}

#[cfg(test)]
mod tests {
    use super::plan_overrides;

    #[test]
    fn plan_overrides_name_the_variables_set() {
        assert_eq!(plan_overrides(|_| None), None);
        let env = |k: &str| match k {
            "LMHEAD_FWD_SPLITS" => Some("12".to_string()),
            "LMHEAD_FWD_RASTER" => Some(" 11 ".to_string()),
            _ => None,
        };
        assert_eq!(plan_overrides(env), Some(serde_json::json!({"LMHEAD_FWD_SPLITS": "12", "LMHEAD_FWD_RASTER": "11"})));
    }
}
