//! Token (+ position) embedding on the GPU (twin of cpu/encoder.rs; kernels in encoder.cu),
//! positions optionally within documents. The backward is deterministic: rows are grouped
//! by token on the host when the ids are uploaded (`DeviceTokens`), and each token's rows
//! are summed in order; within documents the position table's rows are grouped the same
//! way, by position, when the document starts are uploaded.

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, cfg, check, check_loc, to_i32, BLOCK};
use super::CudaBackend;
use crate::backend::{BResult, EmbedInputs, EmbedLocs, EncoderOps, SeqShape, WeightGrads, Weights};
use cudarc::driver::PushKernelArg;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "encoder",
    src: include_str!("encoder.cu"),
    functions: &["encoder_fwd", "encoder_bwd_wpe", "encoder_bwd_wte"],
    big_smem: no_big_smem,
    defines: no_defines,
};

impl EncoderOps for CudaBackend {
    fn encoder_fwd(
        &self,
        out: &mut Self::Buf,
        x: EmbedInputs<'_, Self>,
        p: Weights<'_, Self, EmbedLocs>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        let (tokens, params, EmbedLocs { wte, wpe }) = (&x.tokens.dev, p.buf, p.at);
        let docs = self.docs_ptr("encoder_fwd", x.docs, b, t)?;
        let n = b * t;
        check("encoder_fwd out", out.len(), 0, n * c)?;
        check("encoder_fwd tokens", tokens.len(), 0, n)?;
        check_loc("encoder_fwd wte", params.len(), wte)?;
        if let Some(wpe) = wpe {
            check_loc("encoder_fwd wpe", params.len(), wpe)?;
        }
        if c == 0 || !wte.len.is_multiple_of(c) || wpe.is_some_and(|p| p.len < t * c) {
            return Err(bad(format!(
                "encoder_fwd: wte ({}) must be a multiple of C = {c} and wpe ({:?}) hold T*C = {}",
                wte.len,
                wpe.map(|p| p.len),
                t * c
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let v = u32::try_from(wte.len / c).map_err(|_| bad("encoder_fwd: vocabulary too large".into()))?;
        // No position table: a null pointer, which the kernel reads as "add nothing".
        let pp = wpe.map_or(0, |p| self.ptr(params, p.off));
        let (o, tk, e) = (self.ptr_mut(out, 0), self.ptr(tokens, 0), self.ptr(params, wte.off));
        let (ni, ti, ci) = (to_i32("B*T", n)?, to_i32("T", t)?, to_i32("C", c)?);
        let f = self.f("encoder_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&tk).arg(&docs).arg(&e).arg(&pp).arg(&ni).arg(&ti).arg(&ci).arg(&v);
        // SAFETY: all ranges checked above; token ids are range-checked in the kernel; the
        // document starts (0 or B*T of them) were checked at upload, each at most its row's
        // position, so every position is below T.
        unsafe { lb.launch(cfg((self.grid_for(n * c / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_fwd", e))?;
        Ok(())
    }

    /// Deterministic embedding backward: the rows are grouped by token on the host (from
    /// the ids' host copy, so nothing waits for the device), and each token's rows are
    /// summed in order. Within documents the position table's rows are summed the same way,
    /// grouped by position by the plan made when the document starts were uploaded.
    fn encoder_bwd(
        &self,
        g: WeightGrads<'_, Self, EmbedLocs>,
        dout: &Self::Buf,
        x: EmbedInputs<'_, Self>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        let (grads, EmbedLocs { wte: dwte, wpe: dwpe }, toks) = (g.buf, g.at, &x.tokens.host);
        self.docs_ptr("encoder_bwd", x.docs, b, t)?;
        let n = b * t;
        check_loc("encoder_bwd dwte", grads.len(), dwte)?;
        if let Some(dwpe) = dwpe {
            check_loc("encoder_bwd dwpe", grads.len(), dwpe)?;
        }
        check("encoder_bwd dout", dout.len(), 0, n * c)?;
        check("encoder_bwd tokens", toks.len(), 0, n)?;
        if c == 0 || !dwte.len.is_multiple_of(c) || dwpe.is_some_and(|p| p.len < t * c) {
            return Err(bad(format!(
                "encoder_bwd: dwte ({}) must be a multiple of C = {c} and dwpe ({:?}) hold T*C",
                dwte.len,
                dwpe.map(|p| p.len)
            )));
        }
        if g.fresh {
            // A scatter leaves the rows of absent ids as they were: clear the tables first.
            // SAFETY: both ranges checked above.
            unsafe {
                self.zero_f32(self.ptr_mut(grads, dwte.off), dwte.len)?;
                if let Some(dwpe) = dwpe {
                    self.zero_f32(self.ptr_mut(grads, dwpe.off), dwpe.len)?;
                }
            }
        }
        if n == 0 {
            return Ok(());
        }
        let vocab = dwte.len / c;
        let toks = &toks[..n];
        if let Some(bad_tok) = toks.iter().find(|&&x| x as usize >= vocab) {
            return Err(bad(format!("encoder_bwd: token id {bad_tok} is outside the vocabulary of {vocab}")));
        }
        // The grouping was planned and uploaded with the ids (`DeviceTokens`); the kernel
        // reads the number of distinct ids from it, so its grid (one block per possible id)
        // does not depend on the batch.
        let plan = x.tokens.plan.as_ref().map(|p| &p.dev).ok_or_else(|| {
            bad("encoder_bwd: these token ids were allocated as loss targets (TokenRole::Targets), without the embedding backward's grouping".to_string())
        })?;
        check("encoder_bwd plan", plan.len(), 0, 3 * n + 2)?;
        let plan_ptr = self.ptr(plan, 0);
        let (g_wte, d) = (self.ptr_mut(grads, dwte.off), self.ptr(dout, 0));
        let (ci, bi, ti) = (to_i32("C", c)?, to_i32("B", b)?, to_i32("T", t)?);
        let f = self.f("encoder_bwd_wte")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&g_wte).arg(&d).arg(&plan_ptr).arg(&ci);
        // SAFETY: the plan (made from these ids at upload) indexes rows < n and ids < vocab
        // (checked above); blocks past its nb distinct ids return at once.
        unsafe { lb.launch(cfg((n as u32, c.div_ceil(BLOCK as usize) as u32, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_bwd_wte", e))?;
        let Some(dwpe) = dwpe else { return Ok(()) };
        let g_wpe = self.ptr_mut(grads, dwpe.off);
        if let Some(docs) = x.docs {
            // Rows grouped by their position within the document (< T, at upload), each
            // position's rows summed in order: the token kernel over the starts' plan.
            let plan = docs.plan.as_ref().map(|p| &p.dev).ok_or_else(|| {
                bad("encoder_bwd: the document starts have no position plan (a bug: DocStarts always get one)".into())
            })?;
            check("encoder_bwd position plan", plan.len(), 0, 3 * n + 2)?;
            let plan_ptr = self.ptr(plan, 0);
            let f = self.f("encoder_bwd_wte")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&g_wpe).arg(&d).arg(&plan_ptr).arg(&ci);
            // SAFETY: the plan indexes rows < n (dout holds n rows) and positions < T (dwpe
            // holds T rows), both checked above and at upload.
            unsafe { lb.launch(cfg((n as u32, c.div_ceil(BLOCK as usize) as u32, 1), (BLOCK, 1, 1), 0)) }
                .map_err(|e| self.launch_err("encoder_bwd_wte (positions within documents)", e))?;
            return Ok(());
        }
        let f = self.f("encoder_bwd_wpe")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&g_wpe).arg(&d).arg(&bi).arg(&ti).arg(&ci);
        // SAFETY: dwpe holds T*C, dout B*T*C (checked above).
        unsafe { lb.launch(cfg((self.grid_for(t * c), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("encoder_bwd_wpe", e))?;
        Ok(())
    }
}
