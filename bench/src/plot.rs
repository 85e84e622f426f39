//! Bar charts as SVG. Plotters' SVG backend writes text as `<text>` elements and, without
//! its `ttf`/`ab_glyph` features, only estimates label widths, so no system font or
//! fontconfig is needed to produce a chart; the viewer renders the text.

use plotters::prelude::*;
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

const COLOURS: [RGBColor; 4] = [
    RGBColor(0x3b, 0x6e, 0xa8),
    RGBColor(0xd9, 0x7a, 0x2b),
    RGBColor(0x5a, 0x9e, 0x57),
    RGBColor(0x9b, 0x59, 0xb6),
];

/// Writes the panels side by side into one SVG file under a common title.
pub fn bar_chart(path: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let width = 360 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, 340)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let root = root
        .titled(title, ("sans-serif", 24))
        .map_err(|e| fail(&e))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel).map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let n = panel.bars.len().max(1);
    let top = panel
        .bars
        .iter()
        .map(|b| b.value)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let top = if top > 0.0 { top * 1.2 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(28)
        .y_label_area_size(52)
        .build_cartesian_2d((0..n).into_segmented(), 0f64..top)?;
    let labels: Vec<String> = panel.bars.iter().map(|b| b.label.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 14))
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc(panel.unit.as_str())
        .draw()?;
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, b)| {
        let mut r = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), b.value),
            ],
            COLOURS[i % COLOURS.len()].filled(),
        );
        r.set_margin(0, 0, 14, 14);
        r
    }))?;
    // The minimum over repetitions as a black tick inside the bar.
    chart.draw_series(panel.bars.iter().enumerate().filter_map(|(i, b)| {
        let low = b.low?;
        let mut r = Rectangle::new(
            [
                (SegmentValue::Exact(i), low),
                (SegmentValue::Exact(i + 1), low),
            ],
            BLACK.stroke_width(2),
        );
        r.set_margin(0, 0, 24, 24);
        Some(r)
    }))?;
    chart.draw_series(panel.bars.iter().enumerate().map(|(i, b)| {
        Text::new(
            format!("{:.2}", b.value),
            (SegmentValue::CenterOf(i), b.value),
            ("sans-serif", 15).into_font().color(&BLACK),
        )
    }))?;
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
        for s in ["musubi", "qemu", "time to hello", "20.00", "<rect"] {
            assert!(svg.contains(s), "{s} missing from the SVG");
        }
    }
}
