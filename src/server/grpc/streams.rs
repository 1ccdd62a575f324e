//! A gRPC connection's streams, run inside the connection's own task.
//!
//! By default hyper spawns every HTTP/2 stream as a task of its own. A call then hops between
//! tasks: the connection reads the request and wakes the stream's task; the stream answers and
//! wakes the connection's task to write. On tokio's multi-thread runtime each such wake may
//! also wake a parked worker (a system call on each side, and often the task moved to the
//! other thread), and a connection that runs right after each answering stream writes each
//! answer alone. Here hyper hands its streams to a [`StreamQueue`] and [`Served`] polls them
//! from the connection's task: the streams that can answer do, leaving their responses in the
//! connection's send buffer, and the connection then writes all of them with one `writev`.
//!
//! What it costs: one connection's calls run on one thread at a time, so a client with a
//! single connection gets at most one core (Envoy opens one per worker thread, and load
//! balances over them). A stream that panics is dropped (its call reset), not the connection.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::FutureExt as _;
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use futures_util::task::AtomicWaker;

type StreamFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How often one poll goes round the connection and its streams before it lets other tasks
/// run: a connection and its streams that keep waking each other (say, tokio's budget for one
/// poll ran out, and the connection's socket reports itself ready again at once) must not hold
/// the thread.
const ROUNDS_PER_POLL: usize = 8;

/// What the connection's task shares with hyper's executor calls and the two wakers.
struct Shared {
    /// Streams hyper started and `Served` has not taken yet.
    new: Mutex<Vec<StreamFuture>>,
    /// The connection was woken (or a stream started) since it was last polled.
    connection_ready: AtomicBool,
    /// A stream was woken since the streams were last polled.
    streams_ready: AtomicBool,
    /// `Served::poll` is running: a wake now is seen before it returns, so it need not
    /// schedule the task again (tokio would run it again as if it had yielded, and might wake
    /// an idle worker for it).
    polling: AtomicBool,
    task: AtomicWaker,
}

impl Shared {
    fn notify(&self, ready: &AtomicBool) {
        // SeqCst with the accesses at the end of `Served::poll`: either this sees that poll
        // has ended and wakes the task, or that poll sees the flag and goes round again.
        ready.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }

    fn any_ready(&self) -> bool {
        self.connection_ready.load(Ordering::SeqCst) || self.streams_ready.load(Ordering::SeqCst)
    }

    /// Moves the streams hyper started into `running`; false if there were none. Drained, not
    /// taken: the list keeps its buffer for the next streams. Only `execute`, called from the
    /// connection's own poll in the same task, takes the lock too.
    fn start_new(&self, running: &mut FuturesUnordered<StreamFuture>) -> bool {
        // Plain futures in a list: one left by a panicking holder is still usable.
        let mut new = self.new.lock().unwrap_or_else(|p| p.into_inner());
        let started = !new.is_empty();
        running.extend(new.drain(..));
        started
    }
}

/// The connection's waker: notes that the connection has work.
struct ConnectionWake(Arc<Shared>);

impl Wake for ConnectionWake {
    fn wake(self: Arc<Self>) {
        self.0.notify(&self.0.connection_ready);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify(&self.0.connection_ready);
    }
}

/// The streams' waker: notes that a stream can go on.
struct StreamsWake(Arc<Shared>);

impl Wake for StreamsWake {
    fn wake(self: Arc<Self>) {
        self.0.notify(&self.0.streams_ready);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify(&self.0.streams_ready);
    }
}

/// The executor hyper's HTTP/2 server hands each new stream to (one per connection).
#[derive(Clone)]
pub struct StreamQueue {
    shared: Arc<Shared>,
}

impl StreamQueue {
    pub fn new() -> StreamQueue {
        StreamQueue {
            shared: Arc::new(Shared {
                new: Mutex::new(Vec::new()),
                connection_ready: AtomicBool::new(true),
                streams_ready: AtomicBool::new(false),
                polling: AtomicBool::new(false),
                task: AtomicWaker::new(),
            }),
        }
    }
}

impl Default for StreamQueue {
    fn default() -> Self {
        StreamQueue::new()
    }
}

impl<F> hyper::rt::Executor<F> for StreamQueue
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        let guarded = AssertUnwindSafe(stream).catch_unwind().map(|ended| {
            if ended.is_err() {
                tracing::error!("a gRPC stream panicked; its call was reset");
            }
        });
        self.shared
            .new
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::pin(guarded));
        self.shared.notify(&self.shared.connection_ready);
    }
}

/// A connection (hyper's connection future, built with `queue` as its executor) served
/// together with its streams in one task; it ends when the connection does. Streams still
/// running then are dropped: their connection is gone (on a graceful shutdown the connection
/// waits for its open streams first).
pub struct Served<F> {
    connection: Pin<Box<F>>,
    running: FuturesUnordered<StreamFuture>,
    shared: Arc<Shared>,
    connection_waker: Waker,
    streams_waker: Waker,
}

impl<F: Future> Served<F> {
    pub fn new(connection: F, queue: &StreamQueue) -> Served<F> {
        let shared = queue.shared.clone();
        Served {
            connection: Box::pin(connection),
            running: FuturesUnordered::new(),
            connection_waker: Waker::from(Arc::new(ConnectionWake(shared.clone()))),
            streams_waker: Waker::from(Arc::new(StreamsWake(shared.clone()))),
            shared,
        }
    }
}

impl<F> Served<F> {
    /// The connection whose streams it runs (to ask it to drain). It is polled on the next
    /// poll, as what was asked of it may have work for it (a `GOAWAY` to write) without any
    /// wake-up of its own.
    pub fn connection(&mut self) -> Pin<&mut F> {
        self.shared.connection_ready.store(true, Ordering::SeqCst);
        self.connection.as_mut()
    }
}

impl<F: Future> Future for Served<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let shared = &this.shared;
        shared.task.register(cx.waker());
        shared.polling.store(true, Ordering::SeqCst);
        for _ in 0..ROUNDS_PER_POLL {
            let mut started = false;
            if shared.connection_ready.swap(false, Ordering::SeqCst) {
                // The connection first: it reads requests (starting streams) and writes what
                // the streams answered.
                let mut connection_cx = Context::from_waker(&this.connection_waker);
                if let Poll::Ready(ended) = this.connection.as_mut().poll(&mut connection_cx) {
                    shared.polling.store(false, Ordering::SeqCst);
                    return Poll::Ready(ended);
                }
                started = shared.start_new(&mut this.running);
            }
            // Then every stream that can go on. One that answers wakes the connection, which
            // only marks it ready while this poll runs.
            if shared.streams_ready.swap(false, Ordering::SeqCst) || started {
                let mut streams_cx = Context::from_waker(&this.streams_waker);
                while let Poll::Ready(Some(())) = this.running.poll_next_unpin(&mut streams_cx) {}
            }
            if !shared.any_ready() {
                shared.polling.store(false, Ordering::SeqCst);
                if !shared.any_ready() {
                    return Poll::Pending;
                }
                // Woken from elsewhere as this poll was ending: go round again.
                shared.polling.store(true, Ordering::SeqCst);
            }
        }
        // Still ready after as many rounds as a poll gets: let other tasks run, then go on.
        shared.polling.store(false, Ordering::SeqCst);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Executor as _;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::oneshot;

    /// A waker that counts how often the task would be scheduled.
    #[derive(Default)]
    struct CountingWake(AtomicUsize);

    impl Wake for CountingWake {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl CountingWake {
        fn count(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Stands in for hyper's connection: counts its polls, ends when `end` is set, and on its
    /// first poll starts the streams in `start` (as hyper starts one per request it reads).
    struct FakeConnection {
        polls: Arc<AtomicUsize>,
        end: Arc<AtomicBool>,
        start: Vec<StreamFuture>,
        queue: StreamQueue,
        /// The connection wakes itself on every poll (a socket that stays ready).
        restless: bool,
        /// The connection wakes the stream waiting in `GRANT` when polled.
        grants: bool,
    }

    impl Future for FakeConnection {
        type Output = &'static str;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<&'static str> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            for stream in std::mem::take(&mut self.start) {
                self.queue.execute(stream);
            }
            if self.end.load(Ordering::SeqCst) {
                return Poll::Ready("ended");
            }
            if self.grants
                && let Some(stream) = GRANT.lock().unwrap_or_else(|p| p.into_inner()).take()
            {
                stream.wake();
            }
            // Like h2: whoever makes the connection ready (a stream that answered) wakes it.
            *WAKER.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            if self.restless {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }

    /// The connection's latest waker, for the streams of a test to wake it as h2 does when
    /// a stream answers. Tests run in parallel: each holds `SERIAL` while it uses this.
    static WAKER: Mutex<Option<Waker>> = Mutex::new(None);
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_connection() {
        if let Some(waker) = WAKER.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            waker.wake_by_ref();
        }
    }

    struct Setup {
        served: Served<FakeConnection>,
        polls: Arc<AtomicUsize>,
        end: Arc<AtomicBool>,
        task: Arc<CountingWake>,
    }

    fn setup(start: Vec<StreamFuture>, restless: bool) -> Setup {
        let queue = StreamQueue::new();
        let (polls, end) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let connection = FakeConnection {
            polls: polls.clone(),
            end: end.clone(),
            start,
            queue: queue.clone(),
            restless,
            grants: false,
        };
        Setup {
            served: Served::new(connection, &queue),
            polls,
            end,
            task: Arc::new(CountingWake::default()),
        }
    }

    impl Setup {
        fn poll(&mut self) -> Poll<&'static str> {
            let waker = Waker::from(self.task.clone());
            Pin::new(&mut self.served).poll(&mut Context::from_waker(&waker))
        }
    }

    #[test]
    fn an_answer_is_written_in_the_same_poll_without_scheduling_the_task_again() {
        let _serial = serial();
        let answered = Arc::new(AtomicBool::new(false));
        let stream = {
            let answered = answered.clone();
            Box::pin(async move {
                answered.store(true, Ordering::SeqCst);
                wake_connection();
            }) as StreamFuture
        };
        let mut served = setup(vec![stream], false);
        assert!(served.poll().is_pending());
        assert!(
            answered.load(Ordering::SeqCst),
            "the new stream ran in that poll"
        );
        assert_eq!(
            served.polls.load(Ordering::SeqCst),
            2,
            "the connection was polled again to write the answer"
        );
        assert_eq!(
            served.task.count(),
            0,
            "a wake from inside the poll does not schedule the task again"
        );
    }

    #[test]
    fn a_stream_woken_from_elsewhere_wakes_the_task_and_answers() {
        let _serial = serial();
        let (reply, replied) = oneshot::channel::<u32>();
        let got = Arc::new(AtomicUsize::new(0));
        let stream = {
            let got = got.clone();
            Box::pin(async move {
                got.store(replied.await.unwrap_or(0) as usize, Ordering::SeqCst);
                wake_connection();
            }) as StreamFuture
        };
        let mut served = setup(vec![stream], false);
        assert!(served.poll().is_pending());
        assert_eq!(got.load(Ordering::SeqCst), 0, "still waiting for its store");
        reply.send(7).unwrap();
        assert_eq!(
            served.task.count(),
            1,
            "the store's answer schedules the task"
        );
        let polls = served.polls.load(Ordering::SeqCst);
        assert!(served.poll().is_pending());
        assert_eq!(got.load(Ordering::SeqCst), 7);
        assert_eq!(
            served.polls.load(Ordering::SeqCst),
            polls + 1,
            "the connection then writes the answer"
        );
    }

    fn a_bug() {
        panic!("a stream's bug");
    }

    /// A stream waiting for its connection, as an answering stream waits for h2 to grant it
    /// room to send: the connection grants it (wakes it) the next time it is polled.
    static GRANT: Mutex<Option<Waker>> = Mutex::new(None);

    struct WaitsForGrant {
        granted: bool,
        answered: Arc<AtomicBool>,
    }

    impl Future for WaitsForGrant {
        type Output = ();

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.granted {
                self.answered.store(true, Ordering::SeqCst);
                return Poll::Ready(());
            }
            self.granted = true;
            *GRANT.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            wake_connection();
            Poll::Pending
        }
    }

    #[test]
    fn a_stream_its_connection_wakes_goes_on_in_the_same_poll() {
        let _serial = serial();
        let answered = Arc::new(AtomicBool::new(false));
        let stream = Box::pin(WaitsForGrant {
            granted: false,
            answered: answered.clone(),
        }) as StreamFuture;
        let mut served = setup(vec![stream], false);
        served.served.connection.as_mut().get_mut().grants = true;
        assert!(served.poll().is_pending());
        assert!(
            answered.load(Ordering::SeqCst),
            "granted and answered in that poll"
        );
        assert_eq!(
            served.task.count(),
            0,
            "a stream woken inside the poll does not schedule the task again"
        );
    }

    #[test]
    fn a_panicking_stream_leaves_the_connection_and_its_other_streams() {
        let _serial = serial();
        let answered = Arc::new(AtomicBool::new(false));
        let panics = Box::pin(async { a_bug() }) as StreamFuture;
        let fine = {
            let answered = answered.clone();
            Box::pin(async move { answered.store(true, Ordering::SeqCst) }) as StreamFuture
        };
        let mut served = setup(vec![panics, fine], false);
        assert!(served.poll().is_pending(), "the connection is still served");
        assert!(answered.load(Ordering::SeqCst));
        served.end.store(true, Ordering::SeqCst);
        wake_connection();
        assert_eq!(served.poll(), Poll::Ready("ended"));
    }

    #[test]
    fn a_connection_that_keeps_waking_itself_lets_other_tasks_run() {
        let _serial = serial();
        let mut served = setup(Vec::new(), true);
        assert!(served.poll().is_pending());
        assert_eq!(served.polls.load(Ordering::SeqCst), ROUNDS_PER_POLL);
        assert_eq!(served.task.count(), 1, "it yields, to be polled again");
    }
}
