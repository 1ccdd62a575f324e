//! The batching of requests that reach the store at the same moment.
//!
//! Every decision is one request of a library call (the library decides a call's requests one
//! after the other, each as it would be alone: `lua/call.lua`). A request that arrives while [`Batcher`]'s calls
//! to its Redis are all out waits, and the next call to go carries every request that waited:
//! under load one `FCALL` (one socket write here, one read and one reply in Redis) decides tens
//! of requests, while a lone request is sent at once, never held back for company. On a cluster
//! each master has a batcher of its own (`nodes.rs`), and a call carries requests of several of
//! its slots.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::call::{Answer, DESCRIPTORS_PER_CALL, Request, Sender, not_served};
use super::master::{Master, RATE_WINDOW, Remedy};
use super::take_back::TakeBack;
use crate::store::{Bound, StoreError, Waited};

/// Requests waiting for a call, and how many calls are out.
struct Queue {
    calls: usize,
    /// In the order they came, which is the order of their ids.
    waiting: VecDeque<Waiting>,
    next_id: u64,
}

struct Waiting {
    id: u64,
    request: Request,
    since: Instant,
    answer: oneshot::Sender<Answer>,
}

/// Sends requests as they come while fewer than `max_calls` calls are out, and otherwise
/// queues them for the next call (see the module's notes). A queued request waits for its turn
/// until its [`crate::store::Deadlines::turn`] (a little before its caller's deadline, or
/// `--redis-queue-timeout`), and is then answered by the failure policy and never sent, even
/// while the calls ahead of it are still out, which also keeps a stalled Redis from collecting
/// an endless queue. Once sent, it waits for Redis until its reply moment
/// ([`crate::store::Deadlines::reply_by`]: `--redis-timeout` from then, or its caller's
/// deadline), whatever it waited before.
pub(super) struct Batcher {
    queue: Mutex<Queue>,
    max_calls: usize,
    /// On a cluster, the master its calls go to, by its own clients (`nodes.rs`).
    master: Option<Arc<Master>>,
}

impl Batcher {
    /// The batcher of a standalone Redis.
    pub fn new(max_calls: usize) -> Arc<Batcher> {
        Batcher::of(max_calls, None)
    }

    /// The cluster master its calls go to.
    pub fn master(&self) -> Option<&Arc<Master>> {
        self.master.as_ref()
    }

    /// The batcher of a cluster master.
    pub fn of(max_calls: usize, master: Option<Arc<Master>>) -> Arc<Batcher> {
        Arc::new(Batcher {
            queue: Mutex::new(Queue {
                calls: 0,
                waiting: VecDeque::new(),
                next_id: 0,
            }),
            max_calls: max_calls.max(1),
            master,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A counter and a queue of plain values: one left by a panicking holder is still usable.
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The answer to `request`: sent at once when a call is free, else with the next call.
    pub async fn submit(self: &Arc<Self>, request: Request, sender: &Sender) -> Answer {
        let turn = {
            let mut queue = self.lock();
            if queue.calls < self.max_calls {
                queue.calls += 1;
                Turn::Now(request)
            } else {
                let (answer, later) = oneshot::channel();
                let since = Instant::now();
                let id = queue.next_id;
                queue.next_id += 1;
                let until = request.deadlines.turn;
                let bound = request.deadlines.turn_bound();
                queue.waiting.push_back(Waiting {
                    id,
                    request,
                    since,
                    answer,
                });
                Turn::Later {
                    id,
                    later,
                    since,
                    until,
                    bound,
                }
            }
        };
        match turn {
            // A request whose hits are taken back if its reply comes after its caller was
            // answered: sent as a batch of one, by a task of its own that waits on for a late
            // reply (`send`).
            Turn::Now(request) if request.take_back.is_some() => {
                let (answer, later) = oneshot::channel();
                let alone = Waiting {
                    id: 0,
                    request,
                    since: Instant::now(),
                    answer,
                };
                tokio::spawn(self.clone().send(vec![alone], sender.clone()));
                later.await.unwrap_or_else(|_| {
                    Err(StoreError::unavailable(
                        "the call carrying this request was dropped",
                    ))
                })
            }
            Turn::Now(request) => {
                let _out = CallOut {
                    batcher: self.clone(),
                    sender: sender.clone(),
                };
                let answer = sender.call_one(self.master.as_deref(), request).await;
                self.note(&answer, sender);
                answer
            }
            Turn::Later {
                id,
                mut later,
                since,
                until,
                bound,
            } => {
                let answer = match tokio::time::timeout_at(until, &mut later).await {
                    Ok(answer) => answer,
                    Err(_) if self.leave(id) => {
                        return Err(StoreError::Timeout(Waited::Turn(since.elapsed(), bound)));
                    }
                    // Its call is out: the call answers it by its reply moment.
                    Err(_) => later.await,
                };
                answer.unwrap_or_else(|_| {
                    Err(StoreError::unavailable(
                        "the call carrying this request was dropped",
                    ))
                })
            }
        }
    }

    /// Takes request `id` out of the queue, if it is still waiting there: true when it was
    /// (it is never sent), false when its call has taken it.
    fn leave(&self, id: u64) -> bool {
        let mut queue = self.lock();
        match queue.waiting.binary_search_by_key(&id, |w| w.id) {
            Ok(at) => {
                queue.waiting.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    /// Counts a call to a cluster master by how its (first) answer went: a timeout or the
    /// master unreachable is a failure; a refusal (not its slot) is not.
    fn note(&self, answer: &Answer, sender: &Sender) {
        if let Some(master) = &self.master {
            let failed = matches!(
                answer,
                Err(StoreError::Timeout(_) | StoreError::Unavailable { .. })
            ) && !not_served(answer);
            let remedy = master.note(failed);
            if remedy == Remedy::None {
                return;
            }
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            let sender = sender.clone();
            runtime.spawn(async move {
                sender
                    .refresh(Instant::now() + sender.timeout.max(RATE_WINDOW))
                    .await;
            });
            if remedy == Remedy::Replace {
                runtime.spawn(master.clone().replace());
            }
        }
    }

    /// A call came back (or its caller left): the requests that waited go with the next call,
    /// sent from a task of its own; with none waiting, the call's place is free. A request
    /// whose turn ended meanwhile is answered so, and not sent.
    fn hand_on(self: &Arc<Self>, sender: &Sender) {
        let batch = {
            let mut queue = self.lock();
            let now = Instant::now();
            let mut batch = Vec::new();
            let mut descriptors = 0;
            while let Some(next) = queue.waiting.front() {
                let size = next.request.descriptors();
                if !batch.is_empty() && descriptors + size > DESCRIPTORS_PER_CALL {
                    break;
                }
                let Some(waiting) = queue.waiting.pop_front() else {
                    break;
                };
                if waiting.answer.is_closed() {
                    // Its caller gave up (Envoy's timeout): nothing to send.
                    continue;
                }
                let deadlines = waiting.request.deadlines;
                if now >= deadlines.turn {
                    let waited = now.duration_since(waiting.since);
                    let turn = Waited::Turn(waited, deadlines.turn_bound());
                    let _ = waiting.answer.send(Err(StoreError::Timeout(turn)));
                    continue;
                }
                descriptors += size;
                batch.push(waiting);
            }
            if batch.is_empty() {
                queue.calls -= 1;
                return;
            }
            batch
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to send with (the process is ending): fail what waited.
            let mut queue = self.lock();
            queue.calls -= 1;
            let stranded = batch.into_iter().chain(queue.waiting.drain(..));
            for waiting in stranded {
                let _ = waiting
                    .answer
                    .send(Err(StoreError::unavailable("the server is shutting down")));
            }
            return;
        };
        let (batcher, sender) = (self.clone(), sender.clone());
        runtime.spawn(batcher.send(batch, sender));
    }

    /// Sends `batch` in one call, answers each request by its moment or by Redis's reply,
    /// hands the call's place on, and takes back what the reply shows recorded for requests
    /// whose callers the policy answered first, where asked to ([`TakeBack`]). The place's
    /// guard is made inside the task: a task dropped unstarted hands nothing on.
    async fn send(self: Arc<Self>, batch: Vec<Waiting>, sender: Sender) {
        let master = self.master.clone();
        let out = CallOut {
            batcher: self,
            sender: sender.clone(),
        };
        let sent = Instant::now();
        let mut pending = Vec::with_capacity(batch.len());
        let mut requests = Vec::with_capacity(batch.len());
        for waiting in batch {
            pending.push(Pending {
                answer: Some(waiting.answer),
                by: waiting.request.deadlines.reply_by(sent, sender.timeout),
                take_back: waiting.request.take_back.clone(),
                answered_by_policy: false,
                lane: waiting.request.lane,
            });
            requests.push(waiting.request);
        }
        let call = sender.call(master.as_deref(), requests);
        let batcher = out.batcher.clone();
        let mut out = Some(out);
        let replies = answer_in_time(call, &mut pending, sent, &mut out).await;
        if let Some(first) = replies.first() {
            batcher.note(first, &sender);
        }
        let mut late = Vec::new();
        for (pending, reply) in pending.into_iter().zip(replies) {
            match (pending.answer, pending.take_back, reply) {
                (Some(answer), _, reply) => {
                    let _ = answer.send(reply);
                }
                (None, Some(take_back), Ok(reply)) if pending.answered_by_policy => {
                    late.push((take_back, reply, pending.lane));
                }
                _ => {}
            }
        }
        // The call's place goes on before what it recorded late is taken back.
        drop(out);
        for (take_back, reply, lane) in late {
            take_back
                .take_back(&reply, &sender, master.as_deref(), lane)
                .await;
        }
    }
}

/// A request of a call that is out: where its answer goes (until it is given), until when
/// Redis's reply is its caller's ([`crate::store::Deadlines::reply_by`]), and, where its
/// recorded hits are to be taken back if its caller is answered by the policy first, what it
/// records.
struct Pending {
    answer: Option<oneshot::Sender<Answer>>,
    by: (Instant, Bound),
    take_back: Option<Arc<TakeBack>>,
    /// Its decision was handed the policy's answer before the reply came. A decision whose
    /// caller had left by then (the answer not taken) keeps its hits: Envoy's own failure mode
    /// decided whether the request passed.
    answered_by_policy: bool,
    lane: usize,
}

/// The replies of `call` (sent at `sent`), each request's caller answered by the failure
/// policy meanwhile once its moment passes: the requests of one call came at different times,
/// for callers of different deadlines, and the call waits for the latest of them. Once every
/// caller is answered, the call's place goes on (`out`): a call that still waits then waits
/// only for a late reply whose hits are to be taken back, and holds up no decision.
async fn answer_in_time(
    call: impl Future<Output = Vec<Answer>>,
    pending: &mut [Pending],
    sent: Instant,
    out: &mut Option<CallOut>,
) -> Vec<Answer> {
    tokio::pin!(call);
    loop {
        let next = pending
            .iter()
            .filter(|p| p.answer.is_some())
            .map(|p| p.by.0)
            .min();
        let Some(next) = next else {
            drop(out.take());
            return call.await;
        };
        tokio::select! {
            biased;
            replies = &mut call => return replies,
            () = tokio::time::sleep_until(next) => {
                let now = Instant::now();
                for p in pending.iter_mut().filter(|p| p.by.0 <= now) {
                    if let Some(answer) = p.answer.take() {
                        let waited = Waited::Redis(p.by.0.saturating_duration_since(sent), p.by.1);
                        p.answered_by_policy = answer.send(Err(StoreError::Timeout(waited))).is_ok();
                    }
                }
            }
        }
    }
}

enum Turn {
    Now(Request),
    /// Queued as `id` at `since`, answered by the policy at `until` (for `bound`) if its call
    /// has not taken it by then.
    Later {
        id: u64,
        later: oneshot::Receiver<Answer>,
        since: Instant,
        until: Instant,
        bound: Bound,
    },
}

/// A call that is out; when it ends, however it ends, its place goes to the waiting requests.
struct CallOut {
    batcher: Arc<Batcher>,
    sender: Sender,
}

impl Drop for CallOut {
    fn drop(&mut self) {
        self.batcher.hand_on(&self.sender);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use arc_swap::ArcSwap;

    use super::*;
    use crate::store::redis::Library;
    use crate::store::redis::call::Slots;

    /// The client's future for one command is about 7 KB, and so is `Library::load`'s: were
    /// either part of a call's future, every decision's future (which awaits one, or waits in
    /// the queue with room for one) would be as large, made and copied per request.
    #[test]
    fn a_call_and_a_queued_request_are_small_futures() {
        let pool = fred::types::Builder::default_centralized()
            .build_pool(1)
            .expect("a pool builds without connecting");
        let sender = Sender {
            pool: Arc::new(ArcSwap::from_pointee(pool)),
            library: Library::new(),
            load_timeout: Duration::from_secs(2),
            resent: Arc::default(),
            timeout: Duration::from_millis(15),
            wait_replicas: 0,
            redirect: false,
            stale: Arc::default(),
            read_at: Arc::default(),
        };
        let request = || Request {
            now_ms: None,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadlines: crate::store::Deadlines::for_caller(Instant::now(), Duration::ZERO, None),
            take_back: None,
        };
        let call = sender.call_one(None, request());
        let batcher = Batcher::new(1);
        let submit = batcher.submit(request(), &sender);
        let (call, submit) = (std::mem::size_of_val(&call), std::mem::size_of_val(&submit));
        assert!(call < 2_048, "a call's future is {call} bytes");
        assert!(
            submit < 2_048,
            "a submitted request's future is {submit} bytes"
        );
    }
}
