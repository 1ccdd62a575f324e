//! The script's reply as Redis's `cmsgpack` packs it: one MessagePack array of integers and,
//! where a request failed, its error text. Only that part of MessagePack is read; anything else
//! (a float, a map, a nil, bytes left over) is a malformed reply, never a panic.
//!
//! Why packed: fred parses a RESP array value by value (each a frame, then a value, then a
//! vector of them, all freed again), a cost per integer of every reply; the packed reply
//! arrives as one bulk string and its integers are read in place (`docs/performance.md`).

/// One value of the array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item<'a> {
    Int(i64),
    Text(&'a [u8]),
}

/// What is wrong with a reply that is not such an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("is not a packed array")]
    NotAnArray,
    #[error("ends inside a value")]
    Truncated,
    #[error("holds a value of MessagePack type 0x{0:02x}, neither an integer nor a text")]
    Unexpected(u8),
    #[error("holds an integer past the signed 64-bit range")]
    TooLarge,
    #[error("has bytes after its array")]
    Trailing,
}

/// The values of a packed array, read one at a time from the bytes they arrived in.
#[derive(Clone, Debug)]
pub struct Items<'a> {
    rest: &'a [u8],
    left: usize,
}

/// Reads the array's header: its values follow.
pub fn array(bytes: &[u8]) -> Result<Items<'_>, Malformed> {
    let (&first, rest) = bytes.split_first().ok_or(Malformed::Truncated)?;
    let (left, rest) = match first {
        0x90..=0x9f => (usize::from(first & 0x0f), rest),
        0xdc => {
            let (n, rest) = take::<2>(rest)?;
            (usize::from(u16::from_be_bytes(n)), rest)
        }
        0xdd => {
            let (n, rest) = take::<4>(rest)?;
            let n = usize::try_from(u32::from_be_bytes(n)).map_err(|_| Malformed::TooLarge)?;
            (n, rest)
        }
        _ => return Err(Malformed::NotAnArray),
    };
    Ok(Items { rest, left })
}

impl<'a> Items<'a> {
    /// Values not yet read, as many as the header said but no more than bytes are left (every
    /// value takes one at least): a bound on what reading them can allocate, whatever the
    /// header claims.
    pub fn len(&self) -> usize {
        self.left.min(self.rest.len())
    }

    /// Whether every value the header announced has been read.
    pub fn is_empty(&self) -> bool {
        self.left == 0
    }

    /// Whether the array ended where the bytes did.
    pub fn finish(&self) -> Result<(), Malformed> {
        if self.left == 0 && self.rest.is_empty() {
            Ok(())
        } else {
            Err(Malformed::Trailing)
        }
    }

    fn read(&mut self) -> Result<Item<'a>, Malformed> {
        let (&kind, rest) = self.rest.split_first().ok_or(Malformed::Truncated)?;
        self.rest = rest;
        Ok(match kind {
            0x00..=0x7f => Item::Int(i64::from(kind)),
            0xe0..=0xff => Item::Int(i64::from(kind.cast_signed())),
            0xcc => Item::Int(i64::from(self.bytes::<1>()?[0])),
            0xcd => Item::Int(i64::from(u16::from_be_bytes(self.bytes()?))),
            0xce => Item::Int(i64::from(u32::from_be_bytes(self.bytes()?))),
            0xcf => Item::Int(
                i64::try_from(u64::from_be_bytes(self.bytes()?))
                    .map_err(|_| Malformed::TooLarge)?,
            ),
            0xd0 => Item::Int(i64::from(i8::from_be_bytes(self.bytes()?))),
            0xd1 => Item::Int(i64::from(i16::from_be_bytes(self.bytes()?))),
            0xd2 => Item::Int(i64::from(i32::from_be_bytes(self.bytes()?))),
            0xd3 => Item::Int(i64::from_be_bytes(self.bytes()?)),
            // str (fixstr, str 8/16/32) and bin 8/16/32: a text as cmsgpack writes a Lua string.
            0xa0..=0xbf => self.text(usize::from(kind & 0x1f))?,
            0xd9 | 0xc4 => {
                let n = usize::from(self.bytes::<1>()?[0]);
                self.text(n)?
            }
            0xda | 0xc5 => {
                let n = usize::from(u16::from_be_bytes(self.bytes()?));
                self.text(n)?
            }
            0xdb | 0xc6 => {
                let n = usize::try_from(u32::from_be_bytes(self.bytes()?))
                    .map_err(|_| Malformed::TooLarge)?;
                self.text(n)?
            }
            other => return Err(Malformed::Unexpected(other)),
        })
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let (taken, rest) = take::<N>(self.rest)?;
        self.rest = rest;
        Ok(taken)
    }

    fn text(&mut self, n: usize) -> Result<Item<'a>, Malformed> {
        if self.rest.len() < n {
            return Err(Malformed::Truncated);
        }
        let (text, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(Item::Text(text))
    }
}

/// The values of the array, one after the other; `None` once they are read. An error ends the
/// reading.
impl<'a> Iterator for Items<'a> {
    type Item = Result<Item<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let item = self.read();
        if item.is_err() {
            self.left = 0;
        }
        Some(item)
    }
}

/// A whole packed array at once: its values, with nothing after them. (The store reads a reply
/// through [`Items`] instead, without collecting it.)
pub fn read_all(bytes: &[u8]) -> Result<Vec<Item<'_>>, Malformed> {
    let mut items = array(bytes)?;
    let all = items.by_ref().collect::<Result<Vec<_>, _>>()?;
    items.finish()?;
    Ok(all)
}

fn take<const N: usize>(bytes: &[u8]) -> Result<([u8; N], &[u8]), Malformed> {
    let (head, rest) = bytes.split_first_chunk::<N>().ok_or(Malformed::Truncated)?;
    Ok((*head, rest))
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // the test packer's casts are range-checked
pub(crate) mod tests {
    use super::*;

    /// Packs values as cmsgpack does (the smallest form of each integer), for tests.
    pub(crate) fn pack(items: &[Item<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        match items.len() {
            n @ 0..=15 => out.push(0x90 | u8::try_from(n).unwrap_or(0)),
            n @ 16..=0xffff => {
                out.push(0xdc);
                out.extend(u16::try_from(n).unwrap_or(0).to_be_bytes());
            }
            n => {
                out.push(0xdd);
                out.extend(u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
            }
        }
        for item in items {
            match *item {
                Item::Int(n) if (0..=0x7f).contains(&n) => out.push(n as u8),
                Item::Int(n) if (-32..0).contains(&n) => out.push(n as i8 as u8),
                Item::Int(n) if (0..=0xffff).contains(&n) => {
                    out.push(0xcd);
                    out.extend((n as u16).to_be_bytes());
                }
                Item::Int(n) if (0..=0xffff_ffff).contains(&n) => {
                    out.push(0xce);
                    out.extend((n as u32).to_be_bytes());
                }
                Item::Int(n) => {
                    out.push(0xd3);
                    out.extend(n.to_be_bytes());
                }
                Item::Text(t) => {
                    out.push(0xd9);
                    out.push(u8::try_from(t.len()).unwrap_or(u8::MAX));
                    out.extend(t);
                }
            }
        }
        out
    }

    proptest::proptest! {
        /// Whatever the bytes, reading them ends in values or an error, never a panic, and
        /// reads no value the bytes do not hold.
        #[test]
        fn any_bytes_are_read_or_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            if let Ok(mut items) = array(&bytes) {
                proptest::prop_assert!(items.len() < bytes.len());
                let mut read = 0;
                for item in items.by_ref() {
                    read += usize::from(item.is_ok());
                }
                proptest::prop_assert!(read <= bytes.len());
                let _ = items.finish();
            }
        }

        /// What cmsgpack's forms pack, read gives back.
        #[test]
        fn packed_integers_read_back(values in proptest::collection::vec(proptest::num::i64::ANY, 0..40)) {
            let items: Vec<Item<'_>> = values.iter().map(|&n| Item::Int(n)).collect();
            let bytes = pack(&items);
            proptest::prop_assert_eq!(read_all(&bytes), Ok(items));
        }
    }

    /// Bytes Redis 7.0's cmsgpack wrote for `{1000, 4, 5, 1, 1, 1000, 4, 5, 2, 2, 1000}` (two
    /// requests' replies of the script, read off `redis-cli FCALL ... | xxd`).
    #[test]
    fn reads_what_redis_packed() {
        let bytes = [
            0x9b, 0xcd, 0x03, 0xe8, 0x04, 0x05, 0x01, 0x01, 0xcd, 0x03, 0xe8, 0x04, 0x05, 0x02,
            0x02, 0xcd, 0x03, 0xe8,
        ];
        let ints: Vec<Item<'_>> = [1000, 4, 5, 1, 1, 1000, 4, 5, 2, 2, 1000]
            .into_iter()
            .map(Item::Int)
            .collect();
        assert_eq!(read_all(&bytes), Ok(ints));
    }

    #[test]
    fn reads_every_integer_form_and_texts() {
        let bytes = [
            0x9d, // 13 values
            0x7f, 0xff, 0xe0, 0xcc, 0xff, 0xcd, 0x01, 0x00, 0xce, 0x00, 0x01, 0x00, 0x00, 0xcf,
            0x00, 0x00, 0x01, 0x9b, 0x76, 0xda, 0xa8, 0x00, 0xd0, 0x80, 0xd1, 0xff, 0x00, 0xd2,
            0xff, 0xff, 0xff, 0x00, 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xa3,
            b'E', b'R', b'R', 0xd9, 0x01, b'x',
        ];
        assert_eq!(
            read_all(&bytes),
            Ok(vec![
                Item::Int(127),
                Item::Int(-1),
                Item::Int(-32),
                Item::Int(255),
                Item::Int(256),
                Item::Int(65_536),
                Item::Int(1_767_225_600_000),
                Item::Int(-128),
                Item::Int(-256),
                Item::Int(-256),
                Item::Int(-1),
                Item::Text(b"ERR"),
                Item::Text(b"x"),
            ])
        );
    }

    #[test]
    fn packs_and_reads_back_long_arrays() {
        let items: Vec<Item<'_>> = (0..70_000).map(|n| Item::Int(n * 1_000_003)).collect();
        assert_eq!(read_all(&pack(&items)), Ok(items.clone()));
        assert_eq!(read_all(&pack(&items[..20])), Ok(items[..20].to_vec()));
    }

    #[test]
    fn anything_else_is_malformed() {
        assert_eq!(read_all(&[]).err(), Some(Malformed::Truncated));
        assert_eq!(
            read_all(&[0x81, 0x01, 0x02]).err(),
            Some(Malformed::NotAnArray)
        );
        assert_eq!(read_all(&[0x92, 0x01]).err(), Some(Malformed::Truncated));
        assert_eq!(
            read_all(&[0x91, 0xcd, 0x01]).err(),
            Some(Malformed::Truncated)
        );
        assert_eq!(
            read_all(&[0x91, 0xa3, b'a']).err(),
            Some(Malformed::Truncated)
        );
        assert_eq!(
            read_all(&[0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0]).err(),
            Some(Malformed::Unexpected(0xcb))
        );
        assert_eq!(
            read_all(&[0x91, 0xc0]).err(),
            Some(Malformed::Unexpected(0xc0))
        );
        assert_eq!(
            read_all(&[0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).err(),
            Some(Malformed::TooLarge)
        );
        assert_eq!(
            read_all(&[0x91, 0x01, 0x02]).err(),
            Some(Malformed::Trailing)
        );
        assert_eq!(
            read_all(&[0xdd, 0xff, 0xff, 0xff, 0xff]).err(),
            Some(Malformed::Truncated),
            "a length no reply could hold reads no further than its bytes"
        );
    }
}
