//! A horizontal bar chart as a standalone SVG file, written by hand: one bar per
//! contender, its value and its ratio to a baseline bar written beside it, an axis
//! with round ticks, a title, a few lines under it, a legend and notes.
//!
//! No plotting crate: the chart is a few dozen elements, and SVG cannot measure text
//! anyway, so the layout estimates text widths from their length ([`EM_PER_CHAR`])
//! and wraps long lines at spaces. The chart draws its own white background, so it reads the same
//! on GitHub's light and dark themes. [`BarChart::svg`] is a pure function of the
//! chart; the caller fills the chart from its measurements.

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

/// A kind of bar, named in the legend.
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

impl BarChart {
    /// The value a full-width bar stands for: the axis's end, rounded up to a tick.
    fn scale(&self) -> (f64, f64) {
        let longest = self.bars.iter().map(|bar| bar.value).filter(|v| v.is_finite()).fold(0.0, f64::max);
        let max = self.axis_max.unwrap_or(longest);
        let max = if max > 0.0 { max } else { 1.0 };
        let step = tick_step(max);
        ((max / step).ceil() * step, step)
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
        let text_room = width - 2.0 * MARGIN;

        let mut body = String::new();
        let mut y = MARGIN + 16.0;
        let _ = writeln!(
            body,
            r#"<text x="{MARGIN}" y="{y:.1}" font-size="17" font-weight="600">{}</text>"#,
            escape(&self.title)
        );
        y += 8.0;
        for line in self.lines.iter().flat_map(|line| wrap(line, text_room, FONT_SIZE)) {
            y += LINE;
            let _ =
                writeln!(body, r#"<text x="{MARGIN}" y="{y:.1}" fill="{MUTED}">{}</text>"#, escape(&line));
        }
        if !self.series.is_empty() {
            y += LINE + 6.0;
            let mut x = MARGIN;
            for series in &self.series {
                let item = 17.0 + text_width(&series.name, FONT_SIZE);
                if x > MARGIN && x + item > width - MARGIN {
                    (x, y) = (MARGIN, y + LINE + 2.0);
                }
                let _ = writeln!(
                    body,
                    r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" rx="2" fill="{}"/><text x="{:.1}" y="{y:.1}">{}</text>"#,
                    y - 10.5,
                    series.colour,
                    x + 17.0,
                    escape(&series.name)
                );
                x += item + 24.0;
            }
        }

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
        y = bottom + 42.0;
        let _ = writeln!(
            body,
            r#"<text x="{:.1}" y="{y:.1}" text-anchor="middle" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
            left + plot / 2.0,
            escape(&self.axis_title)
        );
        y += 8.0;
        let cut_note = cut_any.then(|| CUT_NOTE.to_owned());
        for note in cut_note.iter().chain(&self.notes).flat_map(|note| wrap(note, text_room, SMALL)) {
            y += LINE;
            let _ = writeln!(
                body,
                r#"<text x="{MARGIN}" y="{y:.1}" fill="{MUTED}" font-size="{SMALL}">{}</text>"#,
                escape(&note)
            );
        }
        let height = y + MARGIN;

        let mut svg = String::new();
        let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" role="img" aria-label="{}">"#,
            escape(&self.title)
        );
        let _ = writeln!(svg, "<title>{}</title>", escape(&self.title));
        // White under everything: GitHub's dark theme shows an image's transparent
        // parts dark, which would hide dark text.
        let _ = writeln!(
            svg,
            r#"<rect width="100%" height="100%" fill="white" stroke="{GRID}" stroke-width="2" rx="6"/>"#
        );
        let _ = writeln!(svg, r#"<g font-family="{FONT}" font-size="{FONT_SIZE}" fill="{TEXT}">"#);
        svg.push_str(&body);
        svg.push_str("</g>\n</svg>\n");
        svg
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
}
