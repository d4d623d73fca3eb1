//! The TCP communicator's collectives on host buffers (`[f32]`, `[f64]`): all-gather,
//! reduce-scatter, all-reduce, broadcast and barrier, each one or two `Mesh::exchange`s, with
//! reductions always in rank order 0..W-1 so results do not depend on arrival order. It exists
//! apart from the links so the arithmetic and buffer layout of each collective read on their own.

use super::wire::{code, reduce_code, Frame};
use super::TcpComm;
use crate::{CommError, Communicator, Group, ReduceOp};

mod sealed {
    pub trait Sealed {}
}

/// Element types the TCP communicator can move and reduce (`f32`, `f64`).
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    #[doc(hidden)]
    const DTYPE: u8;
    #[doc(hidden)]
    fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp);
    #[doc(hidden)]
    fn divide(acc: &mut [Self], world: usize);
}

macro_rules! float_element {
    ($t:ty, $code:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: u8 = $code;
            fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b),
                    // NaN-propagating: a NaN on any rank must not be hidden by the others.
                    ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| {
                        if b > *a || b.is_nan() {
                            *a = b
                        }
                    }),
                }
            }
            fn divide(acc: &mut [Self], world: usize) {
                let w = world as $t;
                acc.iter_mut().for_each(|a| *a /= w);
            }
        }
    };
}
float_element!(f32, code::F32);
float_element!(f64, code::F64);

/// Split `s` into consecutive pieces of the given lengths (which must fit).
fn split_parts<T>(mut s: &mut [T], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    for len in lens {
        let (head, tail) = std::mem::take(&mut s).split_at_mut(len);
        out.push(head);
        s = tail;
    }
    out
}

/// `len` elements of `T` from the reusable scratch buffer.
fn scratch_slice<T: Element>(scratch: &mut Vec<u64>, len: usize) -> Result<&mut [T], CommError> {
    let too_big = || CommError::Other(format!("a scratch buffer of {len} elements does not fit in memory"));
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(too_big)?;
    let words = bytes.div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    // u64 words are aligned for f32 and f64, so this cast cannot fail.
    let all: &mut [T] = bytemuck::try_cast_slice_mut(&mut scratch[..words])
        .map_err(|e| CommError::Other(format!("scratch buffer cast failed: {e}")))?;
    Ok(&mut all[..len])
}

/// `dest = c0 ⊕ c1 ⊕ … ⊕ c(W-1)`, strictly left to right, then divide for Avg.
fn reduce_in_rank_order<T: Element>(dest: &mut [T], contribs: &[&mut [T]], op: ReduceOp, world: usize) {
    if let Some((first, rest)) = contribs.split_first() {
        dest.copy_from_slice(first);
        for c in rest {
            T::combine(dest, c, op);
        }
    }
    if op == ReduceOp::Avg {
        T::divide(dest, world);
    }
}

impl Group for TcpComm {
    fn rank(&self) -> usize {
        self.mesh.rank
    }

    fn world(&self) -> usize {
        self.mesh.world
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.mesh.check_usable()?;
        if self.mesh.world == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::BARRIER, code::NO_DTYPE, code::NO_REDUCE, 0, 0);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, &[][..])).collect();
        let recvs = (0..self.mesh.world).filter(|&p| p != self.mesh.rank).map(|p| (p, &mut [][..])).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }
}

impl TcpComm {
    /// A point-to-point exchange with `peer`: send `send`, receive as many elements into
    /// `recv`, both directions at once (the network check times links with it). Every rank of
    /// the group calls it the same number of times, in rounds of disjoint pairs; a rank
    /// without a partner in a round passes `None` (the call keeps its sequence in step).
    pub fn exchange_with<T: Element>(
        &mut self,
        peer: Option<usize>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, send.len());
        if recv.len() != n {
            return Err(bad_size("exchange", w, format!("send has {n} elements but recv has {}", recv.len())));
        }
        if let Some(p) = peer.filter(|&p| p >= w || p == r) {
            return Err(bad_size("exchange", w, format!("rank {r} cannot exchange with rank {p}")));
        }
        self.mesh.check_usable()?;
        // Both sides announce the same pair (lower rank first), so a mismatched schedule is caught.
        let pair = peer.map_or(0, |p| r.min(p) * w + r.max(p));
        let frame = Frame::new(code::EXCHANGE, T::DTYPE, code::NO_REDUCE, pair, n);
        match peer {
            Some(p) => {
                let bytes: &[u8] = bytemuck::cast_slice(send);
                self.mesh.exchange(frame, &[(p, bytes)], vec![(p, bytemuck::cast_slice_mut::<T, u8>(recv))])
            }
            None => self.mesh.exchange(frame, &[], Vec::new()),
        }
    }
}

fn bad_size(op: &'static str, world: usize, detail: String) -> CommError {
    CommError::BadSize { op, world, detail }
}

impl<T: Element> Communicator<[T]> for TcpComm {
    fn all_gather(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, send.len());
        if n.checked_mul(w) != Some(recv.len()) {
            return Err(bad_size(
                "all_gather",
                w,
                format!("send has {n} elements, so recv needs {w} × {n}, but it has {}", recv.len()),
            ));
        }
        self.mesh.check_usable()?;
        recv[r * n..(r + 1) * n].copy_from_slice(send);
        if w == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::ALL_GATHER, T::DTYPE, code::NO_REDUCE, 0, n);
        let bytes: &[u8] = bytemuck::cast_slice(send);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, bytes)).collect();
        let size = std::mem::size_of_val(send);
        let parts = split_parts(bytemuck::cast_slice_mut::<T, u8>(recv), std::iter::repeat_n(size, w));
        let recvs = parts.into_iter().enumerate().filter(|&(q, _)| q != r).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }

    fn reduce_scatter(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, recv.len());
        if n.checked_mul(w) != Some(send.len()) {
            return Err(bad_size(
                "reduce_scatter",
                w,
                format!("recv has {n} elements, so send needs {w} × {n}, but it has {}", send.len()),
            ));
        }
        self.mesh.check_usable()?;
        let chunk = |q: usize| &send[q * n..(q + 1) * n];
        if w == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let frame = Frame::new(code::REDUCE_SCATTER, T::DTYPE, reduce_code(op), 0, n);
        let slots = scratch_slice::<T>(&mut self.scratch, w * n)?;
        let mut parts = split_parts(slots, std::iter::repeat_n(n, w));
        parts[r].copy_from_slice(chunk(r));
        let sends: Vec<(usize, &[u8])> =
            self.mesh.send_order().map(|p| (p, bytemuck::cast_slice::<T, u8>(chunk(p)))).collect();
        let recvs = parts
            .iter_mut()
            .enumerate()
            .filter(|&(q, _)| q != r)
            .map(|(q, s)| (q, bytemuck::cast_slice_mut::<T, u8>(s)))
            .collect();
        self.mesh.exchange(frame, &sends, recvs)?;
        reduce_in_rank_order(recv, &parts, op, w);
        Ok(())
    }

    fn all_reduce(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, buf.len());
        self.mesh.check_usable()?;
        if w == 1 {
            return Ok(());
        }
        // Chunk c is buf[c*k .. (c+1)*k] clipped to n: trailing chunks may be short or empty.
        let k = n.div_ceil(w);
        let range = |c: usize| (c * k).min(n)..((c + 1) * k).min(n);
        let own = range(r);
        let m = own.len();

        // Reduce phase: rank p gets everybody's chunk p and reduces it in rank order.
        let frame = Frame::new(code::ALL_REDUCE_REDUCE, T::DTYPE, reduce_code(op), 0, n);
        let slots = scratch_slice::<T>(&mut self.scratch, w * m)?;
        let mut parts = split_parts(slots, std::iter::repeat_n(m, w));
        parts[r].copy_from_slice(&buf[own.clone()]);
        {
            let sends: Vec<(usize, &[u8])> =
                self.mesh.send_order().map(|p| (p, bytemuck::cast_slice::<T, u8>(&buf[range(p)]))).collect();
            let recvs = parts
                .iter_mut()
                .enumerate()
                .filter(|&(q, _)| q != r)
                .map(|(q, s)| (q, bytemuck::cast_slice_mut::<T, u8>(s)))
                .collect();
            self.mesh.exchange(frame, &sends, recvs)?;
        }
        reduce_in_rank_order(&mut buf[own], &parts, op, w);

        // Gather phase: every rank gets every reduced chunk, byte for byte.
        let frame = Frame { op: code::ALL_REDUCE_GATHER, ..frame };
        let size = std::mem::size_of::<T>();
        let mut parts = split_parts(bytemuck::cast_slice_mut::<T, u8>(buf), (0..w).map(|c| range(c).len() * size));
        let mine: &[u8] = std::mem::take::<&mut [u8]>(&mut parts[r]);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, mine)).collect();
        let recvs = parts.into_iter().enumerate().filter(|&(q, _)| q != r).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }

    fn broadcast(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, buf.len());
        if root >= w {
            return Err(bad_size("broadcast", w, format!("root {root} is not a rank (buffer of {n} elements)")));
        }
        self.mesh.check_usable()?;
        if w == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::BROADCAST, T::DTYPE, code::NO_REDUCE, root, n);
        // Non-roots answer the root with an empty frame, so a root mismatch is caught
        // on both sides.
        if r == root {
            let bytes: &[u8] = bytemuck::cast_slice(buf);
            let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, bytes)).collect();
            let recvs = (0..w).filter(|&p| p != r).map(|p| (p, &mut [][..])).collect();
            self.mesh.exchange(frame, &sends, recvs)
        } else {
            let bytes = bytemuck::cast_slice_mut::<T, u8>(buf);
            self.mesh.exchange(frame, &[(root, &[][..])], vec![(root, bytes)])
        }
    }
}
