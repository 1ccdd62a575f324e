//! Script calls, and the batching of requests that reach the store at the same moment.
//!
//! Every decision is one request of the script (`lua/slidegate.lua` decides a call's requests one
//! after the other, each as it would be alone). On standalone Redis, a request that arrives
//! while [`Batcher`]'s calls are all out waits, and the next call to go carries every request
//! that waited: under load one `FCALL` (one socket write here, one read and one reply in Redis)
//! decides tens of requests, while a lone request is sent at once, never held back for company.
//! On a cluster each master has a batcher of its own, and a call carries requests of several of
//! its slots by the script's spread function (see the script's end); a request the master no
//! longer serves (a slot moved since the routing was read) is sent again on its own, its keys
//! declared, where the client follows the cluster's redirection.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::prelude::*;
use futures_util::future::join_all;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::packed::{self, Item, Items};
use super::{Library, call_failed};
use crate::store::StoreError;

/// How long to wait before sending a call Redis answered `TRYAGAIN` (a slot mid-migration).
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(5);

/// The most descriptors one call carries (a request's descriptors always go together): enough
/// that a queue under load leaves in a few calls, few enough that a call keeps Redis busy for
/// about a millisecond, so calls queued behind it stay well inside the store deadline.
const DESCRIPTORS_PER_CALL: usize = 32;

/// One request's part of a script call: its time, its keys, and its arguments after the call's
/// request count and time (layout in `lua/slidegate.lua`).
pub(super) struct Request {
    /// When it was asked, in ms since the epoch; `None` where Redis's clock decides.
    pub now_ms: Option<u64>,
    pub keys: Vec<Key>,
    pub args: Vec<Value>,
    pub slots: Slots,
    /// Which of the pool's clients carries it (taken modulo the pool's size). Every call of
    /// one request goes by the same client: a client is one task that writes to and reads
    /// from every master, so a request of three masters wakes that one task, where a client
    /// per call would wake three, and tokio hands all but one of them to another worker
    /// (a `futex` wake-up each).
    pub lane: usize,
    /// When its caller stops waiting (`grpc-timeout`), where it said.
    pub deadline: Option<Instant>,
}

impl Request {
    /// How many descriptors it carries: its arguments are its shape, two per descriptor, and a
    /// tentative request's prefix (`RedisStore::script_input`).
    fn descriptors(&self) -> usize {
        self.args.len().saturating_sub(1) / 2
    }
}

/// Where a request's keys sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slots {
    /// Standalone Redis: no slots.
    Standalone,
    /// A cluster: one hash slot holds them all.
    One(u16),
    /// A cluster: several slots of one master (the routing said so when the request was made).
    Several,
}

/// What Redis Cluster answers a script that reaches for a key of a slot its master does not
/// serve (moved, or mid-migration with the key already gone).
const NOT_SERVED: &str = "Script attempted to access a non local key";

/// One request's answer: the script's reply for it, as integers.
pub(super) type Answer = Result<Vec<i64>, StoreError>;

/// What sends a call: the pool (replaced whole when it stays broken) and the script's library.
#[derive(Clone)]
pub(super) struct Sender {
    pub pool: Arc<ArcSwap<Pool>>,
    pub library: Library,
    /// How long loading the library may take (`--redis-connect-timeout`).
    pub load_timeout: Duration,
    /// Requests a cluster master refused (it no longer serves their slot) and that were sent
    /// again; read by the metrics.
    pub resent: Arc<AtomicU64>,
    /// How long a call waits for Redis for a caller that sent no deadline (`--redis-timeout`).
    pub timeout: Duration,
}

impl Sender {
    /// One call carrying one request alone (its keys declared, unless they sit in several
    /// slots).
    pub async fn call_one(&self, request: Request) -> Answer {
        self.call(vec![request])
            .await
            .pop()
            .unwrap_or_else(|| Err(StoreError::Protocol("script reply is empty".into())))
    }

    /// One call carrying `requests`; an answer per request, in order. Requests of several
    /// cluster slots (one master's: see [`Batcher`]) go by the spread function; a request of
    /// one slot that its master no longer serves is sent again on its own, and one of several
    /// slots is answered [`NotServed`], for the caller to send a call per slot.
    pub async fn call(&self, requests: Vec<Request>) -> Vec<Answer> {
        if !over_several_slots(&requests) {
            self.call_declared(requests).await
        } else if self.library.spreads() {
            self.call_spread(requests).await
        } else {
            self.each_alone(requests).await
        }
    }

    /// By `EVALSHA` a call's keys must share a slot: each request of one slot alone, and those
    /// of several slots answered [`NotServed`].
    async fn each_alone(&self, requests: Vec<Request>) -> Vec<Answer> {
        join_all(requests.into_iter().map(|r| async move {
            match r.slots {
                Slots::Several => Err(not_served_error("the script goes by EVALSHA")),
                _ => self.call_one(r).await,
            }
        }))
        .await
    }

    /// A call's client (its first request's lane) and how long it waits ([`call_wait`]); `None`
    /// when every caller has stopped waiting.
    fn terms(&self, requests: &[Request]) -> Option<(usize, Duration)> {
        let lane = requests.first().map_or(0, |r| r.lane);
        call_wait(requests, self.timeout, Instant::now()).map(|wait| (lane, wait))
    }

    /// One call with every key declared (they share a slot, or there are no slots). The
    /// requests are not needed after it, so their parts move into the command.
    async fn call_declared(&self, requests: Vec<Request>) -> Vec<Answer> {
        let count = requests.len();
        let Some((lane, wait)) = self.terms(&requests) else {
            return vec![Err(StoreError::Timeout(Duration::ZERO)); count];
        };
        let mut keys = Vec::with_capacity(requests.iter().map(|r| r.keys.len()).sum());
        let mut args = Vec::with_capacity(2 + requests.iter().map(|r| r.args.len()).sum::<usize>());
        args.push(int(count));
        args.push(call_now(&requests));
        for request in requests {
            keys.extend(request.keys);
            args.extend(request.args);
        }
        match self.send(lane, wait, keys, args, false).await {
            Ok(reply) => split(reply, count),
            Err(e) => vec![Err(e); count],
        }
    }

    /// One call of the spread function: the keys first, after their number, and the first
    /// declared (it routes the call). The requests are kept (their parts are shared buffers) to
    /// send again any the master refuses.
    async fn call_spread(&self, requests: Vec<Request>) -> Vec<Answer> {
        let count = requests.len();
        let Some((lane, wait)) = self.terms(&requests) else {
            return vec![Err(StoreError::Timeout(Duration::ZERO)); count];
        };
        let key_count: usize = requests.iter().map(|r| r.keys.len()).sum();
        let arg_count: usize = requests.iter().map(|r| r.args.len()).sum();
        let mut args = Vec::with_capacity(3 + key_count + arg_count);
        args.push(int(key_count));
        for request in &requests {
            args.extend(request.keys.iter().cloned().map(Value::from));
        }
        args.push(int(count));
        args.push(call_now(&requests));
        for request in &requests {
            args.extend(request.args.iter().cloned());
        }
        let routing: Vec<Key> = requests
            .iter()
            .flat_map(|r| r.keys.first())
            .take(1)
            .cloned()
            .collect();
        let answers = match self.send(lane, wait, routing, args, true).await {
            Ok(reply) => split(reply, count),
            Err(e) => vec![Err(e); count],
        };
        self.resend_refused(requests, answers).await
    }

    /// Requests of one slot the master no longer serves, each again on its own (nothing of
    /// theirs was recorded: see the script's end); the others' answers as they are.
    async fn resend_refused(
        &self,
        requests: Vec<Request>,
        mut answers: Vec<Answer>,
    ) -> Vec<Answer> {
        let again: Vec<usize> = (0..answers.len())
            .filter(|&i| requests[i].slots != Slots::Several && not_served(&answers[i]))
            .collect();
        if again.is_empty() {
            return answers;
        }
        tracing::debug!(
            requests = again.len(),
            "a master no longer serves a slot it was sent; sending those requests on their own"
        );
        self.resent.fetch_add(again.len() as u64, Ordering::Relaxed);
        let mut requests: Vec<Option<Request>> = requests.into_iter().map(Some).collect();
        let resent = join_all(
            again
                .iter()
                .filter_map(|&i| requests[i].take())
                .map(|request| self.call_one(request)),
        )
        .await;
        for (i, answer) in again.into_iter().zip(resent) {
            answers[i] = answer;
        }
        answers
    }

    /// Sends until Redis answers. TRYAGAIN: a slot is being migrated and this call's keys are
    /// split between two masters for a moment; Redis asks to send it again shortly (the caller's
    /// deadline bounds the retries). A missing function (a restart, FUNCTION FLUSH, a node that
    /// never saw it): load it and send again, once. Keys and arguments are shared buffers: a
    /// copy to send again is cheap.
    async fn send(
        &self,
        lane: usize,
        wait: Duration,
        keys: Vec<Key>,
        args: Vec<Value>,
        spread: bool,
    ) -> Result<Value, StoreError> {
        let mut loaded = false;
        loop {
            let pool = self.pool.load();
            let sent = self
                .library
                .call_as(
                    client_of(&pool, lane),
                    Some(wait),
                    keys.clone(),
                    args.clone(),
                    spread,
                )
                .await;
            match sent {
                Ok(reply) => return Ok(reply),
                Err(e) if e.details().starts_with("TRYAGAIN") => {
                    tokio::time::sleep(TRY_AGAIN_AFTER).await;
                }
                Err(e) if Library::missing(&e) && !loaded => {
                    loaded = true;
                    // Boxed: rare, and its future (about 7 KB) would otherwise be part of
                    // every call's, and of every decision's that awaits one.
                    if let Err(e) =
                        Box::pin(self.library.load(pool.next(), self.load_timeout)).await
                    {
                        return Err(call_failed(&e));
                    }
                }
                Err(e) => return Err(call_failed(&e)),
            }
        }
    }
}

/// The longest a caller whose deadline is its own waits for a call (a `grpc-timeout` of hours
/// would otherwise hold a call's place that long while Redis does not answer), unless
/// `--redis-timeout` is longer; the same bound as a decision's wait for its turn
/// (`QUEUED_AT_MOST`).
const CALLER_WAIT_AT_MOST: Duration = Duration::from_secs(1);

/// How long a call carrying `requests` waits for Redis, from `now`: as long as the longest any
/// of their callers still waits, its deadline where it sent one (up to [`CALLER_WAIT_AT_MOST`]
/// or `timeout`, the longer), else `timeout`. A caller that waits longer than
/// `--redis-timeout` (Envoy with a longer filter timeout, a gRPC client's own deadline) is not
/// answered with a failure while it would still take an answer; one that waits less frees the
/// call's place sooner. `None` when every caller has stopped waiting: nothing to send. Each
/// try of [`Sender::send`] waits this long (as each waited `--redis-timeout` before).
pub(super) fn call_wait(requests: &[Request], timeout: Duration, now: Instant) -> Option<Duration> {
    let wait = requests
        .iter()
        .map(|r| match r.deadline {
            Some(deadline) => deadline
                .saturating_duration_since(now)
                .min(CALLER_WAIT_AT_MOST.max(timeout)),
            None => timeout,
        })
        .max()?;
    // A zero timeout is none to the client: a call that may wait no time is not sent.
    (!wait.is_zero()).then_some(wait)
}

/// The client of `pool` for `lane` (see [`Request::lane`]). The pool is read at each try, so
/// a pool replaced meanwhile is the one used.
pub(super) fn client_of(pool: &Pool, lane: usize) -> &Client {
    let clients = pool.clients();
    // A pool always has a client (built with at least one); `next` covers the impossible.
    clients
        .get(lane % clients.len().max(1))
        .unwrap_or_else(|| pool.next())
}

/// Whether `requests` sit in more than one cluster slot (one of several slots, or several of
/// one slot each).
fn over_several_slots(requests: &[Request]) -> bool {
    match requests.first().map(|first| first.slots) {
        Some(Slots::One(slot)) => requests.iter().any(|r| r.slots != Slots::One(slot)),
        Some(Slots::Several) => true,
        Some(Slots::Standalone) | None => false,
    }
}

/// The time a call's requests are decided at: the latest of theirs (none is decided before it
/// was asked), or `""`, Redis's own clock.
fn call_now(requests: &[Request]) -> Value {
    let latest = requests
        .iter()
        .map(|r| r.now_ms)
        .try_fold(0, |latest, now| now.map(|now| latest.max(now)));
    match latest {
        Some(now_ms) => number(now_ms),
        None => Value::from_static_str(""),
    }
}

/// A count as a script argument.
fn int(n: usize) -> Value {
    number(u64::try_from(n).unwrap_or(u64::MAX))
}

/// The digits of 0 to 99, two per number ("05" for 5).
static SMALL_NUMBERS: [[u8; 2]; 100] = small_numbers();

const fn small_numbers() -> [[u8; 2]; 100] {
    let mut digits = [[0u8; 2]; 100];
    let (mut n, mut tens, mut ones) = (0, b'0', b'0');
    while n < 100 {
        digits[n] = [tens, ones];
        n += 1;
        if ones == b'9' {
            (tens, ones) = (tens + 1, b'0');
        } else {
            ones += 1;
        }
    }
    digits
}

/// A whole number as a script argument. Most are small (a call's request count, a request's
/// shape, a descriptor's hits): those go as static digits, a bulk string the client copies
/// out, where the client would format an integer into digits on every call. Larger ones (a
/// call's time) go as integers: no string made for them. Redis reads the same digits either
/// way.
pub(super) fn number(n: u64) -> Value {
    match usize::try_from(n) {
        Ok(i) if i < 10 => Value::from_static(&SMALL_NUMBERS[i][1..]),
        Ok(i) if i < 100 => Value::from_static(&SMALL_NUMBERS[i]),
        _ => Value::Integer(i64::try_from(n).unwrap_or(i64::MAX)),
    }
}

/// A request of a spread call reached for a key of a slot its master does not serve.
#[derive(Debug, thiserror::Error)]
#[error("the master does not serve this key's slot")]
struct NotServed;

fn not_served_error(why: &str) -> StoreError {
    StoreError::Unavailable {
        context: format!("script: {why}"),
        source: Some(Arc::new(NotServed)),
    }
}

/// Whether `answer` is [`NotServed`]: the request is to be sent again, a call per slot.
pub(super) fn not_served(answer: &Result<impl Sized, StoreError>) -> bool {
    matches!(answer, Err(StoreError::Unavailable { source: Some(source), .. }) if source.is::<NotServed>())
}

/// Splits the script's reply (one flat array, packed: the call's time, then per request its
/// length and its integers, or `-1` and what failed; see [`super::packed`]) into the requests'
/// answers, each the call's time and the request's integers. A reply of the wrong shape fails
/// every request of the call.
fn split(reply: Value, count: usize) -> Vec<Answer> {
    split_flat(&reply, count).unwrap_or_else(|e| vec![Err(e); count])
}

fn split_flat(reply: &Value, count: usize) -> Result<Vec<Answer>, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("script reply {what}"));
    // fred hands a bulk string over as bytes unless it is valid UTF-8, which a packed array's
    // first byte (0x90 to 0x9f, 0xdc or 0xdd) all but rules out; text is read the same.
    let bytes: &[u8] = match reply {
        Value::Bytes(bytes) => bytes,
        Value::String(text) => text.as_bytes(),
        _ => return Err(bad("is not the script's packed array")),
    };
    let mut values = packed::array(bytes).map_err(|e| bad(&e.to_string()))?;
    fn next<'a>(values: &mut Items<'a>) -> Result<Option<Item<'a>>, StoreError> {
        values
            .next()
            .transpose()
            .map_err(|e| StoreError::Protocol(format!("script reply {e}")))
    }
    let now = match next(&mut values)? {
        Some(Item::Int(now)) if now >= 0 => now,
        _ => return Err(bad("does not start with the call's time")),
    };
    let mut answers = Vec::with_capacity(count);
    while answers.len() < count {
        let length = match next(&mut values)? {
            Some(Item::Int(-1)) => {
                let message = match next(&mut values)? {
                    Some(Item::Text(text)) => String::from_utf8_lossy(text).into_owned(),
                    _ => String::new(),
                };
                answers.push(Err(failed(&message)));
                continue;
            }
            Some(Item::Int(length)) => {
                usize::try_from(length).map_err(|_| bad("holds a negative length"))?
            }
            _ => return Err(bad("does not answer every request of the call")),
        };
        // (A length no reply could hold allocates no more than what is left.)
        let mut integers = Vec::with_capacity(1 + length.min(values.len()));
        integers.push(now);
        for _ in 0..length {
            match next(&mut values)? {
                Some(Item::Int(n)) => integers.push(n),
                Some(Item::Text(_)) => return Err(bad("holds a value that is not an integer")),
                None => return Err(bad("ends inside a request's part")),
            }
        }
        answers.push(Ok(integers));
    }
    if !values.is_empty() {
        return Err(bad("is longer than its requests"));
    }
    values.finish().map_err(|e| bad(&e.to_string()))?;
    Ok(answers)
}

/// What a request that failed inside the script says: Redis's error (a key of another type, a
/// slot its master does not serve) or the script's own (code `SLIDEGATE`).
fn failed(message: &str) -> StoreError {
    if message.contains(NOT_SERVED) {
        return not_served_error(message);
    }
    super::request_failed(message)
}

/// Requests waiting for a call, and how many calls are out.
struct Queue {
    calls: usize,
    waiting: VecDeque<Waiting>,
}

struct Waiting {
    request: Request,
    since: Instant,
    answer: oneshot::Sender<Answer>,
}

/// Sends requests as they come while fewer than `max_calls` calls are out, and otherwise
/// queues them for the next call (see the module's notes). Requests wait at most
/// `queued_at_most`: time spent behind other calls is not Redis being slow, but a bound keeps a
/// stalled Redis from collecting an endless queue.
pub(super) struct Batcher {
    queue: Mutex<Queue>,
    max_calls: usize,
    queued_at_most: Duration,
}

impl Batcher {
    pub fn new(max_calls: usize, queued_at_most: Duration) -> Arc<Batcher> {
        Arc::new(Batcher {
            queue: Mutex::new(Queue {
                calls: 0,
                waiting: VecDeque::new(),
            }),
            max_calls: max_calls.max(1),
            queued_at_most,
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
                queue.waiting.push_back(Waiting {
                    request,
                    since: Instant::now(),
                    answer,
                });
                Turn::Later(later)
            }
        };
        match turn {
            Turn::Now(request) => {
                let _out = CallOut {
                    batcher: self.clone(),
                    sender: sender.clone(),
                };
                sender.call_one(request).await
            }
            Turn::Later(later) => later.await.unwrap_or_else(|_| {
                Err(StoreError::unavailable(
                    "the call carrying this request was dropped",
                ))
            }),
        }
    }

    /// A call came back (or its caller left): the requests that waited go with the next call,
    /// sent from a task of its own; with none waiting, the call's place is free.
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
                if now.duration_since(waiting.since) > self.queued_at_most {
                    let _ = waiting
                        .answer
                        .send(Err(StoreError::Timeout(self.queued_at_most)));
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
        // The guard is made inside the task: a task dropped unstarted hands nothing on.
        runtime.spawn(async move {
            let _out = CallOut {
                batcher,
                sender: sender.clone(),
            };
            let (requests, answers): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|w| (w.request, w.answer)).unzip();
            let replies = sender.call(requests).await;
            for (answer, reply) in answers.into_iter().zip(replies) {
                let _ = answer.send(reply);
            }
        });
    }
}

enum Turn {
    Now(Request),
    Later(oneshot::Receiver<Answer>),
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
    use super::*;

    /// The script's reply of these integers, packed as Redis's cmsgpack packs it.
    fn ints(values: &[i64]) -> Value {
        packed_reply(&values.iter().map(|&n| Item::Int(n)).collect::<Vec<_>>())
    }

    fn packed_reply(items: &[Item<'_>]) -> Value {
        Value::Bytes(packed::tests::pack(items).into())
    }

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
        };
        let request = || Request {
            now_ms: None,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadline: None,
        };
        let call = sender.call_one(request());
        let batcher = Batcher::new(1, Duration::from_secs(1));
        let submit = batcher.submit(request(), &sender);
        let (call, submit) = (std::mem::size_of_val(&call), std::mem::size_of_val(&submit));
        assert!(call < 2_048, "a call's future is {call} bytes");
        assert!(
            submit < 2_048,
            "a submitted request's future is {submit} bytes"
        );
    }

    /// A lane names one client of the pool however many calls it makes, and requests in turn
    /// take every client.
    #[test]
    fn a_lane_is_one_client_of_the_pool() {
        let pool = fred::types::Builder::default_centralized()
            .build_pool(3)
            .expect("a pool builds without connecting");
        let id = |lane| client_of(&pool, lane).id().to_string();
        let ids: Vec<String> = pool.clients().iter().map(|c| c.id().to_string()).collect();
        assert_eq!(ids.len(), 3);
        for lane in 0..9 {
            assert_eq!(id(lane), ids[lane % 3], "lane {lane}");
            assert_eq!(id(lane), id(lane), "lane {lane} twice");
        }
        let taken: std::collections::HashSet<String> = (10..13).map(id).collect();
        assert_eq!(
            taken.len(),
            3,
            "three requests in turn take the three clients"
        );
    }

    /// A call waits as long as the longest-waiting of its callers: a caller's own deadline
    /// where it sent one (up to a second), `--redis-timeout` where it did not; a call whose
    /// callers have all stopped waiting is not sent.
    #[test]
    fn a_call_waits_as_long_as_its_longest_waiting_caller() {
        let now = Instant::now();
        let timeout = Duration::from_millis(15);
        let request = |deadline: Option<Duration>| Request {
            now_ms: None,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadline: deadline.map(|d| now + d),
        };
        let wait = |deadlines: &[Option<u64>]| {
            let requests: Vec<Request> = deadlines
                .iter()
                .map(|d| request(d.map(Duration::from_millis)))
                .collect();
            call_wait(&requests, timeout, now).map(|w| w.as_millis())
        };
        assert_eq!(wait(&[None]), Some(15));
        assert_eq!(
            wait(&[Some(20)]),
            Some(20),
            "Envoy's 20 ms, past --redis-timeout"
        );
        assert_eq!(wait(&[Some(5)]), Some(5), "a caller that waits less");
        assert_eq!(wait(&[Some(5), None, Some(12)]), Some(15));
        assert_eq!(wait(&[Some(5), Some(40), None]), Some(40));
        assert_eq!(wait(&[Some(3_600_000)]), Some(1_000), "at most a second");
        let requests = [request(Some(Duration::from_secs(3_600)))];
        assert_eq!(
            call_wait(&requests, Duration::from_secs(5), now),
            Some(Duration::from_secs(5)),
            "or --redis-timeout where that is longer"
        );
        assert_eq!(wait(&[Some(0), Some(0)]), None, "every caller has gone");
        let gone = Request {
            deadline: Some(now - Duration::from_millis(1)),
            ..request(None)
        };
        assert_eq!(call_wait(&[gone], timeout, now), None);
        assert_eq!(wait(&[]), None, "no request, no call");
    }

    #[test]
    fn a_call_is_decided_at_its_latest_requests_time() {
        let request = |now_ms| Request {
            now_ms,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadline: None,
        };
        let now = |nows: &[Option<u64>]| {
            let requests: Vec<Request> = nows.iter().map(|&n| request(n)).collect();
            call_now(&requests)
        };
        assert_eq!(
            now(&[Some(1_000), Some(1_003), Some(999)]),
            Value::Integer(1_003)
        );
        // Redis's clock: its own time.
        assert_eq!(now(&[None, None]), Value::from_static_str(""));
    }

    #[test]
    fn numbers_go_as_their_digits() {
        let digits = |n: u64| match number(n) {
            Value::Bytes(b) => String::from_utf8(b.to_vec()).expect("digits"),
            Value::Integer(i) => i.to_string(),
            other => panic!("{other:?}"),
        };
        for n in [0, 1, 5, 9, 10, 42, 99, 100, 1_767_225_600_000, u64::MAX / 2] {
            assert_eq!(digits(n), n.to_string());
        }
        // Capped at i64's largest, as Redis reads integers (no number slidegate sends comes near).
        assert_eq!(digits(u64::MAX), i64::MAX.to_string());
        // The small ones are static: nothing made per call.
        assert!(matches!(number(7), Value::Bytes(_)));
        assert!(matches!(number(1_000), Value::Integer(1_000)));
    }

    #[test]
    fn a_reply_splits_into_one_answer_per_request() {
        let mut flat = vec![1_000, 9, 1, 1, 0, 0, 1, 1, 1, 1, 1_000];
        flat.extend([4, 5, 3, 3, 999]);
        let mut reply: Vec<Item<'_>> = flat.iter().map(|&n| Item::Int(n)).collect();
        reply.splice(
            11..11,
            [
                Item::Int(-1),
                Item::Text(b"WRONGTYPE Operation against a key"),
                Item::Int(-1),
                Item::Text(b"SLIDEGATE request 3: mode must be 0, 1 or 2"),
            ],
        );
        let answers = split(packed_reply(&reply), 4);
        assert_eq!(answers.len(), 4);
        assert_eq!(
            answers[0].as_ref().ok(),
            Some(&vec![1_000, 1, 1, 0, 0, 1, 1, 1, 1, 1_000])
        );
        // Redis's own error: the store is unavailable for that request; the script's code: a
        // protocol error, for that request alone.
        assert!(
            matches!(&answers[1], Err(StoreError::Unavailable { context, .. }) if context.contains("WRONGTYPE"))
        );
        assert!(matches!(&answers[2], Err(StoreError::Protocol(m)) if m.contains("mode")));
        // Each answer starts with the call's time.
        assert_eq!(answers[3].as_ref().ok(), Some(&vec![1_000, 5, 3, 3, 999]));
    }

    #[test]
    fn replies_of_the_wrong_shape_fail_every_request_of_the_call() {
        let protocol = |a: &Answer| matches!(a, Err(StoreError::Protocol(_)));
        for reply in [
            // Not the packed array: a RESP array or integer, a packed map, bytes after it.
            Value::Array(vec![
                Value::Integer(9),
                Value::Integer(1),
                Value::Integer(7),
            ]),
            Value::Integer(1),
            Value::Bytes(vec![0x81, 0x09, 0x01].into()),
            Value::Bytes(vec![0x93, 0x09, 0x01, 0x07, 0x00].into()),
            // No time, or a negative one.
            ints(&[]),
            ints(&[-5, 1, 7, 1, 7]),
            // One request answered where two were sent.
            ints(&[9, 1, 7]),
            // A length past the reply's end, or one no reply could hold.
            ints(&[9, 3, 7, 7]),
            ints(&[9, i64::MAX, 7]),
            ints(&[9, -2, 7]),
            // More than the requests.
            ints(&[9, 1, 7, 1, 7, 1, 7]),
            // A header and a request's length that claim billions of values, over a few bytes:
            // refused without allocating for them.
            Value::Bytes(
                vec![
                    0xdd, 0xff, 0xff, 0xff, 0xff, 0x09, 0xce, 0xff, 0xff, 0xff, 0xff, 0x01,
                ]
                .into(),
            ),
            // A value that is not an integer.
            packed_reply(&[
                Item::Int(9),
                Item::Int(1),
                Item::Text(b"x"),
                Item::Int(1),
                Item::Int(7),
            ]),
        ] {
            let answers = split(reply.clone(), 2);
            assert_eq!(answers.len(), 2, "{reply:?}");
            assert!(answers.iter().all(protocol), "{reply:?} -> {answers:?}");
        }
        let answers = split(ints(&[4, 1, 7, 2, 8, 9]), 2);
        assert_eq!(answers[0].as_ref().ok(), Some(&vec![4, 7]));
        assert_eq!(answers[1].as_ref().ok(), Some(&vec![4, 8, 9]));
    }
}
