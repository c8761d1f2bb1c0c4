//! The sweep chart: output throughput and TTFT P95 against concurrency, as a hand-written SVG.
//! Owns axes, scales and series drawing; one or more servers per chart.

use std::fmt::Write;

use crate::report::BenchReport;

const PANEL_W: f64 = 440.0;
const PANEL_H: f64 = 320.0;
const MARGIN_L: f64 = 70.0;
const MARGIN_R: f64 = 20.0;
const MARGIN_T: f64 = 50.0;
const MARGIN_B: f64 = 50.0;
const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// One server's sweep: its name and its runs, one per concurrency level.
pub struct SweepSeries<'a> {
    pub name: &'a str,
    pub runs: &'a [BenchReport],
}

/// Two panels side by side: output tokens/s and TTFT P95 (ms), each against concurrency.
pub fn sweep_svg(series: &[SweepSeries<'_>]) -> String {
    let points = |get: fn(&BenchReport) -> Option<f64>| -> Vec<(&str, Vec<(f64, f64)>)> {
        series
            .iter()
            .map(|s| {
                let pts = s
                    .runs
                    .iter()
                    .filter_map(|r| Some((r.concurrency? as f64, get(r)?)))
                    .filter(|(_, y)| y.is_finite())
                    .collect();
                (s.name, pts)
            })
            .collect()
    };
    let throughput = points(|r| Some(r.output_token_throughput));
    let ttft = points(|r| r.ttft_ms.as_ref().map(|s| s.p95));
    let mut svg = String::new();
    let width = PANEL_W * 2.0;
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{PANEL_H}" viewBox="0 0 {width} {PANEL_H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{width}" height="{PANEL_H}" fill="white"/>"#);
    panel(&mut svg, 0.0, "Output throughput", "tokens/s", &throughput);
    panel(&mut svg, PANEL_W, "TTFT P95", "ms", &ttft);
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, left: f64, title: &str, unit: &str, series: &[(&str, Vec<(f64, f64)>)]) {
    let (x0, x1) = (left + MARGIN_L, left + PANEL_W - MARGIN_R);
    let (y0, y1) = (PANEL_H - MARGIN_B, MARGIN_T);
    let mut levels: Vec<f64> = series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)).collect();
    levels.sort_by(f64::total_cmp);
    levels.dedup();
    let y_max = nice_ceiling(
        series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
            .fold(0.0, f64::max),
    );
    let (lo, hi) = (
        levels.first().copied().unwrap_or(1.0),
        levels.last().copied().unwrap_or(1.0),
    );
    let log = lo > 0.0 && hi / lo >= 8.0;
    let scale_x = |x: f64| -> f64 {
        let (a, b, v) = if log {
            (lo.log2(), hi.log2(), x.log2())
        } else {
            (lo.min(0.0), hi, x)
        };
        if b > a {
            x0 + (v - a) / (b - a) * (x1 - x0)
        } else {
            (x0 + x1) / 2.0
        }
    };
    let scale_y = |y: f64| y0 - y / y_max * (y0 - y1);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14" font-weight="bold">{} ({})</text>"#,
        (x0 + x1) / 2.0,
        escape(title),
        escape(unit)
    );
    let _ = writeln!(svg, r##"<path d="M{x0},{y1} V{y0} H{x1}" fill="none" stroke="#333"/>"##);
    for i in 0..=5 {
        let y = y_max * f64::from(i) / 5.0;
        let py = scale_y(y);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            py + 4.0,
            tick_label(y)
        );
    }
    for x in &levels {
        let px = scale_x(*x);
        let _ = writeln!(
            svg,
            r##"<line x1="{px:.1}" y1="{y0}" x2="{px:.1}" y2="{}" stroke="#333"/><text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
            y0 + 5.0,
            y0 + 18.0,
            tick_label(*x)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">concurrency{}</text>"#,
        (x0 + x1) / 2.0,
        PANEL_H - 12.0,
        if log { " (log scale)" } else { "" }
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", scale_x(*x), scale_y(*y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (x, y) in pts {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"><title>{}: concurrency {}, {} {}</title></circle>"#,
                scale_x(*x),
                scale_y(*y),
                escape(name),
                tick_label(*x),
                tick_label(*y),
                escape(unit)
            );
        }
        let ly = 38.0 + 14.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{}" y="{}" width="12" height="3" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            x0 + 8.0,
            ly - 4.0,
            x0 + 24.0,
            ly,
            escape(name)
        );
    }
}

/// The smallest of 1, 2, 5 times a power of ten at or above `v` (1 for empty charts).
fn nice_ceiling(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * power)
}

fn tick_label(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e9 {
        format!("{}", v as i64)
    } else if v.abs() >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(3.2), 5.0);
        assert_eq!(nice_ceiling(1234.0), 2000.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
