//! When a networked store gives up on a decision, and what the failure policy's answer then
//! says it waited for. A decision waits for two things in turn: its turn to call Redis (the
//! batcher's queue, where waiting sends nothing) and Redis's reply to the call that carries it.
//! Each has its own bound, so that a saturated slidegate and a slow Redis read apart in the
//! error and neither cuts the other short:
//!
//! * a turn is bounded by the caller's deadline (just before it), and without one by
//!   `--redis-queue-timeout`;
//! * a reply by `--redis-timeout` from when the call was sent, or the caller's deadline where
//!   that comes first.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

tokio::task_local! {
    /// When the caller of the decision being made stops waiting for it (its `grpc-timeout`).
    static CALLER_DEADLINE: Instant;
}

/// Runs `decision` for a caller that waits until `deadline`: the Redis store's calls for it
/// end a little before that moment (see [`Deadlines`]). Kept beside the decision rather than
/// passed through the limiter: a deadline is the transport's, and only a store that waits on a
/// network has a use for it.
pub async fn with_caller_deadline<F: Future>(deadline: Instant, decision: F) -> F::Output {
    CALLER_DEADLINE.scope(deadline, decision).await
}

/// The deadline of the caller whose decision is being made, where it sent one (set by
/// [`with_caller_deadline`]; the HTTP endpoint's callers and a gRPC call without
/// `grpc-timeout` have none).
pub fn caller_deadline() -> Option<Instant> {
    CALLER_DEADLINE.try_with(|deadline| *deadline).ok()
}

/// How long before its caller's deadline a decision the store could not make is answered by
/// the failure policy, at least: room for the answer to travel back, so that the caller (Envoy,
/// with its 20 ms filter timeout) receives the policy's answer and not its own timeout. A tenth
/// of the time left where that is more (a caller's clock started before it sent), half of it
/// where that is less.
pub const ANSWER_MARGIN: Duration = Duration::from_millis(3);

/// What ended a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// The caller's deadline (its `grpc-timeout`), less the [`ANSWER_MARGIN`].
    CallerDeadline,
    /// `--redis-timeout`: a call sent and not answered.
    RedisTimeout,
    /// `--redis-queue-timeout`: a turn not come, for a caller without a deadline.
    QueueTimeout,
    /// `--redis-connect-timeout`: connecting, or loading the function library.
    ConnectTimeout,
}

/// What a decision the store gave up on had waited for, and how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// Its turn to call Redis: every call to that Redis was out (slidegate saturated).
    Turn(Duration, Bound),
    /// Redis's reply to a call sent (Redis slow, or away).
    Redis(Duration, Bound),
}

impl std::fmt::Display for Waited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bound = match self {
            Waited::Turn(waited, bound) => {
                let ms = waited.as_millis();
                write!(f, "waited {ms} ms for a turn to call Redis")?;
                bound
            }
            Waited::Redis(waited, bound) => {
                let ms = waited.as_millis();
                write!(f, "Redis did not answer within {ms} ms")?;
                bound
            }
        };
        f.write_str(match bound {
            Bound::CallerDeadline => ", until just before the caller's deadline",
            Bound::RedisTimeout => " (--redis-timeout)",
            Bound::QueueTimeout => " (--redis-queue-timeout)",
            Bound::ConnectTimeout => " (--redis-connect-timeout)",
        })
    }
}

/// The moments of one decision that reached a networked store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// A little before its caller's deadline ([`ANSWER_MARGIN`]), where it sent one.
    pub caller: Option<Instant>,
    /// Until when it may wait for its turn to call Redis: `caller`, or without one
    /// `--redis-queue-timeout` after it reached the store.
    pub turn: Instant,
}

impl Deadlines {
    /// The moments of a decision that reaches the store at `now`, for the caller it is made
    /// for ([`caller_deadline`]).
    pub fn new(now: Instant, queue_timeout: Duration) -> Deadlines {
        Deadlines::for_caller(now, queue_timeout, caller_deadline())
    }

    /// The moments of a decision that reaches the store at `now` for a caller that waits
    /// until `deadline`, where it said.
    pub fn for_caller(now: Instant, queue_timeout: Duration, deadline: Option<Instant>) -> Self {
        let caller = deadline.map(|deadline| {
            let left = deadline.saturating_duration_since(now);
            let margin = ANSWER_MARGIN.max(left / 10).min(left / 2);
            deadline.checked_sub(margin).unwrap_or(now).max(now)
        });
        Deadlines {
            caller,
            turn: caller.unwrap_or(now + queue_timeout),
        }
    }

    /// What ends the wait for a turn.
    pub fn turn_bound(&self) -> Bound {
        if self.caller.is_some() {
            Bound::CallerDeadline
        } else {
            Bound::QueueTimeout
        }
    }

    /// Until when a call sent at `sent` is waited for on this decision's behalf:
    /// `timeout` (`--redis-timeout`) later, or the caller's moment where that comes first; and
    /// which of the two it is.
    pub fn reply_by(&self, sent: Instant, timeout: Duration) -> (Instant, Bound) {
        let own = sent + timeout;
        match self.caller {
            Some(caller) if caller < own => (caller, Bound::CallerDeadline),
            _ => (own, Bound::RedisTimeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision's turn ends just before its caller's deadline, or at the queue timeout
    /// without one; a call sent for it is waited for `--redis-timeout` from when it is sent,
    /// or until just before the caller's deadline where that comes first.
    #[tokio::test(start_paused = true)]
    async fn a_turn_and_a_reply_each_have_their_own_bound() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let at = |deadline: Option<u64>| {
            Deadlines::for_caller(now, ms(1_000), deadline.map(|d| now + ms(d)))
        };
        let since = |moment: Instant| moment.duration_since(now).as_millis();
        let none = at(None);
        assert_eq!(
            (since(none.turn), none.turn_bound()),
            (1_000, Bound::QueueTimeout),
            "no deadline: --redis-queue-timeout"
        );
        let (by, bound) = none.reply_by(now + ms(900), ms(15));
        assert_eq!(
            (since(by), bound),
            (915, Bound::RedisTimeout),
            "from when sent"
        );
        let envoy = at(Some(20));
        assert_eq!(
            (since(envoy.turn), envoy.turn_bound()),
            (17, Bound::CallerDeadline),
            "3 ms before Envoy's 20 ms"
        );
        let (by, bound) = envoy.reply_by(now, ms(15));
        assert_eq!((since(by), bound), (15, Bound::RedisTimeout));
        let (by, bound) = envoy.reply_by(now + ms(10), ms(15));
        assert_eq!(
            (since(by), bound),
            (17, Bound::CallerDeadline),
            "sent late: the caller's moment first"
        );
        assert_eq!(since(at(Some(50)).turn), 45, "a tenth of 50 ms");
        assert_eq!(since(at(Some(1_000)).turn), 900);
        assert_eq!(since(at(Some(4)).turn), 2, "half of what is left");
        assert_eq!(since(at(Some(0)).turn), 0, "a deadline already passed");
    }

    /// A decision knows its caller's deadline inside its own future only: not outside it, and
    /// not in another decision polled beside it.
    #[tokio::test]
    async fn a_callers_deadline_is_its_decisions_alone() {
        assert_eq!(caller_deadline(), None);
        let deadline = Instant::now() + Duration::from_millis(20);
        let (inside, beside) = tokio::join!(
            with_caller_deadline(deadline, async {
                tokio::task::yield_now().await;
                caller_deadline()
            }),
            async {
                tokio::task::yield_now().await;
                caller_deadline()
            }
        );
        assert_eq!(inside, Some(deadline));
        assert_eq!(beside, None);
        assert_eq!(caller_deadline(), None);
    }

    #[test]
    fn a_timeout_says_what_it_waited_for() {
        let ms = Duration::from_millis;
        let texts = [
            (
                Waited::Turn(ms(12), Bound::CallerDeadline),
                "waited 12 ms for a turn to call Redis, until just before the caller's deadline",
            ),
            (
                Waited::Turn(ms(1_000), Bound::QueueTimeout),
                "waited 1000 ms for a turn to call Redis (--redis-queue-timeout)",
            ),
            (
                Waited::Redis(ms(15), Bound::RedisTimeout),
                "Redis did not answer within 15 ms (--redis-timeout)",
            ),
            (
                Waited::Redis(ms(9), Bound::CallerDeadline),
                "Redis did not answer within 9 ms, until just before the caller's deadline",
            ),
        ];
        for (waited, text) in texts {
            assert_eq!(waited.to_string(), text);
        }
    }
}
