//! YAML text into the model ([`RawFile`]) with serde-saphyr, and the recovery that lets one run
//! report every field error of a file rather than only the first: the field named by an error
//! is blanked and the file parsed again. Whether an error is a field error is read from the
//! text of serde's and serde-saphyr's messages, as neither gives it a kind.

use super::errors::ConfigError;
use super::model::RawFile;

/// How many field errors of one file are collected before giving up on the rest.
const MAX_FIELD_ERRORS: usize = 50;

/// Parses a file and, on a field error (a wrong type, an unknown key), reports it and parses
/// again without that field, so one run names every such error of the file, not only the
/// first. The field's lines are blanked, not removed, so later errors keep their line numbers.
/// It stops at a syntax error, at a field that opens a list item (blanking it would change
/// the structure), or when a retry finds something other than a field error (which could then
/// be an artefact of the blanking, so it is not reported).
pub(super) fn parse_reporting_all(file: &str, text: &str) -> Result<RawFile, Vec<ConfigError>> {
    let mut lines: Vec<&str> = text.lines().collect();
    let mut errors: Vec<ConfigError> = Vec::new();
    let mut current = std::borrow::Cow::Borrowed(text);
    loop {
        let error = match parse(file, &current) {
            Ok(raw) if errors.is_empty() => return Ok(raw),
            Ok(_) => return Err(errors),
            Err(error) => error,
        };
        let field_error = is_field_error(&error.message);
        if !errors.is_empty() && !field_error {
            return Err(errors);
        }
        let line = error.line;
        errors.push(error);
        if !field_error || errors.len() >= MAX_FIELD_ERRORS || !blank_field(&mut lines, line) {
            return Err(errors);
        }
        current = std::borrow::Cow::Owned(lines.join("\n"));
    }
}

/// A serde error about one field's value or name, as opposed to the YAML's structure.
fn is_field_error(message: &str) -> bool {
    // serde's own messages, and the YAML parser's for scalars that do not read as the type
    // (`invalid u32`, `invalid boolean`, ...).
    [
        "unknown field",
        "duplicate field",
        "invalid ",
        "expected a whole number",
        "expected a number",
    ]
    .iter()
    .any(|start| message.starts_with(start))
}

/// Blanks the field at 1-based `line` and the lines nested under it; false when that is not a
/// plain `key: value` line (a list item's first key, or no line at all).
fn blank_field(lines: &mut [&str], line: u64) -> bool {
    let Some(at) = usize::try_from(line).ok().and_then(|l| l.checked_sub(1)) else {
        return false;
    };
    let Some(text) = lines.get(at) else {
        return false;
    };
    let trimmed = text.trim_start();
    if trimmed.is_empty() || trimmed.starts_with('-') || !trimmed.contains(':') {
        return false;
    }
    let indent = text.len() - trimmed.len();
    let nested = lines[at + 1..]
        .iter()
        .take_while(|l| {
            let t = l.trim_start();
            t.is_empty() || t.starts_with('#') || l.len() - t.len() > indent
        })
        .count();
    for blanked in &mut lines[at..=at + nested] {
        *blanked = "";
    }
    true
}

/// The parser's limits for one file of `bytes`: its defaults (which stop inputs that expand,
/// by aliases or nesting, into far more than they hold), except that the node and event counts
/// grow with the file, as no node takes less than a byte without an alias: a file of 100,000
/// rules (about 900,000 nodes) loads as its size allows.
fn parse_options(bytes: usize) -> serde_saphyr::Options {
    let defaults = serde_saphyr::Budget::default();
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_nodes: defaults.max_nodes.max(bytes),
            max_events: defaults.max_events.max(bytes.saturating_mul(2)),
        },
    }
}

fn parse(file: &str, text: &str) -> Result<RawFile, ConfigError> {
    let mut path = String::new();
    let options = parse_options(text.len());
    let parsed = serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = yaml_path(e.path());
            e.into_inner()
        })
    });
    parsed.map_err(|e| {
        let location = e.location();
        let found = location.and_then(|l| scalar_at(text, l.line(), l.column()));
        ConfigError {
            file: file.to_string(),
            line: location.map_or(0, |l| l.line()),
            path,
            message: plain(&first_line(&e.to_string()), found),
        }
    })
}

/// The parser's terse messages for a number that is not one, said with the accepted form and
/// what was found.
fn plain(message: &str, found: Option<&str>) -> String {
    let range = match message {
        "invalid u32" => "a whole number from 0 to 4294967295",
        "invalid u64" => "a whole number from 0 to 18446744073709551615",
        "invalid u16" => "a whole number from 0 to 65535",
        "invalid floating point" => "a number",
        _ => return message.to_string(),
    };
    match found {
        Some(found) => format!("expected {range}, found `{found}`"),
        None => format!("expected {range}"),
    }
}

/// The plain scalar written at `line` and `column` (1-based) of `text`.
fn scalar_at(text: &str, line: u64, column: u64) -> Option<&str> {
    let line = text
        .lines()
        .nth(usize::try_from(line.checked_sub(1)?).ok()?)?;
    let from = usize::try_from(column.checked_sub(1)?).ok()?;
    let rest = line.get(from..)?;
    let end = rest.find([',', '}', ']', '#']).unwrap_or(rest.len());
    let scalar = rest[..end].trim();
    (!scalar.is_empty()).then_some(scalar)
}

/// The YAML path of a parse error as the user wrote it. The `value` level that `Spanned`
/// wrappers add (after a domain, a descriptor, a `rate_limit` or a `rate_limits` item) is left out.
fn yaml_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    let mut spanned_before = false;
    let mut parent = "";
    for segment in path.iter() {
        match segment {
            Segment::Map { key } if key == "value" && spanned_before => spanned_before = false,
            Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
                spanned_before = matches!(key.as_str(), "domain" | "rate_limit");
                parent = key;
            }
            Segment::Seq { index } => {
                out.push_str(&format!("[{index}]"));
                spanned_before = matches!(parent, "descriptors" | "rate_limits");
            }
            Segment::Enum { .. } | Segment::Unknown => spanned_before = false,
        }
    }
    out
}

/// The parser's message without its source snippet (file and line are printed separately).
fn first_line(message: &str) -> String {
    let mut line = message.lines().next().unwrap_or(message).trim();
    line = line.strip_prefix("error: ").unwrap_or(line);
    if let (true, Some(at)) = (line.starts_with("line "), line.find(": ")) {
        line = &line[at + 2..];
    }
    line.to_string()
}

#[cfg(test)]
mod tests {
    use crate::config::compile_sources;

    #[test]
    fn every_field_error_of_a_file_is_reported() {
        let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: many}\n  - key: b\n    ratelimit:\n      unit: second\n  - key: c\n    rate_limit:\n      unit: minute\n      requests_per_unit: -3\n    shadow_mode: maybe\n";
        let errors =
            compile_sources(&[("f.yaml".into(), yaml.into())]).expect_err("three bad fields");
        let lines: Vec<(u64, String)> = errors.0.iter().map(|e| (e.line, e.path.clone())).collect();
        assert_eq!(
            lines,
            [
                (4, "descriptors[0].rate_limit.requests_per_unit".to_string()),
                (6, "descriptors[1].ratelimit".to_string()),
                (
                    11,
                    "descriptors[2].rate_limit.requests_per_unit".to_string()
                ),
                (12, "descriptors[2].shadow_mode".to_string()),
            ],
            "{errors}"
        );
        // A broken structure stops the search instead of guessing.
        let broken = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second\n";
        assert_eq!(
            compile_sources(&[("f.yaml".into(), broken.into())])
                .expect_err("syntax")
                .0
                .len(),
            1
        );
    }
}
