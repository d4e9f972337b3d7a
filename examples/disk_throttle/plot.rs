//! The SVG plot of a run: compaction bandwidth and foreground p99 latency per slice, by phase.

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::args::Args;
use crate::phases::Phase;
use crate::report::{q, Row};
use crate::BoxError;

fn phase_color(p: Phase) -> RGBColor {
    match p {
        Phase::Idle => RGBColor(44, 160, 44),
        Phase::Cross => RGBColor(148, 103, 189),
        Phase::Unthrottled => RGBColor(214, 39, 40),
        Phase::Plain => RGBColor(255, 127, 14),
        Phase::IoThrottle => RGBColor(31, 119, 180),
        Phase::Target => RGBColor(23, 190, 207),
    }
}

pub(crate) fn plot_real(args: &Args, rows: &[Row]) -> Result<(), BoxError> {
    let root = SVGBackend::new(&args.plot, (1000, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(380);
    let x_max = args.rounds as f64 + 0.5;
    let bw_max = rows.iter().map(|r| r.bg_mb_s()).fold(1.0, f64::max) * 1.3;
    let p99_ms = |r: &Row| (q(&r.fg, 0.99).as_secs_f64() * 1e3).max(1e-3);
    let lat_max = rows.iter().map(p99_ms).fold(0.1, f64::max) * 2.0;
    let lat_min = rows
        .iter()
        .map(p99_ms)
        .fold(f64::MAX, f64::min)
        .min(lat_max)
        / 2.0;
    panel(
        &top,
        rows,
        Panel {
            caption: (
                format!(
                    "disk_throttle: compaction bandwidth by phase ({} KiB O_DIRECT writes)",
                    args.bg_kib
                ),
                20,
            ),
            x_max,
            y_desc: "compaction MB/s",
            label: |p| p.name().to_owned(),
            value: &|r| r.bg_mb_s(),
        },
        0.0..bw_max,
    )?;
    panel(
        &bottom,
        rows,
        Panel {
            caption: (
                "foreground 4 KiB read latency from arrival, p99 per slice (log scale)".to_owned(),
                18,
            ),
            x_max,
            y_desc: "ms",
            label: |p| format!("{} p99", p.name()),
            value: &p99_ms,
        },
        (lat_min..lat_max).log_scale(),
    )?;
    root.present()?;
    Ok(())
}

/// What one panel shows: a line per phase of `value` over the rounds.
struct Panel<'a> {
    /// The caption and its font size.
    caption: (String, u32),
    x_max: f64,
    y_desc: &'a str,
    /// A phase's name in the legend.
    label: fn(Phase) -> String,
    value: &'a dyn Fn(&Row) -> f64,
}

/// One panel of the plot on `area`, the y axis over `y` (linear or log).
fn panel<Y>(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    rows: &[Row],
    p: Panel<'_>,
    y: Y,
) -> Result<(), BoxError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(p.caption.0, ("sans-serif", p.caption.1))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..p.x_max, y)?;
    chart
        .configure_mesh()
        .x_desc("round (one slice of each phase per round)")
        .y_desc(p.y_desc)
        .draw()?;
    for phase in Phase::ALL {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.phase == phase)
            .map(|r| (r.round as f64, (p.value)(r)))
            .collect();
        let c = phase_color(phase);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label((p.label)(phase))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
