//! YAML text into the model ([`RawFile`]) with serde-saphyr, and the recovery that lets one run
//! report every field error of a file rather than only the first: the field named by an error
//! is blanked and the file parsed again. Whether an error is a field error is read from the
//! text of serde's and serde-saphyr's messages, as neither gives it a kind.

use super::errors::ConfigError;
use super::model::RawFile;

/// How many field errors of one file are collected before giving up on the rest.
const MAX_FIELD_ERRORS: usize = 50;

/// The words of serde's and serde-saphyr's errors that parsing reads.
/// `tests::serde_messages_are_as_read` provokes each from the libraries themselves, so an
/// upgrade that rewords one fails there instead of silently changing which errors are
/// recovered from or how a config error reads.
mod serde_messages {
    /// serde, for a key the model does not have (`deny_unknown_fields`).
    pub(super) const UNKNOWN_FIELD: &str = "unknown field";
    /// serde's derive, for a field given twice. serde-saphyr reports a repeated key itself, as
    /// `duplicate mapping key`, which is not read as a field error.
    pub(super) const DUPLICATE_FIELD: &str = "duplicate field";
    /// serde-saphyr, for a scalar that does not read as its field's type (`invalid u32`,
    /// `invalid boolean`), and serde, for a value of the wrong kind (`invalid type: `,
    /// `invalid value: `, `invalid length `).
    pub(super) const INVALID: &str = "invalid ";
    /// serde-saphyr, for a number that does not read as one of these types; reworded by
    /// [`super::plain`] with the range the type accepts.
    pub(super) const INVALID_U32: &str = "invalid u32";
    pub(super) const INVALID_U64: &str = "invalid u64";
    pub(super) const INVALID_U16: &str = "invalid u16";
    pub(super) const INVALID_FLOAT: &str = "invalid floating point";
    /// How serde-saphyr renders an error: `error: line 3 column 5: <message>`, then the source
    /// snippet on lines of its own; [`super::first_line`] keeps the message alone.
    pub(super) const RENDERED_ERROR: &str = "error: ";
    pub(super) const RENDERED_LINE: &str = "line ";
    pub(super) const RENDERED_LOCATION_END: &str = ": ";
    /// The field that serde-saphyr's `Spanned` wrapper adds to an error's path, left out of the
    /// path a config error names.
    pub(super) const SPANNED_VALUE: &str = "value";
}

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
        let Failed { error, field_error } = match parse(file, &current) {
            Ok(raw) if errors.is_empty() => return Ok(raw),
            Ok(_) => return Err(errors),
            Err(failed) => failed,
        };
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

/// Whether the libraries' `message` is about one field's value or name, as opposed to the
/// YAML's structure.
fn is_field_error(message: &str) -> bool {
    [
        serde_messages::UNKNOWN_FIELD,
        serde_messages::DUPLICATE_FIELD,
        serde_messages::INVALID,
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

/// A parse that failed: its error as reported, and whether the libraries call it a field error
/// (judged on their own words, before [`plain`] rewords them).
struct Failed {
    error: ConfigError,
    field_error: bool,
}

fn parse(file: &str, text: &str) -> Result<RawFile, Failed> {
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
        let message = first_line(&e.to_string());
        Failed {
            field_error: is_field_error(&message),
            error: ConfigError {
                file: file.to_string(),
                line: location.map_or(0, |l| l.line()),
                path,
                message: plain(&message, found),
            },
        }
    })
}

/// The parser's terse messages for a number that is not one, said with the accepted form and
/// what was found.
fn plain(message: &str, found: Option<&str>) -> String {
    let range = match message {
        serde_messages::INVALID_U32 => "a whole number from 0 to 4294967295",
        serde_messages::INVALID_U64 => "a whole number from 0 to 18446744073709551615",
        serde_messages::INVALID_U16 => "a whole number from 0 to 65535",
        serde_messages::INVALID_FLOAT => "a number",
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
            Segment::Map { key } if key == serde_messages::SPANNED_VALUE && spanned_before => {
                spanned_before = false;
            }
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
    line = line
        .strip_prefix(serde_messages::RENDERED_ERROR)
        .unwrap_or(line);
    if let (true, Some(at)) = (
        line.starts_with(serde_messages::RENDERED_LINE),
        line.find(serde_messages::RENDERED_LOCATION_END),
    ) {
        line = &line[at + serde_messages::RENDERED_LOCATION_END.len()..];
    }
    line.to_string()
}

#[cfg(test)]
mod tests {
    use super::serde_messages::*;
    use super::*;
    use crate::config::compile_sources;

    /// serde-saphyr's error for `yaml` deserialized as `T`, rendered whole.
    fn rendered<T: serde::de::DeserializeOwned>(yaml: &str) -> String {
        match serde_saphyr::from_str::<T>(yaml) {
            Ok(_) => panic!("{yaml:?} should not deserialize"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn serde_messages_are_as_read() {
        // What config files provoke, deserialized into the model.
        let unknown = rendered::<RawFile>("descriptors:\n  - key: a\n    ratelimit: 1\n");
        let location = format!("{RENDERED_ERROR}{RENDERED_LINE}3 column 5{RENDERED_LOCATION_END}");
        assert!(
            unknown.starts_with(&format!("{location}{UNKNOWN_FIELD} `ratelimit`")),
            "{unknown}"
        );
        let bad_count = "descriptors:\n  - key: a\n    rate_limit: {requests_per_unit: x}\n";
        let count = rendered::<RawFile>(bad_count);
        assert_eq!(first_line(&count), INVALID_U32, "{count}");
        let flag = rendered::<RawFile>("descriptors:\n  - key: a\n    shadow_mode: maybe\n");
        assert!(first_line(&flag).starts_with(INVALID), "{flag}");
        let mut path = String::new();
        let options = parse_options(bad_count.len());
        let _ = serde_saphyr::with_deserializer_from_str_with_options(bad_count, options, |de| {
            serde_path_to_error::deserialize::<_, RawFile>(de).map_err(|e| {
                path = e.path().to_string();
                e.into_inner()
            })
        });
        let spanned = SPANNED_VALUE;
        assert_eq!(
            path,
            format!("descriptors[0].{spanned}.rate_limit.{spanned}.requests_per_unit")
        );
        // Numbers of types the model has no field of, which `plain` rewords all the same.
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Numbers {
            #[serde(default)]
            u64: u64,
            #[serde(default)]
            u16: u16,
            #[serde(default)]
            f64: f64,
            #[serde(default)]
            f32: f32,
        }
        let numbers = [
            ("u64", INVALID_U64),
            ("u16", INVALID_U16),
            ("f64", INVALID_FLOAT),
            ("f32", INVALID_FLOAT),
        ];
        for (field, said) in numbers {
            let wrong = rendered::<Numbers>(&format!("{field}: x"));
            assert_eq!(first_line(&wrong), said, "{wrong}");
        }
        // serde's words, through serde-saphyr's error type.
        use serde::de::{Error as _, Unexpected};
        let duplicate = serde_saphyr::Error::duplicate_field("key").to_string();
        assert!(duplicate.starts_with(DUPLICATE_FIELD), "{duplicate}");
        for wrong in [
            serde_saphyr::Error::invalid_type(Unexpected::Bool(true), &"a string"),
            serde_saphyr::Error::invalid_value(Unexpected::Unsigned(3), &"one or two"),
            serde_saphyr::Error::invalid_length(3, &"two"),
        ] {
            let wrong = first_line(&wrong.to_string());
            assert!(wrong.starts_with(INVALID), "{wrong}");
        }
    }

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
