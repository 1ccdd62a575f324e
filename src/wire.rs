//! The protobuf messages to and from the limiter's domain types. Both transports use these
//! conversions: gRPC directly, and `POST /json` after pbjson has read the proto3 JSON form into
//! the same messages, so the two cannot answer differently.

use pbjson_types::{ListValue, Struct, Value};

use crate::limiter::{self, Code, Decision, RuleMetadata};
use crate::proto::rate_limit_response::{self as resp, DescriptorStatus};
use crate::proto::{HeaderValue, RateLimitRequest, RateLimitResponse};

/// Protobuf request to domain request. Never fails: checks belong to the limiter.
pub fn from_proto(request: RateLimitRequest) -> limiter::Request {
    limiter::Request {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(|d| limiter::Descriptor {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                limit: d.limit.map(|l| limiter::Override {
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit,
                }),
                hits_addend: d.hits_addend.map(|h| h.value),
            })
            .collect(),
    }
}

/// Domain decision to protobuf response. `request` is what was decided: the reference server's
/// `dynamic_metadata` echoes it.
pub fn to_proto(request: &limiter::Request, decision: Decision) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code(decision.overall),
        statuses: decision
            .statuses
            .into_iter()
            .map(|s| DescriptorStatus {
                code: code(s.code),
                current_limit: s.current_limit.map(|l| resp::RateLimit {
                    name: l.name.as_deref().unwrap_or_default().to_string(),
                    requests_per_unit: l.requests_per_unit,
                    // limiter::Unit's discriminants are the proto values.
                    unit: l.unit as i32,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset_ms.map(duration),
                quota: None,
            })
            .collect(),
        response_headers_to_add: decision
            .response_headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        dynamic_metadata: decision
            .dynamic_metadata
            .map(|rules| dynamic_metadata(request, rules)),
        ..Default::default()
    }
}

fn code(code: Code) -> i32 {
    match code {
        Code::Ok => resp::Code::Ok as i32,
        Code::OverLimit => resp::Code::OverLimit as i32,
    }
}

fn duration(ms: u64) -> pbjson_types::Duration {
    pbjson_types::Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        // Below 1e9, so it always fits an i32.
        nanos: i32::try_from((ms % 1000) * 1_000_000).unwrap_or_default(),
    }
}

/// The reference server's `dynamic_metadata` shape: `{domain, descriptors: [{entries: ["k=v"],
/// limit?, hitsAddend?}], hitsAddend, metadata?}`, `metadata` being the matched rules'.
fn dynamic_metadata(request: &limiter::Request, rules: RuleMetadata) -> Struct {
    let descriptors: Vec<Value> = request
        .descriptors
        .iter()
        .map(|d| {
            let mut fields: Vec<(String, Value)> = vec![(
                "entries".into(),
                d.entries
                    .iter()
                    .map(|(k, v)| Value::from(format!("{k}={v}")))
                    .collect::<Vec<_>>()
                    .into(),
            )];
            if let Some(limit) = d.limit {
                let unit = limiter::Unit::from_proto(limit.unit)
                    .map_or("UNKNOWN".to_string(), |u| u.name().to_uppercase());
                let limit: Struct = [
                    (
                        "requestsPerUnit".to_string(),
                        Value::from(f64::from(limit.requests_per_unit)),
                    ),
                    ("unit".to_string(), Value::from(unit)),
                ]
                .into_iter()
                .collect();
                fields.push(("limit".into(), limit.into()));
            }
            if let Some(hits) = d.hits_addend {
                fields.push(("hitsAddend".into(), number(hits)));
            }
            Value::from(fields.into_iter().collect::<Struct>())
        })
        .collect();
    let mut fields: Vec<(String, Value)> = vec![
        ("domain".into(), Value::from(request.domain.clone())),
        ("descriptors".into(), descriptors.into()),
        (
            "hitsAddend".into(),
            number(u64::from(request.hits_addend.max(1))),
        ),
    ];
    if !rules.0.is_empty() {
        fields.push(("metadata".into(), json_struct(rules.0).into()));
    }
    fields.into_iter().collect()
}

/// A protobuf number is a double; hits above 2^53 lose precision there, as in the reference.
#[allow(clippy::cast_precision_loss)]
fn number(n: u64) -> Value {
    Value::from(n as f64)
}

fn json_struct(map: serde_json::Map<String, serde_json::Value>) -> Struct {
    map.into_iter().map(|(k, v)| (k, json_value(v))).collect()
}

fn json_value(value: serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(b),
        Json::Number(n) => Value::from(n.as_f64().unwrap_or_default()),
        Json::String(s) => Value::from(s),
        Json::Array(items) => Value::from(items.into_iter().map(json_value).collect::<ListValue>()),
        Json::Object(map) => Value::from(json_struct(map)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_keep_milliseconds() {
        let d = duration(1_500);
        assert_eq!((d.seconds, d.nanos), (1, 500_000_000));
        let d = duration(0);
        assert_eq!((d.seconds, d.nanos), (0, 0));
    }

    #[test]
    fn dynamic_metadata_echoes_the_request_and_the_rules() {
        let request = limiter::Request {
            domain: "d".into(),
            descriptors: vec![limiter::Descriptor {
                entries: vec![("ip".into(), "m".into())],
                limit: Some(limiter::Override {
                    requests_per_unit: 5,
                    unit: 2,
                }),
                hits_addend: Some(3),
            }],
            hits_addend: 0,
        };
        let mut rules = serde_json::Map::new();
        rules.insert("team".into(), serde_json::json!("edge"));
        let shaped = dynamic_metadata(&request, RuleMetadata(rules));
        let json = serde_json::to_value(&shaped).expect("a Struct serialises");
        assert_eq!(
            json,
            serde_json::json!({
                "domain": "d",
                "descriptors": [{
                    "entries": ["ip=m"],
                    "limit": {"requestsPerUnit": 5.0, "unit": "MINUTE"},
                    "hitsAddend": 3.0
                }],
                "hitsAddend": 1.0,
                "metadata": {"team": "edge"}
            })
        );
    }
}
