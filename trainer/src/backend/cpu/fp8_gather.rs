//! ZeRO-3's FP8 weight gathers on the CPU (`backend/fp8_gather.rs`): the reference pack and
//! unpack on the bytes of the f32 buffers (a gather buffer holds bytes, four to an element).

use super::CpuBackend;
use crate::backend::fp8::amax;
use crate::backend::fp8_gather::{pack_piece, unpack, Fp8GatherLayout, Fp8GatherOps};
use crate::backend::{BResult, BackendError, Loc};

fn check(l: &Fp8GatherLayout, gather: &[f32], unit: &[f32]) -> BResult<()> {
    if l.elem != 4 || gather.len() < l.buffer_elems() || unit.len() < l.shard * l.world {
        return Err(BackendError::Device(format!(
            "FP8 gather: buffers of {} and {} f32 for a layout of {}-byte elements, {} and {} elements (a bug)",
            gather.len(),
            unit.len(),
            l.elem,
            l.buffer_elems(),
            l.shard * l.world
        )));
    }
    Ok(())
}

impl Fp8GatherOps for CpuBackend {
    fn amax_parts(&self, src: &Vec<f32>, parts: &[Loc]) -> BResult<Vec<f32>> {
        Ok(parts.iter().map(|p| amax(&src[p.off..p.end()])).collect())
    }

    fn fp8_gather_pack(
        &self,
        l: &Fp8GatherLayout,
        rank: usize,
        amax: &Vec<f32>,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
    ) -> BResult<()> {
        check(l, dst, src)?;
        let own = &src[rank * l.shard..(rank + 1) * l.shard];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut dst[..l.buffer_elems()]);
        pack_piece(l, rank, own, amax, &mut bytes[rank * l.piece_bytes..(rank + 1) * l.piece_bytes]);
        Ok(())
    }

    fn fp8_gather_unpack(
        &self,
        l: &Fp8GatherLayout,
        amax: &Vec<f32>,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
    ) -> BResult<()> {
        check(l, src, dst)?;
        let bytes: &[u8] = bytemuck::cast_slice(&src[..l.buffer_elems()]);
        unpack(l, bytes, amax, &mut dst[..l.shard * l.world]);
        Ok(())
    }
}
