//! Deciding a request: its items grouped by slot (or by master), one script call per group,
//! tentative calls combined, and the entries of a rejected request spread over several
//! masters removed again (`undo`), so a request is all-or-nothing and never over-admits.

use tracing::Instrument as _;

use super::encode::{parse_reply, unavailable};
use super::take_back::{Recorded, Taken, removal};
use super::*;

/// The counts of a rejected spread request's group without the hits taken back: every
/// descriptor on a key counted all the hits the request recorded on it (debits stay). A log
/// descriptor that fitted reports when the oldest entry it counts leaves, which changes only
/// where the window held nothing else (then 0): the entry taken back was the log's newest (an
/// entry is stamped no earlier than its log's newest). A descriptor that did not fit reports 0
/// where its hits now fit the window. Answers the descriptors whose resets these counts do not
/// settle, to be read again ([`RedisStore::undo`]): a counter's hits went to the bucket of the
/// call's clock, which may be behind the newest bucket, and a descriptor that still does not
/// fit waits for fewer hits to leave.
fn take_back_counts(
    items: &[CheckItem<'_>],
    group: &[usize],
    outcomes: &mut [ItemOutcome],
) -> Vec<usize> {
    let taken: Vec<(&crate::store::StoreKey, u64)> = group
        .iter()
        .filter(|&&i| outcomes[i].recorded && !items[i].debit)
        .map(|&i| (&items[i].key, items[i].hits))
        .collect();
    let mut unsettled = Vec::new();
    for &i in group {
        let hits: u64 = taken
            .iter()
            .filter(|(key, _)| **key == items[i].key)
            .map(|(_, hits)| hits)
            .sum();
        if hits == 0 {
            continue;
        }
        let (item, outcome) = (&items[i], &mut outcomes[i]);
        let mut settled = true;
        for (w, window) in outcome.windows.iter_mut().zip(item.windows.iter()) {
            w.count = w.count.saturating_sub(hits);
            let room = w.count + item.size() <= u64::from(window.limit);
            if (outcome.fits && w.count == 0) || (!outcome.fits && room) {
                w.reset_ms = 0;
            } else if !outcome.fits || matches!(item.algorithm, Algorithm::SlidingCounter { .. }) {
                settled = false;
            }
        }
        if !settled {
            unsettled.push(i);
        }
    }
    unsettled
}

impl RedisStore {
    /// One group's call: by its master's batcher (the store's on standalone Redis), or by the
    /// redirect client where its cluster master is not known yet. A group of one slot whose
    /// master refused it (the slot moved) goes again to the master the cluster names now; if
    /// that is still the one that refused, the slot is mid-migration and this request's keys
    /// have left (or are new): it is answered by the failure policy until the slot has moved.
    ///
    /// As a trace's span (`--tracing`): the master and slot, the attempt (2 when it followed
    /// its slot) and the outcome.
    pub(super) async fn call_group(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> Result<GroupReply, StoreError> {
        let span = if crate::traces::spans_wanted() {
            tracing::debug_span!(
                "redis_call",
                otel.name = "redis",
                node = tracing::field::Empty,
                slot = tracing::field::Empty,
                items = group.items.len(),
                attempt = 1u32,
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        if !span.is_disabled() {
            if let Some(master) = group.master.as_ref().and_then(|b| b.master()) {
                span.record("node", tracing::field::display(&master.server));
            }
            if let Slots::One(slot) = group.slots {
                span.record("slot", slot);
            }
        }
        let once = self.call_group_once(items, group, now_ms, call, mode, &span);
        // Untraced, the call's future is awaited as it is.
        let result = if span.is_disabled() {
            once.await
        } else {
            once.instrument(span.clone()).await
        };
        span.record(
            "outcome",
            result.as_ref().map_or_else(StoreError::kind, |_| "ok"),
        );
        result
    }

    async fn call_group_once(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        now_ms: u64,
        call: &Call,
        mode: Mode,
        span: &tracing::Span,
    ) -> Result<GroupReply, StoreError> {
        let mut request = self.script_input(items, group, now_ms, call, mode);
        let batcher = self.batcher.as_ref().or(group.master.as_ref());
        let mut answer = match batcher {
            Some(batcher) => batcher.submit(request, &self.sender).await,
            // A cluster whose slots the client has not read yet: the redirect client routes
            // it alone, awaited here, so it waits for no late reply: what it records stands.
            None => {
                request.take_back = None;
                self.sender.call_one(None, request).await
            }
        };
        if let Slots::One(slot) = group.slots
            && self.nodes.is_some()
            && not_served(&answer)
        {
            span.record("attempt", 2u32);
            // Boxed: rare, and its future would otherwise enlarge every decision's.
            answer = Box::pin(self.follow_slot(items, group, slot, now_ms, call, mode)).await;
        }
        parse_reply(&answer?, items, &group.items, mode == Mode::Tentative)
    }

    /// [`RedisStore::call_group`]'s second try for a slot whose master refused it.
    async fn follow_slot(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        slot: u16,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> call::Answer {
        self.sender.resent.fetch_add(1, Ordering::Relaxed);
        // Reading the slots again is waited for as a call sent now would be.
        let (until, _) = call.deadlines.reply_by(Instant::now(), self.sender.timeout);
        self.sender.refresh(until).await;
        let now = self
            .nodes
            .as_ref()
            .and_then(|nodes| nodes.batcher(slot, &self.sender));
        let moved = match (&now, &group.master) {
            (Some(now), Some(before)) => !Arc::ptr_eq(now, before),
            (Some(_), None) => true,
            (None, _) => false,
        };
        let mut request = self.script_input(items, group, now_ms, call, mode);
        let source = match now {
            Some(master) if moved => {
                tracing::debug!(
                    slot,
                    "a slot moved to another master: its request follows it"
                );
                return master.submit(request, &self.sender).await;
            }
            Some(master) => master.master().cloned(),
            None => None,
        };
        // Still the master that refused it: the slot is migrating from it, and this request's
        // keys have left it (or are new).
        let importer = match (&source, &self.nodes) {
            (Some(source), Some(nodes)) => nodes.importer(slot, source, until).await,
            _ => None,
        };
        let answer = match importer.as_ref().and_then(|b| b.master()) {
            // Awaited here, so it waits for no late reply: what it records stands.
            Some(importer) => {
                request.take_back = None;
                self.sender.call_asking(importer, request).await
            }
            None => Err(StoreError::unavailable("no master imports it")),
        };
        match answer {
            Err(e) if not_served(&Err::<(), _>(e.clone())) || importer.is_none() => {
                Err(StoreError::unavailable(format!(
                    "hash slot {slot} is moving between masters and this request's keys are on neither where the cluster says: answered by the failure policy until it has moved"
                )))
            }
            answer => answer,
        }
    }

    /// With `rejected`, the request is already rejected elsewhere (`Store::check_rejected`);
    /// with `take_back`, what a late reply shows recorded is taken back
    /// (`Store::check_or_take_back`).
    pub(super) async fn decide(
        &self,
        items: &[CheckItem<'_>],
        groups: Vec<Group>,
        now_ms: u64,
        rejected: bool,
        take_back: bool,
    ) -> Result<CheckOutcome, StoreError> {
        let number = self.calls.fetch_add(1, Ordering::Relaxed);
        let call = Call {
            take_back: take_back && !rejected,
            number,
            // Requests take the pool's clients in turn, as `Pool::next` would hand them out
            // (the low 32 bits: a `usize` on every target).
            lane: usize::try_from(number & u64::from(u32::MAX)).unwrap_or(0),
            deadlines: Deadlines::new(Instant::now(), self.recipe.options.queue_timeout),
        };
        let mode = match (rejected, groups.len()) {
            (true, _) => Mode::Rejected,
            (false, 1) => Mode::Final,
            (false, _) => Mode::Tentative,
        };
        // One group (standalone Redis, or one slot) is awaited as it is: collecting its large
        // future into a list for `join_all` would copy it for nothing.
        let replies = match groups.as_slice() {
            [group] => vec![self.call_group(items, group, now_ms, &call, mode).await],
            _ => {
                join_all(
                    groups
                        .iter()
                        .map(|g| self.call_group(items, g, now_ms, &call, mode)),
                )
                .await
            }
        };
        let (groups, replies, mode) = if replies.iter().any(not_served) {
            // Boxed: rare, and its future would otherwise enlarge every decision's.
            Box::pin(self.per_slot(items, groups, replies, now_ms, &call, mode)).await
        } else {
            (groups, replies, mode)
        };
        let mut outcomes = vec![ItemOutcome::default(); items.len()];
        let mut recorded_groups: Vec<(&[usize], u64, Vec<Entry>)> = Vec::new();
        let mut first_error = None;
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(reply) => {
                    if reply.recorded() {
                        recorded_groups.push((&group.items, reply.now_ms, reply.entries));
                    }
                    for (&i, outcome) in group.items.iter().zip(reply.items) {
                        outcomes[i] = outcome;
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let admitted = first_error.is_none()
            && !rejected
            && admits(items.iter().zip(&outcomes).map(|(i, o)| (i.role, o.fits)));
        if mode == Mode::Tentative && !admitted && !recorded_groups.is_empty() {
            // Boxed: rare, and its future would otherwise enlarge every decision's.
            Box::pin(self.undo(items, &recorded_groups, &call, &mut outcomes)).await;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(CheckOutcome {
                admitted,
                items: outcomes,
            }),
        }
    }

    /// The groups of several slots whose master refused one of their keys (it no longer serves
    /// that slot), sent again as a call per slot, each to the master of its slot (and on, where
    /// that one refuses it too: `call_group`): tentatively, as the request now spans several calls, unless it was already
    /// rejected. Such a group recorded nothing (see the spread function in `lua/register.lua`); the other
    /// groups' replies stand (they were tentative, as the request had several groups).
    pub(super) async fn per_slot(
        &self,
        items: &[CheckItem<'_>],
        groups: Vec<Group>,
        replies: Vec<Result<GroupReply, StoreError>>,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> (Vec<Group>, Vec<Result<GroupReply, StoreError>>, Mode) {
        let mut kept = Vec::with_capacity(groups.len() + 2);
        let mut again = Vec::new();
        for (group, reply) in groups.into_iter().zip(replies) {
            if group.slots == Slots::Several && not_served(&reply) {
                let mut slots = self.slot_groups(items, &group.items);
                if let Some(nodes) = &self.nodes {
                    for g in &mut slots {
                        if let Slots::One(slot) = g.slots {
                            g.master = nodes.batcher(slot, &self.sender);
                        }
                    }
                }
                again.extend(slots);
            } else {
                kept.push((group, reply));
            }
        }
        tracing::debug!(
            calls = again.len(),
            "a master no longer serves every slot of a request: a call per slot"
        );
        self.sender.resent.fetch_add(1, Ordering::Relaxed);
        let mode = if mode == Mode::Rejected {
            mode
        } else {
            Mode::Tentative
        };
        let replies = join_all(
            again
                .iter()
                .map(|g| self.call_group(items, g, now_ms, call, mode)),
        )
        .await;
        kept.extend(again.into_iter().zip(replies));
        let (groups, replies) = kept.into_iter().unzip();
        (groups, replies, mode)
    }

    /// Removes the entries a rejected request recorded in the slots that admitted it (debits
    /// stay: that usage happened), by the library's undo function, in either log format. From a compact
    /// log, exactly; from a sorted-set log, a removed entry leaves the running totals of later
    /// entries as they were, so windows that still hold an earlier entry count its hits until
    /// that entry ages out: stricter for a while, never looser.
    pub(super) async fn undo(
        &self,
        items: &[CheckItem<'_>],
        groups: &[(&[usize], u64, Vec<Entry>)],
        call: &Call,
        outcomes: &mut [ItemOutcome],
    ) {
        let prefix = self.prefix(call);
        let mut removals = Vec::new();
        let mut unsettled = Vec::new();
        for (group, now_ms, entries) in groups {
            unsettled.extend(
                take_back_counts(items, group, outcomes)
                    .into_iter()
                    .map(|i| (i, *now_ms)),
            );
            for (position, (&i, entry)) in group.iter().zip(entries).enumerate() {
                if !outcomes[i].recorded || items[i].debit {
                    continue;
                }
                outcomes[i].recorded = false;
                let taken = Taken {
                    entry: *entry,
                    now_ms: *now_ms,
                    tentative: Some((&prefix, position + 1)),
                };
                let client = self.undo_client(&items[i], call.lane);
                let recorded =
                    Recorded::of(self.key(items[i].key.data(items[i].algorithm)), &items[i]);
                removals.extend(removal(&client, &self.sender, None, &recorded, &taken));
            }
        }
        for result in join_all(removals).await {
            if let Err(e) = result {
                // The members stay until they age out: stricter, never looser.
                tracing::warn!(error = %unavailable(&e), "could not remove hits of a rejected cross-slot request");
            }
        }
        self.read_again(items, &unsettled, call.lane, outcomes)
            .await;
    }

    /// The descriptors whose resets the counts do not settle (`take_back_counts`), read again
    /// at their call's time once the hits are removed: their windows as they are now.
    async fn read_again(
        &self,
        items: &[CheckItem<'_>],
        unsettled: &[(usize, u64)],
        lane: usize,
        outcomes: &mut [ItemOutcome],
    ) {
        let reads = unsettled.iter().map(|&(i, now_ms)| {
            let client = self.slot_client(&items[i].key, lane);
            async move { (i, self.read(&items[i], now_ms, &client).await) }
        });
        for (i, read) in join_all(reads).await {
            match read {
                Ok(read) => outcomes[i].windows = read.outcomes(&items[i], outcomes[i].fits),
                // The counts stand; a reset stays as counted with the hits, maybe sooner.
                Err(e) => {
                    tracing::debug!(error = %e, "could not read a rejected cross-slot request's descriptor again")
                }
            }
        }
    }

    /// The client that removes `item`'s entries: on a cluster, its slot's master's own (a
    /// client that follows no redirection: an entry whose slot moved meanwhile stays until it
    /// ages out, stricter), or the redirect client while that master is not known.
    fn undo_client(&self, item: &CheckItem<'_>, lane: usize) -> Client {
        self.slot_client(&item.key, lane)
    }

    /// The client for a call on `key`'s slot outside a decision's batch: on a cluster, the
    /// slot's master's own, or the redirect client while that master is not known.
    pub(super) fn slot_client(&self, key: &crate::store::StoreKey, lane: usize) -> Client {
        let master = self.nodes.as_ref().and_then(|nodes| {
            let slot = fred::util::redis_keyslot(key.tag().as_bytes());
            nodes.batcher(slot, &self.sender)?.master().cloned()
        });
        self.sender.client_for(master.as_deref(), lane)
    }

    /// A single group on standalone Redis. On a cluster, one group per master that serves
    /// the items' slots (a call of the spread function reaches them all: `docs/redis.md`,
    /// *Redis Cluster*), or, while the masters are not known or the script goes by `EVALSHA`, one
    /// per slot.
    pub(super) fn groups(&self, items: &[CheckItem<'_>]) -> Vec<Group> {
        let Some(nodes) = &self.nodes else {
            return vec![Group {
                items: (0..items.len()).collect(),
                slots: Slots::Standalone,
                master: None,
            }];
        };
        let mut groups = self.slot_groups(items, &(0..items.len()).collect::<Vec<_>>());
        for group in &mut groups {
            if let Slots::One(slot) = group.slots {
                group.master = nodes.batcher(slot, &self.sender);
            }
        }
        if groups.len() == 1 || !self.sender.library.spreads() {
            return groups;
        }
        // Slots of one master in one group.
        let mut merged: Vec<Group> = Vec::with_capacity(groups.len());
        for group in groups {
            let same = merged
                .iter_mut()
                .find(|m| match (&m.master, &group.master) {
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    _ => false,
                });
            match same {
                Some(m) => {
                    m.items.extend(group.items);
                    m.slots = Slots::Several;
                }
                None => merged.push(group),
            }
        }
        merged
    }

    /// One group per hash slot of the items at `members`, each with no master chosen.
    pub(super) fn slot_groups(&self, items: &[CheckItem<'_>], members: &[usize]) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for &i in members {
            let slot = Slots::One(fred::util::redis_keyslot(items[i].key.tag().as_bytes()));
            match groups.iter_mut().find(|g| g.slots == slot) {
                Some(group) => group.items.push(i),
                None => groups.push(Group {
                    items: vec![i],
                    slots: slot,
                    master: None,
                }),
            }
        }
        groups
    }
}

/// What the calls of one request share: its number in this process, which names its
/// tentative log entries ([`RedisStore::prefix`]), and the client that carries them
/// ([`Request::lane`]).
pub(super) struct Call {
    pub(super) number: u64,
    pub(super) lane: usize,
    /// Until when the request may wait for its turn, and for Redis once sent.
    pub(super) deadlines: Deadlines,
    /// What its calls record is taken back from a reply that comes after its moment
    /// (`take_back.rs`).
    pub(super) take_back: bool,
}

/// Items of a request that go in one script call.
pub(super) struct Group {
    pub(super) items: Vec<usize>,
    pub(super) slots: Slots,
    /// On a cluster, the batcher of the master that serves them, when known.
    pub(super) master: Option<Arc<Batcher>>,
}

pub(super) struct GroupReply {
    pub(super) now_ms: u64,
    pub(super) items: Vec<ItemOutcome>,
    /// Per item, the log entry it recorded (zeros: none).
    pub(super) entries: Vec<Entry>,
}

/// A log entry a request recorded: its running total and, in a tentative request, its time,
/// which with the request's prefix name it, for its removal ([`RedisStore::undo`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) cum: u64,
    pub(super) at_ms: u64,
}

impl GroupReply {
    /// Whether the call recorded anything (a descriptor's entry or hits) for its request.
    pub(super) fn recorded(&self) -> bool {
        self.items.iter().any(|o| o.recorded)
    }
}
