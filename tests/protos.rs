//! slidegate's copies of other projects' protos, field by field against theirs: every field and
//! enum value number of a message slidegate copies, as the upstream file defines it at the
//! revision named, must be in slidegate's copy under the same name and number.
// Tests may panic on a broken set-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

/// `envoyproxy/ratelimit`, `api/ratelimit/config/ratelimit/v3/rls_conf.proto`, at revision
/// f2fb15770f7fd1c88ca6c3a1b58ee513917ace96: (message or enum, field or value, number).
const RLS_CONF: &[(&str, &str, u32)] = &[
    ("RateLimitConfig", "name", 1),
    ("RateLimitConfig", "domain", 2),
    ("RateLimitConfig", "descriptors", 3),
    ("RateLimitDescriptor", "key", 1),
    ("RateLimitDescriptor", "value", 2),
    ("RateLimitDescriptor", "rate_limit", 3),
    ("RateLimitDescriptor", "descriptors", 4),
    ("RateLimitDescriptor", "shadow_mode", 5),
    ("RateLimitDescriptor", "detailed_metric", 6),
    ("RateLimitDescriptor", "quota_mode", 7),
    ("RateLimitDescriptor", "metadata", 8),
    ("RateLimitPolicy", "unit", 1),
    ("RateLimitPolicy", "requests_per_unit", 2),
    ("RateLimitPolicy", "unlimited", 3),
    ("RateLimitPolicy", "name", 4),
    ("RateLimitPolicy", "replaces", 5),
    ("RateLimitReplace", "name", 1),
    ("RateLimitUnit", "UNKNOWN", 0),
    ("RateLimitUnit", "SECOND", 1),
    ("RateLimitUnit", "MINUTE", 2),
    ("RateLimitUnit", "HOUR", 3),
    ("RateLimitUnit", "DAY", 4),
    ("RateLimitUnit", "WEEK", 7),
    ("RateLimitUnit", "MONTH", 5),
    ("RateLimitUnit", "YEAR", 6),
];

/// Every `name = number;` of each top-level message and enum of a proto file (nested ones are
/// not used by these files).
fn numbers(proto: &str) -> BTreeMap<(String, String), u32> {
    let mut found = BTreeMap::new();
    let mut block: Option<String> = None;
    for line in proto.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["message" | "enum", name, "{"] => block = Some((*name).to_string()),
            ["}"] => block = None,
            _ => {
                let (Some(block), Some((left, right))) = (&block, line.split_once('=')) else {
                    continue;
                };
                let name = left.split_whitespace().last().unwrap_or("").to_string();
                let number = right.trim().trim_end_matches(';').trim().parse().unwrap();
                found.insert((block.clone(), name), number);
            }
        }
    }
    found
}

#[test]
fn rls_conf_matches_the_references_field_by_field() {
    let ours = numbers(include_str!(
        "../proto/ratelimit/config/ratelimit/v3/rls_conf.proto"
    ));
    let mut wrong = Vec::new();
    for &(block, field, number) in RLS_CONF {
        let had = ours.get(&(block.to_string(), field.to_string()));
        if had != Some(&number) {
            wrong.push(format!("{block}.{field}: reference {number}, ours {had:?}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(
        ours.len(),
        RLS_CONF.len(),
        "slidegate's copy has fields the reference's has not: {ours:?}"
    );
}

#[test]
fn the_reader_finds_what_a_proto_declares() {
    let proto = "message A {\n  string x = 1; // a comment = 9\n  repeated B y = 12;\n}\nenum E {\n  Z = 0;\n}\n";
    let found = numbers(proto);
    assert_eq!(found.len(), 3);
    assert_eq!(found[&("A".into(), "y".into())], 12);
    assert_eq!(found[&("E".into(), "Z".into())], 0);
}
