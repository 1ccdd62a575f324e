//! The admin API, on its own listener (`--admin-addr`) and only with a credential: a token file
//! (`--admin-token-file`: `Authorization: Bearer`), or mutual TLS (`--admin-tls-client-ca`), or
//! both. `POST /admin/v1/inspect` shows how a request's descriptors stand, `POST
//! /admin/v1/reset` forgets their windows and bans. Both take the body `POST /json` takes (a
//! `RateLimitRequest` in proto3 JSON). Every call is logged under [`TARGET`] (who, what,
//! result) and counted in `slidegate_admin_calls_total`; a call without a valid token (where
//! tokens are asked for) gets 401 and nothing else.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

use crate::limiter::inspect_reset::{Cleared, Standing};
use crate::limiter::{Limiter, LimiterError};
use crate::metrics::Metrics;
use crate::proto::RateLimitRequest;
use crate::server::budget::RequestBytes;
use crate::wire;

/// The admin log's target: `--log-level slidegate::admin=info` keeps it when others are quieter.
pub const TARGET: &str = "slidegate::admin";

/// Tokens shorter than this are refused when the file is read: a guessable token is no lock.
const MIN_TOKEN_LEN: usize = 16;

/// The token file: one token per line, `NAME TOKEN` (the name is what the log shows) or a lone
/// `TOKEN` (logged as `line N`); blank lines and `#` comments are skipped. Read again when its
/// modification time, size or inode change, so a rotated token takes effect without a restart.
pub struct Tokens {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

#[derive(Default)]
struct Loaded {
    stamp: Option<(std::time::SystemTime, u64, u64)>,
    tokens: Vec<(String, Vec<u8>)>,
}

impl Tokens {
    /// Reads the file once: an unreadable file, or one without a usable token, is an error
    /// naming `--admin-token-file`.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let tokens = Tokens {
            path: path.to_path_buf(),
            loaded: Mutex::new(Loaded::default()),
        };
        tokens.refresh()?;
        Ok(tokens)
    }

    /// Reads the file again if it changed. On an error the tokens held are dropped: a file
    /// that can no longer be read lets nobody in.
    fn refresh(&self) -> Result<(), String> {
        use std::os::unix::fs::MetadataExt as _;
        let mut loaded = self
            .loaded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let stamp = std::fs::metadata(&self.path)
            .and_then(|m| Ok((m.modified()?, m.len(), m.ino())))
            .map_err(|e| self.error(&e.to_string()));
        let stamp = match stamp {
            Ok(stamp) => stamp,
            Err(e) => {
                *loaded = Loaded::default();
                return Err(e);
            }
        };
        if loaded.stamp == Some(stamp) {
            return Ok(());
        }
        let read = std::fs::read_to_string(&self.path)
            .map_err(|e| self.error(&e.to_string()))
            .and_then(|text| parse_tokens(&text).map_err(|e| self.error(&e)));
        match read {
            Ok(tokens) => {
                *loaded = Loaded {
                    stamp: Some(stamp),
                    tokens,
                };
                Ok(())
            }
            Err(e) => {
                *loaded = Loaded::default();
                Err(e)
            }
        }
    }

    fn error(&self, what: &str) -> String {
        format!(
            "--admin-token-file {}: {what}; it must hold one token per line, `NAME TOKEN` or `TOKEN`, each token at least {MIN_TOKEN_LEN} characters",
            self.path.display()
        )
    }

    /// The name of the token `header` (`Authorization`) carries, if it is one of the file's.
    /// Every token is compared in full, whatever matched before, so the time taken does not
    /// tell how much of a guess was right.
    fn who(&self, header: Option<&str>) -> Option<String> {
        if let Err(e) = self.refresh() {
            tracing::warn!(target: TARGET, "{e}");
        }
        let offered = header?.strip_prefix("Bearer ")?.trim().as_bytes();
        let loaded = self
            .loaded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut found = None;
        for (name, token) in &loaded.tokens {
            if same(offered, token) {
                found = Some(name.clone());
            }
        }
        found
    }
}

fn parse_tokens(text: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut tokens = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, token) = match line.split_once(char::is_whitespace) {
            Some((name, token)) => (name.to_string(), token.trim()),
            None => (format!("line {}", n + 1), line),
        };
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the token on line {} has {} characters",
                n + 1,
                token.len()
            ));
        }
        tokens.push((name, token.as_bytes().to_vec()));
    }
    if tokens.is_empty() {
        return Err("no token in the file".into());
    }
    Ok(tokens)
}

/// Equal bytes, compared in time that depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let differ = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(differ) == 0
}

/// Who is at the other end of a connection, by its client certificate (mutual TLS).
#[derive(Clone, Debug)]
pub struct Peer(pub Option<String>);

/// What the admin handlers share.
#[derive(Clone)]
pub struct AdminState {
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    /// `None`: mutual TLS alone admits a caller.
    pub tokens: Option<Arc<Tokens>>,
    pub bytes: RequestBytes,
    pub body_timeout: std::time::Duration,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/admin/v1/inspect", post(inspect))
        .route("/admin/v1/reset", post(reset))
        .with_state(state)
}

#[derive(Clone, Copy)]
enum Action {
    Inspect,
    Reset,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Inspect => "inspect",
            Action::Reset => "reset",
        }
    }
}

async fn inspect(
    State(state): State<AdminState>,
    peer: Option<axum::Extension<Peer>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    serve(state, peer.map(|p| p.0), headers, body, Action::Inspect).await
}

async fn reset(
    State(state): State<AdminState>,
    peer: Option<axum::Extension<Peer>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    serve(state, peer.map(|p| p.0), headers, body, Action::Reset).await
}

/// Who the caller is: its token's name where tokens are asked for (`None` without a valid
/// one), with its certificate's name where it has one.
fn caller(state: &AdminState, peer: Option<Peer>, headers: &HeaderMap) -> Option<String> {
    let certificate = peer.and_then(|p| p.0);
    let Some(tokens) = &state.tokens else {
        // Mutual TLS alone: the handshake admitted the certificate.
        return certificate;
    };
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let name = tokens.who(authorization)?;
    Some(match certificate {
        Some(certificate) => format!("{name} ({certificate})"),
        None => name,
    })
}

/// Checks the caller before reading anything of the body, then runs `action`.
async fn serve(
    state: AdminState,
    peer: Option<Peer>,
    headers: HeaderMap,
    body: axum::body::Body,
    action: Action,
) -> Response {
    let Some(who) = caller(&state, peer, &headers) else {
        state.metrics.admin_call(action.name(), "unauthorized");
        tracing::warn!(target: TARGET, action = action.name(), "admin call refused: no valid bearer token");
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "unauthorized\n",
        )
            .into_response();
    };
    let request = match read_request(&state, body).await {
        Ok(request) => request,
        Err(refused) => {
            state.metrics.admin_call(action.name(), "invalid");
            tracing::info!(target: TARGET, who = %who, action = action.name(), result = "invalid", "admin call");
            return refused;
        }
    };
    let answer = match action {
        Action::Inspect => state
            .limiter
            .inspect(&request)
            .await
            .map(|found| inspect_json(&found)),
        Action::Reset => state
            .limiter
            .reset(&request)
            .await
            .map(|found| reset_json(&found)),
    };
    let (result, response) = match answer {
        Ok(body) => ("ok", (StatusCode::OK, axum::Json(body)).into_response()),
        Err(LimiterError::InvalidRequest(message)) => (
            "invalid",
            (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
        ),
        Err(e) => (
            "store_error",
            (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
        ),
    };
    state.metrics.admin_call(action.name(), result);
    tracing::info!(
        target: TARGET,
        who = %who,
        action = action.name(),
        domain = %request.domain,
        descriptors = request.descriptors.len(),
        result,
        "admin call"
    );
    response
}

/// The body as a `RateLimitRequest`, read within the HTTP port's body timeout and bounds.
async fn read_request(
    state: &AdminState,
    body: axum::body::Body,
) -> Result<crate::limiter::Request, Response> {
    let account = state.bytes.connection();
    let read = super::http::read_body(body, account.hold());
    let body = match tokio::time::timeout(state.body_timeout, read).await {
        Ok(Ok(body)) => body,
        Ok(Err(refused)) => return Err(refused.into_response()),
        Err(_) => {
            return Err((
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request's body did not arrive whole within {:?} (--body-timeout)\n",
                    state.body_timeout
                ),
            )
                .into_response());
        }
    };
    match serde_json::from_slice::<RateLimitRequest>(&body) {
        Ok(request) => Ok(wire::from_proto(request)),
        Err(e) => Err((
            StatusCode::BAD_REQUEST,
            format!("invalid RateLimitRequest JSON (the body POST /json takes): {e}\n"),
        )
            .into_response()),
    }
}

fn inspect_json(found: &[Standing]) -> Value {
    let descriptors: Vec<Value> = found
        .iter()
        .map(|d| {
            let windows: Vec<Value> = d
                .windows
                .iter()
                .map(|w| {
                    json!({
                        "limit": w.limit,
                        "window": seconds(w.window_ms),
                        "used": w.used,
                        "remaining": w.remaining,
                        "reset": seconds(w.reset_ms),
                    })
                })
                .collect();
            json!({
                "rule": d.rule,
                "windows": windows,
                "ban": d.ban_remaining_ms.map(|ms| json!({ "remaining": seconds(ms) })),
                "entries": d.entries,
            })
        })
        .collect();
    json!({ "descriptors": descriptors })
}

fn reset_json(found: &[Cleared]) -> Value {
    let descriptors: Vec<Value> = found
        .iter()
        .map(|d| json!({ "rule": d.rule, "cleared": d.cleared }))
        .collect();
    json!({ "descriptors": descriptors })
}

/// Milliseconds as seconds, to the millisecond: `60s`, `41.2s`, `0.005s`.
pub fn seconds(ms: u64) -> String {
    let fraction = ms % 1000;
    if fraction == 0 {
        return format!("{}s", ms / 1000);
    }
    let digits = format!("{fraction:03}");
    format!("{}.{}s", ms / 1000, digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_to_the_millisecond() {
        assert_eq!(seconds(60_000), "60s");
        assert_eq!(seconds(41_200), "41.2s");
        assert_eq!(seconds(5), "0.005s");
        assert_eq!(seconds(0), "0s");
    }

    #[test]
    fn token_lines_name_their_token_and_short_tokens_are_refused() {
        let tokens = parse_tokens("# ops\nalice 0123456789abcdef0\n\n0123456789abcdefXY\n")
            .expect("two tokens");
        assert_eq!(tokens[0].0, "alice");
        assert_eq!(tokens[0].1, b"0123456789abcdef0");
        assert_eq!(tokens[1].0, "line 4");
        let short = parse_tokens("bob short").expect_err("too short");
        assert!(
            short.contains("line 1") && short.contains("5 characters"),
            "{short}"
        );
        assert!(parse_tokens("# nothing\n").is_err());
    }

    #[test]
    fn a_token_matches_only_in_full() {
        assert!(same(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!same(b"0123456789abcdeX", b"0123456789abcdef"));
        assert!(!same(b"0123456789abcde", b"0123456789abcdef"));
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_missing_one_lets_nobody_in() {
        let dir = std::env::temp_dir().join(format!("slidegate-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tokens");
        std::fs::write(&path, "alice 0123456789abcdef\n").expect("write");
        let tokens = Tokens::load(&path).expect("a token");
        assert_eq!(
            tokens.who(Some("Bearer 0123456789abcdef")).as_deref(),
            Some("alice")
        );
        assert_eq!(tokens.who(Some("Bearer wrong")), None);
        assert_eq!(
            tokens.who(Some("0123456789abcdef")),
            None,
            "the scheme is needed"
        );
        std::fs::write(&path, "carol fedcba9876543210-new\n").expect("rotate");
        assert_eq!(tokens.who(Some("Bearer 0123456789abcdef")), None);
        assert_eq!(
            tokens.who(Some("Bearer fedcba9876543210-new")).as_deref(),
            Some("carol")
        );
        std::fs::remove_file(&path).expect("remove");
        assert_eq!(tokens.who(Some("Bearer fedcba9876543210-new")), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
