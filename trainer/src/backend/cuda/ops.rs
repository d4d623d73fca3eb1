//! Launch code for every op of the CUDA backend: bounds checks (an out-of-range `Loc`
//! must be an error, not a silent write past a buffer), pointer arithmetic and launch
//! geometry. The kernels themselves are the `.cu` files beside this.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::matmul::{Act, Gemm, OutType};
use super::{check, check_loc, AttentionImpl, CudaBackend};
use crate::backend::{AdamWStep, AttnShape, BResult, BackendError, Loc};

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;
/// Rows per block in the LayerNorm backward, and per chunk in the bias gradient. A
/// constant (not derived from the GPU), so results are the same bits on every GPU.
const LN_ROWS_PER_BLOCK: usize = 32;
/// layernorm_bwd_warp: rows per warp, warps per block, and the widest row it takes
/// (8 chunks of 8 elements per lane).
const LN_ROWS_PER_WARP: usize = 8;
const LN_WARPS_PER_BLOCK: usize = 4;
const LN_BWD_WARP_MAX_C: usize = 2048;
const BIAS_ROWS_PER_CHUNK: usize = 256;
/// Blocks of the sum-of-squares kernel (fixed, for the same reason).
const SUMSQ_BLOCKS: usize = 1024;
/// Attention tiles (attention.cu's TILE and LDP).
/// A linear layer with an odd output size is staged through zero-padded buffers, the
/// activations in row chunks of at most this many bytes (see `stage_pad`).
const STAGE_BYTES: usize = 256 << 20;
const ATT_TILE: usize = 64;
const ATT_LDP: usize = 80;

fn bad(msg: String) -> BackendError {
    BackendError::Device(msg)
}

fn to_i32(what: &str, x: usize) -> BResult<i32> {
    i32::try_from(x).map_err(|_| bad(format!("{what} = {x} is too large for the CUDA kernels (limit {})", i32::MAX)))
}

fn cfg(grid: (u32, u32, u32), block: (u32, u32, u32), smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: smem as u32 }
}

/// The two parts of a partial-sum reduction's destination (weight and bias gradient).
struct Split {
    dst0: u64,
    dst1: u64,
    split: usize,
}

impl CudaBackend {
    fn f(&self, name: &str) -> BResult<&CudaFunction> {
        self.kernels.get(name)
    }

    /// Blocks for a grid-stride loop over `work` items: enough to fill the GPU, no more.
    fn grid_for(&self, work: usize) -> u32 {
        let want = work.div_ceil(BLOCK as usize).max(1);
        want.min(self.sm_count * 16).max(1) as u32
    }

    fn launch_err(&self, kernel: &str, e: cudarc::driver::DriverError) -> BackendError {
        self.err(&format!("launching `{kernel}`"), e)
    }

    /// `dst0[j] += Σ_k partial[k][j]` for `j < split`, `dst1[j - split] += ..` beyond.
    fn reduce_partials(&self, s: Split, partial: u64, nchunks: usize, w: usize) -> BResult<()> {
        let f = self.f("reduce_partials")?;
        let (split, nchunks_i, w_i) = (to_i32("width", s.split)?, to_i32("chunks", nchunks)?, to_i32("width", w)?);
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&s.dst0).arg(&s.dst1).arg(&split).arg(&partial).arg(&nchunks_i).arg(&w_i);
        // SAFETY: partial holds nchunks*w floats; dst0/dst1 hold split and w-split.
        unsafe { lb.launch(cfg((w.div_ceil(256) as u32, 1, 1), (256, 1, 1), 0)) }
            .map_err(|e| self.launch_err("reduce_partials", e))?;
        Ok(())
    }

    /// The padded output size and rows per chunk to stage a linear layer with `oc`
    /// outputs through, or `None` to run it in place. cuBLASLt picks slow kernels when
    /// `oc` is odd: the GPT-2 head (V = 50257) took 13.1 ms forward on an H100 against
    /// 1.8 ms for V = 50304, and padding only the leading dimension did not help (17 ms).
    /// So the weight is padded with zero rows and the activations with zero columns to
    /// a multiple of 64; the results are the same. Small layers are not worth the copies.
    fn stage_pad(n: usize, oc: usize) -> Option<(usize, usize)> {
        if oc.is_multiple_of(8) || n * oc < (1 << 20) {
            return None;
        }
        let padded = oc.div_ceil(64) * 64;
        let rows = (STAGE_BYTES / (padded * 2) / 64 * 64).clamp(64, 65_535);
        Some((padded, rows.min(n)))
    }

    /// Rows `0..rows` of `src` (leading dimension `src_ld`, `cols` used) into `dst`
    /// (`dst_ld`), zero-filling `dst` columns `cols..zero_to`.
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        dst: u64,
        dst_ld: usize,
        src: u64,
        src_ld: usize,
        rows: usize,
        cols: usize,
        zero_to: usize,
    ) -> BResult<()> {
        if rows == 0 || zero_to == 0 {
            return Ok(());
        }
        let f = self.f("copy_rows_bf16")?;
        let (dl, sl, ci, zi) = (dst_ld as i64, src_ld as i64, to_i32("columns", cols)?, to_i32("columns", zero_to)?);
        // A grid's y extent is at most 65535: go in slabs of rows.
        for r0 in (0..rows).step_by(65_535) {
            let nr = (rows - r0).min(65_535);
            let (d, s) = (dst + (r0 * dst_ld * 2) as u64, src + (r0 * src_ld * 2) as u64);
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&d).arg(&dl).arg(&s).arg(&sl).arg(&ci).arg(&zi);
            let grid = (zero_to.div_ceil(8 * 256) as u32, nr as u32, 1);
            // SAFETY: callers pass buffers holding `rows` rows of their leading dimension.
            unsafe { lb.launch(cfg(grid, (256, 1, 1), 0)) }.map_err(|e| self.launch_err("copy_rows_bf16", e))?;
        }
        Ok(())
    }

    /// A pointer to the bias `params[b]` that cuBLASLt's bias epilogue accepts: the bias
    /// itself when 16-byte aligned, else a copy in scratch (cuBLASLt's heuristic offers
    /// algorithms that then refuse a misaligned bias, seen for odd layer widths).
    fn aligned_bias(&self, params: &CudaSlice<bf16>, b: Loc) -> BResult<u64> {
        let p = self.ptr(params, b.off);
        if p.is_multiple_of(16) {
            return Ok(p);
        }
        let dst = self.scratch(&self.scratch_bias, b.len, "bias staging")?;
        let mut cell = self.scratch_bias.borrow_mut();
        let s = cell.as_mut().expect("allocated by scratch()");
        self.stream
            .memcpy_dtod(&params.slice(b.off..b.end()), &mut s.slice_mut(0..b.len))
            .map_err(|e| self.err("staging a bias", e))?;
        Ok(dst)
    }

    /// The weight `[oc, c]` (and bias `[oc]`) padded with zero rows to `ocp`, in the
    /// weight-staging scratch: returns (weight, bias) pointers.
    fn padded_weight(
        &self,
        params: &CudaSlice<bf16>,
        w: Loc,
        bias: Option<Loc>,
        oc: usize,
        ocp: usize,
        c: usize,
    ) -> BResult<(u64, Option<u64>)> {
        let len = ocp * c + if bias.is_some() { ocp } else { 0 };
        let wp = self.scratch(&self.scratch_bf16_w, len, "padded weight")?;
        // Weight rows, then zero rows: one copy of rows of length c (aligned or not).
        self.copy_rows(wp, c, self.ptr(params, w.off), c, oc, c, c)?;
        self.copy_rows(wp + (oc * c * 2) as u64, c, wp, c, ocp - oc, 0, c)?;
        let bp = match bias {
            Some(bl) => {
                let bp = wp + (ocp * c * 2) as u64;
                self.copy_rows(bp, ocp, self.ptr(params, bl.off), oc, 1, oc, ocp)?;
                Some(bp)
            }
            None => None,
        };
        Ok((wp, bp))
    }

    pub(super) fn op_cast_to_buf(
        &self,
        dst: &mut CudaSlice<bf16>,
        doff: usize,
        src: &CudaSlice<f32>,
        at: Loc,
    ) -> BResult<()> {
        check_loc("cast_to_buf source", src.len(), at)?;
        check("cast_to_buf destination", dst.len(), doff, at.len)?;
        if at.len == 0 {
            return Ok(());
        }
        let (d, s, n) = (self.ptr_mut(dst, doff), self.ptr(src, at.off), at.len as i64);
        let f = self.f("cast_f32_bf16")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&d).arg(&s).arg(&n);
        // SAFETY: both ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(at.len), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("cast_f32_bf16", e))?;
        Ok(())
    }

    pub(super) fn op_add_grad(
        &self,
        dst: &mut CudaSlice<f32>,
        doff: usize,
        src: &CudaSlice<f32>,
        at: Loc,
    ) -> BResult<()> {
        check_loc("add_grad source", src.len(), at)?;
        check("add_grad destination", dst.len(), doff, at.len)?;
        if at.len == 0 {
            return Ok(());
        }
        let (d, s, n) = (self.ptr_mut(dst, doff), self.ptr(src, at.off), at.len as i64);
        let f = self.f("add_f32")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&d).arg(&s).arg(&n);
        // SAFETY: both ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(at.len), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("add_f32", e))?;
        Ok(())
    }

    /// Per-block f64 partial sums on the device, summed in block order on the host.
    /// `dst[2·slot..+2]` (an `F64Pair`) = Σ `x[at]` (or of squares), plus the pair already
    /// there when `accumulate`. Nothing is read back to the host.
    pub(super) fn op_sum_into(
        &self,
        x: &CudaSlice<f32>,
        at: Loc,
        square: bool,
        dst: &mut CudaSlice<f32>,
        slot: usize,
        accumulate: bool,
    ) -> BResult<()> {
        check_loc("sum_into source", x.len(), at)?;
        check("sum_into destination", dst.len(), 2 * slot, 2)?;
        let blocks = at.len.div_ceil(BLOCK as usize).clamp(1, SUMSQ_BLOCKS);
        let partial = self.scratch(&self.scratch_f64, blocks, "sum partials")?;
        let (xp, n, sq) = (self.ptr(x, at.off), at.len as i64, square as i32);
        let f = self.f("sum_partial")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&partial).arg(&xp).arg(&n).arg(&sq);
        // SAFETY: x range checked; partial holds `blocks` doubles.
        unsafe { lb.launch(cfg((blocks as u32, 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("sum_partial", e))?;
        let (d, nb, acc) = (self.ptr_mut(dst, 2 * slot), blocks as i32, accumulate as i32);
        let f = self.f("sum_finish")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&d).arg(&partial).arg(&nb).arg(&acc);
        // SAFETY: dst holds the pair at 2*slot (checked); partial holds nb doubles.
        unsafe { lb.launch(cfg((1, 1, 1), (32, 1, 1), 0)) }.map_err(|e| self.launch_err("sum_finish", e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_encoder_fwd(
        &self,
        out: &mut CudaSlice<bf16>,
        tokens: &CudaSlice<u32>,
        params: &CudaSlice<bf16>,
        wte: Loc,
        wpe: Loc,
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        let n = b * t;
        check("encoder_fwd out", out.len(), 0, n * c)?;
        check("encoder_fwd tokens", tokens.len(), 0, n)?;
        check_loc("encoder_fwd wte", params.len(), wte)?;
        check_loc("encoder_fwd wpe", params.len(), wpe)?;
        if c == 0 || !wte.len.is_multiple_of(c) || wpe.len < t * c {
            return Err(bad(format!(
                "encoder_fwd: wte ({}) must be a multiple of C = {c} and wpe ({}) hold T*C = {}",
                wte.len,
                wpe.len,
                t * c
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let v = u32::try_from(wte.len / c).map_err(|_| bad("encoder_fwd: vocabulary too large".into()))?;
        let (o, tk, e, p) =
            (self.ptr_mut(out, 0), self.ptr(tokens, 0), self.ptr(params, wte.off), self.ptr(params, wpe.off));
        let (ni, ti, ci) = (to_i32("B*T", n)?, to_i32("T", t)?, to_i32("C", c)?);
        let f = self.f("encoder_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&tk).arg(&e).arg(&p).arg(&ni).arg(&ti).arg(&ci).arg(&v);
        // SAFETY: all ranges checked above; token ids are range-checked in the kernel.
        unsafe { lb.launch(cfg((self.grid_for(n * c / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_fwd", e))?;
        Ok(())
    }

    /// Deterministic embedding backward: the rows are grouped by token on the host
    /// (one small download of the token ids, which the loss download of the same
    /// micro-step waits for anyway), and each token's rows are summed in order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_encoder_bwd(
        &self,
        grads: &mut CudaSlice<f32>,
        dwte: Loc,
        dwpe: Loc,
        dout: &CudaSlice<bf16>,
        toks: &[u32],
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        let n = b * t;
        check_loc("encoder_bwd dwte", grads.len(), dwte)?;
        check_loc("encoder_bwd dwpe", grads.len(), dwpe)?;
        check("encoder_bwd dout", dout.len(), 0, n * c)?;
        check("encoder_bwd tokens", toks.len(), 0, n)?;
        if c == 0 || !dwte.len.is_multiple_of(c) || dwpe.len < t * c {
            return Err(bad(format!(
                "encoder_bwd: dwte ({}) must be a multiple of C = {c} and dwpe ({}) hold T*C",
                dwte.len, dwpe.len
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let vocab = dwte.len / c;
        let toks = &toks[..n];
        if let Some(bad_tok) = toks.iter().find(|&&x| x as usize >= vocab) {
            return Err(bad(format!("encoder_bwd: token id {bad_tok} is outside the vocabulary of {vocab}")));
        }
        // plan = [starts (nb+1) | tokens (nb) | rows (n)], rows sorted by (token, row).
        let mut rows: Vec<u32> = (0..n as u32).collect();
        rows.sort_by_key(|&r| toks[r as usize]);
        let mut starts = Vec::new();
        let mut uniq = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            let tk = toks[r as usize];
            if uniq.last() != Some(&tk) {
                uniq.push(tk);
                starts.push(i as u32);
            }
        }
        starts.push(n as u32);
        let nb = uniq.len();
        let mut plan = starts;
        plan.extend_from_slice(&uniq);
        plan.extend_from_slice(&rows);
        // Staged through pinned memory (sized for the largest plan, 3n + 1) and copied whole.
        let cap = 3 * n + 1;
        let mut pinned = self.plan_pinned.borrow_mut();
        if pinned.as_ref().is_none_or(|p| p.len() < cap) {
            *pinned = Some(self.pinned(cap, "the embedding backward plan")?);
        }
        let staged = pinned.as_mut().expect("allocated above");
        let cap = staged.len();
        staged.as_mut_slice().map_err(|e| self.err("staging the embedding plan", e))?[..plan.len()]
            .copy_from_slice(&plan);
        self.scratch(&self.scratch_u32, cap, "embedding backward plan")?;
        let plan_ptr = {
            let mut cell = self.scratch_u32.borrow_mut();
            let s = cell.as_mut().expect("allocated by scratch()");
            self.stream
                .memcpy_htod(&*staged, &mut s.slice_mut(0..cap))
                .map_err(|e| self.err("uploading the embedding plan", e))?;
            self.ptr(s, 0)
        };
        let (g_wte, g_wpe, d) = (self.ptr_mut(grads, dwte.off), self.ptr_mut(grads, dwpe.off), self.ptr(dout, 0));
        let (nbi, ci, bi, ti) = (to_i32("distinct tokens", nb)?, to_i32("C", c)?, to_i32("B", b)?, to_i32("T", t)?);
        let f = self.f("encoder_bwd_wte")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&g_wte).arg(&d).arg(&plan_ptr).arg(&nbi).arg(&ci);
        // SAFETY: the plan indexes rows < n and tokens < vocab (checked above).
        unsafe { lb.launch(cfg((nb as u32, c.div_ceil(BLOCK as usize) as u32, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_bwd_wte", e))?;
        let f = self.f("encoder_bwd_wpe")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&g_wpe).arg(&d).arg(&bi).arg(&ti).arg(&ci);
        // SAFETY: dwpe holds T*C, dout B*T*C (checked above).
        unsafe { lb.launch(cfg((self.grid_for(t * c), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_bwd_wpe", e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_layernorm_fwd(
        &self,
        out: &mut CudaSlice<bf16>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        bias: Loc,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        check("layernorm_fwd out", out.len(), 0, n * c)?;
        check("layernorm_fwd inp", inp.len(), 0, n * c)?;
        check("layernorm_fwd mean", mean.len(), 0, n)?;
        check("layernorm_fwd rstd", rstd.len(), 0, n)?;
        check_loc("layernorm_fwd weight", params.len(), w)?;
        check_loc("layernorm_fwd bias", params.len(), bias)?;
        if w.len != c || bias.len != c {
            return Err(bad(format!(
                "layernorm_fwd: weight and bias must have C = {c} elements, have {} and {}",
                w.len, bias.len
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let (o, mp, rp, x, wp, bp) = (
            self.ptr_mut(out, 0),
            self.ptr_mut(mean, 0),
            self.ptr_mut(rstd, 0),
            self.ptr(inp, 0),
            self.ptr(params, w.off),
            self.ptr(params, bias.off),
        );
        let (ni, ci) = (to_i32("N", n)?, to_i32("C", c)?);
        let f = self.f("layernorm_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&mp).arg(&rp).arg(&x).arg(&wp).arg(&bp).arg(&ni).arg(&ci);
        // SAFETY: all ranges checked above; one warp per row, rows < n.
        unsafe { lb.launch(cfg((n.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0)) }
            .map_err(|e| self.launch_err("layernorm_fwd", e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_layernorm_bwd(
        &self,
        dinp: &mut CudaSlice<bf16>,
        grads: &mut CudaSlice<f32>,
        dw: Loc,
        db: Loc,
        dout: &CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        check("layernorm_bwd dinp", dinp.len(), 0, n * c)?;
        check("layernorm_bwd dout", dout.len(), 0, n * c)?;
        check("layernorm_bwd inp", inp.len(), 0, n * c)?;
        check("layernorm_bwd mean", mean.len(), 0, n)?;
        check("layernorm_bwd rstd", rstd.len(), 0, n)?;
        check_loc("layernorm_bwd weight", params.len(), w)?;
        check_loc("layernorm_bwd dw", grads.len(), dw)?;
        check_loc("layernorm_bwd db", grads.len(), db)?;
        if w.len != c || dw.len != c || db.len != c {
            return Err(bad(format!("layernorm_bwd: weight and gradients must have C = {c} elements")));
        }
        if n == 0 {
            return Ok(());
        }
        let (dx, dy, x, wp, mp, rp) = (
            self.ptr_mut(dinp, 0),
            self.ptr(dout, 0),
            self.ptr(inp, 0),
            self.ptr(params, w.off),
            self.ptr(mean, 0),
            self.ptr(rstd, 0),
        );
        let s = Split { dst0: self.ptr_mut(grads, dw.off), dst1: self.ptr_mut(grads, db.off), split: c };
        if c.is_multiple_of(8) && c <= LN_BWD_WARP_MAX_C && [dx, dy, x, wp].iter().all(|p| p.is_multiple_of(16)) {
            // Fast path: a warp per LN_ROWS_PER_WARP rows, 16-byte loads, no block barriers.
            let nparts = n.div_ceil(LN_ROWS_PER_WARP);
            let partial = self.scratch_f32(nparts * 2 * c)?;
            let (ni, ci, rpw) = (to_i32("N", n)?, to_i32("C", c)?, LN_ROWS_PER_WARP as i32);
            let f = self.f("layernorm_bwd_warp")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&dx).arg(&partial).arg(&dy).arg(&x).arg(&wp).arg(&mp).arg(&rp).arg(&ni).arg(&ci).arg(&rpw);
            let blocks = nparts.div_ceil(LN_WARPS_PER_BLOCK) as u32;
            // SAFETY: ranges and alignment checked above; warp g writes partial row g < nparts
            // (warps past the last row return before writing); partial holds nparts*2C floats.
            unsafe { lb.launch(cfg((blocks, 1, 1), ((32 * LN_WARPS_PER_BLOCK) as u32, 1, 1), 0)) }
                .map_err(|e| self.launch_err("layernorm_bwd_warp", e))?;
            return self.reduce_partials(s, partial, nparts, 2 * c);
        }
        let smem = 2 * c * 4;
        if smem + 256 > self.kernels.max_smem {
            return Err(bad(format!(
                "layernorm_bwd: C = {c} needs {smem} bytes of shared memory, more than the device's {}",
                self.kernels.max_smem
            )));
        }
        let nblocks = n.div_ceil(LN_ROWS_PER_BLOCK);
        let partial = self.scratch_f32(nblocks * 2 * c)?;
        let (ni, ci, rpb) = (to_i32("N", n)?, to_i32("C", c)?, LN_ROWS_PER_BLOCK as i32);
        let f = self.f("layernorm_bwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&dx).arg(&partial).arg(&dy).arg(&x).arg(&wp).arg(&mp).arg(&rp).arg(&ni).arg(&ci).arg(&rpb);
        // SAFETY: all ranges checked above; partial holds nblocks*2C floats.
        unsafe { lb.launch(cfg((nblocks as u32, 1, 1), (256, 1, 1), smem)) }
            .map_err(|e| self.launch_err("layernorm_bwd", e))?;
        self.reduce_partials(s, partial, nblocks, 2 * c)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_matmul_fwd(
        &self,
        out: &mut CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        bias: Option<Loc>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        check("matmul_fwd out", out.len(), 0, n * oc)?;
        check("matmul_fwd inp", inp.len(), 0, n * c)?;
        check_loc("matmul_fwd weight", params.len(), w)?;
        if w.len != oc * c {
            return Err(bad(format!("matmul_fwd: weight has {} elements, expected OC*C = {}", w.len, oc * c)));
        }
        if let Some(bl) = bias {
            check_loc("matmul_fwd bias", params.len(), bl)?;
            if bl.len != oc {
                return Err(bad(format!("matmul_fwd: bias has {} elements, expected OC = {oc}", bl.len)));
            }
        }
        if n == 0 || oc == 0 {
            return Ok(());
        }
        if c == 0 {
            return Err(bad("matmul_fwd: C = 0".into()));
        }
        // cuBLASLt uses the calling thread's current context, unlike cudarc's calls,
        // which set it themselves: the backend may have moved threads since.
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the context", e))?;
        if let Some((ocp, rows)) = Self::stage_pad(n, oc) {
            // Odd output size: GEMM with the padded weight into a padded buffer, then
            // copy the real columns out, a chunk of rows at a time.
            let (wp, bp) = self.padded_weight(params, w, bias, oc, ocp, c)?;
            let tmp = self.scratch(&self.scratch_bf16, rows * ocp, "GEMM staging")?;
            let (ip, op) = (self.ptr(inp, 0), self.ptr_mut(out, 0));
            for r0 in (0..n).step_by(rows) {
                let nr = rows.min(n - r0);
                let g = Self::fwd_gemm(wp, ip + (r0 * c * 2) as u64, tmp, nr, c, ocp, bp, None);
                self.lt.gemm(&g, self.stream.cu_stream() as _)?;
                self.copy_rows(op + (r0 * oc * 2) as u64, oc, tmp, ocp, nr, oc, oc)?;
            }
            return Ok(());
        }
        let bias = bias.map(|bl| self.aligned_bias(params, bl)).transpose()?;
        let g = Self::fwd_gemm(self.ptr(params, w.off), self.ptr(inp, 0), self.ptr_mut(out, 0), n, c, oc, bias, None);
        self.lt.gemm(&g, self.stream.cu_stream() as _)
    }

    /// The linear backward (`matmul_bwd`), optionally with `dinp ⊙= GELU'(pre)` in the dinp
    /// GEMM's epilogue (`dgelu_pre`; only on the unpadded path, which the caller checked).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_matmul_bwd(
        &self,
        dinp: &mut CudaSlice<bf16>,
        grads: &mut CudaSlice<f32>,
        dw: Loc,
        dbias: Option<Loc>,
        dout: &CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
        dgelu_pre: Option<u64>,
    ) -> BResult<()> {
        check("matmul_bwd dinp", dinp.len(), 0, n * c)?;
        check("matmul_bwd dout", dout.len(), 0, n * oc)?;
        check("matmul_bwd inp", inp.len(), 0, n * c)?;
        check_loc("matmul_bwd weight", params.len(), w)?;
        check_loc("matmul_bwd dw", grads.len(), dw)?;
        if w.len != oc * c || dw.len != oc * c {
            return Err(bad(format!("matmul_bwd: weight and its gradient must have OC*C = {} elements", oc * c)));
        }
        if let Some(bl) = dbias {
            check_loc("matmul_bwd dbias", grads.len(), bl)?;
            if bl.len != oc {
                return Err(bad(format!("matmul_bwd: bias gradient has {} elements, expected OC = {oc}", bl.len)));
            }
        }
        if n == 0 || c == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the context", e))?;
        let stream = self.stream.cu_stream() as _;
        if oc == 0 {
            // dinp = dout·W with an empty inner dimension is zero.
            return self.stream.memset_zeros(&mut dinp.slice_mut(0..n * c)).map_err(|e| self.err("zeroing dinp", e));
        }
        if let Some((ocp, rows)) = Self::stage_pad(n, oc) {
            if dgelu_pre.is_some() {
                return Err(bad("matmul_bwd: the GELU epilogue needs the unpadded path".into()));
            }
            // Odd output size: dout chunks are copied with zero columns up to ocp, the
            // weight gets zero rows; dW accumulates into a padded fp32 buffer (chunks
            // in order) that is added to the gradient at the end.
            let (wp, _) = self.padded_weight(params, w, None, oc, ocp, c)?;
            let tmp = self.scratch(&self.scratch_bf16, rows * ocp, "GEMM staging")?;
            let dwp = self.scratch_f32(ocp * c)?;
            let (dp, ip, dxp) = (self.ptr(dout, 0), self.ptr(inp, 0), self.ptr_mut(dinp, 0));
            for (i, r0) in (0..n).step_by(rows).enumerate() {
                let nr = rows.min(n - r0);
                self.copy_rows(tmp, ocp, dp + (r0 * oc * 2) as u64, oc, nr, oc, ocp)?;
                let g = Gemm {
                    transa: false,
                    transb: false,
                    m: c,
                    n: nr,
                    k: ocp,
                    a: wp,
                    lda: c,
                    b: tmp,
                    ldb: ocp,
                    d: dxp + (r0 * c * 2) as u64,
                    ldd: c,
                    out: OutType::Bf16,
                    beta: 0.0,
                    bias: None,
                    act: Act::None,
                    aux: None,
                };
                self.lt.gemm(&g, stream)?;
                let beta = if i == 0 { 0.0 } else { 1.0 };
                let g = Gemm {
                    transa: false,
                    transb: true,
                    m: c,
                    n: ocp,
                    k: nr,
                    a: ip + (r0 * c * 2) as u64,
                    lda: c,
                    b: tmp,
                    ldb: ocp,
                    d: dwp,
                    ldd: c,
                    out: OutType::F32,
                    beta,
                    bias: None,
                    act: Act::None,
                    aux: None,
                };
                self.lt.gemm(&g, stream)?;
            }
            // dW (oc rows of c, contiguous) += the first oc rows of the padded one.
            let (dwr, n_i) = (self.ptr_mut(grads, dw.off), (oc * c) as i64);
            let f = self.f("add_f32")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&dwr).arg(&dwp).arg(&n_i);
            // SAFETY: dw holds oc*c floats (checked above); dwp holds ocp*c >= oc*c.
            unsafe { lb.launch(cfg((self.grid_for(oc * c), 1, 1), (BLOCK, 1, 1), 0)) }
                .map_err(|e| self.launch_err("add_f32", e))?;
        } else {
            self.matmul_bwd_gemms(dinp, grads, dw, dout, inp, params, w, n, c, oc, dgelu_pre)?;
        }
        if let Some(bl) = dbias {
            let nchunks = n.div_ceil(BIAS_ROWS_PER_CHUNK);
            let partial = self.scratch_f32(nchunks * oc)?;
            let (d, ni, oci, rpc) = (self.ptr(dout, 0), to_i32("N", n)?, to_i32("OC", oc)?, BIAS_ROWS_PER_CHUNK as i32);
            let f = self.f("bias_grad_partial")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&partial).arg(&d).arg(&ni).arg(&oci).arg(&rpc);
            // SAFETY: dout holds n*oc; partial holds nchunks*oc floats.
            unsafe { lb.launch(cfg((oc.div_ceil(64) as u32, nchunks as u32, 1), (64, 4, 1), 0)) }
                .map_err(|e| self.launch_err("bias_grad_partial", e))?;
            let db = self.ptr_mut(grads, bl.off);
            self.reduce_partials(Split { dst0: db, dst1: db, split: oc }, partial, nchunks, oc)?;
        }
        Ok(())
    }

    /// The two GEMMs of the linear backward on operands used in place.
    #[allow(clippy::too_many_arguments)]
    fn matmul_bwd_gemms(
        &self,
        dinp: &mut CudaSlice<bf16>,
        grads: &mut CudaSlice<f32>,
        dw: Loc,
        dout: &CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
        dgelu_pre: Option<u64>,
    ) -> BResult<()> {
        let stream = self.stream.cu_stream() as _;
        let g = Self::dinp_gemm(self.ptr_mut(dinp, 0), self.ptr(dout, 0), self.ptr(params, w.off), n, c, oc, dgelu_pre);
        self.lt.gemm(&g, stream)?;
        // dWᵀ(c×oc) += inpᵀ(c×n) · dout(n×oc), accumulated in fp32.
        let g = Gemm {
            transa: false,
            transb: true,
            m: c,
            n: oc,
            k: n,
            a: self.ptr(inp, 0),
            lda: c,
            b: self.ptr(dout, 0),
            ldb: oc,
            d: self.ptr_mut(grads, dw.off),
            ldd: c,
            out: OutType::F32,
            beta: 1.0,
            bias: None,
            act: Act::None,
            aux: None,
        };
        self.lt.gemm(&g, stream)?;
        Ok(())
    }

    /// `outᵀ(oc×n) = (Wᵀ)ᵀ·inpᵀ (+ bias)` into bf16, optionally `GELU(·)` with the
    /// pre-activation kept in `gelu_pre` (the GELU_AUX epilogue).
    #[allow(clippy::too_many_arguments)]
    fn fwd_gemm(
        w: u64,
        inp: u64,
        out: u64,
        n: usize,
        c: usize,
        oc: usize,
        bias: Option<u64>,
        gelu_pre: Option<u64>,
    ) -> Gemm {
        Gemm {
            transa: true,
            transb: false,
            m: oc,
            n,
            k: c,
            a: w,
            lda: c,
            b: inp,
            ldb: c,
            d: out,
            ldd: oc,
            out: OutType::Bf16,
            beta: 0.0,
            bias,
            act: if gelu_pre.is_some() { Act::Gelu } else { Act::None },
            aux: gelu_pre,
        }
    }

    /// `dinpᵀ(c×n) = W(c×oc stored) · doutᵀ(oc×n)`, optionally `⊙ GELU'(pre)` in the epilogue.
    fn dinp_gemm(dinp: u64, dout: u64, w: u64, n: usize, c: usize, oc: usize, dgelu_pre: Option<u64>) -> Gemm {
        Gemm {
            transa: false,
            transb: false,
            m: c,
            n,
            k: oc,
            a: w,
            lda: c,
            b: dout,
            ldb: oc,
            d: dinp,
            ldd: c,
            out: OutType::Bf16,
            beta: 0.0,
            bias: None,
            act: if dgelu_pre.is_some() { Act::DGelu } else { Act::None },
            aux: dgelu_pre,
        }
    }

    /// `pre = inp·Wᵀ + bias`, `out = GELU(pre)` in one GEMM (GELU_AUX_BIAS epilogue).
    /// `Ok(false)` where that does not apply (padded shapes, no cuBLASLt algorithm): the
    /// caller then runs matmul and GELU separately.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_matmul_gelu_fwd(
        &self,
        pre: &mut CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        bias: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<bool> {
        check("matmul_gelu_fwd pre", pre.len(), 0, n * oc)?;
        check("matmul_gelu_fwd out", out.len(), 0, n * oc)?;
        check("matmul_gelu_fwd inp", inp.len(), 0, n * c)?;
        check_loc("matmul_gelu_fwd weight", params.len(), w)?;
        check_loc("matmul_gelu_fwd bias", params.len(), bias)?;
        if w.len != oc * c || bias.len != oc {
            return Err(bad(format!("matmul_gelu_fwd: weight must hold OC*C = {} and bias OC = {oc}", oc * c)));
        }
        // cuBLASLt's heuristic offers GELU epilogues it then refuses to run for aux rows
        // that are not a multiple of 8 elements (seen on H100): those take the two-op path.
        if n == 0 || c == 0 || oc == 0 || !oc.is_multiple_of(8) || Self::stage_pad(n, oc).is_some() {
            return Ok(false);
        }
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the context", e))?;
        let (b, aux) = (Some(self.aligned_bias(params, bias)?), Some(self.ptr_mut(pre, 0)));
        let g = Self::fwd_gemm(self.ptr(params, w.off), self.ptr(inp, 0), self.ptr_mut(out, 0), n, c, oc, b, aux);
        if !self.lt.supports(&g) {
            return Ok(false);
        }
        self.lt.gemm(&g, self.stream.cu_stream() as _)?;
        Ok(true)
    }

    /// `matmul_bwd_dgelu` with GELU' in the dinp GEMM's epilogue (DGELU). `Ok(false)` where
    /// that does not apply; the caller then runs matmul_bwd and gelu_bwd.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_matmul_bwd_dgelu(
        &self,
        dpre: &mut CudaSlice<bf16>,
        grads: &mut CudaSlice<f32>,
        dw: Loc,
        dbias: Loc,
        dout: &CudaSlice<bf16>,
        act: &CudaSlice<bf16>,
        pre: &CudaSlice<bf16>,
        params: &CudaSlice<bf16>,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<bool> {
        check("matmul_bwd_dgelu pre", pre.len(), 0, n * c)?;
        check("matmul_bwd_dgelu dpre", dpre.len(), 0, n * c)?;
        check_loc("matmul_bwd_dgelu weight", params.len(), w)?;
        if n == 0 || c == 0 || oc == 0 || !c.is_multiple_of(8) || Self::stage_pad(n, oc).is_some() || w.len != oc * c {
            return Ok(false);
        }
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the context", e))?;
        let pre_ptr = self.ptr(pre, 0);
        let g =
            Self::dinp_gemm(self.ptr_mut(dpre, 0), self.ptr(dout, 0), self.ptr(params, w.off), n, c, oc, Some(pre_ptr));
        if !self.lt.supports(&g) {
            return Ok(false);
        }
        self.op_matmul_bwd(dpre, grads, dw, Some(dbias), dout, act, params, w, n, c, oc, Some(pre_ptr))?;
        Ok(true)
    }

    /// Head size, scale and the kernel-name suffix for an attention shape.
    fn attn_geometry(&self, s: AttnShape) -> BResult<(usize, f32)> {
        if s.nh == 0 || !s.c.is_multiple_of(s.nh) {
            return Err(bad(format!("attention: C = {} is not a multiple of the {} heads", s.c, s.nh)));
        }
        let hs = s.c / s.nh;
        if !matches!(hs, 32 | 64 | 128) {
            return Err(bad(format!("attention: head size {hs} is not supported by the CUDA kernels (32, 64 or 128)")));
        }
        Ok((hs, 1.0 / (hs as f32).sqrt()))
    }

    fn attn_smem(hs: usize, kind: &str) -> usize {
        let ld = hs + 4;
        let floats = match kind {
            "fwd" => 3 * ATT_TILE * ld + ATT_TILE * ATT_LDP,
            "dkv" => 4 * ATT_TILE * ld + 2 * ATT_TILE * ATT_LDP + 2 * ATT_TILE,
            _ => 4 * ATT_TILE * ld + ATT_TILE * ATT_LDP + 2 * ATT_TILE,
        };
        floats * 4
    }

    pub(super) fn op_attention_fwd(
        &self,
        out: &mut CudaSlice<bf16>,
        saved: &mut CudaSlice<f32>,
        qkv: &CudaSlice<bf16>,
        s: AttnShape,
    ) -> BResult<()> {
        let (hs, scale) = self.attn_geometry(s)?;
        let n = s.b * s.t;
        check("attention_fwd out", out.len(), 0, n * s.c)?;
        check("attention_fwd qkv", qkv.len(), 0, n * 3 * s.c)?;
        check("attention_fwd saved", saved.len(), 0, s.b * s.nh * s.t)?;
        if n == 0 {
            return Ok(());
        }
        let mma = hs == 64 && self.attention.get() == AttentionImpl::TensorCore;
        let name = if mma { "attn_fwd_mma64".to_string() } else { format!("attn_fwd_{hs}") };
        let f = self.f(&name)?;
        let (o, l, q) = (self.ptr_mut(out, 0), self.ptr_mut(saved, 0), self.ptr(qkv, 0));
        let (ti, nhi) = (to_i32("T", s.t)?, to_i32("NH", s.nh)?);
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&l).arg(&q).arg(&ti).arg(&nhi).arg(&scale);
        let grid = (s.t.div_ceil(ATT_TILE) as u32, s.nh as u32, s.b as u32);
        let (threads, smem) = if mma { (128, 0) } else { (256, Self::attn_smem(hs, "fwd")) };
        // SAFETY: ranges checked above; the kernel guards rows >= T.
        unsafe { lb.launch(cfg(grid, (threads, 1, 1), smem)) }.map_err(|e| self.launch_err(&name, e))?;
        Ok(())
    }

    pub(super) fn op_attention_bwd(
        &self,
        dqkv: &mut CudaSlice<bf16>,
        dout: &CudaSlice<bf16>,
        qkv: &CudaSlice<bf16>,
        out: &CudaSlice<bf16>,
        saved: &CudaSlice<f32>,
        s: AttnShape,
    ) -> BResult<()> {
        let (hs, scale) = self.attn_geometry(s)?;
        let n = s.b * s.t;
        check("attention_bwd dqkv", dqkv.len(), 0, n * 3 * s.c)?;
        check("attention_bwd dout", dout.len(), 0, n * s.c)?;
        check("attention_bwd qkv", qkv.len(), 0, n * 3 * s.c)?;
        check("attention_bwd out", out.len(), 0, n * s.c)?;
        check("attention_bwd saved", saved.len(), 0, s.b * s.nh * s.t)?;
        if n == 0 {
            return Ok(());
        }
        let rows = s.b * s.nh * s.t;
        let d = self.scratch_f32(rows)?;
        let (dq, dy, q, o, l) =
            (self.ptr_mut(dqkv, 0), self.ptr(dout, 0), self.ptr(qkv, 0), self.ptr(out, 0), self.ptr(saved, 0));
        let (bi, ti, nhi, hsi) = (to_i32("B", s.b)?, to_i32("T", s.t)?, to_i32("NH", s.nh)?, hs as i32);
        let f = self.f("attn_bwd_d")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&d).arg(&dy).arg(&o).arg(&bi).arg(&ti).arg(&nhi).arg(&hsi);
        // SAFETY: one warp per (b, t, h) row, rows < B*T*NH; D holds that many floats.
        unsafe { lb.launch(cfg((rows.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0)) }
            .map_err(|e| self.launch_err("attn_bwd_d", e))?;
        let grid = (s.t.div_ceil(ATT_TILE) as u32, s.nh as u32, s.b as u32);
        let mma = hs == 64 && self.attention.get() == AttentionImpl::TensorCore;
        let suffix = if mma { "mma64".to_string() } else { hs.to_string() };
        for (kind, name) in [("dkv", format!("attn_bwd_dkv_{suffix}")), ("dq", format!("attn_bwd_dq_{suffix}"))] {
            let f = self.f(&name)?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&dq).arg(&dy).arg(&q).arg(&l).arg(&d).arg(&ti).arg(&nhi).arg(&scale);
            let (threads, smem) = if mma { (128, 0) } else { (256, Self::attn_smem(hs, kind)) };
            // SAFETY: ranges checked above; dK/dV and dQ are disjoint columns of dqkv.
            unsafe { lb.launch(cfg(grid, (threads, 1, 1), smem)) }.map_err(|e| self.launch_err(&name, e))?;
        }
        Ok(())
    }

    pub(super) fn op_gelu_fwd(&self, out: &mut CudaSlice<bf16>, inp: &CudaSlice<bf16>, n: usize) -> BResult<()> {
        check("gelu_fwd out", out.len(), 0, n)?;
        check("gelu_fwd inp", inp.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let (o, x, ni) = (self.ptr_mut(out, 0), self.ptr(inp, 0), n as i64);
        let f = self.f("gelu_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&x).arg(&ni);
        // SAFETY: ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("gelu_fwd", e))?;
        Ok(())
    }

    pub(super) fn op_gelu_bwd(
        &self,
        dinp: &mut CudaSlice<bf16>,
        inp: &CudaSlice<bf16>,
        dout: &CudaSlice<bf16>,
        n: usize,
    ) -> BResult<()> {
        check("gelu_bwd dinp", dinp.len(), 0, n)?;
        check("gelu_bwd inp", inp.len(), 0, n)?;
        check("gelu_bwd dout", dout.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let (dx, x, dy, ni) = (self.ptr_mut(dinp, 0), self.ptr(inp, 0), self.ptr(dout, 0), n as i64);
        let f = self.f("gelu_bwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&dx).arg(&x).arg(&dy).arg(&ni);
        // SAFETY: ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("gelu_bwd", e))?;
        Ok(())
    }

    pub(super) fn op_residual_fwd(
        &self,
        out: &mut CudaSlice<bf16>,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        n: usize,
    ) -> BResult<()> {
        check("residual_fwd out", out.len(), 0, n)?;
        check("residual_fwd a", a.len(), 0, n)?;
        check("residual_fwd b", b.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let (o, x, y, ni) = (self.ptr_mut(out, 0), self.ptr(a, 0), self.ptr(b, 0), n as i64);
        let f = self.f("residual_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&x).arg(&y).arg(&ni);
        // SAFETY: ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("residual_fwd", e))?;
        Ok(())
    }

    pub(super) fn op_cross_entropy(
        &self,
        logits: &mut CudaSlice<bf16>,
        losses: &mut CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        n: usize,
        v: usize,
        dloss_scale: f32,
    ) -> BResult<()> {
        check("cross_entropy logits", logits.len(), 0, n * v)?;
        check("cross_entropy losses", losses.len(), 0, n)?;
        check("cross_entropy targets", targets.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        if v == 0 {
            return Err(bad("cross_entropy: empty vocabulary".into()));
        }
        let blocks = u32::try_from(n).map_err(|_| bad(format!("cross_entropy: {n} rows is too many")))?;
        let (lg, ls, tg, vi) =
            (self.ptr_mut(logits, 0), self.ptr_mut(losses, 0), self.ptr(targets, 0), to_i32("V", v)?);
        let f = self.f("cross_entropy_fwd_bwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&lg).arg(&ls).arg(&tg).arg(&vi).arg(&dloss_scale);
        // SAFETY: one block per row, rows < n; targets >= V give a NaN loss, no access.
        unsafe { lb.launch(cfg((blocks, 1, 1), (1024, 1, 1), 0)) }
            .map_err(|e| self.launch_err("cross_entropy_fwd_bwd", e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_adamw(
        &self,
        params: &mut CudaSlice<bf16>,
        poff: usize,
        master: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        moff: usize,
        grads: &CudaSlice<f32>,
        goff: usize,
        len: usize,
        h: AdamWStep,
    ) -> BResult<()> {
        check("adamw params", params.len(), poff, len)?;
        check("adamw master", master.len(), moff, len)?;
        check("adamw m", m.len(), moff, len)?;
        check("adamw v", v.len(), moff, len)?;
        check("adamw grads", grads.len(), goff, len)?;
        if len == 0 {
            return Ok(());
        }
        // Exactly as cpu/adamw.rs computes them.
        let bc1 = 1.0 - h.beta1.powi(h.t as i32);
        let bc2 = 1.0 - h.beta2.powi(h.t as i32);
        let (p, w, mp, vp, g, n) = (
            self.ptr_mut(params, poff),
            self.ptr_mut(master, moff),
            self.ptr_mut(m, moff),
            self.ptr_mut(v, moff),
            self.ptr(grads, goff),
            len as i64,
        );
        let f = self.f("adamw")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&p)
            .arg(&w)
            .arg(&mp)
            .arg(&vp)
            .arg(&g)
            .arg(&n)
            .arg(&h.lr)
            .arg(&h.beta1)
            .arg(&h.beta2)
            .arg(&h.eps)
            .arg(&h.weight_decay)
            .arg(&bc1)
            .arg(&bc2)
            .arg(&h.grad_scale);
        // SAFETY: ranges checked above.
        unsafe { lb.launch(cfg((self.grid_for(len), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("adamw", e))?;
        Ok(())
    }
}
