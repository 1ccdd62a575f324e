//! The conformance suite on the embedded store.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;
mod conformance;

use std::sync::Arc;

use conformance::{Backend, StoreFuture};
use slidegate::store::MemoryStore;

struct Memory;

impl Backend for Memory {
    fn store(&self) -> StoreFuture<'_> {
        Box::pin(async { Arc::new(MemoryStore::new()) as Arc<dyn slidegate::store::Store> })
    }
}

conformance_suite!(Memory);
