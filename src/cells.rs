//! Thread per core (`--thread-per-core`): one single-threaded tokio runtime per worker, a
//! *cell*, each serving the gRPC connections handed to it and holding its own Redis client.
//!
//! Why: on tokio's shared multi-thread runtime a lone call's tasks (the connection, its stream,
//! the Redis client's) wake each other across threads, and each wake of a parked worker is a
//! system call and a cache miss; in a cell they all run on one thread. What it costs: a cell's
//! connections stay on its thread (no work stealing), so a cell whose thread gets less CPU
//! answers slower while the others idle (`docs/performance.md`, *Thread per core*).

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{mpsc, oneshot};

thread_local! {
    /// The index of the cell this thread runs, if it runs one.
    static CELL: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Which cell the calling thread runs; `None` outside the cells (the main runtime's threads).
pub fn current() -> Option<usize> {
    CELL.with(Cell::get)
}

/// Work for a cell: called on the cell's thread, inside its runtime (so it may spawn tasks and
/// register sockets there).
type Job = Box<dyn FnOnce() + Send>;

/// The cells, each a thread with its own runtime. Dropping this ends them: each thread's
/// runtime stops, with the tasks it still holds.
pub struct Cells {
    jobs: Vec<mpsc::UnboundedSender<Job>>,
    /// Connections open in each cell (see [`Place`]).
    open: Arc<[AtomicUsize]>,
    /// Where the search for the least busy cell starts, so that ties take turns.
    next: AtomicUsize,
}

/// A connection's place in a cell: counted among the cell's open connections until dropped.
pub struct Place {
    cell: usize,
    open: Arc<[AtomicUsize]>,
}

impl Place {
    pub fn cell(&self) -> usize {
        self.cell
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.open[self.cell].fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Cells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cells").field("count", &self.len()).finish()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot start cell {index}: {source}")]
pub struct CellError {
    index: usize,
    source: std::io::Error,
}

impl Cells {
    /// Starts `count` cells (at least one).
    pub fn start(count: usize) -> Result<Cells, CellError> {
        let jobs = (0..count.max(1))
            .map(start_cell)
            .collect::<Result<Vec<_>, _>>()?;
        let open = (0..jobs.len()).map(|_| AtomicUsize::new(0)).collect();
        Ok(Cells {
            jobs,
            open,
            next: AtomicUsize::new(0),
        })
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// A place for a new connection in the cell with the fewest open (ties in turn), so that
    /// connections (many Envoys, or one Envoy's workers, each with its own) stay spread evenly
    /// as others close. Connections are accepted one at a time, so two never race for a place.
    pub fn place(&self) -> Place {
        let count = self.jobs.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let cell = (0..count)
            .map(|i| (start + i) % count)
            .min_by_key(|&cell| self.open[cell].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.open[cell].fetch_add(1, Ordering::Relaxed);
        Place {
            cell,
            open: self.open.clone(),
        }
    }

    /// Runs `job` on cell `index` (modulo the count). False if that cell has ended.
    pub fn run_on(&self, index: usize, job: impl FnOnce() + Send + 'static) -> bool {
        self.jobs[index % self.jobs.len()]
            .send(Box::new(job))
            .is_ok()
    }

    /// Runs the future `make` returns on cell `index` and waits for its output; `None` if the
    /// cell has ended, or ends before the future does.
    pub async fn run<T, F>(
        &self,
        index: usize,
        make: impl FnOnce() -> F + Send + 'static,
    ) -> Option<T>
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        let (done, output) = oneshot::channel();
        let sent = self.run_on(index, move || {
            tokio::spawn(async move {
                let _ = done.send(make().await);
            });
        });
        if !sent {
            return None;
        }
        output.await.ok()
    }
}

fn start_cell(index: usize) -> Result<mpsc::UnboundedSender<Job>, CellError> {
    let error = |source| CellError { index, source };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(error)?;
    let (jobs, mut incoming) = mpsc::unbounded_channel::<Job>();
    std::thread::Builder::new()
        .name(format!("sg-cell-{index}"))
        .spawn(move || {
            CELL.with(|cell| cell.set(Some(index)));
            runtime.block_on(async move {
                while let Some(job) = incoming.recv().await {
                    job();
                }
            });
        })
        .map_err(error)?;
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_on_its_cell() {
        let cells = Cells::start(3).unwrap();
        assert_eq!(current(), None, "the test's own thread is no cell");
        for index in 0..3 {
            let ran_on = cells.run(index, || async { current() }).await;
            assert_eq!(ran_on, Some(Some(index)));
        }
    }

    #[test]
    fn a_connection_goes_to_the_cell_with_the_fewest_open() {
        let cells = Cells::start(3).unwrap();
        let mut places: Vec<Place> = (0..6).map(|_| cells.place()).collect();
        let cells_of = |places: &[Place]| places.iter().map(Place::cell).collect::<Vec<_>>();
        assert_eq!(cells_of(&places), [0, 1, 2, 0, 1, 2], "ties take turns");
        // Both of cell 1's connections close: the next two go there.
        places.retain(|place| place.cell() != 1);
        let next: Vec<Place> = (0..3).map(|_| cells.place()).collect();
        assert_eq!(cells_of(&next), [1, 1, 2], "then in turn again");
    }

    #[tokio::test]
    async fn a_cell_serves_sockets_on_its_own_thread() {
        // A socket registered inside the cell is driven by the cell's runtime: the echo below
        // completes with the test's runtime blocked on nothing but the answer.
        let cells = Cells::start(1).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let served = cells.run(0, move || async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut byte = [0u8; 1];
            tokio::io::AsyncReadExt::read_exact(&mut stream, &mut byte)
                .await
                .unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut stream, &byte)
                .await
                .unwrap();
            current()
        });
        let client = async {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut stream, b"x")
                .await
                .unwrap();
            let mut byte = [0u8; 1];
            tokio::io::AsyncReadExt::read_exact(&mut stream, &mut byte)
                .await
                .unwrap();
            byte
        };
        let (served, echoed) = tokio::join!(served, client);
        assert_eq!(served, Some(Some(0)));
        assert_eq!(&echoed, b"x");
    }

    #[tokio::test]
    async fn dropping_the_cells_ends_them() {
        let cells = Cells::start(1).unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        // A task that would never end by itself: it holds `tx` until its runtime stops.
        assert!(cells.run_on(0, move || {
            tokio::spawn(async move {
                let _tx = tx;
                std::future::pending::<()>().await;
            });
        }));
        drop(cells);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), rx).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "the cell's tasks are dropped with it"
        );
    }
}
