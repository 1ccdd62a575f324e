//! `--redis-wait-replicas N`: a call is answered only once N replicas hold what it wrote.
//!
//! Redis replicates asynchronously: a master that fails before its replicas have a write loses
//! it, and the replica promoted in its place admits those requests again. After each script
//! call, `WAIT N <ms>` on the connection that carried it (Redis counts that connection's writes)
//! waits until N replicas have them, within the call's time. Fewer in time: the call's requests
//! are answered by the failure policy, and their entries stay (stricter, never looser).

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use tokio::time::Instant;

use crate::store::StoreError;

/// Waits until `replicas` replicas acknowledge the writes of the call just made by `client`,
/// whose keys sit in the slot of `routing` (on a cluster: `WAIT` goes to that master, over the
/// connection the call took), at most until `until`.
pub(super) async fn confirm(
    client: &Client,
    routing: Option<&Key>,
    replicas: u32,
    until: Instant,
) -> Result<(), StoreError> {
    let ms = until.saturating_duration_since(Instant::now()).as_millis();
    // WAIT's 0 means for ever: a call with no time left asks for a millisecond.
    let ms = u64::try_from(ms).unwrap_or(u64::MAX).max(1);
    let slot = routing.map(|key| fred::util::redis_keyslot(key.as_bytes()));
    let wait = CustomCommand::new_static("WAIT", ClusterHash::from(slot), false);
    // The client's own timeout a little past WAIT's, which Redis keeps itself.
    let client = client.with_options(&Options {
        timeout: Some(std::time::Duration::from_millis(ms + 50)),
        ..Options::default()
    });
    let acknowledged: Result<i64, Error> = client
        .custom(
            wait,
            vec![i64::from(replicas), i64::try_from(ms).unwrap_or(i64::MAX)],
        )
        .await;
    match acknowledged {
        Ok(n) if n >= i64::from(replicas) => Ok(()),
        Ok(n) => Err(StoreError::unavailable(format!(
            "{n} of {replicas} replicas acknowledged the call's writes within {ms} ms (--redis-wait-replicas)"
        ))),
        Err(e) => Err(super::encode::unavailable(&e)),
    }
}
