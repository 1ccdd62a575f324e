//! The compiled rule tree and descriptor matching.
//!
//! The config loader builds a [`Limits`] once per load; requests only read it. Matching walks one
//! tree level per request entry with hash look-ups (exact value, then the wildcards of that key in
//! file order, then the key-only child), so its cost grows with the descriptor's depth, not with
//! the number of rules.

use std::collections::HashMap;
use std::sync::Arc;

use super::unit::Unit;
use crate::store;
pub use crate::store::Algorithm;

/// One window of a rule: at most `limit` hits in any interval of `length_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub limit: u32,
    pub length_ms: u64,
    /// The unit reported in `current_limit`: the configured unit, or the nearest one for an
    /// arbitrary window.
    pub unit: Unit,
    /// The window's `name`, reported in `current_limit` and matched by `replaces`.
    pub name: Option<Arc<str>>,
}

impl Window {
    /// A window of exactly one unit, as the reference format writes it.
    pub fn per_unit(limit: u32, unit: Unit, name: Option<Arc<str>>) -> Window {
        Window {
            limit,
            length_ms: unit.millis(),
            unit,
            name,
        }
    }

    /// What a store counts of this window.
    pub fn counted(&self) -> store::Window {
        store::Window {
            limit: self.limit,
            length_ms: self.length_ms,
        }
    }
}

/// What a matched rule asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Every window must have room; windows share one log, trimmed by the longest.
    Windows {
        windows: Vec<Window>,
        /// The same windows as the store counts them, in the same order (handed to the store
        /// by reference on every request). Built by [`Limit::windows`].
        counted: Vec<store::Window>,
        /// After going over, reject everything on this descriptor for this long.
        ban_ms: Option<u64>,
        algorithm: Algorithm,
        /// The rule as the Redis script reads it, made here once.
        text: store::RuleText,
    },
    /// Matched, never limited; answered without touching the store.
    Unlimited,
}

/// Redis memory, about, as `docs/redis.md` (*Memory and TTLs*) has it measured: a compact log
/// of one entry, key and all, and each entry more (a slot: 4 bytes, 6 in a log whose longest
/// window passes 2^30 ms; a weighted entry takes two).
const LOG_BYTES: u64 = 64;
const LONG_WINDOW_MS: u64 = 1 << 30;
/// A sorted-set log's entry past 128 entries (a skiplist), where a rule's log can pass
/// [`store::COMPACT_LOG_MAX_ENTRIES`] and keeps a sorted set.
const SKIPLIST_ENTRY_BYTES: u64 = 145;
/// A `sliding_counter` bucket (328 bytes for a hash of 10 buckets).
const BUCKET_BYTES: u64 = 33;
/// A ban key.
const BAN_BYTES: u64 = 72;

impl Limit {
    /// About how much Redis memory one descriptor value of this limit can hold at most: its log
    /// full (one entry per recorded call, up to the longest window's limit), or its counter's
    /// buckets, and its ban. `None`: unlimited, nothing held.
    pub fn redis_bytes(&self) -> Option<u64> {
        let Limit::Windows {
            windows,
            ban_ms,
            algorithm,
            ..
        } = self
        else {
            return None;
        };
        let held = match algorithm {
            Algorithm::SlidingLog => {
                let (entries, longest) = windows
                    .iter()
                    .max_by_key(|w| (w.length_ms, w.limit))
                    .map_or((0, 0), |w| (u64::from(w.limit), w.length_ms));
                if entries > u64::from(store::COMPACT_LOG_MAX_ENTRIES) {
                    entries.saturating_mul(SKIPLIST_ENTRY_BYTES)
                } else {
                    let slot = if longest < LONG_WINDOW_MS { 4 } else { 6 };
                    LOG_BYTES + entries.saturating_sub(1).saturating_mul(slot)
                }
            }
            Algorithm::SlidingCounter { buckets } => {
                let mut lengths: Vec<u64> = windows.iter().map(|w| w.length_ms).collect();
                lengths.sort_unstable();
                lengths.dedup();
                BUCKET_BYTES * u64::from(*buckets) * lengths.len() as u64
            }
        };
        Some(held + ban_ms.map_or(0, |_| BAN_BYTES))
    }

    pub fn windows(windows: Vec<Window>, ban_ms: Option<u64>, algorithm: Algorithm) -> Limit {
        let counted: Vec<store::Window> = windows.iter().map(Window::counted).collect();
        let text = store::RuleText::new(&counted, algorithm, ban_ms);
        Limit::Windows {
            windows,
            counted,
            ban_ms,
            algorithm,
            text,
        }
    }
}

/// A configured rule: where it sits and how it behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Stat-style path, e.g. `messaging.message_type_marketing.to_number`.
    pub path: String,
    pub domain: Arc<str>,
    /// The path split for metric labels: the first level, and the rest joined with `.`.
    pub stat_key1: Arc<str>,
    pub stat_key2: Arc<str>,
    /// Per level: whether metrics show the request's value there (`value_to_metric`, or every
    /// level with `detailed_metric`).
    pub value_levels: Vec<bool>,
    pub limit: Limit,
    /// Names of rules this one removes from a request's decision when both match.
    pub replaces: Vec<Arc<str>>,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    /// Calls record usage already spent, even when it crosses the limit (token budgets).
    pub debit: bool,
    pub detailed_metric: bool,
    /// Free-form `metadata`, returned in `dynamic_metadata` when that is switched on.
    pub metadata: Option<serde_json::Value>,
    /// Entry key whose value decides the store's hash tag (co-locates a request's descriptors).
    pub tag_by: Option<String>,
    /// File and line the rule came from, for introspection and errors.
    pub source: Arc<str>,
    /// The observer's data about this rule (the metrics' counters for it).
    pub observer_slot: ObserverSlot,
}

impl Rule {
    /// Whether `name` names this rule (any of its windows).
    pub fn is_named(&self, name: &str) -> bool {
        match &self.limit {
            Limit::Windows { windows, .. } => {
                windows.iter().any(|w| w.name.as_deref() == Some(name))
            }
            Limit::Unlimited => false,
        }
    }
}

pub use super::observe::ObserverSlot;

/// A value pattern with `*` wildcards anywhere (`foo*`, `*bar`, `a*b*c`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    text: String,
}

impl Pattern {
    pub fn new(text: impl Into<String>) -> Pattern {
        Pattern { text: text.into() }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// `*` matches zero or more characters. Greedy-left matching of the literal pieces is exact
    /// for a pattern made only of literals and `*`.
    pub fn matches(&self, value: &str) -> bool {
        let mut pieces = self.text.split('*');
        let first = pieces.next().unwrap_or_default();
        let Some(mut rest) = value.strip_prefix(first) else {
            return false;
        };
        let mut pieces: Vec<&str> = pieces.collect();
        let Some(last) = pieces.pop() else {
            // No `*` at all: the whole value had to equal the text.
            return rest.is_empty();
        };
        for piece in pieces {
            match rest.find(piece) {
                Some(at) => rest = &rest[at + piece.len()..],
                None => return false,
            }
        }
        rest.len() >= last.len() && rest.ends_with(last)
    }
}

/// One node of the tree: the rule that applies when the request's last entry lands here, and the
/// children for the next entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    pub rule: Option<Arc<Rule>>,
    pub children: HashMap<String, KeyChildren>,
}

impl Node {
    /// Calls `f` with every rule at or under this node and the (key, value) pairs that lead
    /// to it from here, after `path`: a wildcard's pattern, `*` for any value.
    fn each_rule<'a>(
        &'a self,
        path: &mut Vec<(&'a str, &'a str)>,
        f: &mut impl FnMut(&[(&'a str, &'a str)], &'a Arc<Rule>),
    ) {
        if let Some(rule) = &self.rule {
            f(path, rule);
        }
        for (key, children) in &self.children {
            let next = children
                .exact
                .iter()
                .map(|(value, node)| (value.as_str(), node))
                .chain(
                    children
                        .wildcards
                        .iter()
                        .map(|w| (w.pattern.as_str(), &w.node)),
                )
                .chain(children.any_value.iter().map(|node| ("*", &**node)));
            for (value, node) in next {
                path.push((key.as_str(), value));
                node.each_rule(path, f);
                path.pop();
            }
        }
    }
}

/// The children of a node that share one entry key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyChildren {
    pub exact: HashMap<String, Node>,
    /// In file order; the first match wins.
    pub wildcards: Vec<WildcardChild>,
    pub any_value: Option<Box<Node>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WildcardChild {
    pub pattern: Pattern,
    /// All values matching the pattern share one log (`share_threshold`).
    pub shared: bool,
    pub node: Node,
}

/// What to answer when the store fails (times out or errors).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailurePolicy {
    /// A gRPC `UNAVAILABLE` error: Envoy's `failure_mode_deny` decides.
    #[default]
    Error,
    /// Answer OK (fail open).
    Allow,
    /// Answer OVER_LIMIT for every limited descriptor (fail closed).
    Deny,
}

/// All loaded rules, by domain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub domains: HashMap<String, Domain>,
}

/// One domain's rules and settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Domain {
    pub root: Node,
    /// Overrides the server's store failure policy for this domain.
    pub store_failure: Option<FailurePolicy>,
    /// Every rule of the domain takes debits.
    pub debit: bool,
    /// After the store lost its data, answer by the failure policy (`store_reset: closed`)
    /// for [`Domain::longest_window_ms`] from when the loss was found.
    pub store_reset_closed: bool,
    /// The longest window of the domain's rules.
    pub longest_window_ms: u64,
    /// Its decisions are logged at info level (`log_decisions: true`).
    pub log_decisions: bool,
}

/// How one level of a matched descriptor enters the log's identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    /// Counted per concrete value (exact, key-only and non-shared wildcard matches).
    Value { key: &'a str, value: &'a str },
    /// Counted once for every value that matches the pattern (`share_threshold`).
    Shared { key: &'a str, pattern: &'a str },
}

/// The rule a descriptor matched and the segments that identify its log.
#[derive(Debug, PartialEq, Eq)]
pub struct Match<'a> {
    pub rule: &'a Arc<Rule>,
    pub segments: Vec<Segment<'a>>,
}

impl Limits {
    pub fn domain(&self, domain: &str) -> Option<&Domain> {
        self.domains.get(domain)
    }

    /// Every rule with the domain it belongs to, for introspection.
    pub fn rules(&self) -> Vec<(&str, &Arc<Rule>)> {
        let mut out = Vec::new();
        for (name, domain) in &self.domains {
            domain.root.each_rule(&mut Vec::new(), &mut |_, rule| {
                out.push((name.as_str(), rule))
            });
        }
        out.sort_by(|a, b| (a.0, &a.1.path).cmp(&(b.0, &b.1.path)));
        out
    }
}

impl Node {
    /// Finds the rule for a descriptor: one level per entry, no backtracking, and a rule only
    /// at the node the last entry reaches.
    pub fn find<'a>(&'a self, entries: &'a [(String, String)]) -> Option<Match<'a>> {
        let mut node = self;
        let mut segments = Vec::with_capacity(entries.len());
        for (key, value) in entries {
            let (next, segment) = node.children.get(key.as_str())?.step(key, value)?;
            segments.push(segment);
            node = next;
        }
        node.rule.as_ref().map(|rule| Match { rule, segments })
    }
}

/// The most tree nodes one bucket id's match may visit: entries that fit several levels could
/// otherwise be tried in every order.
const BUCKET_MATCH_VISITS: usize = 4_096;

impl Node {
    /// Finds the rule for a bucket id of the Rate Limit Quota Service: a descriptor of its
    /// entries in whichever order the tree has them (a bucket id is a map). At each level the
    /// entries whose key the level has are tried in the order of their keys, each matched as
    /// [`Node::find`] matches an entry (exact value, wildcard, key-only), and the first order
    /// that ends at a rule with every entry used wins.
    pub fn find_bucket<'a>(&'a self, entries: &'a [(String, String)]) -> Option<Match<'a>> {
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by(|&a, &b| entries[a].0.cmp(&entries[b].0));
        let mut used = vec![false; entries.len()];
        let mut segments = Vec::with_capacity(entries.len());
        let mut visits = 0;
        let rule = self.find_unordered(entries, &order, &mut used, &mut segments, &mut visits)?;
        Some(Match { rule, segments })
    }

    fn find_unordered<'a>(
        &'a self,
        entries: &'a [(String, String)],
        order: &[usize],
        used: &mut [bool],
        segments: &mut Vec<Segment<'a>>,
        visits: &mut usize,
    ) -> Option<&'a Arc<Rule>> {
        *visits += 1;
        if segments.len() == entries.len() {
            return self.rule.as_ref();
        }
        for &i in order {
            if used[i] || *visits > BUCKET_MATCH_VISITS {
                continue;
            }
            let (key, value) = &entries[i];
            let Some(children) = self.children.get(key.as_str()) else {
                continue;
            };
            let Some((next, segment)) = children.step(key, value) else {
                continue;
            };
            used[i] = true;
            segments.push(segment);
            if let Some(rule) = next.find_unordered(entries, order, used, segments, visits) {
                return Some(rule);
            }
            segments.pop();
            used[i] = false;
        }
        None
    }
}

impl KeyChildren {
    /// The node an entry of this key leads to, and how it enters the log's identity: its exact
    /// value, else the first wildcard that matches it (file order), else the key-only child.
    fn step<'a>(&'a self, key: &'a str, value: &'a str) -> Option<(&'a Node, Segment<'a>)> {
        if let Some(next) = self.exact.get(value) {
            return Some((next, Segment::Value { key, value }));
        }
        if let Some(w) = self.wildcards.iter().find(|w| w.pattern.matches(value)) {
            let segment = if w.shared {
                Segment::Shared {
                    key,
                    pattern: w.pattern.as_str(),
                }
            } else {
                Segment::Value { key, value }
            };
            return Some((&w.node, segment));
        }
        self.any_value
            .as_deref()
            .map(|next| (next, Segment::Value { key, value }))
    }
}

impl Rule {
    /// One line for introspection: path, windows, ban, modes and where the rule came from.
    pub fn describe(&self) -> String {
        let limit = match &self.limit {
            Limit::Unlimited => "unlimited".to_string(),
            Limit::Windows {
                windows,
                ban_ms,
                algorithm,
                ..
            } => {
                let windows: Vec<String> = windows
                    .iter()
                    .map(|w| {
                        let name = w
                            .name
                            .as_deref()
                            .map(|n| format!(" ({n})"))
                            .unwrap_or_default();
                        format!("{}/{}{name}", w.limit, human_ms(w.length_ms))
                    })
                    .collect();
                let ban = ban_ms
                    .map(|b| format!(" ban={}", human_ms(b)))
                    .unwrap_or_default();
                let algorithm = match algorithm {
                    Algorithm::SlidingLog => String::new(),
                    Algorithm::SlidingCounter { buckets } => {
                        format!(" sliding_counter({buckets} buckets)")
                    }
                };
                format!("{}{ban}{algorithm}", windows.join(", "))
            }
        };
        let mut flags = Vec::new();
        if self.shadow_mode {
            flags.push("shadow");
        }
        if self.quota_mode {
            flags.push("quota");
        }
        if self.debit {
            flags.push("debit");
        }
        let flags = if flags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", flags.join(", "))
        };
        let memory = self
            .limit
            .redis_bytes()
            .map(|bytes| format!(", up to about {} in Redis per value", human_bytes(bytes)))
            .unwrap_or_default();
        format!("{}: {limit}{flags} ({}){memory}", self.path, self.source)
    }
}

/// Bytes as `72 B`, `2.9 KB`, `14.5 MB` (powers of 1,000).
pub fn human_bytes(bytes: u64) -> String {
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} KB", bytes as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", bytes as f64 / 1e6),
        _ => format!("{:.1} GB", bytes as f64 / 1e9),
    }
}

impl Limits {
    /// Every rule, one line each, sorted by domain and path, with the Rate Limit Quota Service
    /// bucket id that matches it (`*` for any value).
    pub fn describe(&self) -> String {
        let mut lines = Vec::new();
        let mut domains: Vec<(&String, &Domain)> = self.domains.iter().collect();
        domains.sort_by_key(|(name, _)| *name);
        for (_, domain) in domains {
            let mut out = Vec::new();
            domain.root.each_rule(&mut Vec::new(), &mut |path, rule| {
                let id: Vec<String> = path.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                out.push((
                    rule.path.clone(),
                    format!("{}; quota bucket {{{}}}", rule.describe(), id.join(", ")),
                ));
            });
            out.sort();
            lines.extend(out.into_iter().map(|(_, line)| line + "\n"));
        }
        lines.concat()
    }
}

/// A window length as written in config: `90s`, `1h30m`, `500ms`.
pub fn human_ms(ms: u64) -> String {
    const UNITS: [(u64, &str); 6] = [
        (604_800_000, "w"),
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
        (1, "ms"),
    ];
    if ms == 0 {
        return "0s".into();
    }
    let mut rest = ms;
    let mut out = String::new();
    for (size, unit) in UNITS {
        if rest >= size {
            out.push_str(&format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What one value of a rule can hold in Redis: a full log by its longest window (compact:
    /// 4 bytes an entry, 6 past 2^30 ms; a sorted set past 1,000 entries), a counter's buckets per distinct window length, a
    /// ban key; nothing for an unlimited rule.
    #[test]
    fn a_rules_redis_memory_per_value() {
        let w = |limit, unit| Window::per_unit(limit, unit, None);
        let log = |windows, ban| Limit::windows(windows, ban, Algorithm::SlidingLog);
        // The longest window's limit bounds the log, whatever the shorter ones allow.
        let login = log(vec![w(3, Unit::Minute), w(50, Unit::Day)], Some(900_000));
        assert_eq!(login.redis_bytes(), Some(64 + 49 * 4 + 72));
        let burst = log(vec![w(500, Unit::Second), w(100, Unit::Hour)], None);
        assert_eq!(burst.redis_bytes(), Some(64 + 99 * 4));
        let big = log(vec![w(1_000, Unit::Hour)], None);
        assert_eq!(big.redis_bytes(), Some(64 + 999 * 4));
        let month = log(vec![w(1_000, Unit::Month)], None);
        assert_eq!(month.redis_bytes(), Some(64 + 999 * 6), "6-byte slots");
        // Past 1,000 entries a log is a sorted set (a skiplist).
        let busy = log(vec![w(1_001, Unit::Hour)], None);
        assert_eq!(busy.redis_bytes(), Some(1_001 * 145));
        let counter = Limit::windows(
            vec![w(100_000, Unit::Minute), w(1_000_000, Unit::Hour)],
            None,
            Algorithm::SlidingCounter { buckets: 10 },
        );
        assert_eq!(
            counter.redis_bytes(),
            Some(2 * 10 * 33),
            "whatever the limits"
        );
        assert_eq!(Limit::Unlimited.redis_bytes(), None);
        assert_eq!(
            [72, 2_872, 145_000, 14_500_000].map(human_bytes),
            ["72 B", "2.9 KB", "145.0 KB", "14.5 MB"]
        );
    }

    #[test]
    fn wildcard_patterns() {
        let cases = [
            ("foo*", "foo", true),
            ("foo*", "foo1", true),
            ("foo*", "fo", false),
            ("*bar", "xbar", true),
            ("*bar", "barx", false),
            ("bar*b", "barab", true),
            ("bar*b", "barb", true),
            ("bar*b", "bara", false),
            ("bar*b", "xbarb", false),
            ("foo*bar*baz", "foobarbaz", true),
            ("foo*bar*baz", "foo123baz", false),
            ("foo*bar*baz", "fooXbarYbaz", true),
            ("a*a", "a", false),
            ("a*a", "aa", true),
            ("*", "", true),
            ("exact", "exact", true),
            ("exact", "exactly", false),
        ];
        for (pattern, value, expected) in cases {
            assert_eq!(
                Pattern::new(pattern).matches(value),
                expected,
                "{pattern} ~ {value}"
            );
        }
    }

    /// Each rule's line names the bucket id that matches it: its path's pairs, a wildcard's
    /// pattern as written, `*` for any value; sorted by path within a domain.
    #[test]
    fn each_rule_is_described_with_its_bucket_id() {
        let limits = crate::config::compile_sources(&[(
            "t.yaml".into(),
            "domain: api
descriptors:
  - key: tenant
    descriptors:
      - key: plan
        value: free
        rate_limit: {unit: minute, requests_per_unit: 600}
  - key: path
    value: /api/*
    rate_limit: {unit: second, requests_per_unit: 5}
"
            .into(),
        )])
        .expect("valid");
        let text = limits.describe();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].ends_with("; quota bucket {path: /api/*}"),
            "{text}"
        );
        assert!(
            lines[1].ends_with("; quota bucket {tenant: *, plan: free}"),
            "{text}"
        );
        assert_eq!(limits.rules().len(), 2);
    }
}
