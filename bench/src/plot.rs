//! Charts as standalone SVG files, written by hand: a horizontal bar chart
//! ([`BarChart`]: one bar per contender, its value and its ratio to a baseline bar
//! written beside it) and a line chart ([`LineChart`]: one line per contender, a
//! rate against the backlog's size or the concurrency). Both have an axis with round
//! ticks, a title, a few lines under it, a legend and notes, drawn by the same
//! helpers.
//!
//! No plotting crate: a chart is a few dozen elements, and SVG cannot measure text
//! anyway, so the layout estimates text widths from their length ([`EM_PER_CHAR`])
//! and wraps long lines at spaces. A chart draws its own white background, so it reads the same
//! on GitHub's light and dark themes. [`BarChart::svg`] and [`LineChart::svg`] are pure
//! functions of the chart; the caller fills the chart from its measurements.

use std::fmt::Write as _;

/// The whole image's width in pixels.
const WIDTH: f64 = 920.0;
const MARGIN: f64 = 20.0;
/// An estimate of a character's average width, in ems, on the generous side: DejaVu
/// Sans, the widest of the fonts a viewer is likely to get, averages about 0.58 on
/// these labels (SVG cannot measure text).
const EM_PER_CHAR: f64 = 0.6;
const FONT_SIZE: f64 = 13.0;
const SMALL: f64 = 12.0;
const FONT: &str = "-apple-system, 'Segoe UI', Helvetica, Arial, sans-serif";
const BAR_HEIGHT: f64 = 22.0;
const BAR_GAP: f64 = 10.0;
const LINE: f64 = 18.0;
/// Text and lines: GitHub's colours for text, muted text and borders.
const TEXT: &str = "#1f2328";
const MUTED: &str = "#59636e";
const GRID: &str = "#d1d9e0";
/// How far a bar cut at the axis's end runs past it, so the cut shows.
const CUT_OVERSHOOT: f64 = 12.0;
/// The last note of a chart with a bar cut at the axis's end.
const CUT_NOTE: &str =
    "A bar with white strokes at the axis's end is cut there: its value is written beside it.";
/// A line chart's plot area: its height, and the room at either end of its x axis
/// that keeps the first and last points off the frame.
const PLOT_HEIGHT: f64 = 300.0;
const X_PAD: f64 = 24.0;
/// The x axis is logarithmic when its values span more than this factor.
const LOG_ABOVE: f64 = 10.0;
/// The line chart's clip path: lines to a point past the axis's end leave the plot
/// through its top.
const PLOT_AREA: &str = "idemq-plot-area";

/// A kind of bar, or a line, named in the legend.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    /// An SVG colour (`#rrggbb`).
    pub(crate) colour: &'static str,
}

/// One bar: a label on the left, a length proportional to `value`.
#[derive(Debug, Clone)]
pub(crate) struct Bar {
    pub(crate) label: String,
    pub(crate) value: f64,
    /// Index into [`BarChart::series`].
    pub(crate) series: usize,
}

/// What [`BarChart::svg`] draws, top to bottom.
#[derive(Debug, Clone, Default)]
pub(crate) struct BarChart {
    pub(crate) title: String,
    /// Lines under the title (what was measured, where, when).
    pub(crate) lines: Vec<String>,
    pub(crate) series: Vec<Series>,
    pub(crate) bars: Vec<Bar>,
    /// The unit written after each value (`msg/s`).
    pub(crate) unit: String,
    /// The bar every other's ratio is written against (an index into `bars`).
    pub(crate) baseline: Option<usize>,
    /// Where the axis ends; longer bars are cut there and say so. `None`: the
    /// longest bar fits.
    pub(crate) axis_max: Option<f64>,
    /// Under the axis: what its values are.
    pub(crate) axis_title: String,
    /// Lines at the bottom.
    pub(crate) notes: Vec<String>,
}

/// One line of a [`LineChart`]: a value at each of the chart's `xs`, or a gap.
#[derive(Debug, Clone)]
pub(crate) struct Line {
    pub(crate) series: Series,
    /// Its points' mark: a circle, square, diamond or triangle (0 to 3, and again).
    pub(crate) marker: usize,
    /// In the order of [`LineChart::xs`]; `None`: nothing to draw there (the line
    /// breaks).
    pub(crate) values: Vec<Option<f64>>,
}

/// What [`LineChart::svg`] draws, top to bottom: values (the y axis, from zero)
/// against measured points (the x axis, ticked at each of them; logarithmic when
/// they span more than [`LOG_ABOVE`] times).
#[derive(Debug, Clone, Default)]
pub(crate) struct LineChart {
    pub(crate) title: String,
    /// Lines under the title (what was measured, where, when).
    pub(crate) lines: Vec<String>,
    /// Where the values were measured, ascending and positive (on a logarithmic axis).
    pub(crate) xs: Vec<f64>,
    pub(crate) series: Vec<Line>,
    /// The values' unit, written over the y axis (`msg/s`).
    pub(crate) unit: String,
    /// Where the y axis ends; a point past it is drawn as an arrow on the axis's top
    /// edge, and a note gives its value. `None`: every point fits.
    pub(crate) axis_max: Option<f64>,
    /// Under the x axis: what its values are.
    pub(crate) axis_title: String,
    /// Lines at the bottom.
    pub(crate) notes: Vec<String>,
}

/// `text` with XML's special characters escaped, for element content and
/// double-quoted attributes alike.
pub(crate) fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// `value` rounded to a whole number, with thousands separated by commas (`12,345`).
pub(crate) fn thousands(value: f64) -> String {
    let rounded = value.round();
    let digits = format!("{:.0}", rounded.abs());
    let mut grouped = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    if rounded < 0.0 {
        grouped.insert(0, '-');
    }
    grouped
}

/// The step between ticks: 1, 2 or 5 times a power of ten, giving about five ticks
/// up to `max`.
fn tick_step(max: f64) -> f64 {
    let rough = max / 5.0;
    let power = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|&step| step >= rough).unwrap_or(rough)
}

/// An axis from zero for values up to `max`: where it ends (rounded up to a tick)
/// and the step between its ticks.
fn round_axis(max: f64) -> (f64, f64) {
    let max = if max > 0.0 { max } else { 1.0 };
    let step = tick_step(max);
    ((max / step).ceil() * step, step)
}

fn tick_label(value: f64, step: f64) -> String {
    if step >= 1.0 {
        thousands(value)
    } else {
        let decimals = (-step.log10().floor()) as usize;
        format!("{value:.decimals$}")
    }
}

fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * EM_PER_CHAR
}

/// `text` broken at spaces into lines of about `width` pixels at font size `size`
/// (a word longer than that gets a line of its own).
fn wrap(text: &str, width: f64, size: f64) -> Vec<String> {
    let most = (width / (size * EM_PER_CHAR)).floor().max(1.0) as usize;
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > most {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

/// Writes a chart's title and the lines under it (wrapped within an image `width`
/// wide) to `body`; returns the last line's baseline.
fn heading(body: &mut String, title: &str, lines: &[String], width: f64) -> f64 {
    let mut y = MARGIN + 16.0;
    let _ = writeln!(
        body,
        r#"<text x="{MARGIN}" y="{y:.1}" font-size="17" font-weight="600">{}</text>"#,
        escape(title)
    );
    y += 8.0;
    for line in lines.iter().flat_map(|line| wrap(line, width - 2.0 * MARGIN, FONT_SIZE)) {
        y += LINE;
        let _ = writeln!(body, r#"<text x="{MARGIN}" y="{y:.1}" fill="{MUTED}">{}</text>"#, escape(&line));
    }
    y
}

/// Writes a legend under `y`: for each series a swatch `swatch_width` wide (drawn
/// by `swatch(index, left, baseline, colour)`) and its name, in rows that wrap
/// within an image `width` wide. Returns the last row's baseline (`y` if there is
/// nothing to name).
fn legend<'a>(
    body: &mut String,
    series: impl IntoIterator<Item = &'a Series>,
    mut y: f64,
    width: f64,
    swatch_width: f64,
    swatch: impl Fn(usize, f64, f64, &str) -> String,
) -> f64 {
    let mut x = MARGIN;
    for (index, series) in series.into_iter().enumerate() {
        if index == 0 {
            y += LINE + 6.0;
        }
        let item = swatch_width + 5.0 + text_width(&series.name, FONT_SIZE);
        if x > MARGIN && x + item > width - MARGIN {
            (x, y) = (MARGIN, y + LINE + 2.0);
        }
        let _ = writeln!(
            body,
            r#"{}<text x="{:.1}" y="{y:.1}">{}</text>"#,
            swatch(index, x, y, series.colour),
            x + swatch_width + 5.0,
            escape(&series.name)
        );
        x += item + 24.0;
    }
    y
}

/// Writes an axis's title, centred on `x`, with its baseline at `y`.
fn axis_title(body: &mut String, x: f64, y: f64, title: &str) {
    let _ = writeln!(
        body,
        r#"<text x="{x:.1}" y="{y:.1}" text-anchor="middle" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
        escape(title)
    );
}

/// Writes the notes under `y`, wrapped within an image `width` wide; returns the
/// image's height.
fn footer<'a>(body: &mut String, notes: impl IntoIterator<Item = &'a String>, y: f64, width: f64) -> f64 {
    let mut y = y + 8.0;
    for note in notes.into_iter().flat_map(|note| wrap(note, width - 2.0 * MARGIN, SMALL)) {
        y += LINE;
        let _ = writeln!(
            body,
            r#"<text x="{MARGIN}" y="{y:.1}" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
            escape(&note)
        );
    }
    y + MARGIN
}

/// The standalone SVG document of a chart: its `body` on a white background.
fn document(title: &str, width: f64, height: f64, body: &str) -> String {
    let mut svg = String::new();
    let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" role="img" aria-label="{}">"#,
        escape(title)
    );
    let _ = writeln!(svg, "<title>{}</title>", escape(title));
    // White under everything: GitHub's dark theme shows an image's transparent
    // parts dark, which would hide dark text.
    let _ = writeln!(
        svg,
        r#"<rect width="100%" height="100%" fill="white" stroke="{GRID}" stroke-width="2" rx="6"/>"#
    );
    let _ = writeln!(svg, r#"<g font-family="{FONT}" font-size="{FONT_SIZE}" fill="{TEXT}">"#);
    svg.push_str(body);
    svg.push_str("</g>\n</svg>\n");
    svg
}

/// A line chart's mark at (`x`, `y`): a circle, square, diamond or triangle for a
/// `shape` of 0 to 3 (and again from 4), so that lines of close colours still
/// differ. With a `tip` (shown on hover) it is a measured point,
/// `class="point"`; without, a legend's swatch.
fn marker(shape: usize, x: f64, y: f64, colour: &str, tip: Option<&str>) -> String {
    let (name, geometry) = match shape % 4 {
        0 => ("circle", format!(r#"cx="{x:.1}" cy="{y:.1}" r="4.5""#)),
        1 => ("rect", format!(r#"x="{:.1}" y="{:.1}" width="8" height="8""#, x - 4.0, y - 4.0)),
        2 => ("path", format!(r#"d="M{x:.1} {:.1} l5.5 5.5 l-5.5 5.5 l-5.5 -5.5z""#, y - 5.5)),
        _ => ("path", format!(r#"d="M{x:.1} {:.1} l5.5 9.5 h-11z""#, y - 5.5)),
    };
    let paint = format!(r#"fill="{colour}" stroke="white" stroke-width="1.5""#);
    match tip {
        Some(tip) => {
            format!(r#"<{name} class="point" {geometry} {paint}><title>{}</title></{name}>"#, escape(tip))
        }
        None => format!("<{name} {geometry} {paint}/>"),
    }
}

impl BarChart {
    /// The value a full-width bar stands for: the axis's end, rounded up to a tick.
    fn scale(&self) -> (f64, f64) {
        let longest = self.bars.iter().map(|bar| bar.value).filter(|v| v.is_finite()).fold(0.0, f64::max);
        round_axis(self.axis_max.unwrap_or(longest))
    }

    /// What is written after a bar: its value, and its ratio to the baseline.
    fn value_label(&self, index: usize) -> String {
        let bar = &self.bars[index];
        let mut label = format!("{} {}", thousands(bar.value), self.unit);
        match self.baseline {
            Some(baseline) if baseline == index => label.push_str("  = baseline"),
            Some(baseline) if self.bars[baseline].value > 0.0 => {
                let _ = write!(label, "  ×{:.2}", bar.value / self.bars[baseline].value);
            }
            _ => {}
        }
        label
    }

    /// The chart as a standalone SVG document.
    pub(crate) fn svg(&self) -> String {
        let (max, step) = self.scale();
        let label_width = self.bars.iter().map(|bar| text_width(&bar.label, FONT_SIZE)).fold(0.0, f64::max);
        let value_width =
            (0..self.bars.len()).map(|i| text_width(&self.value_label(i), FONT_SIZE)).fold(0.0, f64::max);
        let left = MARGIN + label_width + 12.0;
        let plot = (WIDTH - left - MARGIN - CUT_OVERSHOOT - value_width - 8.0).max(120.0);
        let width = (left + plot + CUT_OVERSHOOT + value_width + 8.0 + MARGIN).ceil();

        let mut body = String::new();
        let y = heading(&mut body, &self.title, &self.lines, width);
        let y = legend(&mut body, &self.series, y, width, 12.0, |_, x, y, colour| {
            format!(r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" rx="2" fill="{colour}"/>"#, y - 10.5)
        });

        let top = y + 18.0;
        let bottom = top + self.bars.len() as f64 * (BAR_HEIGHT + BAR_GAP) - BAR_GAP;
        // Grid lines and tick labels, under the bars.
        let ticks = (max / step).round() as usize;
        for tick in 0..=ticks {
            let value = tick as f64 * step;
            let x = left + plot * value / max;
            let colour = if tick == 0 { MUTED } else { GRID };
            let _ = writeln!(
                body,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{colour}"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
                top - 6.0,
                bottom + 6.0,
                bottom + 22.0,
                tick_label(value, step)
            );
        }
        let mut cut_any = false;
        for (index, bar) in self.bars.iter().enumerate() {
            let y = top + index as f64 * (BAR_HEIGHT + BAR_GAP);
            let cut = bar.value > max;
            cut_any |= cut;
            let length = if cut { plot + CUT_OVERSHOOT } else { plot * bar.value.max(0.0) / max };
            let colour = self.series.get(bar.series).map_or(MUTED, |series| series.colour);
            let middle = y + BAR_HEIGHT / 2.0 + FONT_SIZE * 0.35;
            let _ = writeln!(
                body,
                r#"<text x="{:.1}" y="{middle:.1}" text-anchor="end">{}</text>"#,
                left - 10.0,
                escape(&bar.label)
            );
            let _ = writeln!(
                body,
                r#"<rect class="bar" x="{left:.1}" y="{y:.1}" width="{length:.3}" height="{BAR_HEIGHT}" fill="{colour}"><title>{}: {} {}</title></rect>"#,
                escape(&bar.label),
                thousands(bar.value),
                escape(&self.unit)
            );
            if cut {
                // Two white strokes across the bar where the axis ends: the bar goes on.
                let x = left + plot + CUT_OVERSHOOT / 2.0;
                let _ = writeln!(
                    body,
                    r#"<path class="cut" d="M{:.1} {:.1} l6 {:.1} M{:.1} {:.1} l6 {:.1}" stroke="white" stroke-width="2.5"/>"#,
                    x - 6.0,
                    y - 2.0,
                    BAR_HEIGHT + 4.0,
                    x - 1.0,
                    y - 2.0,
                    BAR_HEIGHT + 4.0
                );
            }
            let _ = writeln!(
                body,
                r#"<text x="{:.1}" y="{middle:.1}">{}</text>"#,
                left + length + 8.0,
                escape(&self.value_label(index))
            );
        }
        axis_title(&mut body, left + plot / 2.0, bottom + 42.0, &self.axis_title);
        let cut_note = cut_any.then(|| CUT_NOTE.to_owned());
        let height = footer(&mut body, cut_note.iter().chain(&self.notes), bottom + 42.0, width);
        document(&self.title, width, height, &body)
    }
}

impl LineChart {
    /// Whether the x axis is logarithmic: its values span more than [`LOG_ABOVE`]
    /// times.
    fn logarithmic(&self) -> bool {
        let (min, max) = self.x_range();
        min > 0.0 && max / min > LOG_ABOVE
    }

    fn x_range(&self) -> (f64, f64) {
        let finite = self.xs.iter().copied().filter(|x| x.is_finite());
        (finite.clone().fold(f64::INFINITY, f64::min), finite.fold(f64::NEG_INFINITY, f64::max))
    }

    /// Where `x` goes along the x axis: 0 at its start, 1 at its end. A linear axis
    /// starts at zero; a logarithmic one at the smallest x.
    fn x_fraction(&self, x: f64) -> f64 {
        let (min, max) = self.x_range();
        if self.logarithmic() {
            (x.ln() - min.ln()) / (max.ln() - min.ln())
        } else if max > 0.0 {
            x / max
        } else {
            0.5
        }
    }

    /// The largest value drawn.
    fn highest(&self) -> f64 {
        let values = self.series.iter().flat_map(|line| line.values.iter().flatten());
        values.copied().filter(|v| v.is_finite()).fold(0.0, f64::max)
    }

    /// The note on points past the y axis's end: each one's value. `None`: there are
    /// none.
    fn past_note(&self, max: f64) -> Option<String> {
        let lines: Vec<String> = self
            .series
            .iter()
            .filter_map(|line| {
                let past: Vec<String> = self
                    .xs
                    .iter()
                    .zip(&line.values)
                    .filter_map(|(&x, &value)| {
                        Some(format!("{} at {}", thousands(value.filter(|&v| v > max)?), thousands(x)))
                    })
                    .collect();
                (!past.is_empty()).then(|| format!("{} {}", line.series.name, past.join(", ")))
            })
            .collect();
        (!lines.is_empty()).then(|| {
            format!(
                "An arrow on the top edge is a point past the axis's end ({}): {}.",
                self.unit,
                lines.join("; ")
            )
        })
    }

    /// The chart as a standalone SVG document.
    pub(crate) fn svg(&self) -> String {
        let (max, step) = round_axis(self.axis_max.unwrap_or_else(|| self.highest()));
        let ticks = (max / step).round() as usize;
        let tick_width = (0..=ticks)
            .map(|tick| text_width(&tick_label(tick as f64 * step, step), SMALL))
            .fold(text_width(&self.unit, SMALL), f64::max);
        let left = MARGIN + tick_width + 10.0;
        let right = WIDTH - MARGIN - 8.0;

        let mut body = String::new();
        let y = heading(&mut body, &self.title, &self.lines, WIDTH);
        let series = self.series.iter().map(|line| &line.series);
        let y = legend(&mut body, series, y, WIDTH, 24.0, |index, x, y, colour| {
            let middle = y - 4.5;
            format!(
                r#"<line x1="{x:.1}" y1="{middle:.1}" x2="{:.1}" y2="{middle:.1}" stroke="{colour}" stroke-width="2"/>{}"#,
                x + 24.0,
                marker(self.series[index].marker, x + 12.0, middle, colour, None)
            )
        });

        let top = y + 40.0;
        let bottom = top + PLOT_HEIGHT;
        let px = |x: f64| left + X_PAD + self.x_fraction(x) * (right - left - 2.0 * X_PAD);
        let py = |value: f64| bottom - PLOT_HEIGHT * value.max(0.0) / max;
        let _ = writeln!(
            body,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
            left - 6.0,
            top - 16.0,
            escape(&self.unit)
        );
        // Grid: a line at each round value, and one at each measured x (and zero,
        // on a linear axis), with their labels.
        for tick in 0..=ticks {
            let value = tick as f64 * step;
            let colour = if tick == 0 { MUTED } else { GRID };
            let y = py(value);
            let _ = writeln!(
                body,
                r#"<line x1="{left:.1}" y1="{y:.1}" x2="{right:.1}" y2="{y:.1}" stroke="{colour}"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
                left - 6.0,
                y + 4.0,
                tick_label(value, step)
            );
        }
        let zero = (!self.logarithmic()).then_some(0.0);
        for x in zero.into_iter().chain(self.xs.iter().copied()) {
            let at = px(x);
            let _ = writeln!(
                body,
                r#"<line class="x-tick" x1="{at:.1}" y1="{top:.1}" x2="{at:.1}" y2="{:.1}" stroke="{GRID}"/><text x="{at:.1}" y="{:.1}" text-anchor="middle" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
                bottom + 5.0,
                bottom + 20.0,
                thousands(x)
            );
        }
        let _ = writeln!(
            body,
            r#"<defs><clipPath id="{PLOT_AREA}"><rect x="{left:.1}" y="{:.1}" width="{:.1}" height="{:.1}"/></clipPath></defs>"#,
            top - 4.0,
            right - left,
            PLOT_HEIGHT + 8.0
        );
        let past_at: Vec<usize> = (0..self.xs.len())
            .map(|at| {
                let past = |line: &&Line| line.values.get(at).copied().flatten().is_some_and(|v| v > max);
                self.series.iter().filter(past).count()
            })
            .collect();
        let mut past_drawn = vec![0; self.xs.len()];
        for line in &self.series {
            let colour = line.series.colour;
            let points: Vec<Option<(f64, f64)>> = self
                .xs
                .iter()
                .zip(&line.values)
                .map(|(&x, value)| value.filter(|v| v.is_finite()).map(|v| (x, v)))
                .collect();
            // A polyline through each run of measured points; a gap breaks the line.
            for run in points.split(Option::is_none).filter(|run| run.len() > 1) {
                let coordinates: Vec<String> =
                    run.iter().flatten().map(|&(x, v)| format!("{:.1},{:.1}", px(x), py(v))).collect();
                let _ = writeln!(
                    body,
                    r#"<polyline class="line" points="{}" fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round" clip-path="url(#{PLOT_AREA})"/>"#,
                    coordinates.join(" ")
                );
            }
            for (at, &(x, value)) in points.iter().enumerate().filter_map(|(at, p)| Some((at, p.as_ref()?))) {
                let tip =
                    format!("{}: {} {} at {}", line.series.name, thousands(value), self.unit, thousands(x));
                if value > max {
                    // Side by side where several lines are past the end at this x.
                    let shift = (past_drawn[at] as f64 - (past_at[at] as f64 - 1.0) / 2.0) * 12.0;
                    past_drawn[at] += 1;
                    let (x, y) = (px(x) + shift, top);
                    let _ = writeln!(
                        body,
                        r#"<path class="past" d="M{x:.1} {:.1} v-12 m-4.5 4.5 l4.5 -4.5 l4.5 4.5" fill="none" stroke="{colour}" stroke-width="2"/>{}"#,
                        y - 2.0,
                        marker(line.marker, x, y, colour, Some(&tip))
                    );
                } else {
                    let _ = writeln!(body, "{}", marker(line.marker, px(x), py(value), colour, Some(&tip)));
                }
            }
        }
        let scale = if self.logarithmic() { " (logarithmic scale)" } else { "" };
        axis_title(&mut body, (left + right) / 2.0, bottom + 40.0, &format!("{}{scale}", self.axis_title));
        let past = self.past_note(max);
        let height = footer(&mut body, past.iter().chain(&self.notes), bottom + 40.0, WIDTH);
        document(&self.title, WIDTH, height, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(values: &[f64]) -> BarChart {
        BarChart {
            title: "Throughput".into(),
            lines: vec!["one round".into()],
            series: vec![
                Series { name: "hand-written".into(), colour: "#bf8700" },
                Series { name: "idemq".into(), colour: "#0969da" },
            ],
            bars: values
                .iter()
                .enumerate()
                .map(|(i, &value)| Bar { label: format!("bar {i}"), value, series: i % 2 })
                .collect(),
            unit: "msg/s".into(),
            baseline: Some(0),
            axis_max: None,
            axis_title: "deliveries per second".into(),
            notes: vec!["a note".into()],
        }
    }

    /// The value of `name="…"` in `tag`.
    fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
        let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        Some(&tag[start..start + tag[start..].find('"')?])
    }

    /// The opening tags of the elements named `name` with `class="bar"`-style filters.
    fn tags<'a>(svg: &'a str, name: &str, class: &str) -> Vec<&'a str> {
        svg.match_indices(&format!("<{name} "))
            .map(|(start, _)| &svg[start..start + svg[start..].find('>').unwrap()])
            .filter(|tag| attribute(tag, "class") == Some(class))
            .collect()
    }

    /// Checks the document the way an XML parser would, as far as this writer's
    /// output goes: every element closed in order, attributes quoted, every `&` an
    /// entity, no `<` or `>` outside markup. Returns the elements' names.
    fn well_formed(svg: &str) -> Vec<String> {
        let body = svg.strip_prefix(r#"<?xml version="1.0" encoding="UTF-8"?>"#).expect("an XML declaration");
        let (mut open, mut seen) = (Vec::<String>::new(), Vec::new());
        let mut rest = body;
        while let Some(start) = rest.find('<') {
            let text = &rest[..start];
            assert!(!text.contains('>'), "a '>' in text: {text}");
            for (i, _) in text.match_indices('&') {
                let entity = &text[i..text[i..].find(';').map_or(text.len(), |end| i + end + 1)];
                assert!(
                    ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].contains(&entity),
                    "a bare '&' in text: {text}"
                );
            }
            let end = start + rest[start..].find('>').expect("an unclosed tag");
            let tag = &rest[start + 1..end];
            assert!(!tag.contains('<'), "a '<' inside a tag: {tag}");
            assert_eq!(tag.matches('"').count() % 2, 0, "an unbalanced quote: {tag}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop().as_deref(), Some(name), "</{name}> closes something else");
            } else {
                let name = tag.split([' ', '/']).next().unwrap().to_owned();
                assert!(!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric()), "{tag}");
                if !tag.ends_with('/') {
                    open.push(name.clone());
                }
                seen.push(name);
            }
            rest = &rest[end + 1..];
        }
        assert!(rest.trim().is_empty(), "text after the root: {rest}");
        assert!(open.is_empty(), "left open: {open:?}");
        assert_eq!(seen.first().map(String::as_str), Some("svg"), "svg is the root");
        seen
    }

    #[test]
    fn the_output_is_well_formed_with_a_white_background_and_every_part() {
        let svg = chart(&[2_000.0, 5_300.0, 1_950.0]).svg();
        let elements = well_formed(&svg);
        assert!(svg.contains(r#"xmlns="http://www.w3.org/2000/svg""#));
        assert!(svg.contains(r#"<rect width="100%" height="100%" fill="white""#), "{svg}");
        assert_eq!(elements.iter().filter(|name| *name == "rect").count(), 1 + 2 + 3, "{elements:?}");
        for part in ["Throughput", "one round", "hand-written", "idemq", "deliveries per second", "a note"] {
            assert!(svg.contains(&format!(">{part}<")), "{part} missing");
        }
        assert!(svg.contains(">5,300 msg/s  ×2.65<"), "{svg}");
        assert!(svg.contains(">2,000 msg/s  = baseline<"), "{svg}");
        // Ticks at round numbers, from zero past the longest bar.
        for tick in ["0", "2,000", "4,000", "6,000"] {
            assert!(svg.contains(&format!(r#"font-size="{SMALL}">{tick}</text>"#)), "tick {tick}");
        }
    }

    #[test]
    fn bar_lengths_are_proportional_to_the_values() {
        let values = [2_014.0, 79_708.0, 5_307.0, 1.0, 0.0];
        let svg = chart(&values).svg();
        let bars = tags(&svg, "rect", "bar");
        assert_eq!(bars.len(), values.len());
        let widths: Vec<f64> =
            bars.iter().map(|tag| attribute(tag, "width").unwrap().parse().unwrap()).collect();
        let per_unit = widths[1] / values[1];
        for (width, value) in widths.iter().zip(values) {
            assert!((width - value * per_unit).abs() < 0.01, "{width} for {value} ({per_unit} per unit)");
        }
        // The axis ends on a tick at or past the longest bar, inside the image.
        let image: f64 = attribute(&svg, "width").unwrap().parse().unwrap();
        assert!(widths[1] <= image - 2.0 * MARGIN, "{} in {image}", widths[1]);
        assert!(tags(&svg, "path", "cut").is_empty());
        assert!(!svg.contains(&escape(CUT_NOTE)));
    }

    #[test]
    fn bars_past_the_axis_are_cut_and_say_so() {
        let mut chart = chart(&[2_000.0, 80_000.0, 9_000.0]);
        chart.axis_max = Some(9_000.0);
        let svg = chart.svg();
        well_formed(&svg);
        let widths: Vec<f64> = tags(&svg, "rect", "bar")
            .iter()
            .map(|tag| attribute(tag, "width").unwrap().parse().unwrap())
            .collect();
        // The axis ends at 10,000 (the tick past 9,000); the others stay proportional.
        assert!((widths[2] / widths[0] - 4.5).abs() < 1e-6, "{widths:?}");
        assert!((widths[1] - widths[2] / 0.9 - CUT_OVERSHOOT).abs() < 0.01, "{widths:?}");
        assert_eq!(tags(&svg, "path", "cut").len(), 1);
        assert!(svg.contains(">80,000 msg/s  ×40.00<"), "{svg}");
        assert!(svg.contains(&format!(">{}<", escape(CUT_NOTE))), "{svg}");
    }

    #[test]
    fn labels_are_escaped_everywhere() {
        let mut chart = chart(&[1.0, 2.0]);
        chart.title = r#"a <b> & "c" 'd'"#.into();
        chart.bars[1].label = "x<y>&z".into();
        chart.series[0].name = "R&D".into();
        chart.unit = "<u>".into();
        chart.notes = vec!["</svg>".into()];
        let svg = chart.svg();
        well_formed(&svg);
        assert!(svg.contains("a &lt;b&gt; &amp; &quot;c&quot; &apos;d&apos;"), "{svg}");
        assert!(svg.contains("x&lt;y&gt;&amp;z") && svg.contains("R&amp;D") && svg.contains("&lt;/svg&gt;"));
        for raw in ["<b>", "x<y", "R&D", "<u>"] {
            assert!(!svg.contains(raw), "{raw} unescaped");
        }
        assert_eq!(svg.matches("</svg>").count(), 1);
    }

    #[test]
    fn long_lines_wrap_at_spaces_within_the_image() {
        let words = "payments over accounts, every tenth twice;".repeat(8).replace(';', "; ");
        let words = words.trim();
        let lines = wrap(words, 400.0, FONT_SIZE);
        assert!(lines.len() > 1, "{lines:?}");
        assert_eq!(lines.join(" "), words);
        assert!(lines.iter().all(|line| text_width(line, FONT_SIZE) <= 400.0), "{lines:?}");
        assert_eq!(wrap("", 400.0, FONT_SIZE), [""]);
        assert_eq!(wrap("unbreakable", 10.0, FONT_SIZE), ["unbreakable"]);

        let mut chart = chart(&[1.0, 2.0]);
        chart.lines = vec![words.to_owned()];
        let svg = chart.svg();
        well_formed(&svg);
        let image: f64 = attribute(&svg, "width").unwrap().parse().unwrap();
        // The lines under the title are the only muted text in the default size.
        let subtitle = svg.lines().filter(|line| line.contains(&format!(r#"fill="{MUTED}">"#))).count();
        assert_eq!(subtitle, wrap(words, image - 2.0 * MARGIN, FONT_SIZE).len());
        assert!(subtitle > 1);
    }

    #[test]
    fn numbers_and_ticks_are_round() {
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.5), "1,000");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
        assert_eq!(thousands(-4_321.0), "-4,321");
        assert_eq!(tick_step(79_708.0), 20_000.0);
        assert_eq!(tick_step(5_307.0), 2_000.0);
        assert!((tick_step(1.0) - 0.2).abs() < 1e-12);
        assert_eq!(tick_label(0.4, 0.2), "0.4");
        // An empty chart, or one of zeros, still draws an axis.
        assert!(well_formed(&chart(&[]).svg()).contains(&"line".to_owned()));
        well_formed(&chart(&[0.0, 0.0]).svg());
    }

    fn line_chart(xs: &[f64], values: &[&[Option<f64>]]) -> LineChart {
        let colours = ["#bf8700", "#0969da", "#1a7f37", "#8250df"];
        LineChart {
            title: "Rate against backlog".into(),
            lines: vec!["one run per point".into()],
            xs: xs.to_vec(),
            series: values
                .iter()
                .enumerate()
                .map(|(i, values)| Line {
                    series: Series { name: format!("line {i}"), colour: colours[i % colours.len()] },
                    marker: i,
                    values: values.to_vec(),
                })
                .collect(),
            unit: "msg/s".into(),
            axis_max: None,
            axis_title: "payments queued".into(),
            notes: vec!["a note".into()],
        }
    }

    /// The (x, y) pairs of each polyline, in order.
    fn polylines(svg: &str) -> Vec<Vec<(f64, f64)>> {
        tags(svg, "polyline", "line")
            .iter()
            .map(|tag| {
                let points = attribute(tag, "points").unwrap().split(' ');
                let pair = |point: &str| {
                    let (x, y) = point.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                };
                points.map(pair).collect()
            })
            .collect()
    }

    /// The centres of the first series' points (circles), in order.
    fn circles(svg: &str) -> Vec<(f64, f64)> {
        let number = |tag: &str, name: &str| attribute(tag, name).unwrap().parse::<f64>().unwrap();
        tags(svg, "circle", "point").iter().map(|tag| (number(tag, "cx"), number(tag, "cy"))).collect()
    }

    #[test]
    fn a_line_chart_is_well_formed_and_names_every_series() {
        let chart = line_chart(
            &[5_000.0, 20_000.0, 80_000.0],
            &[&[Some(2_000.0), Some(2_100.0), Some(1_900.0)], &[Some(4_000.0), Some(5_300.0), Some(5_100.0)]],
        );
        let svg = chart.svg();
        let elements = well_formed(&svg);
        assert!(svg.contains(r#"<rect width="100%" height="100%" fill="white""#), "{svg}");
        assert_eq!(elements.iter().filter(|name| *name == "polyline").count(), 2, "{elements:?}");
        for part in ["Rate against backlog", "one run per point", "line 0", "line 1", "msg/s", "a note"] {
            assert!(svg.contains(&format!(">{part}<")), "{part} missing");
        }
        assert!(svg.contains(">payments queued (logarithmic scale)<"), "{svg}");
        // The x ticks are the measured values; the y ticks round, from zero past the highest.
        for tick in ["5,000", "20,000", "80,000", "0", "2,000", "4,000", "6,000"] {
            assert!(svg.contains(&format!(r#"font-size="{SMALL}">{tick}</text>"#)), "tick {tick}");
        }
        assert!(svg.contains("<title>line 1: 5,300 msg/s at 20,000</title>"), "{svg}");
        assert_eq!(tags(&svg, "circle", "point").len() + tags(&svg, "rect", "point").len(), 6);
        assert!(tags(&svg, "path", "past").is_empty());
    }

    #[test]
    fn points_are_placed_monotonically_on_both_axes() {
        let values = [Some(1_000.0), Some(2_000.0), Some(4_000.0)];
        // A logarithmic x axis: values four times apart are equally spaced.
        let svg = line_chart(&[5_000.0, 20_000.0, 80_000.0], &[&values]).svg();
        let points = circles(&svg);
        assert_eq!(polylines(&svg), std::slice::from_ref(&points));
        let (gap_1, gap_2) = (points[1].0 - points[0].0, points[2].0 - points[1].0);
        assert!(gap_1 > 100.0 && (gap_1 - gap_2).abs() < 0.2, "{points:?}");
        // The y axis from zero (its line is the lowest): heights proportional to the values.
        let zero = tags(&svg, "line", "x-tick").iter().map(|t| attribute(t, "y2").unwrap()).next().unwrap();
        let zero: f64 = zero.parse::<f64>().unwrap() - 5.0;
        let heights: Vec<f64> = points.iter().map(|&(_, y)| zero - y).collect();
        assert!((heights[1] / heights[0] - 2.0).abs() < 0.01, "{heights:?}");
        assert!((heights[2] / heights[0] - 4.0).abs() < 0.01, "{heights:?}");

        // Within ten times, a linear x axis from zero, which gets a tick too.
        let svg = line_chart(&[300.0, 600.0, 1_200.0], &[&values]).svg();
        assert!(!svg.contains("logarithmic"));
        let ticks: Vec<f64> = tags(&svg, "line", "x-tick")
            .iter()
            .map(|t| attribute(t, "x1").unwrap().parse().unwrap())
            .collect();
        assert_eq!(ticks.len(), 4, "zero and the three measured values");
        assert!(ticks.windows(2).all(|pair| pair[0] < pair[1]), "{ticks:?}");
        let from_zero: Vec<f64> = ticks.iter().map(|x| x - ticks[0]).collect();
        assert!((from_zero[3] / from_zero[1] - 4.0).abs() < 0.01, "{from_zero:?}");
        assert_eq!(circles(&svg).iter().map(|&(x, _)| x).collect::<Vec<_>>(), ticks[1..]);
    }

    #[test]
    fn missing_points_break_the_line_and_points_past_the_axis_say_so() {
        let mut chart = line_chart(
            &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            &[
                &[Some(10.0), Some(12.0), None, Some(11.0), Some(9.0), None],
                &[Some(90.0), Some(95.0), None, None, Some(13.0), Some(99.0)],
                &[Some(15.0), Some(95.0), None, None, None, None],
            ],
        );
        chart.axis_max = Some(20.0);
        let svg = chart.svg();
        well_formed(&svg);
        let lines = polylines(&svg);
        assert_eq!(lines.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 2, 2, 2], "{lines:?}");
        assert_eq!(circles(&svg).len(), 4, "the first series' measured points");
        let past = tags(&svg, "path", "past");
        assert_eq!(past.len(), 4, "90, 95, 99 and the other 95 are past 20");
        // The two past the end at x = 2 stand side by side, 12 pixels apart.
        let start =
            |tag: &str| attribute(tag, "d").unwrap()[1..].split(' ').next().unwrap().parse::<f64>().unwrap();
        assert!((start(past[3]) - start(past[1]) - 12.0).abs() < 0.01, "{past:?}");
        assert!(svg.contains(&format!(r#"clip-path="url(#{PLOT_AREA})""#)));
        assert!(
            svg.contains(">An arrow on the top edge is a point past the axis&apos;s end (msg/s): line 1 90 at 1, 95 at 2, 99 at 32; line 2 95 at 2.<"),
            "{svg}"
        );
    }

    #[test]
    fn a_line_chart_escapes_its_text_and_survives_empty_input() {
        let mut chart = line_chart(&[1.0, 2.0], &[&[Some(1.0), Some(2.0)]]);
        chart.title = "a <b> & c".into();
        chart.series[0].series.name = "R&D <lanes>".into();
        chart.unit = "<u>".into();
        chart.axis_title = "x & y".into();
        chart.notes = vec!["</svg>".into()];
        let svg = chart.svg();
        well_formed(&svg);
        assert!(svg.contains("a &lt;b&gt; &amp; c") && svg.contains("R&amp;D &lt;lanes&gt;"), "{svg}");
        assert!(svg.contains("x &amp; y") && svg.contains("&lt;u&gt;") && svg.contains("&lt;/svg&gt;"));
        for raw in ["<b>", "R&D", "<u>", "<lanes>"] {
            assert!(!svg.contains(raw), "{raw} unescaped");
        }
        assert_eq!(svg.matches("</svg>").count(), 1);
        // Nothing measured, or nothing that passed: an axis and no line.
        well_formed(&line_chart(&[], &[]).svg());
        let svg = line_chart(&[4.0], &[&[None]]).svg();
        well_formed(&svg);
        assert!(polylines(&svg).is_empty() && circles(&svg).is_empty());
    }
}
