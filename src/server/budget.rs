//! Request bytes held in memory while a request's body arrives: bounded per connection and
//! over the whole server, so that one client sending large messages slowly, or many of them
//! at once, cannot take the memory the others need. A request that would pass a bound is
//! answered at once (`RESOURCE_EXHAUSTED` on gRPC, 413 on HTTP) and its bytes let go.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The server's bound, shared by every connection of both ports.
#[derive(Clone, Debug)]
pub struct RequestBytes {
    total: Arc<AtomicUsize>,
    total_cap: usize,
    per_connection_cap: usize,
}

/// Which bound a request would have passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exhausted {
    /// `--max-buffered-per-connection`.
    Connection(usize),
    /// `--max-buffered`.
    Server(usize),
}

impl std::fmt::Display for Exhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exhausted::Connection(cap) => write!(
                f,
                "request bytes held for this connection would pass {cap} (--max-buffered-per-connection)"
            ),
            Exhausted::Server(cap) => write!(
                f,
                "request bytes held by the server would pass {cap} (--max-buffered)"
            ),
        }
    }
}

impl RequestBytes {
    pub fn new(total_cap: usize, per_connection_cap: usize) -> RequestBytes {
        RequestBytes {
            total: Arc::default(),
            total_cap,
            per_connection_cap,
        }
    }

    /// The account of one new connection.
    pub fn connection(&self) -> ConnectionBytes {
        ConnectionBytes {
            server: self.clone(),
            own: Arc::default(),
        }
    }

    /// Bytes held now, over every connection.
    pub fn held(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }
}

/// One connection's account (clones share it).
#[derive(Clone, Debug)]
pub struct ConnectionBytes {
    server: RequestBytes,
    own: Arc<AtomicUsize>,
}

impl ConnectionBytes {
    /// The server's bound this account is under.
    pub fn server(&self) -> &RequestBytes {
        &self.server
    }

    /// An empty hold for one request, charged as its buffer grows.
    pub fn hold(&self) -> Hold<'_> {
        Hold {
            account: self,
            bytes: 0,
        }
    }
}

/// The bytes one request holds; given back when it is dropped.
#[derive(Debug)]
pub struct Hold<'a> {
    account: &'a ConnectionBytes,
    bytes: usize,
}

impl Hold<'_> {
    /// Charges `more` bytes to the connection and the server, or to neither when either would
    /// pass its bound.
    pub fn grow(&mut self, more: usize) -> Result<(), Exhausted> {
        let server = &self.account.server;
        charge(&self.account.own, more, server.per_connection_cap)
            .map_err(Exhausted::Connection)?;
        if let Err(cap) = charge(&server.total, more, server.total_cap) {
            self.account.own.fetch_sub(more, Ordering::Relaxed);
            return Err(Exhausted::Server(cap));
        }
        self.bytes += more;
        Ok(())
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return; // nearly every request: its message came in one frame
        }
        self.account.own.fetch_sub(self.bytes, Ordering::Relaxed);
        self.account
            .server
            .total
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Adds `more` to `counter` unless that passes `cap` (then returns the cap).
fn charge(counter: &AtomicUsize, more: usize, cap: usize) -> Result<(), usize> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
            held.checked_add(more).filter(|&after| after <= cap)
        })
        .map(|_| ())
        .map_err(|_| cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_bounded_per_connection_and_in_total_and_given_back() {
        let server = RequestBytes::new(100, 60);
        let (a, b) = (server.connection(), server.connection());
        let mut first = a.hold();
        first.grow(50).expect("within both bounds");
        let mut second = a.hold();
        assert_eq!(second.grow(20), Err(Exhausted::Connection(60)));
        second.grow(10).expect("the connection's last 10 bytes");
        let mut other = b.hold();
        assert_eq!(other.grow(50), Err(Exhausted::Server(100)));
        assert_eq!(server.held(), 60, "a refused charge is charged to neither");
        other.grow(40).expect("the server's last 40 bytes");
        drop((first, second, other));
        assert_eq!(server.held(), 0, "every hold given back");
        let mut again = a.hold();
        again
            .grow(60)
            .expect("the connection's bound is free again");
    }
}
