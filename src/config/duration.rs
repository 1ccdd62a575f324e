//! Durations written in config and flags: `90s`, `5m`, `36h`, `1h30m`, `500ms`, `2d`, `1w`, and
//! decimals as Envoy and Go write them (`0.05s`, `1.5h`).

/// Parses a duration into milliseconds. Every number needs a unit; the sum must be positive and
/// a whole number of milliseconds.
pub fn parse_ms(text: &str) -> Result<u64, String> {
    match parse_ms_or_zero(text)? {
        0 => Err(format!("duration '{text}' must be longer than zero")),
        ms => Ok(ms),
    }
}

/// [`parse_ms`], where zero (`0`, `0s`, `0.0s`) is allowed: for delays that may be off.
pub fn parse_ms_or_zero(text: &str) -> Result<u64, String> {
    if text.trim() == "0" {
        return Ok(0);
    }
    let explain = || {
        format!(
            "invalid duration '{text}': write a number with a unit (ms, s, m, h, d, w), e.g. 90s, 0.05s or 1h30m"
        )
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(explain());
    }
    let too_long = || format!("duration '{text}' is too long");
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let (whole, fraction, after) = number(rest).ok_or_else(explain)?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let scale: u64 = match &after[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            _ => return Err(explain()),
        };
        rest = &after[unit_len..];
        let whole_ms = whole.checked_mul(scale).ok_or_else(too_long)?;
        let fraction_ms = fraction_of(fraction, scale)
            .ok_or_else(|| format!("duration '{text}' is finer than a millisecond"))?;
        total = total
            .checked_add(whole_ms)
            .and_then(|t| t.checked_add(fraction_ms))
            .ok_or_else(too_long)?;
    }
    Ok(total)
}

/// A leading `digits[.digits]`: the whole part, the fraction's digits, and what follows.
fn number(text: &str) -> Option<(u64, &str, &str)> {
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let whole_len = digits(text);
    let (whole_text, after) = text.split_at(whole_len);
    let (fraction, after) = match after.strip_prefix('.') {
        Some(tail) => tail.split_at(digits(tail)),
        None => ("", after),
    };
    if whole_text.is_empty() && fraction.is_empty() {
        return None;
    }
    let whole = if whole_text.is_empty() {
        0
    } else {
        whole_text.parse().ok()?
    };
    Some((whole, fraction, after))
}

/// `0.<fraction>` of `scale` milliseconds, if that is a whole number of milliseconds.
fn fraction_of(fraction: &str, scale: u64) -> Option<u64> {
    let significant = fraction.trim_end_matches('0');
    if significant.is_empty() {
        return Some(0);
    }
    let denominator = 10u64.checked_pow(u32::try_from(significant.len()).ok()?)?;
    let numerator: u64 = significant.parse().ok()?;
    let ms = u128::from(numerator) * u128::from(scale);
    let denominator = u128::from(denominator);
    (ms % denominator == 0).then(|| u64::try_from(ms / denominator).ok())?
}

#[cfg(test)]
mod tests {
    use super::parse_ms;

    #[test]
    fn accepts_units_and_compounds() {
        assert_eq!(parse_ms("90s"), Ok(90_000));
        assert_eq!(parse_ms("5m"), Ok(300_000));
        assert_eq!(parse_ms("36h"), Ok(129_600_000));
        assert_eq!(parse_ms("1h30m"), Ok(5_400_000));
        assert_eq!(parse_ms("500ms"), Ok(500));
        assert_eq!(parse_ms("2d"), Ok(172_800_000));
        assert_eq!(parse_ms("1w"), Ok(604_800_000));
    }

    #[test]
    fn accepts_decimals_as_envoy_and_go_write_them() {
        assert_eq!(parse_ms("0.05s"), Ok(50));
        assert_eq!(parse_ms("1.5h"), Ok(5_400_000));
        assert_eq!(parse_ms(".5s"), Ok(500));
        assert_eq!(parse_ms("2.s"), Ok(2_000));
        assert_eq!(parse_ms("1.25m30s"), Ok(105_000));
        assert_eq!(parse_ms("0.0010s"), Ok(1));
    }

    #[test]
    fn rejects_what_it_cannot_read() {
        for bad in [
            "",
            "90",
            "s",
            "5 m",
            "1x",
            "0s",
            "-5s",
            "99999999999999999999s",
            ".s",
            "1..5s",
            "0.5ms",
            "0.0001s",
        ] {
            assert!(parse_ms(bad).is_err(), "{bad}");
        }
    }
}
