//! Line charts as SVG files for `launcher sweep` (throughput and memory per rank against
//! ranks, one line per ZeRO stage), drawn with plotters' SVG backend: text is written as SVG
//! text, so no font or image library is needed to build or run it.

use anyhow::Context;
use plotters::prelude::*;
use std::path::Path;

/// One line: its label, a color index, solid or dashed, and its (x, y) points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: usize,
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

/// Draw `series` (x = ranks) into an SVG file at `path`. Series without points are listed
/// in the legend as "(no run finished)".
pub fn lines(path: &Path, title: &str, y_desc: &str, series: &[Series]) -> anyhow::Result<()> {
    draw(path, title, y_desc, series)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("cannot draw {}", path.display()))
}

fn draw(path: &Path, title: &str, y_desc: &str, series: &[Series]) -> Result<(), Box<dyn std::error::Error>> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_min, x_max) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let (x_min, x_max) = if x_min.is_finite() { (x_min, x_max) } else { (1.0, 2.0) };
    let y_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0f64, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.15 } else { 1.0 };
    let x_pad = ((x_max - x_min) * 0.05).max(0.25);

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d((x_min - x_pad)..(x_max + x_pad), 0.0..y_max)?;
    let ranks: Vec<f64> = {
        let mut r: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
        r.sort_by(f64::total_cmp);
        r.dedup();
        r
    };
    chart
        .configure_mesh()
        .x_desc("ranks")
        .y_desc(y_desc)
        .x_labels(ranks.len().max(2) * 2)
        .x_label_formatter(&|x| {
            if x.fract().abs() < 1e-9 && ranks.contains(x) {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .draw()?;
    for s in series {
        let color = Palette99::pick(s.color).to_rgba();
        let style = color.stroke_width(2);
        let label = if s.points.is_empty() { format!("{} (no run finished)", s.label) } else { s.label.clone() };
        let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 24, y)], style);
        if s.dashed {
            chart.draw_series(DashedLineSeries::new(s.points.clone(), 8, 5, style))?.label(label).legend(legend);
            chart.draw_series(s.points.iter().map(|&p| Cross::new(p, 5, style)))?;
        } else {
            chart.draw_series(LineSeries::new(s.points.clone(), style))?.label(label).legend(legend);
            chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_svg_with_one_line_per_series_and_a_legend() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.svg");
        let series = vec![
            Series {
                label: "stage 1".into(),
                color: 0,
                dashed: false,
                points: vec![(1.0, 100.0), (2.0, 90.0), (3.0, 85.0)],
            },
            Series { label: "stage 2 predicted".into(), color: 1, dashed: true, points: vec![(1.0, 10.0), (3.0, 5.0)] },
            Series { label: "stage 3".into(), color: 2, dashed: false, points: vec![] },
        ];
        lines(&path, "tokens/s per CPU rank", "tokens/s per rank", &series).expect("draw");
        let svg = std::fs::read_to_string(&path).expect("svg");
        assert!(svg.starts_with("<svg") || svg.contains("<svg"), "{svg}");
        for text in ["stage 1", "stage 2 predicted", "stage 3 (no run finished)", "tokens/s per CPU rank", "ranks"] {
            assert!(svg.contains(text), "`{text}` missing");
        }
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
    }
}
