//! Durations written in config: `90s`, `5m`, `36h`, `1h30m`, `500ms`, `2d`, `1w`.

/// Parses a duration into milliseconds. Every number needs a unit; the sum must be positive.
pub fn parse_ms(text: &str) -> Result<u64, String> {
    let explain = || {
        format!(
            "invalid duration '{text}': write a number with a unit (ms, s, m, h, d, w), e.g. 90s or 1h30m"
        )
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(explain());
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(explain());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| explain())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let scale: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            _ => return Err(explain()),
        };
        rest = &rest[unit_len..];
        total = number
            .checked_mul(scale)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("duration '{text}' is too long"))?;
    }
    if total == 0 {
        return Err(format!("duration '{text}' must be longer than zero"));
    }
    Ok(total)
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
            "1.5h",
        ] {
            assert!(parse_ms(bad).is_err(), "{bad}");
        }
    }
}
