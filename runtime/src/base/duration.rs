//! Durations as idemq writes them for people — in messages, log fields and `--help`
//! alike: `1d`, `7d 12m 40s`, `30s`, `250ms`. The same units the settings are written
//! in (`--retention 30d`), so what is printed can be pasted back as a setting.
//!
//! humantime's `format_duration` writes `1day`, `7days 12m 40s` and a year as
//! 365.25 days; `Debug` writes `1.5s` or `604800s`. Neither is used for people.

use std::fmt;
use std::time::Duration;

/// `duration` written as people write it (see the module docs): whole units from
/// days down to nanoseconds, largest first, zero units left out; `0s` for zero.
///
/// ```text
/// 86_400 s    → 1d
/// 648_760 s   → 7d 12m 40s
/// 1.25 s      → 1s 250ms
/// ```
pub fn human(duration: Duration) -> Human {
    Human(duration)
}

/// See [`human`]; `Display` only.
#[derive(Clone, Copy)]
pub struct Human(Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u128); 7] = [
            ("d", 86_400_000_000_000),
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
            ("ms", 1_000_000),
            ("us", 1_000),
            ("ns", 1),
        ];
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        let mut parts = Vec::with_capacity(4);
        let mut nanos = self.0.as_nanos();
        for (unit, size) in UNITS {
            let n = nanos / size;
            nanos %= size;
            if n > 0 {
                parts.push(format!("{n}{unit}"));
            }
        }
        f.write_str(&parts.join(" "))
    }
}

impl fmt::Debug for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(duration: Duration) -> String {
        human(duration).to_string()
    }

    #[test]
    fn whole_units_largest_first_zero_units_left_out() {
        assert_eq!(shown(Duration::from_secs(86_400)), "1d");
        assert_eq!(shown(Duration::from_secs(7 * 86_400 + 12 * 60 + 40)), "7d 12m 40s");
        assert_eq!(shown(Duration::from_secs(30)), "30s");
        assert_eq!(shown(Duration::from_millis(250)), "250ms");
        assert_eq!(shown(Duration::from_secs(25 * 60)), "25m");
        assert_eq!(shown(Duration::from_secs(3_600 + 30 * 60)), "1h 30m");
        assert_eq!(shown(Duration::from_millis(1_250)), "1s 250ms");
        assert_eq!(
            shown(Duration::from_secs(400 * 86_400)),
            "400d",
            "no years: a year is no whole number of days"
        );
    }

    #[test]
    fn zero_and_less_than_a_millisecond() {
        assert_eq!(shown(Duration::ZERO), "0s");
        assert_eq!(shown(Duration::from_micros(1_500)), "1ms 500us");
        assert_eq!(shown(Duration::from_nanos(7)), "7ns");
    }

    #[test]
    fn what_is_printed_parses_back_to_the_same_duration() {
        for duration in [
            Duration::from_secs(30 * 86_400),
            Duration::from_secs(7 * 86_400 + 12 * 60 + 40),
            Duration::from_millis(90_250),
            Duration::from_nanos(1_000_001),
        ] {
            let text = shown(duration);
            assert_eq!(humantime::parse_duration(&text).expect(&text), duration, "{text}");
        }
    }
}
