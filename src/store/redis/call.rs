//! Script calls: the requests a call carries, sending them (keys declared, or by the script's
//! spread function on a cluster master), `TRYAGAIN` and a lost library handled, requests a master
//! no longer serves sent again on their own, and until when a call waits for Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::prelude::*;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand};
use futures_util::future::join_all;
use tokio::time::Instant;

use super::encode::{int, number, split};
use super::master::Master;
use super::take_back::TakeBack;
use super::{Library, call_failed};
use crate::store::{Bound, Deadlines, StoreError, Waited};

/// How long to wait before sending a call Redis answered `TRYAGAIN` (a slot mid-migration).
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(5);

/// The most descriptors one call carries (a request's descriptors always go together): enough
/// that a queue under load leaves in a few calls, few enough that a call keeps Redis busy for
/// about a millisecond, so calls queued behind it stay well inside the store deadline.
pub(super) const DESCRIPTORS_PER_CALL: usize = 32;

/// One request's part of a script call: its time, its keys, and its arguments after the call's
/// request count and time (layout in `lua/contract.lua`).
pub(super) struct Request {
    /// When it was asked, in ms since the epoch; `None` where Redis's clock decides.
    pub now_ms: Option<u64>,
    pub keys: Vec<Key>,
    pub args: Vec<Value>,
    pub slots: Slots,
    /// Which of the pool's clients carries it (taken modulo the pool's size; on a cluster, of
    /// its master's own clients), so that requests take the clients in turn.
    pub lane: usize,
    /// Until when it may wait for its turn, and for Redis once sent ([`Deadlines`]).
    pub deadlines: Deadlines,
    /// Where its caller is answered `OVER_LIMIT` by the deny policy if Redis has not answered
    /// by its moment: what it records, taken back from a reply that comes after all
    /// (`take_back.rs`).
    pub take_back: Option<Arc<TakeBack>>,
}

impl Request {
    /// How many descriptors it carries: its arguments are its shape, two per descriptor, and a
    /// tentative request's prefix (`RedisStore::script_input`).
    pub(super) fn descriptors(&self) -> usize {
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
pub(super) const NOT_SERVED: &str = "Script attempted to access a non local key";

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
    /// How long a decision waits for Redis from the moment it reaches the store
    /// (`--redis-timeout`; its caller's deadline may end it sooner).
    pub timeout: Duration,
    /// Replicas that must hold a call's writes before it is answered (`--redis-wait-replicas`).
    pub wait_replicas: u32,
    /// Redis Cluster: the pool is one client of the whole cluster, the redirect client, whose
    /// view of the slots is the store's (`nodes.rs`, read again by [`Sender::refresh`]); it
    /// carries only requests of a slot whose master is not known yet, keys declared, and
    /// follows no redirection. Every other call goes by its master's own clients (see
    /// [`Via::Master`]): a redirection makes a client stop all its other calls while it follows
    /// it (it reads the cluster's slots again, or sends `ASKING` and waits for its reply), so a
    /// request of a moving slot would hold up the calls of every slot sharing its client.
    pub redirect: bool,
    /// Set when a master refused a request (its slot moved): the routing copy is read again.
    pub stale: Arc<std::sync::atomic::AtomicBool>,
    /// When the redirect client last read the cluster's slots ([`Sender::refresh`]).
    pub read_at: Arc<tokio::sync::Mutex<Option<Instant>>>,
}

/// How soon after a read of the cluster's slots another is not made: the callers refused
/// meanwhile take that one.
const READ_AGAIN_AFTER: Duration = Duration::from_millis(20);

/// Which client carries a call, and where it goes.
#[derive(Clone, Copy)]
enum Via<'a> {
    /// The pool's client of this lane ([`Request::lane`]), routed by the call's keys.
    Lane(usize),
    /// The client of this lane of this cluster master's own: the spread function with no
    /// key declared, which Redis runs where it is sent, and a key the master does not serve
    /// fails only the request that reached for it; or, by `EVALSHA`, one slot's keys declared,
    /// refused whole with `MOVED` or `ASK`, which that client does not follow.
    Master(usize, &'a Master),
    /// [`Sender::redirect`].
    Redirect,
}

impl Sender {
    /// One call carrying one request alone, to `master` where known (see [`Sender::call`]).
    pub async fn call_one(&self, master: Option<&Master>, request: Request) -> Answer {
        self.call(master, vec![request])
            .await
            .pop()
            .unwrap_or_else(|| Err(StoreError::Protocol("script reply is empty".into())))
    }

    /// One call carrying `requests`; an answer per request, in order. On a cluster, requests
    /// of one master's slots (see [`Batcher`]) go to that master by the spread function; a
    /// request the master does not serve is answered [`NotServed`], for its caller to send it
    /// where its slot went (`RedisStore::call_group`), or a call per slot where it has several.
    /// Without a master (not known yet), or by `EVALSHA` (no spread function), each request's
    /// keys are declared.
    pub async fn call(&self, master: Option<&Master>, requests: Vec<Request>) -> Vec<Answer> {
        match master {
            Some(master) if self.library.spreads() => self.call_master(master, requests).await,
            _ if !over_several_slots(&requests) => self.call_declared(master, requests).await,
            _ => self.each_alone(master, requests).await,
        }
    }

    /// `request` alone, its keys declared, to `importer`, the master a slot is migrating to,
    /// after `ASKING` on the same connection (one pipeline: nothing comes between them): a
    /// request whose keys have left the master serving the slot, or are new. The importing
    /// master decides it when it holds every key of it, and answers `TRYAGAIN` while they
    /// are split between the two (sent again shortly). A request of one key goes there safely:
    /// the serving master refused it because that key has left it, so it is at the importer or
    /// nowhere. By `EVALSHA` (no function) it is not sent: the client sends a script only on
    /// its own (it loads one it finds missing), never in a pipeline behind `ASKING`.
    pub async fn call_asking(&self, importer: &Master, request: Request) -> Answer {
        let requests = [request];
        let Some(term) = self.terms(&requests) else {
            return Err(no_time_left(&requests));
        };
        let until = term.until;
        if self.library.by_script() {
            return Err(not_served_error(
                "the slot is migrating and calls go by EVALSHA",
            ));
        }
        let now = call_now(&requests);
        let [request] = requests;
        let mut args = Vec::with_capacity(2 + request.args.len());
        args.push(int(1));
        args.push(now);
        args.extend(request.args);
        loop {
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Err(term.gave_up());
            }
            let pool = importer.pool.load();
            let client = client_of(&pool, request.lane, false);
            let pipeline = client.pipeline().with_options(&Options {
                timeout: Some(wait),
                ..Options::default()
            });
            let asking = CustomCommand::new_static("ASKING", ClusterHash::Random, false);
            let function = self.library.function.clone();
            let queued: Result<(), Error> = async {
                pipeline.custom::<(), Value>(asking, Vec::new()).await?;
                pipeline
                    .fcall::<(), _, _, _>(function, request.keys.clone(), args.clone())
                    .await
            }
            .await;
            if let Err(e) = queued {
                return Err(call_failed(&e));
            }
            let reply = pipeline.try_all::<Value>().await.pop();
            match reply {
                Some(Ok(reply)) => {
                    if self.wait_replicas > 0 {
                        let routing = request.keys.first();
                        Box::pin(super::replicas::confirm(
                            client,
                            routing,
                            self.wait_replicas,
                            until,
                        ))
                        .await?;
                    }
                    return split(reply, 1).pop().unwrap_or_else(|| {
                        Err(StoreError::Protocol("script reply is empty".into()))
                    });
                }
                Some(Err(e)) if e.details().starts_with("TRYAGAIN") => {
                    tokio::time::sleep_until(until.min(Instant::now() + TRY_AGAIN_AFTER)).await;
                }
                Some(Err(e)) if elsewhere(&e) => return Err(not_served_error(e.details())),
                Some(Err(e)) if *e.kind() == ErrorKind::Timeout => return Err(term.gave_up()),
                Some(Err(e)) => return Err(call_failed(&e)),
                None => return Err(StoreError::Protocol("no reply to ASKING's call".into())),
            }
        }
    }

    /// The client a call of `lane` goes by: `master`'s own, on a cluster where its master is
    /// known; else the redirect client on a cluster, or the pool's client of `lane`.
    pub fn client_for(&self, master: Option<&Master>, lane: usize) -> Client {
        match master {
            Some(master) => client_of(&master.pool.load(), lane, false).clone(),
            None if self.redirect => redirect_client(&self.pool.load()).clone(),
            None => client_of(&self.pool.load(), lane, false).clone(),
        }
    }

    /// Reads the cluster's slots again, by the redirect client (the one client that stops for
    /// it), waiting at most until `until`; one read at a time, and none again within
    /// [`READ_AGAIN_AFTER`] of the last; the store's routing copy is read again after it.
    pub async fn refresh(&self, until: Instant) {
        let client = redirect_client(&self.pool.load()).clone();
        let read_at = self.read_at.clone();
        let read = async move {
            let mut last = read_at.lock().await;
            if last.is_some_and(|at| at.elapsed() < READ_AGAIN_AFTER) {
                return; // read meanwhile
            }
            if let Err(e) = client.sync_cluster().await {
                tracing::debug!(error = %e, "reading the cluster's slots failed");
            }
            *last = Some(Instant::now());
        };
        let _ = tokio::time::timeout_at(until, read).await;
        self.stale.store(true, Ordering::Relaxed);
    }

    /// By `EVALSHA` a call's keys must share a slot: each request of one slot alone, and those
    /// of several slots answered [`NotServed`].
    async fn each_alone(&self, master: Option<&Master>, requests: Vec<Request>) -> Vec<Answer> {
        join_all(requests.into_iter().map(|r| async move {
            match r.slots {
                Slots::Several => Err(not_served_error("the script goes by EVALSHA")),
                _ => self
                    .call_declared(master, vec![r])
                    .await
                    .pop()
                    .unwrap_or_else(|| Err(StoreError::Protocol("script reply is empty".into()))),
            }
        }))
        .await
    }

    /// A call's client (its first request's lane) and until when it waits ([`call_until`]);
    /// `None` when every request's time is up.
    fn terms(&self, requests: &[Request]) -> Option<Term> {
        let lane = requests.first().map_or(0, |r| r.lane);
        let sent = Instant::now();
        let (until, bound) = call_until(requests, sent, self.timeout, self.load_timeout)?;
        Some(Term {
            lane,
            sent,
            until,
            bound,
        })
    }

    /// One call with every key declared (they share a slot, or there are no slots). The
    /// requests are not needed after it, so their parts move into the command.
    async fn call_declared(&self, master: Option<&Master>, requests: Vec<Request>) -> Vec<Answer> {
        let count = requests.len();
        let Some(term) = self.terms(&requests) else {
            return vec![Err(no_time_left(&requests)); count];
        };
        let mut keys = Vec::with_capacity(requests.iter().map(|r| r.keys.len()).sum());
        let mut args = Vec::with_capacity(2 + requests.iter().map(|r| r.args.len()).sum::<usize>());
        args.push(int(count));
        args.push(call_now(&requests));
        for request in requests {
            keys.extend(request.keys);
            args.extend(request.args);
        }
        let via = match master {
            // By `EVALSHA` on a cluster: the master's own client, which follows no
            // redirection (a refusal comes back as `MOVED` or `ASK`: [`elsewhere`]).
            Some(master) => Via::Master(term.lane, master),
            None if self.redirect => Via::Redirect,
            None => Via::Lane(term.lane),
        };
        match self.send(via, &term, keys, args, false).await {
            Ok(reply) => split(reply, count),
            Err(e) => vec![Err(e); count],
        }
    }

    /// One call of the spread function to `master`: the keys first in `ARGV`, after their
    /// number, none declared. A request the master refuses (not its slot now) is answered
    /// [`NotServed`] at once, like the others, so that the call's place is free again: its
    /// caller finds where the slot went (`RedisStore::call_group`).
    async fn call_master(&self, master: &Master, requests: Vec<Request>) -> Vec<Answer> {
        let count = requests.len();
        let Some(term) = self.terms(&requests) else {
            return vec![Err(no_time_left(&requests)); count];
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
        let via = Via::Master(term.lane, master);
        match self.send(via, &term, Vec::new(), args, true).await {
            Ok(reply) => split(reply, count),
            Err(e) => vec![Err(e); count],
        }
    }

    /// Sends until Redis answers, or the term's end. TRYAGAIN: a slot is being migrated and this
    /// call's keys are split between two masters for a moment; Redis asks to send it again
    /// shortly. A missing function (a restart, FUNCTION FLUSH, a node that never saw it): load
    /// it and send again, once. Keys and arguments are shared buffers: a copy to send again is
    /// cheap.
    async fn send(
        &self,
        via: Via<'_>,
        term: &Term,
        keys: Vec<Key>,
        args: Vec<Value>,
        spread: bool,
    ) -> Result<Value, StoreError> {
        let until = term.until;
        let mut loaded = false;
        loop {
            // A zero timeout is none to the client: a call with no time left is not sent.
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Err(term.gave_up());
            }
            let pool = match via {
                Via::Master(_, master) => master.pool.load(),
                Via::Lane(_) | Via::Redirect => self.pool.load(),
            };
            let client = match via {
                Via::Master(lane, _) | Via::Lane(lane) => client_of(&pool, lane, false),
                Via::Redirect => redirect_client(&pool),
            };
            let sent = self
                .library
                .call_as(client, None, Some(wait), keys.clone(), args.clone(), spread)
                .await;
            match sent {
                Ok(reply) if self.wait_replicas == 0 => return Ok(reply),
                Ok(reply) => {
                    // Boxed: the client's future for WAIT would otherwise be part of every
                    // call's, and of every decision's that awaits one. (A master's own client
                    // has one server: no key routes it.)
                    let replicas = self.wait_replicas;
                    let routing = keys.first();
                    Box::pin(super::replicas::confirm(client, routing, replicas, until)).await?;
                    return Ok(reply);
                }
                Err(e) if self.redirect && elsewhere(&e) => {
                    return Err(not_served_error(e.details()));
                }
                // A master's own client (by `EVALSHA`: its call keeps to one slot, whose keys a
                // migration has split): the call's requests follow the slot one by one, rather
                // than the call holding the master's place until they come together.
                Err(e) if e.details().starts_with("TRYAGAIN") && matches!(via, Via::Master(..)) => {
                    return Err(not_served_error(e.details()));
                }
                Err(e) if e.details().starts_with("TRYAGAIN") => {
                    tokio::time::sleep_until(until.min(Instant::now() + TRY_AGAIN_AFTER)).await;
                }
                Err(e) if Library::missing(&e) && !loaded => {
                    loaded = true;
                    // Boxed: rare, and its future (about 7 KB) would otherwise be part of
                    // every call's, and of every decision's that awaits one.
                    Box::pin(self.load_by(&pool, term)).await?;
                }
                // The client's own timeout: the call's term ended.
                Err(e) if *e.kind() == ErrorKind::Timeout => return Err(term.gave_up()),
                Err(e) => return Err(call_failed(&e)),
            }
        }
    }

    /// Loads the library for a call that found it missing: in a task of its own, so that it
    /// completes (within `--redis-connect-timeout`) for the calls after this one even when
    /// this call's time runs out first.
    async fn load_by(&self, pool: &Pool, term: &Term) -> Result<(), StoreError> {
        let (library, client, timeout) =
            (self.library.clone(), pool.next().clone(), self.load_timeout);
        let load = tokio::spawn(async move { library.load(&client, timeout).await });
        match tokio::time::timeout_at(term.until, load).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(call_failed(&e)),
            Ok(Err(_)) => Err(StoreError::unavailable(
                "loading the function library failed",
            )),
            Err(_) => Err(term.gave_up()),
        }
    }
}

/// What a call waits for: its client (its first request's lane), when it was sent, and until
/// when it waits for Redis ([`call_until`]) and why then.
pub(super) struct Term {
    pub lane: usize,
    pub sent: Instant,
    pub until: Instant,
    pub bound: Bound,
}

impl Term {
    /// The call's error once its term ended without Redis's reply.
    pub fn gave_up(&self) -> StoreError {
        let waited = self.until.saturating_duration_since(self.sent);
        StoreError::Timeout(Waited::Redis(waited, self.bound))
    }
}

/// Until when a call carrying `requests`, sent at `now`, waits for Redis: as long as the
/// latest of their moments ([`Deadlines::reply_by`], `timeout` being `--redis-timeout`), so
/// that none is answered by the failure policy while it would still take Redis's answer (one
/// whose moment comes sooner is answered then by [`super::batch::Batcher`]); and `late` after
/// it is sent (`--redis-connect-timeout`: how long the client waits on a silent connection
/// before it drops it, and with it any reply) where a request's recorded hits are to be taken
/// back from a reply that comes after its moment ([`Request::take_back`]). `None` when every
/// request's time is up: nothing to send.
fn call_until(
    requests: &[Request],
    now: Instant,
    timeout: Duration,
    late: Duration,
) -> Option<(Instant, Bound)> {
    requests
        .iter()
        .filter_map(|r| {
            let (by, bound) = r.deadlines.reply_by(now, timeout);
            match &r.take_back {
                _ if by <= now => None,
                Some(_) if now + late > by => Some((now + late, Bound::ConnectTimeout)),
                _ => Some((by, bound)),
            }
        })
        .max_by_key(|(until, _)| *until)
}

/// Why a call whose every request's time is up before it is sent answers so: they waited for
/// a turn until their moments.
fn no_time_left(requests: &[Request]) -> StoreError {
    let deadlines = requests.first().map(|r| r.deadlines);
    let bound = deadlines.map_or(Bound::CallerDeadline, |d| d.turn_bound());
    StoreError::Timeout(Waited::Turn(Duration::ZERO, bound))
}

/// Whether a cluster call failed because its keys are not where it was sent: a replica since a
/// failover (`READONLY`), a node the client has no connection to (left the cluster), or a
/// redirection the client was told not to follow ([`Library::call_as`]).
fn elsewhere(e: &Error) -> bool {
    let details = e.details();
    ["READONLY", "MOVED ", "ASK "]
        .iter()
        .any(|code| details.starts_with(code))
        || e.kind() == &ErrorKind::Routing
}

/// The client of `pool` for `lane` (see [`Request::lane`]), leaving out the last where it is
/// the `redirect` client ([`Sender::redirect`]). The pool is read at each try, so a pool
/// replaced meanwhile is the one used.
pub(super) fn client_of(pool: &Pool, lane: usize, redirect: bool) -> &Client {
    let clients = pool.clients();
    let lanes = clients.len().saturating_sub(usize::from(redirect)).max(1);
    // A pool always has a client (built with at least one); `next` covers the impossible.
    clients.get(lane % lanes).unwrap_or_else(|| pool.next())
}

/// A cluster pool's redirect client: its last ([`Sender::redirect`]).
pub(super) fn redirect_client(pool: &Pool) -> &Client {
    pool.clients().last().unwrap_or_else(|| pool.next())
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

/// A request of a spread call reached for a key of a slot its master does not serve.
#[derive(Debug, thiserror::Error)]
#[error("the master does not serve this key's slot")]
struct NotServed;

pub(super) fn not_served_error(why: &str) -> StoreError {
    StoreError::Unavailable {
        context: format!("script: {why}"),
        source: Some(Arc::new(NotServed)),
    }
}

/// Whether `answer` is [`NotServed`]: the request is to be sent again, a call per slot.
pub(super) fn not_served(answer: &Result<impl Sized, StoreError>) -> bool {
    matches!(answer, Err(StoreError::Unavailable { source: Some(source), .. }) if source.is::<NotServed>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane names one client of the pool however many calls it makes, and requests in turn
    /// take every client.
    #[test]
    fn a_lane_is_one_client_of_the_pool() {
        let pool = fred::types::Builder::default_centralized()
            .build_pool(3)
            .expect("a pool builds without connecting");
        let id = |lane| client_of(&pool, lane, false).id().to_string();
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

    /// A call waits until the latest of its requests' moments to be answered, and as long as
    /// the client waits on a silent connection where a request's recorded hits are to be taken
    /// back from a late reply; a call whose requests' time is all up is not sent.
    #[test]
    fn a_call_waits_until_its_latest_requests_moment() {
        let now = Instant::now();
        let ms = |ms: i64| {
            if ms >= 0 {
                now + Duration::from_millis(ms.unsigned_abs())
            } else {
                now - Duration::from_millis(ms.unsigned_abs())
            }
        };
        let request = |caller: i64, take_back: bool| Request {
            now_ms: None,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadlines: Deadlines {
                caller: Some(ms(caller)),
                turn: ms(caller),
            },
            take_back: take_back.then(|| Arc::new(TakeBack::default())),
        };
        let until = |callers: &[(i64, bool)]| {
            let requests: Vec<Request> = callers.iter().map(|&(c, t)| request(c, t)).collect();
            let late = Duration::from_millis(2_000);
            call_until(&requests, now, Duration::from_millis(15), late)
                .map(|(u, bound)| (u.duration_since(now).as_millis(), bound))
        };
        let caller = Bound::CallerDeadline;
        assert_eq!(until(&[(10, false)]), Some((10, caller)));
        assert_eq!(
            until(&[(100, false)]),
            Some((15, Bound::RedisTimeout)),
            "--redis-timeout first"
        );
        assert_eq!(
            until(&[(5, false), (12, false), (9, false)]),
            Some((12, caller)),
            "the latest"
        );
        assert_eq!(
            until(&[(-1, false), (4, false)]),
            Some((4, caller)),
            "one whose time is up rides along"
        );
        assert_eq!(
            until(&[(4, false), (10, true)]),
            Some((2_000, Bound::ConnectTimeout)),
            "a late reply is waited for where hits are to be taken back"
        );
        assert_eq!(
            until(&[(0, false), (-3, true)]),
            None,
            "every request's time is up"
        );
        assert_eq!(until(&[]), None, "no request, no call");
    }

    #[test]
    fn a_call_is_decided_at_its_latest_requests_time() {
        let request = |now_ms| Request {
            now_ms,
            keys: Vec::new(),
            args: Vec::new(),
            slots: Slots::Standalone,
            lane: 0,
            deadlines: Deadlines::for_caller(Instant::now(), Duration::ZERO, None),
            take_back: None,
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
}
