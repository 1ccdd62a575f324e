//! The HTTP port: `/healthz` (alive), `/readyz` and `/healthcheck` (able to decide), `/metrics`
//! (Prometheus), `/config` (the loaded rules, one per line), and `POST /json`, which takes the
//! proto3 JSON form of a `RateLimitRequest` and answers the JSON `RateLimitResponse` with 200
//! (OK), 429 (OVER_LIMIT), 400 (bad request) or 503 (store or config unavailable).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::limiter::{Code, Limiter, LimiterError};
use crate::metrics::Metrics;
use crate::proto::RateLimitRequest;
use crate::server::budget::{Hold, RequestBytes};
use crate::wire;

/// What the HTTP handlers share.
#[derive(Clone)]
pub struct HttpState {
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    /// False until serving starts and again once shutdown begins.
    pub ready: Arc<AtomicBool>,
    /// Ready only once at least one domain is loaded (the reference's
    /// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
    pub ready_needs_config: bool,
    /// When set, not ready until it is true (the xDS source's first config).
    pub config_arrived: Option<Arc<AtomicBool>>,
    /// The server's bound on request bytes held while bodies arrive.
    pub bytes: RequestBytes,
    /// How long a `POST /json` body may take to arrive whole.
    pub body_timeout: Duration,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/healthcheck", get(healthcheck))
        .route("/readyz", get(readyz))
        .route("/json", post(json))
        .route("/metrics", get(metrics))
        .route("/config", get(config))
        .with_state(state)
}

/// `/metrics` alone at `path`, for a separate metrics listener (the reference's
/// `PROMETHEUS_ADDR` and `PROMETHEUS_PATH`).
pub fn metrics_router(limiter: Arc<Limiter>, metrics: Arc<Metrics>, path: &str) -> Router {
    Router::new().route(
        path,
        get(move || {
            let (limiter, metrics) = (limiter.clone(), metrics.clone());
            async move {
                // This listener knows no drain or config state: readiness is the store's.
                metrics.set_ready(limiter.store().ready().await);
                exposition(&limiter, &metrics)
            }
        }),
    )
}

/// Alive: 200, unless the store has given up recovering by itself (then a restart helps).
async fn healthz(State(state): State<HttpState>) -> Response {
    if state.limiter.store().alive() {
        (StatusCode::OK, "OK\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the store cannot recover by itself\n",
        )
            .into_response()
    }
}

/// Able to decide now: serving, the store answers, and a config is loaded if one is required.
async fn is_ready(state: &HttpState) -> bool {
    let serving = || state.ready.load(Ordering::SeqCst);
    let configured = super::config_ready(
        &state.limiter,
        state.ready_needs_config,
        state.config_arrived.as_deref(),
    );
    if !serving() || !configured {
        return false;
    }
    // A drain that begins while a slow store is being pinged is reported at once, not when the
    // ping returns: load balancers must stop sending without waiting on the store.
    let ping = state.limiter.store().ready();
    tokio::pin!(ping);
    loop {
        tokio::select! {
            answers = &mut ping => return answers && serving(),
            () = tokio::time::sleep(DRAIN_CHECK) => {
                if !serving() {
                    return false;
                }
            }
        }
    }
}

/// How often a readiness probe waiting on the store looks whether draining began.
const DRAIN_CHECK: std::time::Duration = std::time::Duration::from_millis(20);

async fn readyz(State(state): State<HttpState>) -> Response {
    if is_ready(&state).await {
        let mut body = String::from("ready\n");
        if let Some(policy) = state.limiter.store().evicting() {
            body.push_str(&format!(
                "warning: Redis evicts keys (maxmemory-policy {policy}): an evicted window is forgotten and its requests admitted again; set maxmemory-policy noeviction\n"
            ));
        }
        for silent in state.limiter.store().silent() {
            body.push_str(&format!(
                "warning: {silent} does not answer: the requests of its slots are answered by the store-failure policy until it (or its replica) serves\n"
            ));
        }
        (StatusCode::OK, body).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

/// The reference's health check, which Envoy Gateway and existing probes use: 200 `OK` while
/// healthy (ready, as `/readyz`), 500 otherwise.
async fn healthcheck(State(state): State<HttpState>) -> Response {
    if is_ready(&state).await {
        (StatusCode::OK, "OK").into_response()
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "unhealthy").into_response()
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    state.metrics.set_ready(is_ready(&state).await);
    exposition(&state.limiter, &state.metrics)
}

fn exposition(limiter: &Limiter, metrics: &Metrics) -> Response {
    if let Some(keys) = limiter.store().live_keys() {
        metrics.set_store_keys(keys);
    }
    if let Some(losses) = limiter.store().data_losses() {
        metrics.set_data_losses(losses);
    }
    if let Some(policy) = limiter.store().evicting() {
        metrics.set_evicting(&policy);
    }
    if let Some(resent) = limiter.store().resent() {
        metrics.set_store_resent(resent);
    }
    metrics.set_spans_dropped(crate::traces::dropped());
    let (content_type, body) = metrics.render();
    ([(axum::http::header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn config(State(state): State<HttpState>) -> String {
    state.limiter.limits().describe()
}

/// `POST /json`: the proto3 JSON form of a `RateLimitRequest` (read by the pbjson mapping
/// generated from `proto/`, like grpc-gateway's), decided on the same path as a gRPC call.
async fn json(State(state): State<HttpState>, request: axum::extract::Request) -> Response {
    // The headers are read in place (an extractor of them would copy them for every call).
    let (parts, body) = request.into_parts();
    let caller = crate::traces::callers_context(&parts.headers);
    crate::traces::within(caller, decide_json(state, body)).await
}

async fn decide_json(state: HttpState, body: axum::body::Body) -> Response {
    let account = state.bytes.connection();
    let read = read_body(body, account.hold());
    let body = match tokio::time::timeout(state.body_timeout, read).await {
        Ok(Ok(body)) => body,
        Ok(Err(refused)) => return refused.into_response(),
        Err(_) => {
            let message = format!(
                "the request's body did not arrive whole within {:?} (--body-timeout)\n",
                state.body_timeout
            );
            // Closes the connection: the rest of the body is not waited for.
            return (
                StatusCode::REQUEST_TIMEOUT,
                [(axum::http::header::CONNECTION, "close")],
                message,
            )
                .into_response();
        }
    };
    let request: RateLimitRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid RateLimitRequest JSON: {e}\n"),
            )
                .into_response();
        }
    };
    let request = wire::from_proto(request);
    match state.limiter.should_rate_limit(&request).await {
        Ok(decision) => {
            let status = match decision.overall {
                Code::Ok => StatusCode::OK,
                Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            (status, axum::Json(wire::to_proto(&request, decision))).into_response()
        }
        Err(LimiterError::InvalidRequest(message)) => {
            (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response()
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

/// The largest `POST /json` body taken (axum's default for a body read whole).
const MAX_JSON_BYTES: usize = 2 << 20;

/// A `POST /json` body, charged to `hold` as it arrives; 413 past [`MAX_JSON_BYTES`] or the
/// server's bound, 400 when the body fails.
pub(super) async fn read_body(
    body: axum::body::Body,
    mut hold: Hold<'_>,
) -> Result<Vec<u8>, (StatusCode, String)> {
    use http_body_util::BodyExt as _;
    let too_large = |message: String| Err((StatusCode::PAYLOAD_TOO_LARGE, format!("{message}\n")));
    let mut body = std::pin::pin!(body);
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                format!("cannot read the body: {e}\n"),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if read.len() + data.len() > MAX_JSON_BYTES {
            return too_large(format!("the body passes {MAX_JSON_BYTES} bytes"));
        }
        if let Err(e) = hold.grow(data.len()) {
            return too_large(e.to_string());
        }
        read.extend_from_slice(&data);
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_field_spellings_and_string_integers() {
        let body = r#"{"domain":"d","hits_addend":2,"descriptors":[
            {"entries":[{"key":"k","value":"v"}],"hitsAddend":"0","limit":{"requests_per_unit":5,"unit":"MINUTE"}}]}"#;
        let request: RateLimitRequest = serde_json::from_str(body).expect("valid JSON");
        let request = wire::from_proto(request);
        assert_eq!(request.hits_addend, 2);
        assert_eq!(request.descriptors[0].hits_addend, Some(0));
        assert_eq!(
            request.descriptors[0].limit,
            Some(crate::limiter::Override {
                requests_per_unit: 5,
                unit: 2
            })
        );
    }

    #[test]
    fn rejects_unknown_fields_and_units() {
        assert!(serde_json::from_str::<RateLimitRequest>(r#"{"domain":"d","bogus":1}"#).is_err());
        assert!(
            serde_json::from_str::<RateLimitRequest>(
                r#"{"domain":"d","descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
            )
            .is_err()
        );
    }
}
