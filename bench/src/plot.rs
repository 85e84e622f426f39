//! Charts as SVG: horizontal bars with their values beside them, and lines. Plotters' SVG backend writes text as `<text>` elements and, without
//! its `ttf`/`ab_glyph` features, only estimates label widths, so no system font or
//! fontconfig is needed to produce a chart; the viewer renders the text.

use plotters::coord::ranged1d::SegmentedCoord;
use plotters::coord::types::RangedCoordusize;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// The bar rows' axis.
type SegmentedRanged = SegmentedCoord<RangedCoordusize>;
use std::path::Path;

/// One bar: the median of a metric for one configuration, with its minimum marked.
#[derive(Debug, Clone)]
pub struct Bar {
    pub label: String,
    pub value: f64,
    pub low: Option<f64>,
}

/// One chart of a metric across configurations.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub unit: String,
    pub bars: Vec<Bar>,
}

/// One line of a [`Lines`] chart: a named series of (x, y) points, drawn in x order.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart: how a metric changes along a numeric axis (speedup against node count, a
/// cumulative distribution against latency).
#[derive(Clone)]
pub struct Lines {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// A logarithmic x axis, for values spread over orders of magnitude.
    pub log_x: bool,
    pub series: Vec<Series>,
    /// Where the legend goes: a corner the lines leave empty. At the top, the y axis is
    /// stretched to leave it room above the lines.
    pub legend: SeriesLabelPosition,
}

/// One part of a chart file, drawn under the one before it.
#[derive(Clone)]
pub enum Drawing {
    Bars(Panel),
    Lines(Lines),
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(0x3b, 0x6e, 0xa8),
    RGBColor(0xd9, 0x7a, 0x2b),
    RGBColor(0x5a, 0x9e, 0x57),
    RGBColor(0x9b, 0x59, 0xb6),
    RGBColor(0xc0, 0x39, 0x2b),
    RGBColor(0x7f, 0x7f, 0x7f),
];

/// The chart's width in pixels; every part spans it.
const WIDTH: u32 = 760;
/// Pixels per bar row, label and value included.
const ROW: u32 = 30;
const FONT: u32 = 14;
/// Plotters without a font library only estimates text widths; this is a little wider than
/// sans-serif at [`FONT`] px averages, so labels are given room rather than clipped.
const CHAR_PX: u32 = 8;

/// Writes the bar panels one under another into one SVG file under a common title.
pub fn bar_chart(path: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    let drawings: Vec<Drawing> = panels.iter().cloned().map(Drawing::Bars).collect();
    chart(path, title, &drawings)
}

fn height_of(d: &Drawing) -> u32 {
    match d {
        Drawing::Bars(p) => 80 + ROW * p.bars.len().max(1) as u32,
        Drawing::Lines(_) => 380,
    }
}

/// Writes `drawings` one under another into one SVG file under a common title.
pub fn chart(path: &Path, title: &str, drawings: &[Drawing]) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let heights: Vec<u32> = drawings.iter().map(height_of).collect();
    let height = 50 + heights.iter().sum::<u32>();
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut rest = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| fail(&e))?;
    for (d, h) in drawings.iter().zip(&heights) {
        let (area, below) = rest.split_vertically(*h);
        match d {
            Drawing::Bars(p) => draw_bars(&area, p).map_err(|e| fail(&e))?,
            Drawing::Lines(l) => draw_lines(&area, l).map_err(|e| fail(&e))?,
        }
        rest = below;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// The value as printed beside its bar: enough digits to tell bars apart, no more.
fn value_text(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A tick of a line chart's x axis: whole numbers (node counts, powers of ten) plainly.
fn axis_text(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{v:.0}")
    } else {
        value_text(v)
    }
}

/// Horizontal bars, one row each: the label on the left where it has room, the value just
/// past the bar's end. Values over more than two orders of magnitude get a log axis, so
/// the small ones are not flat against it.
fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let n = panel.bars.len().max(1);
    let finite = || panel.bars.iter().map(|b| b.value).filter(|v| v.is_finite());
    let top = finite().fold(0.0, f64::max);
    let bottom = finite().fold(f64::INFINITY, f64::min);
    let log = bottom > 0.0 && top / bottom > 100.0;
    let longest = panel
        .bars
        .iter()
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(4) as u32;
    let label_px = (longest * CHAR_PX + 12).clamp(60, WIDTH / 2);
    let caption = if log {
        format!("{} ({}, log scale)", panel.title, panel.unit)
    } else {
        format!("{} ({})", panel.title, panel.unit)
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(caption, ("sans-serif", 17))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(30)
        .y_label_area_size(label_px);
    let rows = (0..n - 1).into_segmented();
    if log {
        // Room past the longest bar for its value: a factor, on a log axis.
        let (lo, hi) = (bottom / 2.0, top * 8.0);
        let mut chart = builder.build_cartesian_2d((lo..hi).log_scale(), rows)?;
        fill_bars(&mut chart, panel, lo)
    } else {
        // Room past the longest bar for its value.
        let top = if top > 0.0 { top * 1.25 } else { 1.0 };
        let mut chart = builder.build_cartesian_2d(0f64..top, rows)?;
        fill_bars(&mut chart, panel, 0.0)
    }
}

/// The mesh, bars from `base`, minimum ticks and values of [`draw_bars`].
fn fill_bars<'a, DB, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, SegmentedRanged>>,
    panel: &Panel,
    base: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let n = panel.bars.len().max(1);
    // Row i from the top is bar i.
    let row = |i: usize| n - 1 - i;
    let labels: Vec<String> = panel.bars.iter().map(|b| b.label.clone()).collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .label_style(("sans-serif", FONT))
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(r) => labels.get(n - 1 - *r).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_labels(6)
        .x_label_formatter(&|v| value_text(*v))
        .draw()?;
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, b)| {
        let mut r = Rectangle::new(
            [
                (base, SegmentValue::Exact(row(i))),
                (b.value.max(base), SegmentValue::Exact(row(i) + 1)),
            ],
            COLOURS[i % COLOURS.len()].filled(),
        );
        r.set_margin(5, 5, 0, 0);
        r
    }))?;
    // The minimum over repetitions as a black tick across the bar.
    chart.draw_series(panel.bars.iter().enumerate().filter_map(|(i, b)| {
        let low = b.low?.max(base);
        let mut r = Rectangle::new(
            [
                (low, SegmentValue::Exact(row(i))),
                (low, SegmentValue::Exact(row(i) + 1)),
            ],
            BLACK.stroke_width(2),
        );
        r.set_margin(2, 2, 0, 0);
        Some(r)
    }))?;
    let beside = ("sans-serif", FONT)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, b)| {
        EmptyElement::at((b.value.max(base), SegmentValue::CenterOf(row(i))))
            + Text::new(
                match b.low {
                    Some(l) => format!("{} (min {})", value_text(b.value), value_text(l)),
                    None => value_text(b.value),
                },
                (6, 0),
                beside.clone(),
            )
    }))?;
    Ok(())
}

/// Lines with a point at each value and a legend naming them.
fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    l: &Lines,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let all = || l.series.iter().flat_map(|s| s.points.iter());
    let fold = |f: fn(f64, f64) -> f64, init: f64, pick: fn(&(f64, f64)) -> f64| {
        all().map(pick).filter(|v| v.is_finite()).fold(init, f)
    };
    let (x_lo, x_hi) = (
        fold(f64::min, f64::INFINITY, |p| p.0),
        fold(f64::max, f64::NEG_INFINITY, |p| p.0),
    );
    let y_hi = fold(f64::max, 0.0, |p| p.1);
    let (x_lo, x_hi) = if x_lo.is_finite() && x_hi > x_lo {
        (x_lo, x_hi)
    } else {
        (1.0, 2.0)
    };
    let at_top = matches!(
        l.legend,
        SeriesLabelPosition::UpperLeft
            | SeriesLabelPosition::UpperMiddle
            | SeriesLabelPosition::UpperRight
    );
    let y_hi = if y_hi <= 0.0 {
        1.0
    } else if at_top {
        y_hi * 1.6
    } else {
        y_hi * 1.1
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&l.title, ("sans-serif", 17))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(44)
        .y_label_area_size(60);
    if l.log_x {
        let mut chart =
            builder.build_cartesian_2d((x_lo * 0.8..x_hi * 1.25).log_scale(), 0f64..y_hi)?;
        chart
            .configure_mesh()
            .label_style(("sans-serif", FONT))
            .x_desc(l.x_desc.as_str())
            .y_desc(l.y_desc.as_str())
            .x_label_formatter(&|v| axis_text(*v))
            .draw()?;
        series_of(&mut chart, l)?;
    } else {
        let pad = (x_hi - x_lo) * 0.05;
        let mut chart = builder.build_cartesian_2d(x_lo - pad..x_hi + pad, 0f64..y_hi)?;
        chart
            .configure_mesh()
            .label_style(("sans-serif", FONT))
            .x_desc(l.x_desc.as_str())
            .y_desc(l.y_desc.as_str())
            .x_labels(((x_hi - x_lo) as usize + 1).clamp(2, 12))
            .x_label_formatter(&|v| axis_text(*v))
            .draw()?;
        series_of(&mut chart, l)?;
    }
    Ok(())
}

fn series_of<'a, DB, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    l: &Lines,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
{
    for (i, s) in l.series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut pts = s.points.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(l.legend.clone())
        .label_font(("sans-serif", FONT))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_labels_and_bars() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.svg");
        bar_chart(
            &p,
            "boot",
            &[
                Panel {
                    title: "time to hello".into(),
                    unit: "ms".into(),
                    bars: vec![
                        Bar {
                            label: "musubi".into(),
                            value: 10.0,
                            low: Some(9.0),
                        },
                        Bar {
                            label: "qemu".into(),
                            value: 20.0,
                            low: None,
                        },
                    ],
                },
                Panel {
                    title: "overhead".into(),
                    unit: "MiB".into(),
                    bars: vec![Bar {
                        label: "musubi".into(),
                        value: 0.0,
                        low: None,
                    }],
                },
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        for s in [
            "musubi",
            "qemu",
            "time to hello",
            "20.00",
            "(min 9.00)",
            "<rect",
        ] {
            assert!(svg.contains(s), "{s} missing from the SVG");
        }
    }

    #[test]
    fn lines_and_wide_bars_are_drawn_with_legend_and_log_axes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l.svg");
        chart(
            &p,
            "nodes",
            &[
                Drawing::Lines(Lines {
                    title: "speedup".into(),
                    x_desc: "nodes".into(),
                    y_desc: "x".into(),
                    log_x: false,
                    legend: SeriesLabelPosition::UpperLeft,
                    series: vec![Series {
                        name: "vmp/tso".into(),
                        points: vec![(2.0, 1.8), (1.0, 1.0)],
                    }],
                }),
                Drawing::Bars(Panel {
                    title: "V/P".into(),
                    unit: "x".into(),
                    bars: vec![
                        Bar {
                            label: "fib".into(),
                            value: 0.9,
                            low: None,
                        },
                        Bar {
                            label: "getpid".into(),
                            value: 2700.0,
                            low: None,
                        },
                    ],
                }),
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        for s in ["vmp/tso", "nodes", "log scale", "2700", "0.90", "<polyline"] {
            assert!(svg.contains(s), "{s} missing from the SVG");
        }
    }
}
