//! FP8 weight gathers at ZeRO-3 (`zero.fp8_gather`, with `train.precision = "fp8"`): each
//! rank casts its piece of a block's linear weights to e4m3 before the all-gather, so the
//! gather moves one byte per weight instead of two (bf16) or four (the CPU's f32), and every
//! rank then expands the gathered codes into the unit's compute buffer, where the FP8 GEMMs
//! quantize them per tensor as they quantize any weight (`fp8.rs`).
//!
//! A unit's flat elements are cut into [`Segment`]s: its FP8 weights (those whose GEMMs run
//! in FP8), the other tensors (norms, biases: "plain", sent at compute precision) and the
//! padding. Rank `r` owns elements `[r·shard, (r+1)·shard)` and sends one *piece* of
//! [`Fp8GatherLayout::piece_bytes`] bytes, so the all-gather stays one in-place collective
//! of equal pieces: the codes (one byte per owned element, 0 where the element is not an FP8
//! weight's), then the side (the owned plain elements at compute precision, in order).
//!
//! Each FP8 weight is cast with the scale of its *whole* tensor's amax, which the engine
//! agrees on once per parameter version (each rank's amax of its parts, one max-reduction
//! for every unit: `zero/gather.rs`). So the codes are those the FP8 GEMM would make from
//! the bf16 weight, and the expanded values (`code / 2^e`, exact at compute precision)
//! quantize back to the same values in the GEMM: the same bits as gathering in bf16.

use super::fp8::Fp8Format;
use super::{BResult, Device, Loc};

/// Most segments a unit may have for an FP8 gather (a GPT-2 block has 10, a Llama block 7:
/// adjacent runs of one kind merge); a unit with more is gathered at compute precision. The
/// CUDA kernels take the table by value (`FP8G_SEGS` in `cuda/fp8.cu`).
pub const MAX_SEGMENTS: usize = 24;

/// What a run of a unit's elements is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// An FP8 weight, with its slot index in each piece.
    Fp8(usize),
    /// Other parameters, sent at compute precision.
    Plain,
    /// Padding (no tensor): sent as nothing, expanded to zero.
    Pad,
}

/// Elements `start..end` of a unit, of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    pub kind: SegmentKind,
    /// Plain elements of the unit before `start`.
    pub plain_before: usize,
}

/// How one unit travels in an FP8 gather (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8GatherLayout {
    /// Sorted, covering `0..shard·world`.
    pub segments: Vec<Segment>,
    /// Elements each rank owns.
    pub shard: usize,
    pub world: usize,
    /// Bytes of one compute-precision element (2 for bf16, 4 for the CPU's f32).
    pub elem: usize,
    /// FP8 weights, as given (their amaxes are indexed by [`SegmentKind::Fp8`]).
    pub slots: usize,
    /// Byte offset of the side inside a piece (the codes come first).
    pub side_off: usize,
    /// Bytes of one rank's piece: a multiple of 16 and of `elem`.
    pub piece_bytes: usize,
}

fn up16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

impl Fp8GatherLayout {
    /// The layout of a unit whose tensors are at `tensors`, of which those inside `fp8` are
    /// FP8 weights,
    /// sharded `shard` elements per rank over `world` ranks, elements of `elem` bytes. `None`
    /// where it has no FP8 weight (or more segments than [`MAX_SEGMENTS`]): it is gathered
    /// at compute precision.
    pub fn new(tensors: &[Loc], fp8: &[Loc], shard: usize, world: usize, elem: usize) -> Option<Fp8GatherLayout> {
        let padded = shard * world;
        let mut ts: Vec<Loc> = tensors.iter().copied().filter(|t| t.len > 0).collect();
        ts.sort_by_key(|t| t.off);
        let mut segments: Vec<Segment> = Vec::new();
        let (mut at, mut plain) = (0, 0);
        // Adjacent runs of one kind are one segment (plain elements, padding, or the tensors
        // of one FP8 weight: Llama's q, k and v of its fused qkv share the GEMM's scale).
        let push = |segments: &mut Vec<Segment>, start: usize, end: usize, kind: SegmentKind, plain: &mut usize| {
            if end <= start {
                return;
            }
            match segments.last_mut() {
                Some(last) if last.kind == kind && last.end == start => last.end = end,
                _ => segments.push(Segment { start, end, kind, plain_before: *plain }),
            }
            if kind == SegmentKind::Plain {
                *plain += end - start;
            }
        };
        for t in &ts {
            if t.off < at || t.end() > padded {
                return None; // overlapping tensors or outside the padded unit: not a layout we cut
            }
            push(&mut segments, at, t.off, SegmentKind::Pad, &mut plain);
            // A tensor inside an FP8 weight takes that weight's slot: one scale per GEMM operand.
            let kind = match fp8.iter().position(|f| f.len > 0 && f.off <= t.off && t.end() <= f.end()) {
                Some(k) => SegmentKind::Fp8(k),
                None => SegmentKind::Plain,
            };
            push(&mut segments, t.off, t.end(), kind, &mut plain);
            at = t.end();
        }
        push(&mut segments, at, padded, SegmentKind::Pad, &mut plain);
        let slots = fp8.len();
        if !segments.iter().any(|s| matches!(s.kind, SegmentKind::Fp8(_))) {
            return None;
        }
        if segments.len() > MAX_SEGMENTS || padded == 0 {
            return None;
        }
        let mut l = Fp8GatherLayout { segments, shard, world, elem, slots, side_off: up16(shard), piece_bytes: 0 };
        let side = (0..world).map(|r| l.plain_in(r)).max().unwrap_or(0);
        l.piece_bytes = up16(l.side_off + side * elem);
        Some(l)
    }

    /// Compute-precision elements of one piece.
    pub fn piece_elems(&self) -> usize {
        self.piece_bytes / self.elem
    }

    /// Elements of the gather buffer (every rank's piece).
    pub fn buffer_elems(&self) -> usize {
        self.world * self.piece_elems()
    }

    /// The segment holding element `e` (the last one for `e = shard·world`).
    pub fn segment_of(&self, e: usize) -> usize {
        self.segments.partition_point(|s| s.end <= e).min(self.segments.len() - 1)
    }

    /// Plain elements of the unit before element `p` (`0 ≤ p ≤ shard·world`).
    pub fn plain_pos(&self, p: usize) -> usize {
        let s = &self.segments[self.segment_of(p)];
        s.plain_before + if s.kind == SegmentKind::Plain { p.min(s.end) - s.start } else { 0 }
    }

    /// Plain elements rank `r` owns (its side).
    pub fn plain_in(&self, r: usize) -> usize {
        self.plain_pos((r + 1) * self.shard) - self.plain_pos(r * self.shard)
    }

    /// The pieces of segments each rank owns: `(rank, segment index, lo, hi)` in unit
    /// elements, for rank `only` or every rank.
    pub fn parts(&self, only: Option<usize>) -> Vec<(usize, usize, usize, usize)> {
        let ranks: Vec<usize> = match only {
            Some(r) => vec![r],
            None => (0..self.world).collect(),
        };
        let mut out = Vec::new();
        for r in ranks {
            let (lo, hi) = (r * self.shard, (r + 1) * self.shard);
            for (k, s) in self.segments.iter().enumerate() {
                let (a, b) = (s.start.max(lo), s.end.min(hi));
                if a < b {
                    out.push((r, k, a, b));
                }
            }
        }
        out
    }

    /// This rank's part of each FP8 weight, by slot: what its amax is taken over.
    pub fn fp8_parts(&self, rank: usize) -> Vec<(usize, Loc)> {
        let parts = self.parts(Some(rank)).into_iter();
        parts
            .filter_map(|(_, k, lo, hi)| match self.segments[k].kind {
                SegmentKind::Fp8(slot) => Some((slot, Loc::new(lo, hi - lo))),
                _ => None,
            })
            .collect()
    }
}

/// Rank `rank`'s piece of `l` into `piece` (`piece_bytes` bytes), from `own`, the unit's
/// elements `rank·shard..` (`shard` of them) at compute precision, each FP8 weight cast with
/// the scale of its tensor's `amax` (by slot): the CPU reference of `fp8_gather_pack` in
/// `cuda/fp8.cu`.
pub fn pack_piece(l: &Fp8GatherLayout, rank: usize, own: &[f32], amax: &[f32], piece: &mut [u8]) {
    let base = rank * l.shard;
    piece.fill(0);
    for (_, k, lo, hi) in l.parts(Some(rank)) {
        let s = l.segments[k];
        let xs = &own[lo - base..hi - base];
        match s.kind {
            SegmentKind::Fp8(slot) => {
                let scale = Fp8Format::E4M3.scale(amax[slot]);
                for (i, &x) in xs.iter().enumerate() {
                    piece[lo - base + i] = Fp8Format::E4M3.encode(x * scale);
                }
            }
            SegmentKind::Plain => {
                let first = s.plain_before + (lo - s.start) - l.plain_pos(base);
                for (i, &x) in xs.iter().enumerate() {
                    let at = l.side_off + (first + i) * 4;
                    piece[at..at + 4].copy_from_slice(&x.to_ne_bytes());
                }
            }
            SegmentKind::Pad => {}
        }
    }
}

/// Every rank's piece of `gathered` (`world · piece_bytes` bytes) expanded into `full` (the
/// unit's `shard · world` elements, f32) with the scales of `amax`: the CPU reference of
/// `fp8_gather_unpack`.
pub fn unpack(l: &Fp8GatherLayout, gathered: &[u8], amax: &[f32], full: &mut [f32]) {
    for (r, k, lo, hi) in l.parts(None) {
        let piece = &gathered[r * l.piece_bytes..(r + 1) * l.piece_bytes];
        let s = l.segments[k];
        let base = r * l.shard;
        match s.kind {
            SegmentKind::Fp8(slot) => {
                let inv = 1.0 / Fp8Format::E4M3.scale(amax[slot]);
                for e in lo..hi {
                    full[e] = Fp8Format::E4M3.decode(piece[e - base]) * inv;
                }
            }
            SegmentKind::Plain => {
                let first = s.plain_before + (lo - s.start) - l.plain_pos(base);
                for (i, e) in (lo..hi).enumerate() {
                    let at = l.side_off + (first + i) * 4;
                    full[e] = f32::from_ne_bytes(piece[at..at + 4].try_into().expect("4 bytes"));
                }
            }
            SegmentKind::Pad => full[lo..hi].fill(0.0),
        }
    }
}

/// The two ends of an FP8 gather, on a backend's compute buffers, and the amaxes they scale by.
pub trait Fp8GatherOps: Device {
    /// The largest magnitude of each of `parts` of `src` (NaN if one holds a NaN), read
    /// back to the host.
    fn amax_parts(&self, src: &Self::Buf, parts: &[Loc]) -> BResult<Vec<f32>>;
    /// Write rank `rank`'s piece of `l` into its place in `dst` (the gather buffer,
    /// [`Fp8GatherLayout::buffer_elems`] elements), from `src`, the unit's compute buffer
    /// holding this rank's elements `rank·shard..(rank+1)·shard`; FP8 weights cast with the
    /// scales of their tensors' `amax` (by slot)
    /// (`amax` holds them on the device: a recorded micro-step replays with new values).
    fn fp8_gather_pack(
        &self,
        l: &Fp8GatherLayout,
        rank: usize,
        amax: &Self::F32,
        src: &Self::Buf,
        dst: &mut Self::Buf,
    ) -> BResult<()>;
    /// Expand every piece of `src` (gathered) into `dst`, the unit's compute buffer
    /// (`shard · world` elements), with the same `amax`.
    fn fp8_gather_unpack(
        &self,
        l: &Fp8GatherLayout,
        amax: &Self::F32,
        src: &Self::Buf,
        dst: &mut Self::Buf,
    ) -> BResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPT-2-like block of width 16: ln (2·16), qkv 48×16 + bias, ...
    fn block() -> (Vec<Loc>, Vec<Loc>) {
        let mut at = 0;
        let mut t = |n: usize| {
            let l = Loc::new(at, n);
            at += n;
            l
        };
        let (l1w, l1b, qkv, qkvb, pw, pb) = (t(16), t(16), t(48 * 16), t(48), t(256), t(16));
        (vec![l1w, l1b, qkv, qkvb, pw, pb], vec![qkv, pw])
    }

    /// Two tensors inside one FP8 weight (Llama's q, k, v in its fused qkv) take that
    /// weight's slot and one scale: the one the GEMM quantizes the fused weight with, even
    /// where the parts' magnitudes differ by binades.
    #[test]
    fn tensors_of_one_fused_weight_share_its_scale() {
        let (ln, q, k, o) = (Loc::new(0, 16), Loc::new(16, 256), Loc::new(272, 64), Loc::new(336, 256));
        let fused = Loc::new(16, 320);
        let l = Fp8GatherLayout::new(&[ln, q, k, o], &[fused, o], 296, 2, 4).expect("layout");
        use SegmentKind::*;
        let kinds: Vec<SegmentKind> = l.segments.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, vec![Plain, Fp8(0), Fp8(1)]); // 592 elements: no padding
        let mut full: Vec<f32> = (0..592).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.37).collect();
        for x in &mut full[272..336] {
            *x *= 1.0 / 64.0; // k, six binades below q
        }
        let amax = [crate::backend::fp8::amax(&full[16..336]), crate::backend::fp8::amax(&full[336..592])];
        let mut gathered = vec![0u8; 2 * l.piece_bytes];
        for r in 0..2 {
            let own = &full[r * 296..(r + 1) * 296];
            pack_piece(&l, r, own, &amax, &mut gathered[r * l.piece_bytes..(r + 1) * l.piece_bytes]);
        }
        let mut out = vec![f32::NAN; 592];
        unpack(&l, &gathered, &amax, &mut out);
        let s = Fp8Format::E4M3.scale(amax[0]);
        for e in 16..336 {
            assert_eq!(out[e], Fp8Format::E4M3.round(full[e] * s) / s, "element {e} of the fused weight");
        }
    }

    #[test]
    fn segments_cover_the_unit_and_merge_plain_runs() {
        let (ts, fp8) = block();
        let numel: usize = ts.iter().map(|t| t.len).sum();
        let shard = numel.div_ceil(3).div_ceil(8) * 8;
        let l = Fp8GatherLayout::new(&ts, &fp8, shard, 3, 2).expect("has FP8 weights");
        let kinds: Vec<SegmentKind> = l.segments.iter().map(|s| s.kind).collect();
        use SegmentKind::*;
        assert_eq!(kinds, vec![Plain, Fp8(0), Plain, Fp8(1), Plain, Pad]);
        assert_eq!(l.segments[0].end, 32);
        assert_eq!(l.segments.last().map(|s| s.end), Some(shard * 3));
        assert_eq!(l.plain_pos(shard * 3), 32 + 48 + 16);
        assert_eq!((0..3).map(|r| l.plain_in(r)).sum::<usize>(), 96);
        assert_eq!(l.piece_bytes % 16, 0);
        assert!(l.piece_bytes < shard * 2, "{} bytes against {}", l.piece_bytes, shard * 2);
        assert!(Fp8GatherLayout::new(&ts, &[], shard, 3, 2).is_none());
    }

    /// Packing every rank's piece and expanding them gives each FP8 weight rounded with its
    /// tensor's scale (the GEMM's rounding) and every other element exactly.
    #[test]
    fn pack_then_unpack_rounds_weights_and_keeps_the_rest() {
        let (ts, fp8) = block();
        let numel: usize = ts.iter().map(|t| t.len).sum();
        for world in [1, 2, 3, 5] {
            let shard = numel.div_ceil(world).div_ceil(8) * 8;
            let l = Fp8GatherLayout::new(&ts, &fp8, shard, world, 4).expect("layout");
            let mut full: Vec<f32> = (0..shard * world).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
            full[numel..].fill(0.0);
            // Each weight's amax over every rank's parts, as the engine agrees on it.
            let mut amax = vec![0f32; l.slots];
            for r in 0..world {
                for (slot, at) in l.fp8_parts(r) {
                    amax[slot] = amax[slot].max(crate::backend::fp8::amax(&full[at.off..at.end()]));
                }
            }
            assert_eq!(amax, fp8.iter().map(|w| crate::backend::fp8::amax(&full[w.off..w.end()])).collect::<Vec<_>>());
            let mut gathered = vec![0u8; world * l.piece_bytes];
            for r in 0..world {
                let own = &full[r * shard..(r + 1) * shard];
                pack_piece(&l, r, own, &amax, &mut gathered[r * l.piece_bytes..(r + 1) * l.piece_bytes]);
            }
            let mut out = vec![f32::NAN; shard * world];
            unpack(&l, &gathered, &amax, &mut out);
            for (r, k, lo, hi) in l.parts(None) {
                match l.segments[k].kind {
                    SegmentKind::Fp8(slot) => {
                        let s = Fp8Format::E4M3.scale(amax[slot]);
                        for e in lo..hi {
                            assert_eq!(out[e], Fp8Format::E4M3.round(full[e] * s) / s, "world {world} rank {r} e {e}");
                        }
                    }
                    _ => assert_eq!(&out[lo..hi], &full[lo..hi], "world {world} rank {r}"),
                }
            }
        }
    }
}
