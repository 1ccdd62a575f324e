//! What one request may ask for. Every bound is checked before anything is read or recorded, so
//! nothing past a bound reaches the store; each breach is an `INVALID_ARGUMENT` that names the
//! bound and the flag that moves it.

use super::unit::Unit;
use super::{LimiterError, Request};

/// The bounds, each with a default (and a `--max-*` flag in the binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestBounds {
    /// Descriptors in one request (Envoy sends one per `rate_limits` entry of a route).
    pub descriptors: usize,
    /// Entries in one descriptor (one per action).
    pub entries: usize,
    /// Bytes of an entry key.
    pub key_bytes: usize,
    /// Bytes of an entry value (a path, a header, an address).
    pub value_bytes: usize,
    /// Hits of one descriptor, and of all descriptors of a request together. A log entry
    /// carries its hits as a weight, so hits cost no memory; the bound keeps running totals
    /// far from the 2^53 the Lua script sums exactly.
    pub hits: u64,
    /// The longest window a caller's `limit` override may ask for (its log lives that long).
    pub override_window_ms: u64,
}

impl Default for RequestBounds {
    fn default() -> Self {
        RequestBounds {
            descriptors: 64,
            entries: 16,
            key_bytes: 256,
            value_bytes: 4096,
            hits: 1_000_000_000,
            override_window_ms: Unit::Year.millis(),
        }
    }
}

impl RequestBounds {
    /// Rejects malformed requests and requests past a bound.
    pub fn validate(&self, request: &Request) -> Result<(), LimiterError> {
        let invalid = |m: String| Err(LimiterError::InvalidRequest(m));
        if request.domain.is_empty() {
            return invalid("rate limit domain must not be empty".into());
        }
        if request.descriptors.is_empty() {
            return invalid("rate limit descriptor list must not be empty".into());
        }
        if request.descriptors.len() > self.descriptors {
            return invalid(format!(
                "the request has {} descriptors; at most {} (--max-descriptors)",
                request.descriptors.len(),
                self.descriptors
            ));
        }
        let mut total_hits: u64 = 0;
        for (n, descriptor) in request.descriptors.iter().enumerate() {
            self.validate_entries(n, &descriptor.entries)?;
            let hits = descriptor
                .hits_addend
                .unwrap_or(u64::from(request.hits_addend));
            total_hits = total_hits.saturating_add(hits);
            if hits > self.hits {
                return invalid(format!(
                    "descriptors[{n}] asks for {hits} hits; at most {} per descriptor and request (--max-hits)",
                    self.hits
                ));
            }
            if let Some(over) = descriptor.limit {
                let Some(unit) = Unit::from_proto(over.unit) else {
                    return invalid(format!(
                        "descriptors[{n}].limit.unit must be one of SECOND, MINUTE, HOUR, DAY, WEEK, MONTH, YEAR (got {})",
                        over.unit
                    ));
                };
                if unit.millis() > self.override_window_ms {
                    return invalid(format!(
                        "descriptors[{n}].limit.unit {} is longer than the longest override window, {} ms (--max-override-window)",
                        unit.name().to_uppercase(),
                        self.override_window_ms
                    ));
                }
            }
        }
        if total_hits > self.hits {
            return invalid(format!(
                "the request asks for {total_hits} hits over its descriptors; at most {} (--max-hits)",
                self.hits
            ));
        }
        Ok(())
    }

    fn validate_entries(&self, n: usize, entries: &[(String, String)]) -> Result<(), LimiterError> {
        let invalid = |m: String| Err(LimiterError::InvalidRequest(m));
        // No entries at all is what Envoy sends when every action of a rate limit was skipped
        // (`skip_if_absent`); it matches nothing and is answered OK without a limit, as the
        // reference does, while the request's other descriptors are decided as usual.
        if entries.len() > self.entries {
            return invalid(format!(
                "descriptors[{n}] has {} entries; at most {} (--max-entries)",
                entries.len(),
                self.entries
            ));
        }
        for (e, (key, value)) in entries.iter().enumerate() {
            if key.is_empty() {
                return invalid(format!("descriptors[{n}].entries[{e}] has an empty key"));
            }
            if key.len() > self.key_bytes {
                return invalid(format!(
                    "descriptors[{n}].entries[{e}].key has {} bytes; at most {} (--max-key-bytes)",
                    key.len(),
                    self.key_bytes
                ));
            }
            if value.len() > self.value_bytes {
                return invalid(format!(
                    "descriptors[{n}].entries[{e}].value has {} bytes; at most {} (--max-value-bytes)",
                    value.len(),
                    self.value_bytes
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Descriptor, Override};

    fn request(descriptors: usize, value: &str, hits: Option<u64>) -> Request {
        Request {
            domain: "d".into(),
            descriptors: (0..descriptors)
                .map(|_| Descriptor {
                    entries: vec![("k".into(), value.into())],
                    limit: None,
                    hits_addend: hits,
                })
                .collect(),
            hits_addend: 0,
        }
    }

    fn message(bounds: &RequestBounds, request: &Request) -> String {
        match bounds.validate(request) {
            Err(LimiterError::InvalidRequest(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn each_bound_is_named_with_its_flag() {
        let bounds = RequestBounds {
            descriptors: 4,
            entries: 2,
            key_bytes: 8,
            value_bytes: 16,
            hits: 100,
            override_window_ms: Unit::Day.millis(),
        };
        assert!(bounds.validate(&request(4, "v", Some(25))).is_ok());
        assert!(message(&bounds, &request(5, "v", None)).contains("--max-descriptors"));
        assert!(message(&bounds, &request(1, &"v".repeat(17), None)).contains("--max-value-bytes"));
        assert!(message(&bounds, &request(1, "v", Some(101))).contains("--max-hits"));
        assert!(
            message(&bounds, &request(4, "v", Some(26))).contains("104 hits over its descriptors")
        );
        let mut many = request(1, "v", None);
        many.descriptors[0].entries = vec![("a".into(), "1".into()); 3];
        assert!(message(&bounds, &many).contains("--max-entries"));
        let mut long_key = request(1, "v", None);
        long_key.descriptors[0].entries[0].0 = "k".repeat(9);
        assert!(message(&bounds, &long_key).contains("--max-key-bytes"));
        let mut yearly = request(1, "v", None);
        yearly.descriptors[0].limit = Some(Override {
            requests_per_unit: 1,
            unit: Unit::Week as i32,
        });
        assert!(message(&bounds, &yearly).contains("WEEK is longer"));
        yearly.descriptors[0].limit = Some(Override {
            requests_per_unit: 1,
            unit: Unit::Day as i32,
        });
        assert!(bounds.validate(&yearly).is_ok());
    }
}
