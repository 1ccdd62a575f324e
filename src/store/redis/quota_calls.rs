//! Quotas on Redis (Envoy's Rate Limit Quota Service): a report's buckets sent to the
//! library's quota function (`lua/quota.lua`), one call per hash slot (every bucket of a slot
//! in one call; on standalone Redis, one call), each decided atomically, so replicas sharing
//! the Redis share every bucket's limit.

use std::collections::BTreeMap;

use fred::types::Value;

use super::packed::{self, Item};
use super::*;
use crate::store::shares::{Grant, MOST_ELAPSED_MS, MOST_REPORTED, QuotaItem, QuotaOutcome};
use crate::store::{QuotaFuture, Role, rule_text};

impl RedisStore {
    pub(super) fn quota_items<'a>(
        &'a self,
        items: &'a [QuotaItem<'a>],
        ttl_ms: u64,
        now_ms: u64,
    ) -> QuotaFuture<'a> {
        Box::pin(async move {
            let mut slots: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
            for (i, item) in items.iter().enumerate() {
                let slot = if self.cluster {
                    fred::util::redis_keyslot(item.key.tag().as_bytes())
                } else {
                    0
                };
                slots.entry(slot).or_default().push(i);
            }
            let calls = slots
                .into_values()
                .map(|group| self.quota_slot(items, group, ttl_ms, now_ms));
            let mut outcomes: Vec<Option<QuotaOutcome>> = vec![None; items.len()];
            for answered in join_all(calls).await {
                for (i, outcome) in answered? {
                    outcomes[i] = Some(outcome);
                }
            }
            outcomes
                .into_iter()
                .map(|o| o.ok_or_else(|| StoreError::Protocol("a bucket went unanswered".into())))
                .collect()
        })
    }

    /// One call of the quota function for the buckets `group` of `items`, all in one slot.
    async fn quota_slot(
        &self,
        items: &[QuotaItem<'_>],
        group: Vec<usize>,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<Vec<(usize, QuotaOutcome)>, StoreError> {
        let mut keys = Vec::with_capacity(2 * group.len());
        let now = match self.clock {
            ClockSource::Server => now_ms.to_string(),
            ClockSource::Redis => String::new(),
        };
        let mut args: Vec<Value> = vec![
            group.len().to_string().into(),
            now.into(),
            ttl_ms.to_string().into(),
        ];
        for &i in &group {
            let item = &items[i];
            keys.push(self.key(item.key.data(item.algorithm)));
            keys.push(self.key(item.key.holders()));
            let rule = rule_text(
                &item.windows,
                item.algorithm,
                0,
                Role::Enforce,
                false,
                self.recipe.options.log_format,
            );
            // A request of one descriptor in mode 3 (usage), then the holder's figures.
            args.extend([
                Value::from("7"),
                item.allowed.min(MOST_REPORTED).to_string().into(),
                rule.into(),
                item.holder.into(),
                item.denied.min(MOST_REPORTED).to_string().into(),
                item.elapsed_ms.min(MOST_ELAPSED_MS).to_string().into(),
            ]);
        }
        let Some(&first) = group.first() else {
            return Ok(Vec::new());
        };
        // Reports come every few seconds, not on a request's path: they wait as admin calls do.
        let reply = self
            .admin_run(&items[first].key, Function::Quota, keys, args)
            .await?;
        let counted: Vec<usize> = group.iter().map(|&i| items[i].windows.len()).collect();
        let outcomes = read_reply(&reply, &counted)?;
        Ok(group.into_iter().zip(outcomes).collect())
    }
}

/// The quota function's reply (layout in `lua/quota.lua`), for buckets of `windows` windows
/// each.
fn read_reply(reply: &Value, windows: &[usize]) -> Result<Vec<QuotaOutcome>, StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("the quota function answered {what}"));
    let bytes = reply.as_bytes().ok_or_else(|| bad(format!("{reply:?}")))?;
    let values = packed::read_all(bytes).map_err(|e| bad(e.to_string()))?;
    let mut values = values.into_iter().skip(1);
    let mut number = || match values.next() {
        Some(Item::Int(n)) => Ok(n),
        Some(Item::Text(text)) => Err(StoreError::Protocol(
            String::from_utf8_lossy(text).into_owned(),
        )),
        None => Err(bad("too few values".into())),
    };
    let u32_of = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
    let mut outcomes = Vec::with_capacity(windows.len());
    for &m in windows {
        let kind = number()?;
        if kind < 0 {
            // A failed bucket: its error text follows.
            number()?;
        }
        let (tokens, fill, interval) = (number()?, number()?, number()?);
        let grant = match kind {
            0 => Grant::Full,
            1 => Grant::Held,
            2 => Grant::TokenBucket {
                max_tokens: u32_of(tokens),
                tokens_per_fill: u32_of(fill),
                fill_interval_s: u32_of(interval),
            },
            other => return Err(bad(format!("a grant of kind {other}"))),
        };
        let counts = (0..m)
            .map(|_| number().map(|n| u64::try_from(n).unwrap_or(0)))
            .collect::<Result<Vec<_>, _>>()?;
        outcomes.push(QuotaOutcome { grant, counts });
    }
    Ok(outcomes)
}
