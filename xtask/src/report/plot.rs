//! The PNG plots of `bench-report` (`plotters` with `ab_glyph` text): time over GEMM time per
//! shape, and the autotuner's latency reduction per shape.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::markdown::distinct;
use super::*;

/// The font family name every text element of the plots uses.
const FONT: &str = "sans-serif";

/// Where to look for a TTF when `LMHEAD_PLOT_FONT` is not set or not readable.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a font with plotters once per process; returns whether text can be drawn.
pub fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let env = std::env::var("LMHEAD_PLOT_FONT").ok().filter(|p| !p.is_empty());
        for path in env.iter().map(String::as_str).chain(FONT_PATHS.iter().copied()) {
            let Ok(bytes) = std::fs::read(path) else {
                if env.as_deref() == Some(path) {
                    eprintln!("xtask: LMHEAD_PLOT_FONT={path} cannot be read; trying the usual font paths");
                }
                continue;
            };
            // plotters keeps `&'static` font data: leak this one buffer for the process lifetime.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                return true;
            }
            eprintln!("xtask: {path} is not a usable TrueType font");
        }
        eprintln!("xtask: no TrueType font found (set LMHEAD_PLOT_FONT=/path/to/font.ttf): plots are drawn without text");
        false
    })
}

/// One plotted series: a legend name, a colour and a y value per x position (`None`: no point).
struct Series {
    name: &'static str,
    color: RGBColor,
    ys: Vec<Option<f64>>,
}

/// Series colours (the usual blue, orange and green of plotting libraries).
const C_FWD: RGBColor = RGBColor(31, 119, 180);
const C_FWD_ENT: RGBColor = RGBColor(255, 127, 14);
const C_FWD_BWD: RGBColor = RGBColor(44, 160, 44);

/// Above this many shapes the x axis shows shape indices instead of names.
const MAX_NAMED_SHAPES: usize = 48;

/// Draws a per-shape chart into a PNG: one marker per value, lines between neighbouring values
/// of a series, a horizontal reference line at `reference`, and (with `text`) a caption, axis
/// labels and a legend. `labels` names the x positions.
fn draw_chart(
    path: &Path,
    caption: &str,
    y_desc: &str,
    labels: &[String],
    series: &[Series],
    reference: (f64, &str),
    text: bool,
) -> Result<(), String> {
    let n = labels.len().max(1);
    let named = labels.len() <= MAX_NAMED_SHAPES;
    // Room below the plot for the rotated shape names (about 7.5 px per character at 14 px).
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let x_area = if !text {
        0
    } else if named {
        (20.0 + 7.5 * longest as f64) as u32
    } else {
        40
    };
    let width = (160 + 36 * n as u32).clamp(900, 2400);
    let height = 560 + x_area;

    // Y range: every value and the reference line, with some headroom.
    let values = series.iter().flat_map(|s| s.ys.iter().flatten().copied()).chain([reference.0]);
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| (lo.min(y), hi.max(y)));
    // Extra headroom on top keeps the legend (upper right) clear of the points.
    let span = (hi - lo).max(0.1);
    let y_lo = if lo >= 0.0 { 0.0 } else { lo - 0.08 * span };
    let y_hi = hi + if text { 0.3 * (hi - y_lo).max(span) } else { 0.08 * span };

    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16).margin_right(24);
    if text {
        builder.caption(caption, (FONT, 22)).x_label_area_size(x_area).y_label_area_size(70);
    }
    // Categorical x axis: shape i sits at the centre of segment i (plotters' integer ranges
    // include their end). A lone shape gets an empty segment either side, since plotters cannot
    // lay out a range of one value.
    let (x_first, x_last) = if labels.len() <= 1 { (-1, 1) } else { (0, labels.len() as i32 - 1) };
    let mut chart = builder.build_cartesian_2d((x_first..x_last).into_segmented(), y_lo..y_hi).map_err(|e| err(&e))?;

    // Tick labels on x: the shape index when there are too many names; the names themselves are
    // drawn below (plotters mis-anchors rotated tick labels, so they are placed by hand).
    let label_of = |v: &SegmentValue<i32>| -> String {
        match v {
            SegmentValue::CenterOf(i) if !named && *i >= 0 => (i + 1).to_string(),
            _ => String::new(),
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235)).disable_x_mesh();
    if text {
        mesh.x_labels(if named { labels.len() } else { 24 })
            .x_label_formatter(&label_of)
            .y_desc(y_desc)
            .x_desc(if named { "" } else { "shape (# in the report tables)" })
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15));
    } else {
        // No font: keep the grid and axes but make every label transparent, which plotters
        // skips before it looks for a font.
        mesh.x_labels(1).y_labels(10).label_style((FONT, 14).into_font().color(&TRANSPARENT));
    }
    mesh.draw().map_err(|e| err(&e))?;
    if text && named {
        // Shape names read downwards from just below the x axis, centred on their position.
        let style = (FONT, 14).into_font().transform(FontTransform::Rotate90).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        for (i, label) in labels.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(SegmentValue::CenterOf(i as i32), y_lo));
            root.draw(&Text::new(label.as_str(), (x, y + 10), style.clone())).map_err(|e| err(&e))?;
        }
    }

    // The reference line across the whole width.
    let (y_ref, ref_name) = reference;
    let ref_line = LineSeries::new([(SegmentValue::Exact(x_first), y_ref), (SegmentValue::Last, y_ref)], BLACK.stroke_width(1));
    let drawn = chart.draw_series(ref_line).map_err(|e| err(&e))?;
    if text {
        drawn.label(ref_name).legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    }

    for s in series {
        let color = s.color;
        let pts: Vec<(SegmentValue<i32>, f64)> =
            s.ys.iter().enumerate().filter_map(|(i, y)| y.map(|y| (SegmentValue::CenterOf(i as i32), y))).collect();
        // Lines only between neighbouring shapes that both have a value.
        for w in s.ys.windows(2).enumerate() {
            if let (i, [Some(a), Some(b)]) = w {
                let seg = [(SegmentValue::CenterOf(i as i32), *a), (SegmentValue::CenterOf(i as i32 + 1), *b)];
                chart.draw_series(LineSeries::new(seg, color.stroke_width(2))).map_err(|e| err(&e))?;
            }
        }
        let drawn = chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
        if text {
            drawn.label(s.name).legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The x label of a record in a multi-group plot: its name, with the suite when there are
/// several suites and a `[fixed]` / `[fallback]` tag for the runs that were not autotuned.
fn plot_label(r: &Record, many_suites: bool) -> String {
    let mut l = if many_suites { format!("{}: {}", r.suite, r.name()) } else { r.name() };
    if r.tuning != Tuning::Auto {
        l.push_str(&format!(" [{}]", r.tuning.as_str()));
    }
    l
}

/// `ratio.png`: time / GEMM time per shape, for every kept record (table order).
pub fn plot_ratio(path: &Path, records: &[Record], text: bool) -> Result<(), String> {
    let rows: Vec<Record> = groups(records).into_iter().flat_map(|g| g.rows).collect();
    let many_suites = distinct(rows.iter().map(|r| r.suite.as_str())).contains(", ");
    let labels: Vec<String> = rows.iter().map(|r| plot_label(r, many_suites)).collect();
    let ratio =
        |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<Option<f64>> { rows.iter().map(|r| f(&r.row).map(|ms| ms / r.row.gemm.p50)).collect() };
    let series = [
        Series { name: "fwd", color: C_FWD, ys: ratio(&|r| Some(r.fwd.p50)) },
        Series { name: "fwd+entropy", color: C_FWD_ENT, ys: ratio(&|r| Some(r.fwd_ent.p50)) },
        Series { name: "fwd+bwd / 4 (per GEMM-equivalent)", color: C_FWD_BWD, ys: ratio(&|r| r.fwd_bwd.as_ref().map(|t| t.p50 / 4.0)) },
    ];
    let gpu = distinct(rows.iter().map(|r| r.gpu.as_str()));
    draw_chart(
        path,
        &format!("LM head time / cuBLAS bf16 GEMM time, p50 ({gpu})"),
        "time / GEMM time",
        &labels,
        &series,
        (1.0, "cuBLAS GEMM = 1"),
        text,
    )
}

/// `autotune.png`: latency reduction of the autotuned run against the fixed configs, per pair.
pub fn plot_autotune(path: &Path, pairs: &[Pair], text: bool) -> Result<(), String> {
    let many_suites = distinct(pairs.iter().map(|p| p.suite.as_str())).contains(", ");
    let labels: Vec<String> = pairs.iter().map(|p| plot_label(&p.auto, many_suites)).collect();
    let op = |k: usize| -> Vec<Option<f64>> { pairs.iter().map(|p| p.reductions()[k]).collect() };
    let series = [
        Series { name: "fwd", color: C_FWD, ys: op(0) },
        Series { name: "fwd+entropy", color: C_FWD_ENT, ys: op(1) },
        Series { name: "fwd+bwd", color: C_FWD_BWD, ys: op(2) },
    ];
    draw_chart(
        path,
        "Autotuned vs fixed configurations: latency reduction",
        "(fixed - auto) / fixed, %",
        &labels,
        &series,
        (0.0, "no change"),
        text,
    )
}
