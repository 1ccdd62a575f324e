//! The admin API's two calls on Redis: inspect (the library's inspect function, read-only: the
//! keys are read here and counted as the decision counts them) and reset (the reset function:
//! every key of one slot deleted in one call). Both go to the master serving each key's slot,
//! by that master's own clients on Redis Cluster, and follow no redirection: an admin call
//! during a slot's migration fails and says so, and is sent again by the operator. The undo of
//! a rejected spread request reads its descriptors again here too.

use std::collections::BTreeMap;

use fred::types::Value;

use super::compact::CompactEntry;
use super::*;
use crate::store::memory::Slot;
use crate::store::{InspectFuture, ItemState, ResetFuture, StoreKey, WindowOutcome, longest_ms};

impl RedisStore {
    pub(super) fn inspect_items<'a>(
        &'a self,
        items: &'a [CheckItem<'a>],
        now_ms: u64,
    ) -> InspectFuture<'a> {
        Box::pin(async move {
            let reads = items.iter().map(|item| self.inspect_one(item, now_ms));
            join_all(reads).await.into_iter().collect()
        })
    }

    async fn inspect_one(
        &self,
        item: &CheckItem<'_>,
        now_ms: u64,
    ) -> Result<ItemState, StoreError> {
        let now = match self.clock {
            ClockSource::Server => Some(now_ms),
            ClockSource::Redis => None,
        };
        let (keys, args) = self.inspect_args(item, now);
        let reply = self
            .admin_run(&item.key, Function::Inspect, keys, args)
            .await?;
        Ok(Read::from_reply(reply, longest_ms(&item.windows))?.state(item))
    }

    /// `item`'s keys as they are now, read by the inspect function through `client` (a
    /// decision's), at `now_ms`.
    pub(super) async fn read(
        &self,
        item: &CheckItem<'_>,
        now_ms: u64,
        client: &Client,
    ) -> Result<Read, StoreError> {
        let (keys, args) = self.inspect_args(item, Some(now_ms));
        let slot = fred::util::redis_keyslot(item.key.tag().as_bytes());
        let reply = self
            .sender
            .library
            .run(
                client,
                (client, self.recipe.options.connect_timeout),
                Function::Inspect,
                slot,
                keys,
                args,
            )
            .await
            .map_err(|e| encode::call_failed(&e))?;
        Read::from_reply(reply, longest_ms(&item.windows))
    }

    /// The inspect function's keys and arguments for `item` at `now_ms` (None: Redis's clock).
    fn inspect_args(&self, item: &CheckItem<'_>, now_ms: Option<u64>) -> (Vec<Key>, Vec<Value>) {
        let keys = vec![
            self.key(item.key.log()),
            self.key(item.key.counters()),
            self.key(item.key.ban()),
        ];
        let now = now_ms.map_or_else(String::new, |now| now.to_string());
        let longest = longest_ms(&item.windows).to_string();
        (keys, vec![now.into(), longest.into()])
    }

    /// An admin call of `function` on `key`'s slot, waiting as an admin call may: fred's
    /// client with options has no Lua calls of its own, and `fcall` on it reaches the client
    /// inside, which waits only a decision's `--redis-timeout`, so the library sends it as a
    /// custom command.
    pub(super) async fn admin_run(
        &self,
        key: &StoreKey,
        function: Function,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, StoreError> {
        let slot = fred::util::redis_keyslot(key.tag().as_bytes());
        let timeout = self.recipe.options.connect_timeout;
        let client = self.admin_client(key);
        self.sender
            .library
            .run(&client, (&client, timeout), function, slot, keys, args)
            .await
            .map_err(|e| encode::call_failed(&e))
    }

    pub(super) fn reset_keys<'a>(&'a self, keys: &'a [StoreKey]) -> ResetFuture<'a> {
        Box::pin(async move {
            // One call per slot (standalone Redis: one slot for all), each key once.
            let mut slots: BTreeMap<u16, Vec<&StoreKey>> = BTreeMap::new();
            for key in keys {
                let slot = if self.cluster {
                    fred::util::redis_keyslot(key.tag().as_bytes())
                } else {
                    0
                };
                let group = slots.entry(slot).or_default();
                if !group.contains(&key) {
                    group.push(key);
                }
            }
            let calls = slots.into_values().map(|group| self.reset_slot(group));
            let mut held: Vec<(&StoreKey, bool)> = Vec::new();
            for result in join_all(calls).await {
                held.extend(result?);
            }
            Ok(keys
                .iter()
                .map(|key| held.iter().any(|(k, cleared)| *k == key && *cleared))
                .collect())
        })
    }

    /// The client for an admin call on `key`'s slot, which waits up to
    /// `--redis-connect-timeout` rather than a decision's `--redis-timeout`: an operator waits.
    fn admin_client(&self, key: &StoreKey) -> fred::clients::WithOptions<Client> {
        let options = fred::types::config::Options {
            timeout: Some(self.recipe.options.connect_timeout),
            ..fred::types::config::Options::default()
        };
        self.slot_client(key, 0).with_options(&options)
    }

    async fn reset_slot<'k>(
        &self,
        group: Vec<&'k StoreKey>,
    ) -> Result<Vec<(&'k StoreKey, bool)>, StoreError> {
        let Some(first) = group.first() else {
            return Ok(Vec::new());
        };
        let names: Vec<Key> = group
            .iter()
            .flat_map(|key| [key.log(), key.counters(), key.ban()])
            .map(|name| self.key(name))
            .collect();
        let reply = self
            .admin_run(first, Function::Reset, names, Vec::new())
            .await?;
        let reply: Vec<i64> = reply.convert().map_err(|e| encode::call_failed(&e))?;
        if reply.len() != group.len() {
            return Err(StoreError::Protocol(format!(
                "the reset function answered {} counts for {} descriptors",
                reply.len(),
                group.len()
            )));
        }
        Ok(group
            .into_iter()
            .zip(reply.into_iter().map(|n| n > 0))
            .collect())
    }
}

/// What the inspect function read of one descriptor's keys.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Read {
    now_ms: u64,
    /// The log's entries inside the longest window, oldest first: (time, cum, weight).
    log: Vec<(u64, u64, u64)>,
    /// The counters: (bucket length, bucket index, hits).
    buckets: Vec<(u64, u64, u64)>,
    ban_end_ms: u64,
}

impl Read {
    fn from_reply(reply: Value, longest_ms: u64) -> Result<Read, StoreError> {
        let bad =
            |what: &str| StoreError::Protocol(format!("the inspect function answered {what}"));
        let Value::Array(parts) = reply else {
            return Err(bad("no array"));
        };
        let mut parts = parts.into_iter();
        let now_ms = parts
            .next()
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("no time"))?;
        let texts = |v: Option<Value>| -> Vec<String> {
            match v {
                Some(Value::Array(items)) => items.iter().filter_map(Value::as_string).collect(),
                _ => Vec::new(),
            }
        };
        let log = match parts.next() {
            Some(Value::Bytes(text)) => {
                compact_entries(&text, now_ms.saturating_sub(longest_ms))
                    .ok_or_else(|| bad("a compact log slidegate did not write"))?
            }
            Some(Value::String(text)) => {
                compact_entries(text.as_bytes(), now_ms.saturating_sub(longest_ms))
                    .ok_or_else(|| bad("a compact log slidegate did not write"))?
            }
            members => texts(members)
                .iter()
                .map(|m| {
                    entry(m)
                        .ok_or_else(|| bad(&format!("a log entry slidegate did not write: {m:?}")))
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let counters = texts(parts.next());
        let buckets = counters
            .chunks(2)
            .map(|pair| match pair {
                [field, hits] => bucket(field, hits),
                _ => None,
            })
            .map(|b| b.ok_or_else(|| bad("a counter slidegate did not write")))
            .collect::<Result<Vec<_>, _>>()?;
        let ban_end_ms = match parts.next() {
            Some(Value::Null) | None => 0,
            Some(v) => v.as_u64().ok_or_else(|| bad("a ban that is not a time"))?,
        };
        Ok(Read {
            now_ms,
            log,
            buckets,
            ban_end_ms,
        })
    }

    /// The state read, counted as a decision counts it (the embedded store's rules, which
    /// the library follows: `tests/differential.rs`).
    fn slot(&self) -> Slot {
        Slot::held(&self.log, &self.buckets, self.ban_end_ms)
    }

    fn state(&self, item: &CheckItem<'_>) -> ItemState {
        self.slot().state(item, self.now_ms)
    }

    /// `item`'s windows as a decision that recorded nothing reports them, where the item
    /// did or did not fit.
    pub(super) fn outcomes(&self, item: &CheckItem<'_>, fits: bool) -> Vec<WindowOutcome> {
        let slot = self.slot();
        item.windows
            .iter()
            .map(|w| slot.outcome(item.algorithm, w, self.now_ms, fits, item.size()))
            .collect()
    }
}

/// A compact log's entries after `edge`, as (time, cum, weight) with cum counted from the first
/// of them; None for a text slidegate did not write.
fn compact_entries(text: &[u8], edge: u64) -> Option<Vec<(u64, u64, u64)>> {
    let mut cum = 0;
    Some(
        compact::entries(text)?
            .into_iter()
            .filter(|e| e.at_ms > edge)
            .map(|CompactEntry { at_ms, weight }| {
                cum += weight;
                (at_ms, cum, weight)
            })
            .collect(),
    )
}

/// A log member, `<cum>:<weight>:<time>[:<prefix>:<i>]`, as (time, cum, weight).
fn entry(member: &str) -> Option<(u64, u64, u64)> {
    let mut parts = member.split(':');
    let cum = parts.next()?.parse().ok()?;
    let weight = parts.next()?.parse().ok()?;
    let at = parts.next()?.parse().ok()?;
    Some((at, cum, weight))
}

/// A counter, field `<bucket_ms>:<bucket>` with its hits.
fn bucket(field: &str, hits: &str) -> Option<(u64, u64, u64)> {
    let (size, index) = field.split_once(':')?;
    Some((size.parse().ok()?, index.parse().ok()?, hits.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::store::{Role, Window};

    fn item(windows: Vec<Window>, algorithm: Algorithm) -> CheckItem<'static> {
        CheckItem {
            key: StoreKey::new("d:k=v", ""),
            windows: Cow::Owned(windows),
            algorithm,
            ban_ms: None,
            hits: 0,
            role: Role::Enforce,
            debit: false,
            text: None,
        }
    }

    /// Two windows: 10 a minute, 20 in 100 s.
    fn minute_and_100s() -> Vec<Window> {
        vec![
            Window {
                limit: 10,
                length_ms: 60_000,
            },
            Window {
                limit: 20,
                length_ms: 100_000,
            },
        ]
    }

    fn texts(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|t| Value::from(*t)).collect())
    }

    /// A log whose middle entry was taken back out (a rejected cross-slot request) counts as
    /// the script does: from the cum before the window's first entry.
    #[test]
    fn a_log_counts_from_the_cum_before_its_first_entry() {
        let reply = Value::Array(vec![
            Value::Integer(100_000),
            texts(&[
                "00000000000000000002:2:40000",
                "00000000000000000006:1:70000:ab-1:1",
                "00000000000000000009:3:99000",
            ]),
            texts(&[]),
            Value::Integer(112_000),
        ]);
        let read = Read::from_reply(reply, 60_000).expect("a well-formed reply");
        let state = read.state(&item(minute_and_100s(), Algorithm::SlidingLog));
        assert_eq!(state.ban_remaining_ms, 12_000);
        assert_eq!(state.entries, Some(3));
        // Inside 60 s: the entries of 70 s and 99 s, counted 9 - (6 - 1) = 4.
        assert_eq!(
            state.windows[0],
            WindowOutcome {
                count: 4,
                reset_ms: 30_000
            }
        );
        assert_eq!(
            state.windows[1],
            WindowOutcome {
                count: 9,
                reset_ms: 40_000
            }
        );
    }

    /// Running totals that go down (no log slidegate wrote) count nothing rather than wrap.
    #[test]
    fn totals_that_go_down_count_nothing() {
        let reply = Value::Array(vec![
            Value::Integer(100_000),
            texts(&[
                "00000000000000000009:1:40000",
                "00000000000000000002:1:70000",
            ]),
            texts(&[]),
            Value::Null,
        ]);
        let read = Read::from_reply(reply, 100_000).expect("a well-formed reply");
        let item = item(minute_and_100s(), Algorithm::SlidingLog);
        let counts: Vec<u64> = read.state(&item).windows.iter().map(|w| w.count).collect();
        assert_eq!(counts, vec![0, 0]);
        let counts: Vec<u64> = read
            .outcomes(&item, false)
            .iter()
            .map(|w| w.count)
            .collect();
        assert_eq!(counts, vec![0, 0]);
    }

    /// A compact log (a 4-byte slot an entry, a weighted entry's weight in the slot after it)
    /// reads as the same entries, counted alike.
    #[test]
    fn a_compact_log_reads_as_its_entries() {
        let mut text = vec![4 + 16];
        text.extend_from_slice(&40_000u64.to_be_bytes()[2..]);
        text.extend_from_slice(&6u64.to_be_bytes()[2..]);
        for slot in [0x8000_0000u32, 2, 30_000, 0x8000_0000 + 59_000, 3] {
            text.extend_from_slice(&slot.to_be_bytes());
        }
        let reply = Value::Array(vec![
            Value::Integer(100_000),
            Value::Bytes(text.clone().into()),
            texts(&[]),
            Value::Null,
        ]);
        let read = Read::from_reply(reply, 100_000).expect("a well-formed reply");
        assert_eq!(
            read.log,
            [(40_000, 2, 2), (70_000, 3, 1), (99_000, 6, 3)],
            "(time, cum, weight)"
        );
        let windows = vec![Window {
            limit: 10,
            length_ms: 60_000,
        }];
        let state = read.state(&item(windows, Algorithm::SlidingLog));
        assert_eq!(
            state.windows[0],
            WindowOutcome {
                count: 4,
                reset_ms: 30_000
            }
        );
        // Cut short, or a slot width it does not know: not slidegate's.
        for bad in [&text[..text.len() - 1], &[5u8; 17][..]] {
            let reply = Value::Array(vec![
                Value::Integer(1),
                Value::Bytes(bad.to_vec().into()),
                texts(&[]),
                Value::Null,
            ]);
            assert!(Read::from_reply(reply, 60_000).is_err());
        }
    }

    #[test]
    fn counters_count_the_buckets_overlapping_each_window() {
        // 60 s in 6 buckets of 10 s at 125 s: buckets 6 to 12 overlap.
        let reply = Value::Array(vec![
            Value::Integer(125_000),
            texts(&[]),
            texts(&[
                "10000:5", "7", "10000:6", "2", "10000:12", "1", "5000:24", "9",
            ]),
            Value::Null,
        ]);
        let read = Read::from_reply(reply, 60_000).expect("a well-formed reply");
        let windows = vec![Window {
            limit: 10,
            length_ms: 60_000,
        }];
        let state = read.state(&item(windows, Algorithm::SlidingCounter { buckets: 6 }));
        assert_eq!(state.entries, None);
        assert_eq!(state.ban_remaining_ms, 0);
        assert_eq!(
            state.windows[0],
            WindowOutcome {
                count: 3,
                reset_ms: 5_000
            }
        );
    }

    #[test]
    fn entries_slidegate_did_not_write_are_an_error() {
        let reply = Value::Array(vec![
            Value::Integer(1),
            texts(&["hello"]),
            texts(&[]),
            Value::Null,
        ]);
        let error = Read::from_reply(reply, 60_000).expect_err("not a slidegate entry");
        assert!(error.to_string().contains("\"hello\""), "{error}");
    }
}
