//! How a flag's text becomes its value: the parsers clap calls (`value_parser = ...`) for
//! durations, sizes, thread counts, ratios and `name=value` pairs, and the boolean reader that
//! the `SLIDEGATE_*` and the reference's variables share.

use std::time::Duration;

use slidegate::config;

/// A duration as the config writes one (`250ms`, `1h30m`), longer than zero.
pub(super) fn duration_arg(text: &str) -> Result<Duration, String> {
    config::duration::parse_ms(text).map(Duration::from_millis)
}

/// A thread count: 1 or more.
pub(super) fn threads_arg(text: &str) -> Result<std::num::NonZeroUsize, String> {
    text.trim()
        .parse::<usize>()
        .ok()
        .and_then(std::num::NonZeroUsize::new)
        .ok_or_else(|| {
            format!("'{text}' is not a thread count: give 1 or more, or leave the flag out for one per CPU")
        })
}

/// A size in bytes: digits, with an optional `KiB`, `MiB` or `GiB` (powers of 1,024).
pub(super) fn bytes_arg(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match &text[digits.len()..] {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => u32::MAX,
    };
    let amount: Option<usize> = digits.trim().parse().ok();
    amount
        .filter(|_| shift != u32::MAX)
        .and_then(|n| n.checked_mul(1usize.checked_shl(shift)?))
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            format!("'{text}' is not a size: write a positive whole number of bytes, or one with KiB, MiB or GiB (8MiB)")
        })
}

/// A delay that may be off: [`duration_arg`], or zero.
pub(super) fn duration_or_zero_arg(text: &str) -> Result<Duration, String> {
    config::duration::parse_ms_or_zero(text).map(Duration::from_millis)
}

/// `name<SEP>value`.
pub(super) fn pair_arg<const SEP: char>(text: &str) -> Result<(String, String), String> {
    match text.split_once(SEP) {
        Some((name, value)) if !name.trim().is_empty() => {
            Ok((name.trim().to_string(), value.trim().to_string()))
        }
        _ => Err(format!("'{text}' is not name{SEP}value")),
    }
}

/// A fraction from 0 to 1.
pub(super) fn ratio_arg(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("'{text}' is not a ratio between 0 and 1")),
    }
}

/// Reads a boolean as the reference server and most tools write one.
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" | "y" | "yes" | "on" => Some(true),
        "0" | "f" | "false" | "n" | "no" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_units_and_refuse_the_rest() {
        assert_eq!(bytes_arg("8MiB"), Ok(8 << 20));
        assert_eq!(bytes_arg("512KiB"), Ok(512 << 10));
        assert_eq!(bytes_arg("2GiB"), Ok(2 << 30));
        assert_eq!(bytes_arg("4096"), Ok(4096));
        for wrong in ["", "0", "8MB", "8 mb", "-1", "MiB", "1.5MiB"] {
            let message = bytes_arg(wrong).expect_err(wrong);
            assert!(message.contains("KiB, MiB or GiB"), "{wrong}: {message}");
        }
    }

    #[test]
    fn a_zero_delay_takes_only_known_units() {
        for zero in ["0", "0s", "0ms", " 0m ", "0.0s"] {
            assert_eq!(duration_or_zero_arg(zero), Ok(Duration::ZERO), "{zero:?}");
        }
        assert_eq!(
            duration_or_zero_arg("1500ms"),
            Ok(Duration::from_millis(1500))
        );
        for bad in ["0parsec", "0x", "parsec", ""] {
            assert!(duration_or_zero_arg(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
