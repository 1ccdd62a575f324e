//! The compact log's bytes read in Rust, for the admin API's inspection and the undo's read:
//! the one reader outside the library (`lua/compact_layout.lua` has the layout, and its parts
//! are the only code that writes it). `tests/redis/script.rs` writes logs of random contents
//! with the library and reads them back here, so the two cannot drift apart.

/// One entry of a compact log: the time it was recorded at and the hits it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompactEntry {
    pub at_ms: u64,
    pub weight: u64,
}

/// The head's tag: a slot width of 4 or 6 bytes, plus this once the log may hold a weighted
/// entry (then the head carries the total of the weights too).
const WEIGHTED: u8 = 16;
/// The head: the tag and a 6-byte base, then in a weighted log a 6-byte total.
const PLAIN_HEAD: usize = 7;
const WEIGHTED_HEAD: usize = 13;

/// A compact log's entries, oldest first; None for a text slidegate did not write.
pub fn entries(text: &[u8]) -> Option<Vec<CompactEntry>> {
    let number = |bytes: &[u8]| bytes.iter().fold(0u64, |v, &b| v << 8 | u64::from(b));
    let tag = *text.first()?;
    let width = usize::from(tag % WEIGHTED);
    let head = if tag >= WEIGHTED {
        WEIGHTED_HEAD
    } else {
        PLAIN_HEAD
    };
    if text.len() < head
        || tag >= 2 * WEIGHTED
        || !matches!(width, 4 | 6)
        || !(text.len() - head).is_multiple_of(width)
    {
        return None;
    }
    // An entry of more than one hit has its slot's top bit set, and its weight in the next.
    let top = 1u64 << (width * 8 - 1);
    let base = number(text.get(1..PLAIN_HEAD)?);
    let mut slots = text[head..].chunks_exact(width).map(number);
    let mut entries = Vec::new();
    while let Some(v) = slots.next() {
        entries.push(if v >= top {
            CompactEntry {
                at_ms: base + (v - top),
                weight: slots.next()?,
            }
        } else {
            CompactEntry {
                at_ms: base + v,
                weight: 1,
            }
        });
    }
    Some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-byte slot an entry, a weighted entry's weight in the slot after it.
    #[test]
    fn a_weighted_log_reads_as_its_entries() {
        let mut text = vec![4 + WEIGHTED];
        text.extend_from_slice(&40_000u64.to_be_bytes()[2..]);
        text.extend_from_slice(&6u64.to_be_bytes()[2..]);
        for slot in [0x8000_0000u32, 2, 30_000, 0x8000_0000 + 59_000, 3] {
            text.extend_from_slice(&slot.to_be_bytes());
        }
        let read: Vec<(u64, u64)> = entries(&text)
            .expect("a log slidegate writes")
            .iter()
            .map(|e| (e.at_ms, e.weight))
            .collect();
        assert_eq!(read, [(40_000, 2), (70_000, 1), (99_000, 3)]);
        // Cut short, a weight missing, or a slot width it does not know: not slidegate's.
        for bad in [
            &text[..text.len() - 1],
            &text[..text.len() - 4],
            &[5u8; 17][..],
            &[],
        ] {
            assert_eq!(entries(bad), None, "{bad:?}");
        }
    }

    /// An unweighted log of 6-byte slots (windows past 2^30 ms) has the 7-byte head.
    #[test]
    fn a_plain_log_of_wide_slots_reads_as_its_entries() {
        let mut text = vec![6];
        text.extend_from_slice(&1_000u64.to_be_bytes()[2..]);
        for slot in [0u64, 5, 1 << 40] {
            text.extend_from_slice(&slot.to_be_bytes()[2..]);
        }
        let read: Vec<u64> = entries(&text)
            .expect("a log slidegate writes")
            .iter()
            .map(|e| e.at_ms)
            .collect();
        assert_eq!(read, [1_000, 1_005, 1_000 + (1 << 40)]);
    }
}
