//! ZeRO-3's FP8 weight gathers on the GPU (`backend/fp8_gather.rs`: the layout and the CPU
//! twin): the amaxes of this rank's parts (`fp8_amax_bf16` per part, read back), the pack
//! (one kernel writing the codes and the bf16 side) and the unpack (one kernel expanding
//! every piece), kernels in `fp8.cu`. The segment table travels by value as a kernel
//! argument (it is fixed per unit); the amaxes, which change every step, from device memory.

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::launch::{bad, cfg, BLOCK};
use super::CudaBackend;
use crate::backend::fp8_gather::{Fp8GatherLayout, Fp8GatherOps, SegmentKind, MAX_SEGMENTS};
use crate::backend::{BResult, Loc};

/// `Fp8GatherTable` of `fp8.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Table {
    start: [i64; MAX_SEGMENTS],
    end: [i64; MAX_SEGMENTS],
    plain_before: [i64; MAX_SEGMENTS],
    kind: [i32; MAX_SEGMENTS],
    nseg: i32,
    pad: i32,
    shard: i64,
    piece_bytes: i64,
    side_off: i64,
}

// SAFETY: plain old data of fixed layout (#[repr(C)], integers only), as the kernel declares it.
unsafe impl DeviceRepr for Table {}

fn table(l: &Fp8GatherLayout) -> BResult<Table> {
    if l.segments.len() > MAX_SEGMENTS || l.elem != 2 {
        return Err(bad(format!(
            "FP8 gather layout with {} segments of {}-byte elements on the bf16 GPU backend (a bug)",
            l.segments.len(),
            l.elem
        )));
    }
    let mut t = Table {
        start: [0; MAX_SEGMENTS],
        end: [0; MAX_SEGMENTS],
        plain_before: [0; MAX_SEGMENTS],
        kind: [-2; MAX_SEGMENTS],
        nseg: l.segments.len() as i32,
        pad: 0,
        shard: l.shard as i64,
        piece_bytes: l.piece_bytes as i64,
        side_off: l.side_off as i64,
    };
    for (k, s) in l.segments.iter().enumerate() {
        t.start[k] = s.start as i64;
        t.end[k] = s.end as i64;
        t.plain_before[k] = s.plain_before as i64;
        t.kind[k] = match s.kind {
            SegmentKind::Fp8(slot) => slot as i32,
            SegmentKind::Plain => -1,
            SegmentKind::Pad => -2,
        };
    }
    Ok(t)
}

impl Fp8GatherOps for CudaBackend {
    fn amax_parts(&self, src: &Self::Buf, parts: &[Loc]) -> BResult<Vec<f32>> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(p) = parts.iter().find(|p| p.end() > src.len()) {
            return Err(bad(format!("amax of {}..{} of a buffer of {} bf16 (a bug)", p.off, p.end(), src.len())));
        }
        self.bind()?;
        // One scale slot (16 bytes: inverse scale, amax) per part, as fp8_amax_bf16 fills them.
        let mut slots = self.alloc::<u8>(16 * parts.len(), "FP8 gather amaxes")?;
        let (base, x) = (self.ptr_mut(&mut slots, 0), self.ptr(src, 0));
        for (k, p) in parts.iter().enumerate() {
            // SAFETY: the buffer holds the part (checked); slot k lies in `slots` (zeroed).
            unsafe { self.fp8_amax(x + 2 * p.off as u64, p.len, base + 16 * k as u64)? };
        }
        let bytes = self.stream.clone_dtoh(&slots).map_err(|e| self.err("reading FP8 gather amaxes", e))?;
        Ok((0..parts.len())
            .map(|k| f32::from_bits(u32::from_ne_bytes(bytes[16 * k + 4..16 * k + 8].try_into().expect("4 bytes"))))
            .collect())
    }

    fn fp8_gather_pack(
        &self,
        l: &Fp8GatherLayout,
        rank: usize,
        amax: &Self::F32,
        src: &Self::Buf,
        dst: &mut Self::Buf,
    ) -> BResult<()> {
        let t = table(l)?;
        if dst.len() < l.buffer_elems() || src.len() < l.shard * l.world || rank >= l.world || amax.len() < l.slots {
            return Err(bad(format!(
                "FP8 gather pack: buffers of {} and {} bf16 and {} amaxes, rank {rank} of {} (a bug)",
                dst.len(),
                src.len(),
                amax.len(),
                l.world
            )));
        }
        self.bind()?;
        let (base, full, am) = (self.ptr_mut(dst, 0), self.ptr(src, 0), self.ptr(amax, 0));
        let rank_i = rank as i32;
        let f = self.f("fp8_gather_pack")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&base).arg(&full).arg(&am).arg(&rank_i).arg(&t);
        // SAFETY: dst holds every piece, src the unit's shard·world bf16, amax a float per
        // slot (checked).
        unsafe { lb.launch(cfg((self.grid_for(l.shard), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("fp8_gather_pack", e))?;
        Ok(())
    }

    fn fp8_gather_unpack(
        &self,
        l: &Fp8GatherLayout,
        amax: &Self::F32,
        src: &Self::Buf,
        dst: &mut Self::Buf,
    ) -> BResult<()> {
        let t = table(l)?;
        let n = l.shard * l.world;
        if src.len() < l.buffer_elems() || dst.len() < n || amax.len() < l.slots {
            return Err(bad(format!(
                "FP8 gather unpack: buffers of {} and {} bf16 and {} amaxes (a bug)",
                src.len(),
                dst.len(),
                amax.len()
            )));
        }
        self.bind()?;
        let (full, pieces, am, ni) = (self.ptr_mut(dst, 0), self.ptr(src, 0), self.ptr(amax, 0), n as i64);
        let f = self.f("fp8_gather_unpack")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&full).arg(&pieces).arg(&am).arg(&ni).arg(&t);
        // SAFETY: src holds every piece, dst n bf16, amax a float per slot (checked).
        unsafe { lb.launch(cfg((self.grid_for(n), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("fp8_gather_unpack", e))?;
        Ok(())
    }
}
