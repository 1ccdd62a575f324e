//! One Redis URL from the reference's variables: `REDIS_URL` (`host:port`, or a comma list for
//! a cluster or a sentinel set-up), `REDIS_TYPE`, `REDIS_AUTH` and `REDIS_SENTINEL_AUTH`,
//! `REDIS_TLS` (the `rediss` scheme, with the `REDIS_TLS_*` rows of `table.rs`), and
//! `REDIS_SOCKET_TYPE`, of which only `tcp` is served.

use super::Env;
use super::table::{self, boolean};
use crate::cli::ServeArgs;

pub(super) fn apply(
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let Env {
        var,
        given,
        as_reference,
    } = env;
    if given("redis_url") {
        return Ok(());
    }
    let Some(url) = var("REDIS_URL") else {
        if as_reference {
            notes.push("REDIS_URL is not set: using the embedded store".into());
        }
        return Ok(());
    };
    let socket = var("REDIS_SOCKET_TYPE").map(|s| s.to_ascii_lowercase());
    if socket.as_deref() == Some("unix") || (socket.is_none() && url.starts_with('/')) {
        return Err("REDIS_SOCKET_TYPE=unix: slidegate reaches Redis over TCP only; set REDIS_SOCKET_TYPE=tcp and REDIS_URL=host:port".into());
    }
    if let Some(other) = socket.filter(|s| s != "tcp") {
        return Err(format!("REDIS_SOCKET_TYPE={other:?}: use tcp"));
    }
    let tls = boolean(var, "REDIS_TLS")?.unwrap_or(false);
    table::apply(table::REDIS_TLS, args, env, notes)?;
    let scheme = if tls { "rediss" } else { "redis" };
    let auth = var("REDIS_AUTH").map_or(String::new(), |auth| match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}@", encode(user), encode(password)),
        None => format!(":{}@", encode(&auth)),
    });
    let kind = var("REDIS_TYPE").map_or("single".into(), |t| t.to_ascii_lowercase());
    args.redis_url = Some(match kind.as_str() {
        "single" => format!("{scheme}://{auth}{url}"),
        "cluster" => format!("{scheme}-cluster://{auth}{url}"),
        "sentinel" => sentinel_url(scheme, &auth, &url, var("REDIS_SENTINEL_AUTH"))?,
        other => {
            return Err(format!(
                "REDIS_TYPE={other:?}: use single, cluster or sentinel"
            ));
        }
    });
    Ok(())
}

/// The reference writes a sentinel set-up as `<master name>,<sentinel>,<sentinel>...`;
/// `REDIS_AUTH` is the servers' password and `REDIS_SENTINEL_AUTH` the sentinels'.
fn sentinel_url(
    scheme: &str,
    auth: &str,
    list: &str,
    sentinel_auth: Option<String>,
) -> Result<String, String> {
    let mut parts = list.split(',').map(str::trim).filter(|p| !p.is_empty());
    let (Some(master), Some(first)) = (parts.next(), parts.next()) else {
        return Err(format!(
            "REDIS_URL={list:?}: with REDIS_TYPE=sentinel write <master name>,<sentinel host:port>,..."
        ));
    };
    let mut url = format!(
        "{scheme}-sentinel://{auth}{first}?sentinelServiceName={}",
        encode(master)
    );
    for node in parts {
        url.push_str("&node=");
        url.push_str(node);
    }
    if let Some(sentinel_auth) = sentinel_auth {
        let (user, password) = sentinel_auth
            .split_once(':')
            .map_or((None, sentinel_auth.as_str()), |(u, p)| (Some(u), p));
        if let Some(user) = user {
            url.push_str(&format!("&sentinelUsername={}", encode(user)));
        }
        url.push_str(&format!("&sentinelPassword={}", encode(password)));
    }
    Ok(url)
}

/// Percent-encodes everything but unreserved characters, for the user info of a URL.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
