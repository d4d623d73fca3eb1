//! Rotary position embedding on the GPU (twin of `rope_rotate` in cpu/attention.rs; kernels
//! in rope.cu): the rotation `AttentionOps::rope_fwd` applies to the query and key heads of
//! a `qkv` buffer in place, and its inverse (`rope_bwd`, on their gradients). Its own file
//! pair beside attention's: an element-wise pass over the projection, nothing shared with
//! the flash-attention kernels; attention.rs's `AttentionOps` impl calls in here.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, cfg, check, to_i32};
use super::CudaBackend;
use crate::backend::{AttnShape, BResult};

/// The vectorised kernels by `G = hs / 16` (16-byte words per half head): head sizes 32,
/// 64, 128 and 256, with 16-byte aligned `qkv` and table. Other head sizes take the general
/// `rope_rotate`.
const ROPE_V8: [(&str, usize); 4] =
    [("rope_rotate_g2", 2), ("rope_rotate_g4", 4), ("rope_rotate_g8", 8), ("rope_rotate_g16", 16)];

/// Threads per block: a warp per row, 8 rows (rope.cu).
const ROPE_THREADS: usize = 256;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "rope",
    src: include_str!("rope.cu"),
    functions: &["rope_rotate", ROPE_V8[0].0, ROPE_V8[1].0, ROPE_V8[2].0, ROPE_V8[3].0],
    big_smem: no_big_smem,
    defines: no_defines,
};

impl CudaBackend {
    /// Rotate the query and key heads of the `B·T` rows of `qkv` in place by the angles of
    /// `table` (`[T, hs/2]` cosines then `[T, hs/2]` sines, `rope_table`); `inverse` by
    /// minus them. `docs`: the device address of the rows' document starts (positions
    /// within documents), 0 for positions within sequences. `op` names the caller in errors.
    pub(super) fn rope(
        &self,
        op: &str,
        qkv: &mut CudaSlice<bf16>,
        table: &CudaSlice<f32>,
        docs: u64,
        s: AttnShape,
        inverse: bool,
    ) -> BResult<()> {
        if s.nh == 0 || s.nkv == 0 || !s.nh.is_multiple_of(s.nkv) || !s.c.is_multiple_of(s.nh) {
            return Err(bad(format!(
                "{op}: {} query heads must be a multiple of the {} key/value heads and divide C = {}",
                s.nh, s.nkv, s.c
            )));
        }
        let (hs, w, n) = (s.hs(), s.qkv_width(), s.b * s.t);
        if hs == 0 || !hs.is_multiple_of(2) {
            return Err(bad(format!("{op}: the head size {hs} must be even (pairs of dimensions rotate)")));
        }
        check(&format!("{op} qkv"), qkv.len(), 0, n * w)?;
        check(&format!("{op} table (cos then sin, [T, hs/2] each)"), table.len(), 0, s.t * hs)?;
        if n == 0 {
            return Ok(());
        }
        let (half, heads) = (hs / 2, s.nh + s.nkv);
        let (q, tb) = (self.ptr_mut(qkv, 0), self.ptr(table, 0));
        let (ni, ti, wi, hi) = (to_i32("B*T", n)?, to_i32("T", s.t)?, to_i32("qkv width", w)?, to_i32("heads", heads)?);
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        let v8 = ROPE_V8.iter().find(|&&(_, g)| 16 * g == hs).filter(|_| q.is_multiple_of(16) && tb.is_multiple_of(16));
        let name = v8.map_or("rope_rotate", |&(name, _)| name);
        let f = self.f(name)?;
        let mut lb = self.stream.launch_builder(f);
        let half_i = half as i32;
        lb.arg(&q).arg(&tb).arg(&ni).arg(&ti).arg(&wi).arg(&hi);
        if v8.is_none() {
            lb.arg(&half_i);
        }
        lb.arg(&sign).arg(&docs);
        let blocks = n.div_ceil(ROPE_THREADS / 32) as u32;
        // SAFETY: qkv holds the n rows of w values and table the T·hs floats (checked
        // above); a warp per row < n touches only the row's first nh + nkv heads (< w) and
        // its position's table entries (p < T: a document start is clamped to the row's own
        // position, and `docs`, when not 0, holds the B·T starts: checked by the caller); the
        // vectorised kernels' 16-byte alignment
        // was checked above (rows are whole words: hs, hence w, is a multiple of 16).
        unsafe { lb.launch(cfg((blocks, 1, 1), (ROPE_THREADS as u32, 1, 1), 0)) }
            .map_err(|e| self.launch_err(name, e))?;
        Ok(())
    }
}
