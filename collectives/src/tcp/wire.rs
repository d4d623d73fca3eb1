//! The TCP communicator's wire format: every message is a 40-byte little-endian header
//! (magic, op code, dtype, reduce op, root or culprit, sender rank, sequence number, element
//! count, payload length) followed by the payload. It exists on its own so the byte layout
//! and the op codes are in one place, apart from how links are driven (`mesh`).

use crate::ReduceOp;

pub(super) const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"STfr");
pub(super) const HEADER_LEN: usize = 40;
/// Abort notices carry a human-readable message; anything longer is a corrupt stream.
pub(super) const MAX_ABORT_PAYLOAD: u64 = 64 * 1024;

/// Op codes on the wire.
pub(super) mod code {
    pub const ALL_GATHER: u8 = 1;
    pub const REDUCE_SCATTER: u8 = 2;
    pub const ALL_REDUCE_REDUCE: u8 = 3;
    pub const ALL_REDUCE_GATHER: u8 = 4;
    pub const BROADCAST: u8 = 5;
    pub const BARRIER: u8 = 6;
    pub const EXCHANGE: u8 = 7;
    pub const ABORT: u8 = 0xff;

    pub const NO_DTYPE: u8 = 0;
    pub const F32: u8 = 1;
    pub const F64: u8 = 2;

    pub const NO_REDUCE: u8 = 0;
    pub const SUM: u8 = 1;
    pub const AVG: u8 = 2;
    pub const MAX: u8 = 3;

    /// `reduce` byte of an abort notice: what kind of failure the culprit caused.
    pub const ABORT_IO: u8 = 0;
    pub const ABORT_PROTOCOL: u8 = 1;
}

/// What a collective is, as announced in every header it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Frame {
    pub(super) op: u8,
    pub(super) dtype: u8,
    pub(super) reduce: u8,
    /// Broadcast root; culprit rank in an abort notice.
    pub(super) aux: u32,
    /// Element count (per rank for all-gather / reduce-scatter, total otherwise).
    pub(super) count: u64,
}

/// A header and its payload, sent as one message.
pub(super) struct Outgoing<'a> {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) payload: &'a [u8],
}

impl Outgoing<'_> {
    pub(super) fn len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }

    /// What is left to send after the first `sent` bytes, as two slices.
    pub(super) fn rest(&self, sent: usize) -> (&[u8], &[u8]) {
        match sent.checked_sub(HEADER_LEN) {
            None => (&self.header[sent..], self.payload),
            Some(k) => (&[], &self.payload[k.min(self.payload.len())..]),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    pub(super) frame: Frame,
    pub(super) from: u32,
    pub(super) seq: u64,
    pub(super) payload: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HEADER_LEN] {
        let f = &self.frame;
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = f.op;
        b[5] = f.dtype;
        b[6] = f.reduce;
        b[8..12].copy_from_slice(&f.aux.to_le_bytes());
        b[12..16].copy_from_slice(&self.from.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&f.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    /// `None` if the bytes do not start with the frame magic.
    pub(super) fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|k| b[i + k]));
        if u32_at(0) != FRAME_MAGIC {
            return None;
        }
        Some(Header {
            frame: Frame { op: b[4], dtype: b[5], reduce: b[6], aux: u32_at(8), count: u64_at(24) },
            from: u32_at(12),
            seq: u64_at(16),
            payload: u64_at(32),
        })
    }
}

pub(super) fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => code::SUM,
        ReduceOp::Avg => code::AVG,
        ReduceOp::Max => code::MAX,
    }
}

impl Frame {
    pub(super) fn new(op: u8, dtype: u8, reduce: u8, aux: usize, count: usize) -> Frame {
        // aux is a rank (< world, checked to fit u32 at setup); usize -> u64 is lossless.
        Frame { op, dtype, reduce, aux: aux as u32, count: count as u64 }
    }

    /// Human-readable description for error messages, e.g.
    /// "`all_gather` #3 of 7 f32 per rank".
    pub(super) fn describe(&self, seq: u64) -> String {
        let dtype = match self.dtype {
            code::F32 => "f32".to_string(),
            code::F64 => "f64".to_string(),
            code::NO_DTYPE => String::new(),
            other => format!("dtype#{other}"),
        };
        let reduce = match self.reduce {
            code::SUM => "Sum".to_string(),
            code::AVG => "Avg".to_string(),
            code::MAX => "Max".to_string(),
            other => format!("reduce#{other}"),
        };
        let n = self.count;
        match self.op {
            code::ALL_GATHER => format!("`all_gather` #{seq} of {n} {dtype} per rank"),
            code::REDUCE_SCATTER => format!("`reduce_scatter` #{seq} ({reduce}) of {n} {dtype} per rank"),
            code::ALL_REDUCE_REDUCE => format!("`all_reduce` #{seq} ({reduce}) of {n} {dtype} (reduce phase)"),
            code::ALL_REDUCE_GATHER => format!("`all_reduce` #{seq} ({reduce}) of {n} {dtype} (gather phase)"),
            code::BROADCAST => format!("`broadcast` #{seq} of {n} {dtype} from root {}", self.aux),
            code::BARRIER => format!("`barrier` #{seq}"),
            code::EXCHANGE => format!("`exchange` #{seq} of {n} {dtype} (point to point, pair code {})", self.aux),
            other => format!("unknown collective code {other} #{seq}"),
        }
    }
}
