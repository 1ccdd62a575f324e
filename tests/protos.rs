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

/// Every `name = number;` of each message and enum of a proto file, nested ones named
/// `Outer.Inner`; a `oneof`'s fields belong to its message, and a `map<…>` field is read as any.
fn numbers(proto: &str) -> BTreeMap<(String, String), u32> {
    let mut found = BTreeMap::new();
    // The open blocks: a message or enum's name, or None for a `oneof` or `service`.
    let mut blocks: Vec<Option<String>> = Vec::new();
    for line in proto.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        let named = || {
            let outer: Vec<&str> = blocks.iter().flatten().map(String::as_str).collect();
            outer.join(".")
        };
        match words.as_slice() {
            ["message" | "enum", name, "{"] => blocks.push(Some((*name).to_string())),
            [_, .., "{"] => blocks.push(None),
            ["}"] => {
                blocks.pop();
            }
            _ => {
                let block = named();
                if block.is_empty() {
                    continue;
                }
                let Some((left, right)) = line.split_once('=') else {
                    continue;
                };
                let Ok(number) = right.trim().trim_end_matches(';').trim().parse() else {
                    continue;
                };
                let name = left.split_whitespace().last().unwrap_or("").to_string();
                found.insert((block.clone(), name), number);
            }
        }
    }
    found
}

/// Envoy's Rate Limit Quota Service, `api/envoy/service/rate_limit_quota/v3/rlqs.proto`: the
/// revision whose `bucket_quota_usages` is a repeated message (ca890636e2953b34c0b25c56f2fc91e70c6c1fa5,
/// what Envoy 1.40 sends), with `last_report` (5) of the later drafts (0e6bcc3dd4af18a0a2de0ce54f840e3ad57d8e6f,
/// whose map of usages Envoy 1.40 does not send); `api/envoy/type/v3/ratelimit_strategy.proto`
/// (075f7a5e9f526022eb55891414b1bad7b567a08d) and `token_bucket.proto`
/// (25560af46e75dc67cb71e67549b8ae6c8f74a1c1).
const RLQS: &[(&str, &str, u32)] = &[
    ("RateLimitQuotaUsageReports", "domain", 1),
    ("RateLimitQuotaUsageReports", "bucket_quota_usages", 2),
    (
        "RateLimitQuotaUsageReports.BucketQuotaUsage",
        "bucket_id",
        1,
    ),
    (
        "RateLimitQuotaUsageReports.BucketQuotaUsage",
        "time_elapsed",
        2,
    ),
    (
        "RateLimitQuotaUsageReports.BucketQuotaUsage",
        "num_requests_allowed",
        3,
    ),
    (
        "RateLimitQuotaUsageReports.BucketQuotaUsage",
        "num_requests_denied",
        4,
    ),
    (
        "RateLimitQuotaUsageReports.BucketQuotaUsage",
        "last_report",
        5,
    ),
    ("RateLimitQuotaResponse", "bucket_action", 1),
    ("RateLimitQuotaResponse.BucketAction", "bucket_id", 1),
    (
        "RateLimitQuotaResponse.BucketAction",
        "quota_assignment_action",
        2,
    ),
    ("RateLimitQuotaResponse.BucketAction", "abandon_action", 3),
    (
        "RateLimitQuotaResponse.BucketAction.QuotaAssignmentAction",
        "assignment_time_to_live",
        2,
    ),
    (
        "RateLimitQuotaResponse.BucketAction.QuotaAssignmentAction",
        "rate_limit_strategy",
        3,
    ),
    ("BucketId", "bucket", 1),
];

const STRATEGY: &[(&str, &str, u32)] = &[
    ("RateLimitStrategy.BlanketRule", "ALLOW_ALL", 0),
    ("RateLimitStrategy.BlanketRule", "DENY_ALL", 1),
    (
        "RateLimitStrategy.RequestsPerTimeUnit",
        "requests_per_time_unit",
        1,
    ),
    ("RateLimitStrategy.RequestsPerTimeUnit", "time_unit", 2),
    ("RateLimitStrategy", "blanket_rule", 1),
    ("RateLimitStrategy", "requests_per_time_unit", 2),
    ("RateLimitStrategy", "token_bucket", 3),
];

const TOKEN_BUCKET: &[(&str, &str, u32)] = &[
    ("TokenBucket", "max_tokens", 1),
    ("TokenBucket", "tokens_per_fill", 2),
    ("TokenBucket", "fill_interval", 3),
    ("TokenBucket", "name", 4),
];

/// `ours` holds exactly `reference`'s numbers.
fn matches(ours: &str, reference: &[(&str, &str, u32)]) {
    let ours = numbers(ours);
    let mut wrong = Vec::new();
    for &(block, field, number) in reference {
        let had = ours.get(&(block.to_string(), field.to_string()));
        if had != Some(&number) {
            wrong.push(format!("{block}.{field}: reference {number}, ours {had:?}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(
        ours.len(),
        reference.len(),
        "slidegate's copy has fields the reference's has not: {ours:?}"
    );
}

#[test]
fn rlqs_matches_envoys_field_by_field() {
    matches(
        include_str!("../proto/envoy/service/rate_limit_quota/v3/rlqs.proto"),
        RLQS,
    );
    matches(
        include_str!("../proto/envoy/type/v3/ratelimit_strategy.proto"),
        STRATEGY,
    );
    matches(
        include_str!("../proto/envoy/type/v3/token_bucket.proto"),
        TOKEN_BUCKET,
    );
}

#[test]
fn rls_conf_matches_the_references_field_by_field() {
    matches(
        include_str!("../proto/ratelimit/config/ratelimit/v3/rls_conf.proto"),
        RLS_CONF,
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
