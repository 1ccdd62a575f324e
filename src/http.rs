//! The HTTP port: `/healthz` (alive), `/readyz` (able to decide), `/metrics` (Prometheus),
//! `/config` (the loaded rules, one per line), and `POST /json`, which takes the proto3 JSON form
//! of a `RateLimitRequest` and answers the JSON `RateLimitResponse` with 200 (OK), 429
//! (OVER_LIMIT), 400 (bad request) or 503 (store or config unavailable).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::limiter::{self, Code, Decision, Limiter, LimiterError};
use crate::metrics::Metrics;

/// What the HTTP handlers share.
#[derive(Clone)]
pub struct HttpState {
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    /// False until serving starts and again once shutdown begins.
    pub ready: Arc<AtomicBool>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "OK\n" }))
        .route("/healthcheck", get(|| async { "OK\n" }))
        .route("/readyz", get(readyz))
        .route("/json", post(json))
        .route("/metrics", get(metrics))
        .route("/config", get(config))
        .with_state(state)
}

async fn readyz(State(state): State<HttpState>) -> Response {
    if state.ready.load(Ordering::SeqCst) && state.limiter.store_ready().await {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn config(State(state): State<HttpState>) -> String {
    state.limiter.limits().describe()
}

async fn json(State(state): State<HttpState>, body: axum::body::Bytes) -> Response {
    let request: JsonRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid RateLimitRequest JSON: {e}\n"),
            )
                .into_response();
        }
    };
    let request = match request.into_domain() {
        Ok(r) => r,
        Err(message) => return (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
    };
    match crate::service::decide(&state.limiter, &state.metrics, &request).await {
        Ok(decision) => {
            let status = match decision.overall {
                Code::Ok => StatusCode::OK,
                Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            (status, axum::Json(JsonResponse::from(decision))).into_response()
        }
        Err(LimiterError::InvalidRequest(message)) => {
            (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response()
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

// === proto3 JSON of the request ===
// Field names are accepted in lowerCamelCase (the canonical JSON name) and as written in the
// proto; 64-bit integers as numbers or strings; enums by name or number.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<JsonInt>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<JsonInt>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(default, rename = "requestsPerUnit", alias = "requests_per_unit")]
    requests_per_unit: Option<JsonInt>,
    #[serde(default)]
    unit: Option<JsonEnum>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonInt {
    Number(u64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonEnum {
    Number(i32),
    Name(String),
}

impl JsonInt {
    fn get(&self, field: &str) -> Result<u64, String> {
        match self {
            JsonInt::Number(n) => Ok(*n),
            JsonInt::Text(t) => t
                .parse()
                .map_err(|_| format!("{field}: '{t}' is not an unsigned integer")),
        }
    }

    fn get_u32(&self, field: &str) -> Result<u32, String> {
        u32::try_from(self.get(field)?).map_err(|_| format!("{field}: out of range for uint32"))
    }
}

impl JsonRequest {
    fn into_domain(self) -> Result<limiter::Request, String> {
        let hits_addend = match &self.hits_addend {
            Some(n) => n.get_u32("hitsAddend")?,
            None => 0,
        };
        let mut descriptors = Vec::with_capacity(self.descriptors.len());
        for d in self.descriptors {
            let limit = match d.limit {
                Some(o) => Some(limiter::Override {
                    requests_per_unit: match &o.requests_per_unit {
                        Some(n) => n.get_u32("limit.requestsPerUnit")?,
                        None => 0,
                    },
                    unit: match o.unit {
                        None => 0,
                        Some(JsonEnum::Number(n)) => n,
                        Some(JsonEnum::Name(name)) if name.eq_ignore_ascii_case("UNKNOWN") => 0,
                        Some(JsonEnum::Name(name)) => limiter::Unit::from_name(&name)
                            .map(|u| u as i32)
                            .ok_or_else(|| format!("limit.unit: unknown unit '{name}'"))?,
                    },
                }),
                None => None,
            };
            descriptors.push(limiter::Descriptor {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                limit,
                hits_addend: d.hits_addend.map(|h| h.get("hitsAddend")).transpose()?,
            });
        }
        Ok(limiter::Request {
            domain: self.domain,
            descriptors,
            hits_addend,
        })
    }
}

// === proto3 JSON of the response (default values omitted, as protobuf JSON printers do) ===

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse {
    overall_code: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dynamic_metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus {
    code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_limit: Option<JsonLimit>,
    #[serde(skip_serializing_if = "is_zero")]
    limit_remaining: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_until_reset: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonLimit {
    #[serde(skip_serializing_if = "String::is_empty")]
    name: String,
    requests_per_unit: u32,
    unit: String,
}

#[derive(Serialize)]
struct JsonHeader {
    key: String,
    value: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// A protobuf JSON duration: seconds with up to millisecond fraction, e.g. `1.500s`.
fn json_duration(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    }
}

impl From<Decision> for JsonResponse {
    fn from(decision: Decision) -> JsonResponse {
        JsonResponse {
            overall_code: code_name(decision.overall),
            statuses: decision
                .statuses
                .into_iter()
                .map(|s| JsonStatus {
                    code: code_name(s.code),
                    current_limit: s.current_limit.map(|l| JsonLimit {
                        name: l.name.as_deref().unwrap_or_default().to_string(),
                        requests_per_unit: l.requests_per_unit,
                        unit: l.unit.name().to_uppercase(),
                    }),
                    limit_remaining: s.limit_remaining,
                    duration_until_reset: s.duration_until_reset_ms.map(json_duration),
                })
                .collect(),
            response_headers_to_add: decision
                .response_headers
                .into_iter()
                .map(|(key, value)| JsonHeader { key, value })
                .collect(),
            dynamic_metadata: decision.dynamic_metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_field_spellings_and_string_integers() {
        let body = r#"{"domain":"d","hits_addend":2,"descriptors":[
            {"entries":[{"key":"k","value":"v"}],"hitsAddend":"0","limit":{"requests_per_unit":5,"unit":"MINUTE"}}]}"#;
        let request: JsonRequest = serde_json::from_str(body).expect("valid JSON");
        let request = request.into_domain().expect("valid request");
        assert_eq!(request.hits_addend, 2);
        assert_eq!(request.descriptors[0].hits_addend, Some(0));
        assert_eq!(
            request.descriptors[0].limit,
            Some(limiter::Override {
                requests_per_unit: 5,
                unit: 2
            })
        );
    }

    #[test]
    fn rejects_unknown_fields_and_units() {
        assert!(serde_json::from_str::<JsonRequest>(r#"{"domain":"d","bogus":1}"#).is_err());
        let request: JsonRequest = serde_json::from_str(
            r#"{"domain":"d","descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
        )
        .expect("JSON");
        assert!(request.into_domain().is_err());
    }

    #[test]
    fn durations_print_as_protobuf_json() {
        assert_eq!(json_duration(2000), "2s");
        assert_eq!(json_duration(1500), "1.500s");
    }
}
