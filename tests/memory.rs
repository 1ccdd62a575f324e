//! The conformance suite on the embedded store.

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
