//! Taking back what a call recorded for a request whose caller was told no without it: the
//! deny policy answered the caller `OVER_LIMIT` because Redis's reply had not come by the
//! decision's moment, and the reply that came after all shows hits recorded. They would take
//! the user's quota for a request that never passed, so they go again (`docs/redis.md`, *The
//! deadline and queueing*). Where the caller was told `UNAVAILABLE` (Envoy's
//! `failure_mode_deny` decides whether the request passed) or the allow policy admitted it,
//! the hits stand, and no take-back is asked for.
//!
//! The removal of one recorded entry is here too: the undo of a rejected request spread over
//! several masters (`decide.rs`) removes its entries the same way.

use std::time::Duration;

use fred::types::config::Options;
use futures_util::future::join_all;

use super::call::Sender;
use super::encode::{read_reply, unavailable};
use super::master::Master;
use super::*;
use crate::store::Window;

/// One descriptor of a request, as taking back what it records needs it.
pub(super) struct Recorded {
    /// Its data key (the log, or a counter's hash), as Redis holds it.
    pub key: Key,
    pub slot: u16,
    pub algorithm: Algorithm,
    pub hits: u64,
    pub windows: Vec<Window>,
    /// Usage already spent (a debit), which stays whatever the answer.
    pub debit: bool,
}

impl Recorded {
    /// `item`, whose data key the store sends as `key`.
    pub fn of(key: Key, item: &CheckItem<'_>) -> Recorded {
        Recorded {
            key,
            slot: fred::util::redis_keyslot(item.key.tag().as_bytes()),
            algorithm: item.algorithm,
            hits: item.hits,
            windows: item.windows.to_vec(),
            debit: item.debit,
        }
    }
}

/// What a request records, kept with it while its call is out, for the case that its caller
/// is answered by the deny policy before the call's reply comes.
#[derive(Default)]
pub(super) struct TakeBack {
    /// Its descriptors, in the request's order.
    descriptors: Vec<Recorded>,
    /// A tentative request's member prefix, which names its entries.
    prefix: Option<String>,
}

impl TakeBack {
    pub fn new(descriptors: Vec<Recorded>, prefix: Option<String>) -> TakeBack {
        TakeBack {
            descriptors,
            prefix,
        }
    }

    /// Takes back what `reply` (the request's answer: the call's time, then its descriptors')
    /// says was recorded, by `master`'s clients (a cluster master the call went to) or the
    /// store's, each removal waiting as long as the client waits on a silent connection.
    /// Debits stay; a removal that fails leaves its entry until it ages out (stricter, never
    /// looser).
    pub async fn take_back(
        &self,
        reply: &[i64],
        sender: &Sender,
        master: Option<&Master>,
        lane: usize,
    ) {
        let windows = self.descriptors.iter().map(|d| d.windows.len());
        let read = match read_reply(reply, windows, self.prefix.is_some()) {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(error = %e, "a late reply could not be read: what it recorded stays");
                return;
            }
        };
        let client = sender.client_for(master, lane);
        let mut removals = Vec::new();
        let mut hits = 0;
        for (i, (d, (outcome, entry))) in self
            .descriptors
            .iter()
            .zip(read.items.iter().zip(&read.entries))
            .enumerate()
        {
            if !outcome.recorded || d.debit {
                continue;
            }
            hits += d.hits;
            let named = self.prefix.as_deref().map(|prefix| (prefix, i + 1));
            let taken = Taken {
                entry: *entry,
                now_ms: read.now_ms,
                tentative: named,
            };
            let wait = Some(sender.load_timeout);
            removals.extend(removal(&client, sender, wait, d, &taken));
        }
        if removals.is_empty() {
            return;
        }
        let failed = join_all(removals).await.into_iter().find_map(Result::err);
        match failed {
            Some(e) => {
                tracing::warn!(error = %unavailable(&e), "could not take back the hits of a call answered by the deny policy before Redis replied: they stay until they age out")
            }
            None => {
                tracing::debug!(
                    hits,
                    "took back the hits of a call answered by the deny policy before Redis replied"
                )
            }
        }
    }
}

/// An entry a request recorded, as its removal names it: the entry the reply reported, the
/// call's time, and, for a tentative request, its member prefix and its place in its call.
pub(super) struct Taken<'a> {
    pub entry: Entry,
    pub now_ms: u64,
    pub tentative: Option<(&'a str, usize)>,
}

/// The calls that remove what `d` recorded as `taken`, by `client`, each waiting `wait` where
/// given (the client's own timeout otherwise). A log's entry goes by the library's undo
/// function (in either log format: a sorted set's by its member, as the script wrote it, a
/// compact log's by its time and weight); a counter's hits from the bucket of the call's time
/// of every distinct bucket length.
pub(super) fn removal(
    client: &Client,
    sender: &Sender,
    wait: Option<Duration>,
    d: &Recorded,
    taken: &Taken<'_>,
) -> Vec<UndoFuture<'static>> {
    let options = Options {
        timeout: wait,
        max_redirections: client.is_clustered().then_some(0),
        ..Options::default()
    };
    let Entry { cum, at_ms } = taken.entry;
    match d.algorithm {
        Algorithm::SlidingLog => {
            let member = match taken.tentative {
                Some((prefix, i)) => format!("{cum:020}:{}:{at_ms}:{prefix}:{i}", d.hits),
                None => format!("{cum:020}:{}:{at_ms}", d.hits),
            };
            let args = vec![
                member.into(),
                at_ms.to_string().into(),
                d.hits.to_string().into(),
            ];
            let (key, slot) = (d.key.clone(), d.slot);
            let (library, load_timeout) = (sender.library.clone(), sender.load_timeout);
            let client = client.clone();
            vec![Box::pin(async move {
                let waiting = client.with_options(&options);
                library
                    .run(
                        &waiting,
                        (&client, load_timeout),
                        Function::Undo,
                        slot,
                        vec![key],
                        args,
                    )
                    .await
                    .map(|_| ())
            })]
        }
        Algorithm::SlidingCounter { buckets } => {
            let hits = i64::try_from(d.hits).unwrap_or(i64::MAX);
            let mut sizes: Vec<u64> = d
                .windows
                .iter()
                .map(|w| w.bucket_span(buckets, taken.now_ms).0)
                .collect();
            sizes.sort_unstable();
            sizes.dedup();
            sizes
                .into_iter()
                .map(|size| {
                    let field = format!("{size}:{}", taken.now_ms / size);
                    let (client, key, options) = (client.clone(), d.key.clone(), options.clone());
                    let future: UndoFuture<'static> = Box::pin(async move {
                        client
                            .with_options(&options)
                            .hincrby::<i64, _, _>(key, field, -hits)
                            .await
                            .map(|_| ())
                    });
                    future
                })
                .collect()
        }
    }
}
