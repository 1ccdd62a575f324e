//! The admin API's domain half: how a request's descriptors stand now (inspect), and forgetting
//! their windows and bans (reset). A request is matched against the rules exactly as a decision
//! matches it, so an operator sees the rule, the keys and the windows a caller's request would
//! meet. Nothing here knows the transport: `server/admin_api.rs` serves it over HTTP.

use std::sync::Arc;

use super::engine::Limiter;
use super::plan::{Plan, plan};
use super::rules::{Rule, Window};
use super::{LimiterError, Request};
use crate::store::{ItemState, StoreKey};

/// How one descriptor of the request stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standing {
    /// The rule's path; `None` where no rule matches (or the request carried its own limit).
    pub rule: Option<String>,
    /// Per window of the rule (or of the request's own limit), in order; empty without one.
    pub windows: Vec<WindowStanding>,
    /// Time left on a ban, if banned.
    pub ban_remaining_ms: Option<u64>,
    /// A sliding log's entries inside its longest window; `None` for `sliding_counter` or
    /// without a limit.
    pub entries: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowStanding {
    pub limit: u32,
    pub window_ms: u64,
    /// Hits inside the window now.
    pub used: u64,
    pub remaining: u64,
    /// Until the oldest hit inside the window leaves it (0 when it holds none).
    pub reset_ms: u64,
}

/// What a reset did to one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cleared {
    pub rule: Option<String>,
    /// It held a window or a ban, and holds none now.
    pub cleared: bool,
}

/// One request descriptor matched: its rule, and the store item it became (if any).
struct Matched<'a> {
    rule: Option<&'a Arc<Rule>>,
    /// The item's index in the plan's batch, and the windows as configured.
    item: Option<(usize, &'a [Window])>,
}

impl Limiter {
    /// How each of `request`'s descriptors stands: recording nothing, touching no TTL, and
    /// leaving the over-limit cache as it is.
    pub async fn inspect(&self, request: &Request) -> Result<Vec<Standing>, LimiterError> {
        self.options.bounds.validate(request)?;
        let limits = self.limits.load_full();
        let Some(domain) = limits.domain(&request.domain) else {
            return Ok(vec![Standing::none(); request.descriptors.len()]);
        };
        let planned = plan(request, &domain.root, self.modes(domain, &request.domain));
        let states = if planned.items.is_empty() {
            Vec::new()
        } else {
            self.store
                .inspect(&planned.items, self.clock.now_ms())
                .await?
        };
        Ok(matched(&planned.plans)
            .into_iter()
            .map(|m| standing(&m, &states))
            .collect())
    }

    /// Forgets the windows and bans of each of `request`'s descriptors (every key its rule
    /// uses), and this process's over-limit cache of them.
    pub async fn reset(&self, request: &Request) -> Result<Vec<Cleared>, LimiterError> {
        self.options.bounds.validate(request)?;
        let limits = self.limits.load_full();
        let Some(domain) = limits.domain(&request.domain) else {
            let none = Cleared {
                rule: None,
                cleared: false,
            };
            return Ok(vec![none; request.descriptors.len()]);
        };
        let planned = plan(request, &domain.root, self.modes(domain, &request.domain));
        let keys: Vec<StoreKey> = planned.items.iter().map(|i| i.key.clone()).collect();
        let held = if keys.is_empty() {
            Vec::new()
        } else {
            self.store.reset(&keys).await?
        };
        for key in &keys {
            self.cache.forget(key.as_str());
        }
        Ok(matched(&planned.plans)
            .into_iter()
            .map(|m| Cleared {
                rule: m.rule.map(|r| r.path.clone()),
                cleared: m
                    .item
                    .is_some_and(|(i, _)| held.get(i).copied().unwrap_or(false)),
            })
            .collect())
    }
}

fn matched<'a>(plans: &'a [Plan<'a>]) -> Vec<Matched<'a>> {
    plans
        .iter()
        .map(|plan| match plan {
            Plan::NoLimit => Matched {
                rule: None,
                item: None,
            },
            Plan::Unlimited(rule) => Matched {
                rule: Some(rule),
                item: None,
            },
            Plan::Check {
                item,
                rule,
                windows,
                ..
            } => Matched {
                rule: *rule,
                item: Some((*item, windows)),
            },
        })
        .collect()
}

fn standing(m: &Matched<'_>, states: &[ItemState]) -> Standing {
    let rule = m.rule.map(|r| r.path.clone());
    let Some((state, windows)) = m
        .item
        .and_then(|(i, windows)| Some((states.get(i)?, windows)))
    else {
        return Standing {
            rule,
            ..Standing::none()
        };
    };
    Standing {
        rule,
        windows: windows
            .iter()
            .zip(&state.windows)
            .map(|(w, found)| WindowStanding {
                limit: w.limit,
                window_ms: w.length_ms,
                used: found.count,
                remaining: u64::from(w.limit).saturating_sub(found.count),
                reset_ms: found.reset_ms,
            })
            .collect(),
        ban_remaining_ms: (state.ban_remaining_ms > 0).then_some(state.ban_remaining_ms),
        entries: state.entries,
    }
}

impl Standing {
    /// No rule, no windows.
    fn none() -> Standing {
        Standing {
            rule: None,
            windows: Vec::new(),
            ban_remaining_ms: None,
            entries: None,
        }
    }
}
