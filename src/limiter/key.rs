//! Store keys. This module alone decides key names and the Redis Cluster hash tag.
//!
//! A key is `rl:{<tag>}<rest>` ([`StoreKey`] lays it out). Redis Cluster hashes only the text
//! between the first `{` and the next `}`, so every key of one descriptor (its log, its bucket
//! counters and its ban) shares the tag and a Lua call that touches them stays in one slot. By
//! default the tag is the whole descriptor identity, which spreads descriptors over the cluster;
//! a rule with `tag_by` tags by one entry's value instead, so descriptors of one request that
//! carry the same value (a user id) share a slot and are decided in one script call.
//!
//! Every name and value is escaped (`%`, `{`, `}`, `:`, `=`, `~` become `%XX`), so the encoding is
//! injective: two different descriptors never share a key, and no value can move a key to another
//! slot by smuggling in a brace.

use std::fmt::Write;

use super::rules::Segment;
pub use crate::store::StoreKey;

/// What a log counts: the configured rule, or a caller's override of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Configured,
    /// A request `limit` override, with its window: each override window has its own log, so a
    /// short override never trims entries a longer one still counts.
    Override {
        window_ms: u64,
    },
}

/// Builds the key of a matched descriptor. `tag_by` names the entry key whose value becomes the
/// tag; when the descriptor has no such entry, the default (whole identity) tag is used.
pub fn build(
    domain: &str,
    segments: &[Segment<'_>],
    variant: Variant,
    tag_by: Option<&str>,
) -> StoreKey {
    let mut identity = String::with_capacity(64);
    escape_into(&mut identity, domain);
    for segment in segments {
        identity.push(':');
        match segment {
            Segment::Value { key, value } => {
                escape_into(&mut identity, key);
                identity.push('=');
                escape_into(&mut identity, value);
            }
            Segment::Shared { key, pattern } => {
                escape_into(&mut identity, key);
                identity.push('~');
                escape_into(&mut identity, pattern);
            }
        }
    }
    if let Variant::Override { window_ms } = variant {
        // A segment always holds an unescaped `=` or `~`; `!` alone cannot be one.
        let _ = write!(identity, ":!{window_ms}");
    }

    let tag_value = tag_by.and_then(|tag_key| {
        segments.iter().find_map(|s| match s {
            Segment::Value { key, value } if *key == tag_key => Some((*key, *value)),
            _ => None,
        })
    });
    match tag_value {
        Some((key, value)) => {
            let mut tag = String::with_capacity(domain.len() + key.len() + value.len() + 2);
            escape_into(&mut tag, domain);
            tag.push(':');
            escape_into(&mut tag, key);
            tag.push('=');
            escape_into(&mut tag, value);
            identity.insert(0, ':');
            StoreKey::new(&tag, &identity)
        }
        None => StoreKey::new(&identity, ""),
    }
}

fn escape_into(out: &mut String, text: &str) {
    // Names and values rarely hold a character to escape: then the text goes as it is, in one
    // copy rather than a character at a time.
    if !text
        .bytes()
        .any(|b| matches!(b, b'%' | b'{' | b'}' | b':' | b'=' | b'~'))
    {
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            ':' => out.push_str("%3A"),
            '=' => out.push_str("%3D"),
            '~' => out.push_str("%7E"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn value<'a>(key: &'a str, value: &'a str) -> Segment<'a> {
        Segment::Value { key, value }
    }

    #[test]
    fn default_key_is_tagged_by_the_whole_identity() {
        let key = build(
            "d",
            &[value("user", "42"), value("path", "/a")],
            Variant::Configured,
            None,
        );
        assert_eq!(key.log(), "rl:{d:user=42:path=/a}:log");
        assert_eq!(key.ban(), "rl:{d:user=42:path=/a}:ban");
        assert_eq!(key.tag(), "d:user=42:path=/a");
    }

    #[test]
    fn tag_by_uses_one_entry() {
        let segments = [value("user", "42"), value("path", "/a")];
        let key = build("d", &segments, Variant::Configured, Some("user"));
        assert_eq!(key.log(), "rl:{d:user=42}:d:user=42:path=/a:log");
        assert_eq!(key.tag(), "d:user=42");
        let missing = build("d", &segments, Variant::Configured, Some("tenant"));
        assert_eq!(missing.tag(), "d:user=42:path=/a");
    }

    #[test]
    fn braces_and_colons_are_escaped() {
        let key = build("d", &[value("k", "a}{b:c")], Variant::Configured, None);
        assert_eq!(key.tag(), "d:k=a%7D%7Bb%3Ac");
        assert_eq!(key.log().matches('{').count(), 1);
        assert_eq!(key.log().matches('}').count(), 1);
    }

    #[test]
    fn shared_and_override_keys_differ_from_plain_ones() {
        let plain = build("d", &[value("f", "a*")], Variant::Configured, None);
        let shared = build(
            "d",
            &[Segment::Shared {
                key: "f",
                pattern: "a*",
            }],
            Variant::Configured,
            None,
        );
        let over = build(
            "d",
            &[value("f", "a*")],
            Variant::Override { window_ms: 1000 },
            None,
        );
        assert_ne!(plain, shared);
        assert_ne!(plain, over);
        assert_ne!(shared, over);
    }

    fn segment() -> impl Strategy<Value = (bool, String, String)> {
        let text = "[a-c%{}:=~!*_]{0,4}";
        (any::<bool>(), text, text)
    }

    fn key_of(
        domain: &str,
        segs: &[(bool, String, String)],
        ov: Option<u64>,
        tag_by: Option<&str>,
    ) -> StoreKey {
        let segments: Vec<Segment<'_>> = segs
            .iter()
            .map(|(shared, k, v)| {
                if *shared {
                    Segment::Shared { key: k, pattern: v }
                } else {
                    Segment::Value { key: k, value: v }
                }
            })
            .collect();
        let variant = ov.map_or(Variant::Configured, |window_ms| Variant::Override {
            window_ms,
        });
        build(domain, &segments, variant, tag_by)
    }

    proptest! {
        #[test]
        fn encoding_is_injective(
            d1 in "[a-b%:{}]{0,3}", s1 in prop::collection::vec(segment(), 0..3), o1 in prop::option::of(0u64..3),
            d2 in "[a-b%:{}]{0,3}", s2 in prop::collection::vec(segment(), 0..3), o2 in prop::option::of(0u64..3),
            t1 in prop::option::of("[a-c%{}:=~!*_]{0,2}"), t2 in prop::option::of("[a-c%{}:=~!*_]{0,2}"),
        ) {
            let k1 = key_of(&d1, &s1, o1, t1.as_deref());
            let k2 = key_of(&d2, &s2, o2, t2.as_deref());
            if (&d1, &s1, o1) != (&d2, &s2, o2) {
                prop_assert_ne!(k1.log(), k2.log());
            }
        }

        #[test]
        fn values_never_change_the_tag_boundary(v in "\\PC{0,12}") {
            let key = build("d", &[value("k", &v)], Variant::Configured, None);
            let log = key.log();
            let open = log.find('{').unwrap_or(usize::MAX);
            let close = log.find('}').unwrap_or(usize::MAX);
            prop_assert_eq!(open, 3);
            prop_assert_eq!(&log[open + 1..close], key.tag());
            prop_assert_eq!(log.matches('{').count() + log.matches('}').count(), 2);
        }
    }
}
