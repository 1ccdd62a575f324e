//! A gRPC connection's streams run inside the connection's own task.
//!
//! hyper hands every HTTP/2 stream (one `ShouldRateLimit` call) to its executor. With tokio's,
//! each call was a task of its own: allocated, queued, and, whenever the other worker was idle,
//! a wake of that worker's thread, which then took the call while the connection's task stayed
//! where it was; the response the stream's task wrote then waited for the connection's task to
//! write it out. Here the connection's task polls its streams itself: a call is read, decided
//! and written on one thread, with no task to spawn. A connection's streams share its task's
//! thread, as its frames already did (h2 reads and writes them all in the connection's task); a
//! client spreads its load over threads by its connections, as Envoy does with one connection
//! per worker.
//!
//! The streams are polled only when woken (each has a waker of its own, as in `futures`'
//! `FuturesUnordered`, which is not used: it wakes its task again whenever it has polled every
//! future it holds, which for a lone call in flight is every time, one extra turn of the
//! runtime per call).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

type Stream = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How many times one poll goes round (the woken streams, then the connection) before letting
/// other tasks run.
const ROUNDS_PER_POLL: usize = 4;

/// hyper's executor for one connection: keeps the streams hyper hands over until [`drive`]
/// takes them.
#[derive(Clone, Default)]
pub struct Streams {
    shared: Arc<Mutex<Shared>>,
}

#[derive(Default)]
struct Shared {
    /// Handed over by hyper, not yet taken by the driver.
    handed: Vec<Stream>,
    /// Slots whose stream was woken, each once (`queued`).
    woken: Vec<usize>,
    queued: Vec<bool>,
    /// The connection was woken (its socket, its timers, a stream's response to write).
    connection_woken: bool,
    /// The driving task's waker, woken when the connection or a stream is woken, or a stream
    /// handed over, while the driver is not polling. While it is, it looks for all three before
    /// it returns instead: a stream's response woke the connection every time, which made the
    /// runtime poll the driver once more for nothing (and, with a worker idle, wake that
    /// worker's thread to take it). hyper hands streams over only from inside the connection's
    /// poll (hyper 1.7, `proto::h2::server`).
    waker: Option<Waker>,
    polling: bool,
    /// The driver has returned: a stream handed over now runs as a task of its own.
    ended: bool,
}

impl Shared {
    fn queue(&mut self, slot: usize) {
        if self.queued.len() <= slot {
            self.queued.resize(slot + 1, false);
        }
        if !self.queued[slot] {
            self.queued[slot] = true;
            self.woken.push(slot);
        }
    }

    /// Starts one of the driver's rounds: marks it polling, keeps its `waker`, and moves the
    /// woken slots to `woken`; answers whether the connection was woken.
    fn begin_round(&mut self, waker: &Waker, woken: &mut Vec<usize>) -> bool {
        self.polling = true;
        if !self.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            self.waker = Some(waker.clone());
        }
        std::mem::swap(woken, &mut self.woken);
        for &slot in woken.iter() {
            self.queued[slot] = false;
        }
        std::mem::take(&mut self.connection_woken)
    }

    fn wake_driver(&self) {
        if !self.polling
            && let Some(waker) = &self.waker
        {
            waker.wake_by_ref();
        }
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // Nothing panics while holding it; a poisoned lock still holds consistent lists.
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        let mut shared = lock(&self.shared);
        if shared.ended {
            drop(shared);
            tokio::spawn(stream);
            return;
        }
        shared.handed.push(Box::pin(stream));
        shared.wake_driver();
    }
}

/// The waker of the connection (`slot: None`) or of one stream's slot: marks it woken and
/// wakes the driver.
struct DriverWaker {
    slot: Option<usize>,
    shared: Arc<Mutex<Shared>>,
}

impl DriverWaker {
    fn waker(slot: Option<usize>, shared: &Arc<Mutex<Shared>>) -> Waker {
        Waker::from(Arc::new(DriverWaker {
            slot,
            shared: shared.clone(),
        }))
    }
}

impl Wake for DriverWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut shared = lock(&self.shared);
        match self.slot {
            Some(slot) => shared.queue(slot),
            None => shared.connection_woken = true,
        }
        shared.wake_driver();
    }
}

/// The streams the driver runs. A slot's waker stays with the slot when another stream takes
/// it: a late wake of a finished stream only polls its successor once more for nothing.
struct Slots {
    streams: Vec<Option<Stream>>,
    wakers: Vec<Waker>,
    free: Vec<usize>,
    live: usize,
}

impl Slots {
    fn insert(&mut self, stream: Stream, shared: &Arc<Mutex<Shared>>) -> usize {
        self.live += 1;
        if let Some(slot) = self.free.pop() {
            self.streams[slot] = Some(stream);
            return slot;
        }
        let slot = self.streams.len();
        self.streams.push(Some(stream));
        self.wakers.push(DriverWaker::waker(Some(slot), shared));
        slot
    }

    /// Polls the stream in `slot`, if any; whether it finished.
    fn poll(&mut self, slot: usize) -> bool {
        let (Some(entry), Some(waker)) = (self.streams.get_mut(slot), self.wakers.get(slot)) else {
            return false;
        };
        let Some(stream) = entry else {
            return false;
        };
        if stream
            .as_mut()
            .poll(&mut Context::from_waker(waker))
            .is_pending()
        {
            return false;
        }
        *entry = None;
        self.free.push(slot);
        self.live -= 1;
        true
    }
}

/// Drives `connection` and every stream it hands to `streams`, in this one task, until the
/// connection and all its streams have ended; answers the connection's outcome.
pub async fn drive<C, E>(connection: C, streams: Streams) -> Result<(), E>
where
    C: Future<Output = Result<(), E>>,
{
    let handle = streams.shared;
    let mut connection = std::pin::pin!(connection);
    let connection_waker = DriverWaker::waker(None, &handle);
    lock(&handle).connection_woken = true; // for its first poll
    let mut outcome: Option<Result<(), E>> = None;
    let mut slots = Slots {
        streams: Vec::new(),
        wakers: Vec::new(),
        free: Vec::new(),
        live: 0,
    };
    // Kept between polls, swapped with the shared lists: no allocation per poll.
    let (mut woken, mut handed) = (Vec::new(), Vec::new());
    let ended = std::future::poll_fn(|cx| {
        for _ in 0..ROUNDS_PER_POLL {
            let poll_connection = lock(&handle).begin_round(cx.waker(), &mut woken);
            // The woken streams first: those a Redis reply woke finish here, and the
            // connection's poll right after writes their responses out with whatever else it
            // has to do.
            for slot in woken.drain(..) {
                slots.poll(slot);
            }
            if poll_connection && outcome.is_none() {
                let polled = connection
                    .as_mut()
                    .poll(&mut Context::from_waker(&connection_waker));
                if let Poll::Ready(ended) = polled {
                    outcome = Some(ended);
                }
            }
            let mut shared = lock(&handle);
            std::mem::swap(&mut handed, &mut shared.handed);
            for stream in handed.drain(..) {
                let slot = slots.insert(stream, &handle);
                shared.queue(slot);
            }
            if shared.woken.is_empty() && (!shared.connection_woken || outcome.is_some()) {
                // Nothing new and nothing woken while polling: all wait for their wakes.
                shared.polling = false;
                if slots.live == 0
                    && let Some(ended) = outcome.take()
                {
                    return Poll::Ready(ended);
                }
                return Poll::Pending;
            }
        }
        // Enough for one turn: come back after the other tasks.
        lock(&handle).polling = false;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
    lock(&handle).ended = true;
    ended
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use hyper::rt::Executor as _;
    use tokio::sync::oneshot;

    use super::*;

    /// Long enough for a loaded machine, short enough that a lost wake fails the test rather
    /// than hanging it.
    const DEADLINE: Duration = Duration::from_secs(10);

    /// A stand-in for hyper's connection: hands `streams` to the executor on its first poll,
    /// then ends at once (as a connection the client closed does while its streams finish).
    fn connection_handing_over(
        executor: Streams,
        streams: Vec<Stream>,
    ) -> impl Future<Output = Result<(), ()>> {
        let mut streams = Some(streams);
        std::future::poll_fn(move |_| {
            for stream in streams.take().unwrap_or_default() {
                executor.execute(stream);
            }
            Poll::Ready(Ok(()))
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_driver_runs_every_stream_and_waits_for_the_last() {
        let executor = Streams::default();
        let done = Arc::new(AtomicUsize::new(0));
        let mut answers = Vec::new();
        let mut streams: Vec<Stream> = Vec::new();
        for _ in 0..40 {
            let (answer, wait) = oneshot::channel::<()>();
            answers.push(answer);
            let done = done.clone();
            streams.push(Box::pin(async move {
                let _ = wait.await;
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        let driver = tokio::spawn(drive(
            connection_handing_over(executor.clone(), streams),
            executor,
        ));
        // Answered from another thread, one at a time, as Redis replies wake the streams.
        let answering = std::thread::spawn(move || {
            for answer in answers {
                std::thread::yield_now();
                answer.send(()).expect("the stream waits");
            }
        });
        let ended = tokio::time::timeout(DEADLINE, driver).await;
        answering.join().expect("answering thread");
        assert_eq!(ended.expect("the driver ended").expect("joined"), Ok(()));
        assert_eq!(done.load(Ordering::SeqCst), 40);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_handed_over_while_the_driver_waits_still_runs() {
        let executor = Streams::default();
        let (end, ended) = oneshot::channel::<()>();
        // A connection that stays open until told, handing nothing over itself.
        let connection = async move {
            let _ = ended.await;
            Ok::<(), ()>(())
        };
        let driver = tokio::spawn(drive(connection, executor.clone()));
        // Until the driver has polled and waits: a stream handed over before its first poll
        // would run without any wake.
        tokio::time::timeout(DEADLINE, async {
            loop {
                {
                    let shared = lock(&executor.shared);
                    if shared.waker.is_some() && !shared.polling {
                        break;
                    }
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the driver polled");
        assert!(runs_when_handed_over(&executor).await, "the stream ran");
        end.send(()).expect("the connection waits");
        let ended = tokio::time::timeout(DEADLINE, driver).await;
        assert_eq!(ended.expect("the driver ended").expect("joined"), Ok(()));
        // Once the driver is gone a stream runs as a task of its own.
        assert!(
            runs_when_handed_over(&executor).await,
            "the late stream ran"
        );
    }

    /// Whether a stream handed to `executor` runs before the deadline.
    async fn runs_when_handed_over(executor: &Streams) -> bool {
        let (ran, run) = oneshot::channel();
        executor.execute(async move {
            let _ = ran.send(());
        });
        matches!(tokio::time::timeout(DEADLINE, run).await, Ok(Ok(())))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_that_wake_themselves_over_and_over_finish() {
        let executor = Streams::default();
        let mut streams: Vec<Stream> = Vec::new();
        for _ in 0..8 {
            streams.push(Box::pin(async {
                for _ in 0..100 {
                    tokio::task::yield_now().await;
                }
            }));
        }
        let driver = drive(connection_handing_over(executor.clone(), streams), executor);
        let ended = tokio::time::timeout(DEADLINE, driver).await;
        assert_eq!(ended.expect("the driver ended"), Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_connections_error_is_the_drivers() {
        let executor = Streams::default();
        let failing = async { Err::<(), &str>("reset by peer") };
        assert_eq!(drive(failing, executor).await, Err("reset by peer"));
    }
}
