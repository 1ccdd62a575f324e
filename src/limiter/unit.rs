//! The time units of the reference config format and of Envoy's `RateLimitUnit` enum.

use std::fmt;

/// A unit of the reference format. The discriminants are the proto enum values, so converting
/// to the wire is a cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

impl Unit {
    const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// The unit's length. Month is 30 days and year 365 days, as in the reference server.
    pub const fn millis(self) -> u64 {
        const S: u64 = 1000;
        match self {
            Unit::Second => S,
            Unit::Minute => 60 * S,
            Unit::Hour => 3600 * S,
            Unit::Day => 86_400 * S,
            Unit::Week => 7 * 86_400 * S,
            Unit::Month => 30 * 86_400 * S,
            Unit::Year => 365 * 86_400 * S,
        }
    }

    /// Parses a unit name as the reference does: case-insensitive.
    pub fn from_name(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(name))
    }

    /// Reads the proto enum value; `UNKNOWN` (0) and out-of-range values are `None`.
    pub fn from_proto(value: i32) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| *u as i32 == value)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// The unit that best describes a window of arbitrary length, for the proto's
    /// `current_limit.unit`, which cannot carry "90 seconds". Closest by ratio, so 90 s reports
    /// as a minute and 36 h as a day.
    pub fn nearest(window_ms: u64) -> Unit {
        let w = window_ms.max(1) as f64;
        let mut best = Unit::Second;
        let mut best_distance = f64::INFINITY;
        for unit in Unit::ALL {
            let distance = (w / unit.millis() as f64).ln().abs();
            if distance < best_distance {
                best = unit;
                best_distance = distance;
            }
        }
        best
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_case_insensitive_and_complete() {
        assert_eq!(Unit::from_name("MINUTE"), Some(Unit::Minute));
        assert_eq!(Unit::from_name("Week"), Some(Unit::Week));
        assert_eq!(Unit::from_name("fortnight"), None);
        for unit in Unit::ALL {
            assert_eq!(Unit::from_name(unit.name()), Some(unit));
            assert_eq!(Unit::from_proto(unit as i32), Some(unit));
        }
        assert_eq!(Unit::from_proto(0), None);
        assert_eq!(Unit::from_proto(8), None);
    }

    #[test]
    fn month_and_year_follow_the_reference() {
        assert_eq!(Unit::Month.millis(), 2_592_000_000);
        assert_eq!(Unit::Year.millis(), 31_536_000_000);
    }

    #[test]
    fn nearest_unit_for_arbitrary_windows() {
        assert_eq!(Unit::nearest(90_000), Unit::Minute);
        assert_eq!(Unit::nearest(36 * 3_600_000), Unit::Day);
        assert_eq!(Unit::nearest(1_500), Unit::Second);
        assert_eq!(Unit::nearest(Unit::Week.millis()), Unit::Week);
        assert_eq!(Unit::nearest(0), Unit::Second);
    }
}
