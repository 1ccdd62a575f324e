//! The YAML as written: the reference format plus slidegate's additive extensions. Unknown keys
//! are errors. Validation and compilation into rules happen in [`super::compile`].

use serde::Deserialize;
use serde_saphyr::Spanned;

/// One config file: one domain.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFile {
    #[serde(default)]
    pub domain: Option<Spanned<String>>,
    #[serde(default)]
    pub descriptors: Vec<Spanned<RawDescriptor>>,
    /// Extension: this domain's answer when the store fails (`error`, `allow`, `deny`),
    /// overriding `--store-failure`.
    #[serde(default)]
    pub store_failure: Option<Spanned<String>>,
    /// Extension: every rule of the domain records usage already spent (token budgets).
    #[serde(default)]
    pub debit: bool,
    /// Extension: after the store lost its data (`open`, the default: decide as usual;
    /// `closed`: answer by the failure policy for one longest window of the domain's rules).
    #[serde(default)]
    pub store_reset: Option<Spanned<String>>,
    /// Extension: log every decision of the domain at info level (the decision log,
    /// `slidegate::decision`), where other domains' are logged at debug level.
    #[serde(default)]
    pub log_decisions: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDescriptor {
    #[serde(default)]
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub rate_limit: Option<Spanned<RawRateLimit>>,
    /// Extension: several windows on one descriptor, sharing one log.
    #[serde(default)]
    pub rate_limits: Option<Vec<Spanned<RawRateLimit>>>,
    /// Extension: after going over, reject for this long (`15m`).
    #[serde(default)]
    pub ban: Option<String>,
    /// Extension: `sliding_log` (exact, the default) or `sliding_counter` (constant memory).
    #[serde(default)]
    pub algorithm: Option<String>,
    /// Extension: buckets per window for `sliding_counter` (default 10).
    #[serde(default)]
    pub buckets: Option<u32>,
    /// Extension: the entry key whose value decides the Redis hash tag.
    #[serde(default)]
    pub tag_by: Option<String>,
    #[serde(default)]
    pub descriptors: Vec<Spanned<RawDescriptor>>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub quota_mode: bool,
    /// Extension: calls record usage already spent, even when it crosses the limit, while any
    /// budget was left; checks (hits 0) fail once it is spent (token budgets).
    #[serde(default)]
    pub debit: bool,
    #[serde(default)]
    pub detailed_metric: bool,
    #[serde(default)]
    pub value_to_metric: bool,
    #[serde(default)]
    pub share_threshold: bool,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRateLimit {
    #[serde(default)]
    pub unit: Option<String>,
    /// Extension: an arbitrary window (`90s`, `5m`, `36h`) instead of `unit`.
    #[serde(default)]
    pub window: Option<String>,
    #[serde(default)]
    pub requests_per_unit: u32,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub replaces: Option<Vec<RawReplace>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReplace {
    #[serde(default)]
    pub name: Option<String>,
}
