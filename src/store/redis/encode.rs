//! What a script call carries and answers: a request's `KEYS` and `ARGV` (the rule as one text,
//! made once per rule), the call's reply split into one answer per request and read back into
//! outcomes, and which errors are the script's own.
//! The layout of both is the table at the top of `lua/contract.lua`.

use super::call::{Answer, NOT_SERVED, not_served_error};
use super::packed::{self, Item, Items};
use super::take_back::{Recorded, TakeBack};
use super::*;

/// The error code the script puts first in its error replies (Redis error replies start with a
/// code, like `WRONGTYPE` or `NOSCRIPT`).
pub(super) const SCRIPT_ERROR_CODE: &str = "SLIDEGATE";

pub(super) fn unavailable(e: &Error) -> StoreError {
    // fred's messages carry the error kind and the server's reply text, never the URL.
    StoreError::Unavailable {
        context: format!("{:?}: {}", e.kind(), e.details()),
        source: Some(std::sync::Arc::new(e.clone())),
    }
}

/// Whether an error text is the script's own (its error code first): the call or request was
/// malformed, a protocol error, not the store being unavailable.
pub(super) fn is_script_error(text: &str) -> bool {
    text.split_whitespace().next() == Some(SCRIPT_ERROR_CODE)
}

/// A script call's failure: the script's own error reply is a protocol error; anything else is
/// the store being unavailable.
pub(super) fn call_failed(e: &Error) -> StoreError {
    if is_script_error(e.details()) {
        StoreError::Protocol(e.details().to_string())
    } else {
        unavailable(e)
    }
}

/// One request of a call failed inside the script: what Redis said (a key of another type, say)
/// or the script's own error.
pub(super) fn request_failed(message: &str) -> StoreError {
    if is_script_error(message) {
        StoreError::Protocol(message.to_string())
    } else {
        StoreError::unavailable(format!("script: {message}"))
    }
}

impl RedisStore {
    /// The script's `KEYS` and `ARGV` for the items of `group`, as one request of a call
    /// (layout in `lua/contract.lua`).
    pub(super) fn script_input(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> Request {
        let (group, slots) = (&group.items, group.slots);
        let mut keys = Vec::with_capacity(group.len() * 2);
        let mut args: Vec<Value> = Vec::with_capacity(2 + group.len() * 2);
        // The request's shape: its descriptor count and mode in one argument.
        args.push(number(4 * group.len() as u64 + mode.code()));
        // What each descriptor records, kept only where a late reply's hits are taken back.
        let mut recorded = Vec::with_capacity(if call.take_back { group.len() } else { 0 });
        for &i in group {
            let item = &items[i];
            let ban_ms = item.ban_ms.unwrap_or(0);
            let data = self.key(item.key.data(item.algorithm));
            if call.take_back {
                recorded.push(Recorded::of(data.clone(), item));
            }
            keys.push(data);
            if ban_ms > 0 {
                keys.push(self.key(item.key.ban()));
            }
            args.push(number(item.hits));
            args.push(rule_arg(item, ban_ms, self.recipe.options.log_format));
        }
        // The prefix names a tentative request's entries, for their removal (`undo`); the
        // script writes the others' without it, so they send none.
        if mode == Mode::Tentative {
            args.push(Value::String(self.prefix(call).into()));
        }
        let now_ms = match self.clock {
            ClockSource::Server => Some(now_ms),
            ClockSource::Redis => None,
        };
        let take_back = call.take_back.then(|| {
            let prefix = (mode == Mode::Tentative).then(|| self.prefix(call));
            std::sync::Arc::new(TakeBack::new(recorded, prefix))
        });
        Request {
            now_ms,
            keys,
            args,
            slots,
            lane: call.lane,
            deadlines: call.deadlines,
            take_back,
        }
    }

    /// A key as Redis holds it: after `--redis-key-prefix` (`CACHE_KEY_PREFIX`), if any.
    pub(super) fn key(&self, name: String) -> Key {
        let prefix = &self.recipe.options.key_prefix;
        if prefix.is_empty() {
            Key::from(name)
        } else {
            Key::from(format!("{prefix}{name}"))
        }
    }

    /// The member prefix of a request's tentative log entries: unique to this process (its
    /// instance) and request.
    pub(super) fn prefix(&self, call: &Call) -> String {
        let mut prefix = String::with_capacity(self.instance.len() + 21);
        prefix.push_str(&self.instance);
        prefix.push('-');
        push_decimal(&mut prefix, call.number);
        prefix
    }
}

/// The item's rule as the script reads it: made when the config compiled, for a configured
/// rule, so a call sends it without building it.
pub(super) fn rule_arg(item: &CheckItem<'_>, ban_ms: u64, format: LogFormat) -> Value {
    match item.text {
        Some(text) => Value::Bytes(text.get(item.role, item.debit, format).clone()),
        None => Value::String(Str::from(rule_text(
            &item.windows,
            item.algorithm,
            ban_ms,
            item.role,
            item.debit,
            format,
        ))),
    }
}

/// A count as a script argument.
pub(super) fn int(n: usize) -> Value {
    number(u64::try_from(n).unwrap_or(u64::MAX))
}

/// The digits of 0 to 99, two per number ("05" for 5).
static SMALL_NUMBERS: [[u8; 2]; 100] = small_numbers();

const fn small_numbers() -> [[u8; 2]; 100] {
    let mut digits = [[0u8; 2]; 100];
    let (mut n, mut tens, mut ones) = (0, b'0', b'0');
    while n < 100 {
        digits[n] = [tens, ones];
        n += 1;
        if ones == b'9' {
            (tens, ones) = (tens + 1, b'0');
        } else {
            ones += 1;
        }
    }
    digits
}

/// A whole number as a script argument. Most are small (a call's request count, a request's
/// shape, a descriptor's hits): those go as static digits, a bulk string the client copies
/// out, where the client would format an integer into digits on every call. Larger ones (a
/// call's time) go as integers: no string made for them. Redis reads the same digits either
/// way.
pub(super) fn number(n: u64) -> Value {
    match usize::try_from(n) {
        Ok(i) if i < 10 => Value::from_static(&SMALL_NUMBERS[i][1..]),
        Ok(i) if i < 100 => Value::from_static(&SMALL_NUMBERS[i]),
        _ => Value::Integer(i64::try_from(n).unwrap_or(i64::MAX)),
    }
}

/// The flags of a descriptor in the script's reply (layout in `lua/contract.lua`).
pub(super) const FITS: u64 = 1;
pub(super) const BAN_SET: u64 = 2;
pub(super) const RECORDED: u64 = 4;
pub(super) const BANNED: u64 = 8;
/// The entry recorded is later than the call's time, which it is otherwise stamped with: its
/// time follows.
pub(super) const LATER: u64 = 16;

/// Reads the script's reply (layout in `lua/contract.lua`); anything else is a protocol error.
pub(super) fn parse_reply(
    reply: &[i64],
    items: &[CheckItem<'_>],
    group: &[usize],
    tentative: bool,
) -> Result<GroupReply, StoreError> {
    read_reply(
        reply,
        group.iter().map(|&i| items[i].windows.len()),
        tentative,
    )
}

/// [`parse_reply`] for descriptors whose rules have `windows` windows each, in order.
pub(super) fn read_reply(
    reply: &[i64],
    windows: impl ExactSizeIterator<Item = usize>,
    tentative: bool,
) -> Result<GroupReply, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("script reply {what}"));
    let mut values = reply.iter().copied();
    let mut next = |what: &str| -> Result<u64, StoreError> {
        let v = values
            .next()
            .ok_or_else(|| bad(&format!("ended before {what}")))?;
        u64::try_from(v).map_err(|_| bad(&format!("has a negative {what}")))
    };
    let now_ms = next("now")?;
    let mut outcomes = Vec::with_capacity(windows.len());
    let mut entries = Vec::with_capacity(windows.len());
    for m in windows {
        let flags = next("flags")?;
        if flags >= LATER * 2 || (tentative && flags & LATER != 0) {
            return Err(bad("has unknown flags"));
        }
        let has = |flag: u64| flags & flag != 0;
        let ban_remaining_ms = if has(BANNED) { next("ban")? } else { 0 };
        if has(BANNED) == (ban_remaining_ms == 0) {
            return Err(bad("has a ban flag and time that disagree"));
        }
        // An entry is named by its time too: a tentative request's follows its running total,
        // as does another's stamped later than the call.
        entries.push(match has(RECORDED) {
            true => Entry {
                cum: next("entry")?,
                at_ms: if tentative || has(LATER) {
                    next("entry's time")?
                } else {
                    now_ms
                },
            },
            false => Entry::default(),
        });
        // A banned item reports no windows; the others one pair per window of their rule.
        let m = if has(BANNED) { 0 } else { m };
        let mut windows = Vec::with_capacity(m);
        for _ in 0..m {
            windows.push(WindowOutcome {
                count: next("count")?,
                reset_ms: next("reset")?,
            });
        }
        outcomes.push(ItemOutcome {
            recorded: has(RECORDED),
            ban_remaining_ms,
            ban_set: has(BAN_SET),
            fits: has(FITS),
            windows,
        });
    }
    if values.next().is_some() {
        return Err(bad("is longer than expected"));
    }
    Ok(GroupReply {
        now_ms,
        items: outcomes,
        entries,
    })
}

/// Splits the script's reply (one flat array, packed: the call's time, then per request its
/// length and its integers, or `-1` and what failed; see [`super::packed`]) into the requests'
/// answers, each the call's time and the request's integers. A reply of the wrong shape fails
/// every request of the call.
pub(super) fn split(reply: Value, count: usize) -> Vec<Answer> {
    split_flat(&reply, count).unwrap_or_else(|e| vec![Err(e); count])
}

fn split_flat(reply: &Value, count: usize) -> Result<Vec<Answer>, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("script reply {what}"));
    // fred hands a bulk string over as bytes unless it is valid UTF-8, which a packed array's
    // first byte (0x90 to 0x9f, 0xdc or 0xdd) all but rules out; text is read the same.
    let bytes: &[u8] = match reply {
        Value::Bytes(bytes) => bytes,
        Value::String(text) => text.as_bytes(),
        _ => return Err(bad("is not the script's packed array")),
    };
    let mut values = packed::array(bytes).map_err(|e| bad(&e.to_string()))?;
    fn next<'a>(values: &mut Items<'a>) -> Result<Option<Item<'a>>, StoreError> {
        values
            .next()
            .transpose()
            .map_err(|e| StoreError::Protocol(format!("script reply {e}")))
    }
    let now = match next(&mut values)? {
        Some(Item::Int(now)) if now >= 0 => now,
        _ => return Err(bad("does not start with the call's time")),
    };
    let mut answers = Vec::with_capacity(count);
    while answers.len() < count {
        let length = match next(&mut values)? {
            Some(Item::Int(-1)) => {
                let message = match next(&mut values)? {
                    Some(Item::Text(text)) => String::from_utf8_lossy(text).into_owned(),
                    _ => String::new(),
                };
                answers.push(Err(failed(&message)));
                continue;
            }
            Some(Item::Int(length)) => {
                usize::try_from(length).map_err(|_| bad("holds a negative length"))?
            }
            _ => return Err(bad("does not answer every request of the call")),
        };
        // (A length no reply could hold allocates no more than what is left.)
        let mut integers = Vec::with_capacity(1 + length.min(values.len()));
        integers.push(now);
        for _ in 0..length {
            match next(&mut values)? {
                Some(Item::Int(n)) => integers.push(n),
                Some(Item::Text(_)) => return Err(bad("holds a value that is not an integer")),
                None => return Err(bad("ends inside a request's part")),
            }
        }
        answers.push(Ok(integers));
    }
    if !values.is_empty() {
        return Err(bad("is longer than its requests"));
    }
    values.finish().map_err(|e| bad(&e.to_string()))?;
    Ok(answers)
}

/// What a request that failed inside the script says: Redis's error (a key of another type, a
/// slot its master does not serve) or the script's own (code `SLIDEGATE`).
fn failed(message: &str) -> StoreError {
    if message.contains(NOT_SERVED) {
        return not_served_error(message);
    }
    request_failed(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script's reply of these integers, packed as Redis's cmsgpack packs it.
    fn ints(values: &[i64]) -> Value {
        packed_reply(&values.iter().map(|&n| Item::Int(n)).collect::<Vec<_>>())
    }

    fn packed_reply(items: &[Item<'_>]) -> Value {
        Value::Bytes(packed::tests::pack(items).into())
    }

    use crate::store::{Role, RuleText};

    #[test]
    fn replies_that_do_not_match_the_request_are_protocol_errors() {
        let key = crate::store::StoreKey::new("d:k=v", "");
        let items = [CheckItem {
            key,
            windows: std::borrow::Cow::Owned(vec![crate::store::Window {
                limit: 5,
                length_ms: 1000,
            }]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits: 1,
            role: Role::Enforce,
            debit: false,
            text: None,
        }];
        // now, flags (fits, recorded), entry, count, reset.
        let good = [1_000, 5, 7, 1, 999];
        let reply = parse_reply(&good, &items, &[0], false).expect("well-formed");
        assert!(reply.recorded() && reply.items[0].fits && reply.items[0].recorded);
        assert_eq!(reply.items[0].windows[0].count, 1);
        assert_eq!(reply.items[0].windows[0].reset_ms, 999);
        assert_eq!(
            reply.entries,
            [Entry {
                cum: 7,
                at_ms: 1_000
            }],
            "stamped at the call's time"
        );
        // Stamped later than the call (the log's newest entry was): its time follows.
        let later =
            parse_reply(&[1_000, 5 | 16, 7, 1_004, 1, 999], &items, &[0], false).expect("later");
        assert_eq!(
            later.entries,
            [Entry {
                cum: 7,
                at_ms: 1_004
            }]
        );
        assert_eq!(later.items[0].windows[0].reset_ms, 999);
        // Tentative: the entry's time follows its running total.
        let tentative =
            parse_reply(&[1_000, 5, 7, 990, 1, 999], &items, &[0], true).expect("well-formed");
        assert_eq!(tentative.entries, [Entry { cum: 7, at_ms: 990 }]);
        assert_eq!(tentative.items[0].windows[0].reset_ms, 999);
        assert!(parse_reply(&good, &items, &[0], true).is_err(), "no time");
        assert!(
            parse_reply(&[1_000, 5 | 16, 7, 990, 1, 999], &items, &[0], true).is_err(),
            "a tentative request's entry's time follows without flag 16"
        );
        // Rejected: no entry, so the count follows the flags.
        let rejected = parse_reply(&[1_000, 0, 5, 400], &items, &[0], false).expect("well-formed");
        assert!(!rejected.recorded() && !rejected.items[0].fits);
        assert_eq!(
            (rejected.items[0].windows[0].count, rejected.entries[0]),
            (5, Entry::default())
        );
        // Banned by this request: the ban's time, and no windows.
        let banned =
            parse_reply(&[1_000, 2 | 8, 900_000], &items, &[0], false).expect("well-formed");
        assert!(banned.items[0].ban_set && banned.items[0].windows.is_empty());
        assert_eq!(banned.items[0].ban_remaining_ms, 900_000);
        for wrong in [
            &good[..4],                  // ends early
            &[1_000, 5, 7, 1, 999, 0],   // longer
            &[1_000, 32 | 5, 7, 1, 999], // unknown flag
            &[1_000, 8, 0],              // banned for no time
            &[1_000, 5, -7, 1, 999],     // negative
        ] {
            assert!(
                matches!(
                    parse_reply(wrong, &items, &[0], false),
                    Err(StoreError::Protocol(_))
                ),
                "{wrong:?}"
            );
        }
    }

    #[test]
    fn numbers_in_the_rule_text_and_prefix_are_plain_decimal() {
        for n in [0, 7, 10, 99, 1_000_000, u64::from(u32::MAX), u64::MAX] {
            let mut text = String::from("x");
            push_decimal(&mut text, n);
            assert_eq!(text, format!("x{n}"));
        }
        let windows = [
            crate::store::Window {
                limit: 5,
                length_ms: 1000,
            },
            crate::store::Window {
                limit: u32::MAX,
                length_ms: 86_400_000,
            },
        ];
        assert_eq!(
            rule_text(
                &windows,
                Algorithm::SlidingCounter { buckets: 12 },
                900_000,
                Role::Quota,
                true,
                LogFormat::Compact
            ),
            "2:900000:12:1:5:1000:4294967295:86400000"
        );
        assert_eq!(
            rule_text(
                &windows[..1],
                Algorithm::SlidingLog,
                0,
                Role::Enforce,
                true,
                LogFormat::SortedSet
            ),
            "0:0:0:3:5:1000"
        );
        // A log that can pass 1,000 entries (its longest window's limit) is a sorted set
        // whatever the format; a counter's text has no log format.
        let busy = |limit, algorithm| {
            let windows = [
                crate::store::Window {
                    limit: 5_000,
                    length_ms: 1000,
                },
                crate::store::Window {
                    limit,
                    length_ms: 60_000,
                },
            ];
            rule_text(
                &windows,
                algorithm,
                0,
                Role::Enforce,
                false,
                LogFormat::Compact,
            )
        };
        assert_eq!(
            busy(1_000, Algorithm::SlidingLog),
            "0:0:0:0:5000:1000:1000:60000"
        );
        assert_eq!(
            busy(1_001, Algorithm::SlidingLog),
            "0:0:0:2:5000:1000:1001:60000"
        );
        assert_eq!(
            busy(1_001, Algorithm::SlidingCounter { buckets: 4 }),
            "0:0:4:0:5000:1000:1001:60000"
        );
    }

    /// A configured rule's text, made when its config compiled, is what the store would build
    /// for the same item, for every role and debit a request can give it; sent as it was made.
    #[test]
    fn a_configured_rules_text_is_made_at_compile_for_every_role_and_debit() {
        let windows = [
            crate::store::Window {
                limit: 5,
                length_ms: 1000,
            },
            crate::store::Window {
                limit: 50,
                length_ms: 60_000,
            },
        ];
        let made = RuleText::new(&windows, Algorithm::SlidingLog, Some(60_000));
        let item = |role, debit, text| CheckItem {
            key: crate::store::StoreKey::new("d:k=v", ""),
            windows: std::borrow::Cow::Borrowed(&windows[..]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: Some(60_000),
            hits: 1,
            role,
            debit,
            text,
        };
        let mut seen = std::collections::HashSet::new();
        for role in [Role::Enforce, Role::Shadow, Role::Quota] {
            for debit in [false, true] {
                for format in [LogFormat::Compact, LogFormat::SortedSet] {
                    let sent = rule_arg(&item(role, debit, Some(&made)), 60_000, format);
                    let built = rule_arg(&item(role, debit, None), 60_000, format);
                    let bytes = |value: &Value| value.as_bytes().map(<[u8]>::to_vec);
                    assert_eq!(bytes(&sent), bytes(&built), "{role:?} {debit} {format:?}");
                    assert!(matches!(sent, Value::Bytes(_)), "sent as made: {sent:?}");
                    assert!(
                        seen.insert(bytes(&sent)),
                        "{role:?} {debit} {format:?}: a text of its own"
                    );
                }
            }
        }
    }

    #[test]
    fn numbers_go_as_their_digits() {
        let digits = |n: u64| match number(n) {
            Value::Bytes(b) => String::from_utf8(b.to_vec()).expect("digits"),
            Value::Integer(i) => i.to_string(),
            other => panic!("{other:?}"),
        };
        for n in [0, 1, 5, 9, 10, 42, 99, 100, 1_767_225_600_000, u64::MAX / 2] {
            assert_eq!(digits(n), n.to_string());
        }
        // Capped at i64's largest, as Redis reads integers (no number slidegate sends comes near).
        assert_eq!(digits(u64::MAX), i64::MAX.to_string());
        // The small ones are static: nothing made per call.
        assert!(matches!(number(7), Value::Bytes(_)));
        assert!(matches!(number(1_000), Value::Integer(1_000)));
    }

    #[test]
    fn a_reply_splits_into_one_answer_per_request() {
        let mut flat = vec![1_000, 9, 1, 1, 0, 0, 1, 1, 1, 1, 1_000];
        flat.extend([4, 5, 3, 3, 999]);
        let mut reply: Vec<Item<'_>> = flat.iter().map(|&n| Item::Int(n)).collect();
        reply.splice(
            11..11,
            [
                Item::Int(-1),
                Item::Text(b"WRONGTYPE Operation against a key"),
                Item::Int(-1),
                Item::Text(b"SLIDEGATE request 3: mode must be 0, 1 or 2"),
            ],
        );
        let answers = split(packed_reply(&reply), 4);
        assert_eq!(answers.len(), 4);
        assert_eq!(
            answers[0].as_ref().ok(),
            Some(&vec![1_000, 1, 1, 0, 0, 1, 1, 1, 1, 1_000])
        );
        // Redis's own error: the store is unavailable for that request; the script's code: a
        // protocol error, for that request alone.
        assert!(
            matches!(&answers[1], Err(StoreError::Unavailable { context, .. }) if context.contains("WRONGTYPE"))
        );
        assert!(matches!(&answers[2], Err(StoreError::Protocol(m)) if m.contains("mode")));
        // Each answer starts with the call's time.
        assert_eq!(answers[3].as_ref().ok(), Some(&vec![1_000, 5, 3, 3, 999]));
    }

    #[test]
    fn replies_of_the_wrong_shape_fail_every_request_of_the_call() {
        let protocol = |a: &Answer| matches!(a, Err(StoreError::Protocol(_)));
        for reply in [
            // Not the packed array: a RESP array or integer, a packed map, bytes after it.
            Value::Array(vec![
                Value::Integer(9),
                Value::Integer(1),
                Value::Integer(7),
            ]),
            Value::Integer(1),
            Value::Bytes(vec![0x81, 0x09, 0x01].into()),
            Value::Bytes(vec![0x93, 0x09, 0x01, 0x07, 0x00].into()),
            // No time, or a negative one.
            ints(&[]),
            ints(&[-5, 1, 7, 1, 7]),
            // One request answered where two were sent.
            ints(&[9, 1, 7]),
            // A length past the reply's end, or one no reply could hold.
            ints(&[9, 3, 7, 7]),
            ints(&[9, i64::MAX, 7]),
            ints(&[9, -2, 7]),
            // More than the requests.
            ints(&[9, 1, 7, 1, 7, 1, 7]),
            // A header and a request's length that claim billions of values, over a few bytes:
            // refused without allocating for them.
            Value::Bytes(
                vec![
                    0xdd, 0xff, 0xff, 0xff, 0xff, 0x09, 0xce, 0xff, 0xff, 0xff, 0xff, 0x01,
                ]
                .into(),
            ),
            // A value that is not an integer.
            packed_reply(&[
                Item::Int(9),
                Item::Int(1),
                Item::Text(b"x"),
                Item::Int(1),
                Item::Int(7),
            ]),
        ] {
            let answers = split(reply.clone(), 2);
            assert_eq!(answers.len(), 2, "{reply:?}");
            assert!(answers.iter().all(protocol), "{reply:?} -> {answers:?}");
        }
        let answers = split(ints(&[4, 1, 7, 2, 8, 9]), 2);
        assert_eq!(answers[0].as_ref().ok(), Some(&vec![4, 7]));
        assert_eq!(answers[1].as_ref().ok(), Some(&vec![4, 8, 9]));
    }
}
