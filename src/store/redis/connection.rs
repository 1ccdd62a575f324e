//! The Redis store's connection: the client configuration from the URL and TLS files, the first
//! probe, the pool and its replacement when calls keep failing, and what `/healthz` reads of it.

use super::encode::unavailable;
use super::*;

/// How long every call may fail before the client pool is replaced: short, so a client left
/// unable to route resumes well within a second; a replacement costs one connection attempt.
pub(super) const REPLACE_AFTER: Duration = Duration::from_millis(250);

/// The longest wait between replacement attempts while new clients cannot connect (Redis is
/// down: the old pool reconnects by itself, so trying often gains nothing).
pub(super) const REPLACE_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// Whether calls have been failing, and since when.
pub(super) struct Health {
    /// Since when calls have failed, counted afresh after each replacement attempt.
    pub(super) failing_since: Option<Instant>,
    /// Since when calls have failed without a success in between.
    pub(super) streak_since: Option<Instant>,
    /// The wait before the next replacement attempt.
    pub(super) retry_after: Duration,
    pub(super) replacing: bool,
    /// Fresh pools that connected, yet calls kept failing through them.
    pub(super) replaced_in_vain: u32,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            failing_since: None,
            streak_since: None,
            retry_after: REPLACE_AFTER,
            replacing: false,
            replaced_in_vain: 0,
        }
    }
}

/// The store cannot recover by itself (`/healthz` says so) when this many fresh pools connected
/// and did not help, over at least [`HOPELESS_STREAK`] of failing calls: long enough that a
/// failover, where new clients connect before a replica is promoted, does not count.
pub(super) const HOPELESS_AFTER: u32 = 3;
pub(super) const HOPELESS_STREAK: Duration = Duration::from_secs(5);

pub(super) fn lock(health: &Mutex<Health>) -> std::sync::MutexGuard<'_, Health> {
    // The state is two plain fields; one left by a panicking holder is still usable.
    health
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a pool is built from, kept to build a fresh one.
pub(super) struct PoolRecipe {
    pub(super) config: Config,
    pub(super) options: RedisOptions,
}

impl PoolRecipe {
    /// The store's pool: on a cluster one client, the redirect client (`call.rs`,
    /// `Sender::redirect`); each master has a pool of its own (`nodes.rs`, [`PoolRecipe::master`]).
    pub(super) fn build(&self) -> Result<Pool, StoreError> {
        let size = if self.config.server.is_clustered() {
            1
        } else {
            self.options.pool_size.max(1)
        };
        self.build_with(self.config.clone(), size)
    }

    /// A pool of `--redis-pool-size` clients to one cluster master alone, connecting in the
    /// background (a call waits for it within its deadline).
    pub(super) fn master(&self, server: &Server) -> Result<Pool, StoreError> {
        let mut config = self.config.clone();
        config.server = fred::types::config::ServerConfig::Centralized {
            server: server.clone(),
        };
        let pool = self.build_with(config, self.options.pool_size.max(1))?;
        let _connecting = pool.connect();
        Ok(pool)
    }

    fn build_with(&self, config: Config, size: usize) -> Result<Pool, StoreError> {
        let options = &self.options;
        Builder::from_config(config)
            .with_connection_config(|c| {
                c.connection_timeout = options.connect_timeout;
                // Small commands, sent as they come: Nagle's algorithm would hold one back
                // waiting for the ACK of the previous (and delayed ACKs make that tens of ms).
                c.tcp.nodelay = Some(true);
                // Cluster topology changes (a slot moved, a failover) need room: a MOVED makes
                // the client re-read the slots and send again, and a connection that stops
                // answering is replaced rather than waited on.
                c.max_command_attempts = 5;
                c.max_redirections = 10;
                c.internal_command_timeout = options.connect_timeout;
                c.unresponsive.max_timeout = Some(options.connect_timeout);
                c.unresponsive.interval = options.connect_timeout / 4;
            })
            // The client gives a command up at the store deadline and marks it so, which keeps
            // it from being sent after a reconnection once its call has failed (see
            // `RedisStore::checked`).
            .with_performance_config(|p| p.default_command_timeout = options.timeout)
            // Retries at most every half second, so calls resume soon after Redis returns.
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 500, 2))
            .build_pool(size)
            .map_err(|e| unavailable(&e))
    }

    /// A new pool, connected and with the script loaded, or why not.
    pub(super) async fn fresh(&self, library: &Library) -> Result<Pool, StoreError> {
        let pool = self.build()?;
        let deadline = self.options.connect_timeout;
        let connect = async {
            pool.init().await?;
            library
                .load(pool.next(), self.options.connect_timeout)
                .await
        };
        match tokio::time::timeout(deadline, connect).await {
            Ok(Ok(())) => Ok(pool),
            Ok(Err(e)) => {
                let _ = pool.quit().await;
                Err(unavailable(&e))
            }
            Err(_) => {
                let _ = pool.quit().await;
                let waited =
                    crate::store::Waited::Redis(deadline, crate::store::Bound::ConnectTimeout);
                Err(StoreError::Timeout(waited))
            }
        }
    }
}

/// The URL with any password (in the user info or a `sentinelPassword` parameter) replaced,
/// safe for logs.
pub fn redact(url: &str) -> String {
    let url = match url.split_once("sentinelPassword=") {
        Some((before, after)) => {
            let rest = after.find('&').map_or("", |at| &after[at..]);
            format!("{before}sentinelPassword=***{rest}")
        }
        None => url.to_string(),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return url;
    };
    // The last `@` ends the user info, as the client reads it: a password may hold an `@`.
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url,
    }
}

/// Accepts the comma form `redis-cluster://h1:p1,h2:p2` and turns it into the client's
/// `redis-cluster://h1:p1?node=h2:p2` form.
pub(super) fn client_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    if !scheme.ends_with("-cluster") {
        return url.to_string();
    }
    let (authority, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut hosts = hosts.trim_end_matches('/').split(',');
    let first = hosts.next().unwrap_or_default();
    let mut out = format!("{scheme}://");
    if let Some(u) = userinfo {
        out.push_str(u);
        out.push('@');
    }
    out.push_str(first);
    let extra: Vec<String> = hosts
        .filter(|h| !h.is_empty())
        .map(|h| format!("node={h}"))
        .collect();
    let mut params: Vec<String> = query.into_iter().map(str::to_string).collect();
    params.extend(extra);
    if !params.is_empty() {
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

/// What a TLS handshake that a Redis does not finish most likely means.
const PLAINTEXT: &str = "the URL asks for TLS (rediss://): if this Redis does not serve TLS, use redis:// (or REDIS_TLS=false)";

/// Tries one connection with `config`: `Ok(true)` when Redis answers, `Ok(false)` when it cannot
/// be reached yet (refused, timed out, a cluster not ready), and an error for what waiting will
/// not fix (a wrong password, a bad TLS set-up, a bad URL).
pub(super) async fn probe(config: &Config, deadline: Duration) -> Result<bool, StoreError> {
    let client = Builder::from_config(config.clone())
        .with_connection_config(|c| c.connection_timeout = deadline)
        .build()
        .map_err(|e| unavailable(&e))?;
    let outcome = tokio::time::timeout(deadline, client.init()).await;
    match outcome {
        Ok(Ok(_)) => {
            let _ = client.quit().await;
            Ok(true)
        }
        Ok(Err(e))
            if !transient(&e) && config.tls.is_some() && e.details().contains("InvalidData") =>
        {
            // A plaintext Redis answered the TLS hello with an error line: no TLS record.
            Err(StoreError::unavailable(format!(
                "{}: {PLAINTEXT}",
                unavailable(&e)
            )))
        }
        Ok(Err(e)) if !transient(&e) => Err(unavailable(&e)),
        Ok(Err(e)) if config.tls.is_some() && *e.kind() == ErrorKind::Timeout => {
            tracing::warn!(
                "Redis did not finish a TLS handshake within {deadline:?}; {PLAINTEXT}; serving by the store-failure policy until it answers"
            );
            Ok(false)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %unavailable(&e), "Redis is not reachable yet; serving by the store-failure policy until it is");
            Ok(false)
        }
        Err(_) if config.tls.is_some() => {
            // A plaintext Redis reads a TLS hello as the start of a command and waits for its
            // end: to the client, a handshake that never finishes.
            tracing::warn!(
                "Redis did not finish a TLS handshake within {deadline:?}; {PLAINTEXT}; serving by the store-failure policy until it answers"
            );
            Ok(false)
        }
        Err(_) => {
            tracing::warn!(
                "Redis did not answer within {deadline:?}; serving by the store-failure policy until it does"
            );
            Ok(false)
        }
    }
}

/// Whether Redis's answer says it refuses writes for now: full (`OOM`, past `maxmemory` with
/// `noeviction`), or a replica or a paused master that takes no writes.
pub(super) fn refuses_writes(details: &str) -> bool {
    ["OOM", "READONLY", "MISCONF"]
        .iter()
        .any(|code| details.starts_with(code))
}

/// Errors that go away by themselves: Redis not up yet, a network blip, a cluster forming. A
/// TLS handshake refused (an alert, a certificate for another name) arrives as an I/O error of
/// kind `InvalidData`, and waiting will not fix it.
pub(super) fn transient(e: &Error) -> bool {
    match e.kind() {
        ErrorKind::IO => !e.details().contains("InvalidData"),
        ErrorKind::Timeout | ErrorKind::Canceled | ErrorKind::Cluster => true,
        _ => false,
    }
}

/// The URL schemes slidegate reads.
const SCHEMES: [&str; 6] = [
    "redis",
    "rediss",
    "redis-cluster",
    "rediss-cluster",
    "redis-sentinel",
    "rediss-sentinel",
];

/// `url` as the client reads it: `host:port` (how the reference's `REDIS_URL` is written) is
/// `redis://host:port`; any other scheme than [`SCHEMES`] is refused with the accepted forms.
pub fn normalize_url(url: &str) -> Result<String, String> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Ok(format!("redis://{url}"));
    };
    if SCHEMES.contains(&scheme) {
        return Ok(url.to_string());
    }
    Err(format!(
        "--redis {}: `{scheme}://` is not a Redis URL slidegate reads; write redis://host:port \
         (rediss:// for TLS), redis-cluster://h1:port,h2:port, redis-sentinel://host:port?sentinelServiceName=NAME, \
         or host:port",
        redact(url)
    ))
}

/// The client's configuration from the URL and the TLS files.
pub(super) fn client_config(options: &RedisOptions) -> Result<Config, StoreError> {
    let url = client_url(&normalize_url(&options.url).map_err(StoreError::unavailable)?);
    let mut config = Config::from_url(&url).map_err(|e| {
        StoreError::unavailable(format!(
            "invalid Redis URL {}: {}",
            redact(&options.url),
            e.details()
        ))
    })?;
    if !options.tls.is_empty() {
        if config.tls.is_none() {
            return Err(StoreError::unavailable(
                "Redis TLS files were given for a URL without TLS: use rediss:// (or REDIS_TLS=true)",
            ));
        }
        config.tls = Some(
            fred::types::config::TlsConnector::from(
                crate::tls::client_config(&options.tls)
                    .map_err(|e| StoreError::unavailable(format!("Redis TLS: {e}")))?,
            )
            .into(),
        );
    }
    Ok(config)
}

/// The pool: connected and with the script loaded when Redis is reachable, else connecting in
/// the background. Redis answered the probe, yet the pool's connections or the script may take
/// longer than `--redis-connect-timeout` on a busy machine: then the connections keep coming up
/// in the background and the first call loads the script (as after a `FUNCTION FLUSH`), rather
/// than slidegate refusing to start over what waiting fixes. What waiting will not fix (a
/// refused password, a script Redis rejects) still stops the start.
pub(super) async fn start_pool(
    recipe: &PoolRecipe,
    library: &Library,
    reachable: bool,
) -> Result<Pool, StoreError> {
    let pool = recipe.build()?;
    let deadline = recipe.options.connect_timeout;
    if reachable {
        match tokio::time::timeout(deadline, pool.init()).await {
            Ok(Ok(_)) => match library.load(pool.next(), deadline).await {
                Ok(()) => {}
                Err(e) if transient(&e) => tracing::warn!(
                    error = %unavailable(&e),
                    "the script was not loaded into Redis at start; the first call loads it"
                ),
                // Waiting fixes a full Redis (keys expire): serve by the failure policy, not
                // ready, meanwhile; a library loaded before still decides once writes pass.
                Err(e) if refuses_writes(e.details()) => tracing::warn!(
                    error = %unavailable(&e),
                    "Redis refuses writes (used memory is past maxmemory): serving by the store-failure policy, not ready, until it takes them again"
                ),
                Err(e) => return Err(unavailable(&e)),
            },
            Ok(Err(e)) => return Err(unavailable(&e)),
            // The connections keep coming up: dropping the wait does not stop them.
            Err(_) => tracing::warn!(
                "Redis answered, but the connections were not all up within {deadline:?}; they keep connecting, and calls answer by the store-failure policy until they are"
            ),
        }
    } else {
        let connecting = pool.clone();
        tokio::spawn(async move {
            match connecting.init().await {
                Ok(_) => tracing::info!("connected to Redis"),
                Err(e) => tracing::error!(error = %unavailable(&e), "cannot connect to Redis"),
            }
        });
    }
    Ok(pool)
}

impl RedisStore {
    /// Follows how calls go. A pool whose calls have all failed for [`REPLACE_AFTER`] is
    /// replaced by a fresh one (in the background; calls go on meanwhile): a cluster client can
    /// be left unable to route after its topology changed under it (a slot migrated), and a new
    /// client reads the topology afresh. If the new pool cannot connect either (Redis is down),
    /// the old one stays and keeps reconnecting, and the next try waits twice as long, up to
    /// [`REPLACE_AT_MOST_EVERY`].
    pub(super) fn note(&self, ok: bool) {
        // A success while nothing failed (nearly every call) changes nothing. A failure noted
        // concurrently may be missed by this read; the next success clears it.
        if ok && !self.failing.load(Ordering::Relaxed) {
            return;
        }
        let mut health = lock(&self.health);
        // Written under the lock, so the flag is set whenever `failing_since` is.
        self.failing.store(!ok, Ordering::Relaxed);
        if ok {
            if health.failing_since.is_some() {
                *health = Health {
                    replacing: health.replacing,
                    ..Health::default()
                };
            }
            return;
        }
        let now = Instant::now();
        health.streak_since.get_or_insert(now);
        let since = *health.failing_since.get_or_insert(now);
        if since.elapsed() < health.retry_after || health.replacing {
            return;
        }
        health.replacing = true;
        drop(health);
        let (pool, recipe, health) = (
            self.sender.pool.clone(),
            self.recipe.clone(),
            self.health.clone(),
        );
        let library = self.sender.library.clone();
        tokio::spawn(async move {
            let replaced = recipe.fresh(&library).await;
            let mut state = lock(&health);
            state.replacing = false;
            // Calls that succeeded meanwhile ended the streak: nothing more to count.
            let still_failing = state.failing_since.is_some();
            if still_failing {
                state.failing_since = Some(Instant::now());
            }
            match replaced {
                Ok(fresh) => {
                    tracing::warn!("Redis calls kept failing: replaced the client pool");
                    let old = pool.swap(Arc::new(fresh));
                    state.replaced_in_vain += u32::from(still_failing);
                    state.retry_after = REPLACE_AFTER;
                    tokio::spawn(async move {
                        let _ = old.quit().await;
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Redis calls keep failing and a new client cannot connect either");
                    state.retry_after = (state.retry_after * 2).min(REPLACE_AT_MOST_EVERY);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(
            redact("redis://:secret@host:6379"),
            "redis://:***@host:6379"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        // The client reads user info up to the last `@`, so the password may hold one.
        assert_eq!(
            redact("redis://u:p@ss@host:6379"),
            "redis://u:***@host:6379"
        );
        assert_eq!(
            redact("redis-sentinel://h:26379?sentinelServiceName=m&sentinelPassword=pw&node=x:1"),
            "redis-sentinel://h:26379?sentinelServiceName=m&sentinelPassword=***&node=x:1"
        );
    }

    #[test]
    fn cluster_urls_accept_a_comma_list() {
        assert_eq!(
            client_url("redis-cluster://a:1,b:2,c:3"),
            "redis-cluster://a:1?node=b:2&node=c:3"
        );
        assert_eq!(
            client_url("rediss-cluster://u:p@a:1,b:2?foo=1"),
            "rediss-cluster://u:p@a:1?foo=1&node=b:2"
        );
        assert_eq!(client_url("redis://a:1"), "redis://a:1");
    }
}
