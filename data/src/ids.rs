//! Token ids whatever their width on disk: [`Ids`] views a shard's payload as `u16`
//! (GPT-2-sized vocabularies, llm.c magic 20240520) or `u32` (Llama 3's 128k, magic
//! 20240801) and hands out `u32`, the width the trainer computes with.
//!
//! Readers match on the width once per window or range, never per token, so the `u16`
//! hot paths (sampling a row, walking validation windows) are the same loops as before.

use std::ops::Range;

/// How token ids are stored in a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Width {
    /// 2 bytes per id: vocabularies of at most 65536 ids (llm.c's GPT-2 layout).
    U16,
    /// 4 bytes per id: larger vocabularies (llm.c's Llama 3 layout).
    U32,
}

impl Width {
    /// The narrowest width that holds every id of a vocabulary of `vocab_size` ids.
    pub fn for_vocab(vocab_size: u32) -> Width {
        if vocab_size <= 1 << 16 {
            Width::U16
        } else {
            Width::U32
        }
    }

    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            Width::U16 => 2,
            Width::U32 => 4,
        }
    }
}

/// A borrowed run of token ids of either width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ids<'a> {
    U16(&'a [u16]),
    U32(&'a [u32]),
}

impl<'a> Ids<'a> {
    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            Ids::U16(s) => s.len(),
            Ids::U32(s) => s.len(),
        }
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage width.
    pub fn width(&self) -> Width {
        match self {
            Ids::U16(_) => Width::U16,
            Ids::U32(_) => Width::U32,
        }
    }

    /// Id `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<u32> {
        match self {
            Ids::U16(s) => s.get(i).map(|&t| u32::from(t)),
            Ids::U32(s) => s.get(i).copied(),
        }
    }

    /// The sub-range `range` (panics when out of bounds, like slice indexing: callers
    /// index with ranges they derived from `len`).
    pub fn slice(&self, range: Range<usize>) -> Ids<'a> {
        match *self {
            Ids::U16(s) => Ids::U16(&s[range]),
            Ids::U32(s) => Ids::U32(&s[range]),
        }
    }

    /// Copy every id into `out` (`out.len()` must equal `self.len()`).
    pub fn copy_to_u32(&self, out: &mut [u32]) {
        assert_eq!(out.len(), self.len(), "copy_to_u32: destination length");
        match self {
            Ids::U16(s) => {
                for (o, &t) in out.iter_mut().zip(s.iter()) {
                    *o = u32::from(t);
                }
            }
            Ids::U32(s) => out.copy_from_slice(s),
        }
    }

    /// Append every id to `out`.
    pub fn extend_u32(&self, out: &mut Vec<u32>) {
        match self {
            Ids::U16(s) => out.extend(s.iter().map(|&t| u32::from(t))),
            Ids::U32(s) => out.extend_from_slice(s),
        }
    }

    /// The ids as `u32`, one at a time (for scans; copy ranges with [`Ids::copy_to_u32`]).
    pub fn iter(&self) -> impl Iterator<Item = u32> + 'a {
        let (a, b) = match *self {
            Ids::U16(s) => (Some(s.iter().map(|&t| u32::from(t))), None),
            Ids::U32(s) => (None, Some(s.iter().copied())),
        };
        a.into_iter().flatten().chain(b.into_iter().flatten())
    }

    /// The largest id (`None` when empty).
    pub fn max(&self) -> Option<u32> {
        match self {
            Ids::U16(s) => s.iter().max().map(|&t| u32::from(t)),
            Ids::U32(s) => s.iter().max().copied(),
        }
    }

    /// The ids' bytes as stored in a shard (little-endian hosts only, checked in `shard.rs`).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            Ids::U16(s) => bytemuck::cast_slice(s),
            Ids::U32(s) => bytemuck::cast_slice(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_widths_read_the_same_ids() {
        let a: Vec<u16> = vec![3, 65535, 0, 7];
        let b: Vec<u32> = a.iter().map(|&t| u32::from(t)).collect();
        for ids in [Ids::U16(&a), Ids::U32(&b)] {
            assert_eq!(ids.len(), 4);
            assert_eq!(ids.get(1), Some(65535));
            assert_eq!(ids.get(4), None);
            assert_eq!(ids.max(), Some(65535));
            assert_eq!(ids.iter().collect::<Vec<_>>(), b);
            let mut out = [0u32; 2];
            ids.slice(1..3).copy_to_u32(&mut out);
            assert_eq!(out, [65535, 0]);
            let mut v = vec![9];
            ids.slice(2..4).extend_u32(&mut v);
            assert_eq!(v, [9, 0, 7]);
        }
        assert_eq!(Ids::U16(&a).as_bytes().len(), 8);
        assert_eq!(Ids::U32(&b).as_bytes().len(), 16);
        assert_eq!(Ids::U16(&[]).max(), None);
        assert_eq!(Width::for_vocab(50257), Width::U16);
        assert_eq!(Width::for_vocab(65536), Width::U16);
        assert_eq!(Width::for_vocab(128256), Width::U32);
    }
}
