//! The LM head and the loss, shared by every family: `logits = x · Wᵀ` over the whole
//! vocabulary, softmax cross-entropy, and — in training — the backward into `dx` and `dW`,
//! in chunks of rows so that a micro-batch's logits never exist whole. Its GEMMs are bf16
//! whatever `train.precision` says.
//!
//! At a 128k vocabulary the logits of 8 × 2048 tokens are 2.1 G values (4 GiB in bf16,
//! more than a 1B model's weights and optimizer state together). A chunk's logits live
//! only from its GEMM to its gradient's two GEMMs, so one `[rows, V]` buffer serves every
//! chunk. The cost is that `dW` is read and written once per chunk instead of once.
//!
//! The per-token losses of the whole micro-batch are kept and summed on the device into an
//! f64 pair (reading the loss every micro-step would stall the device).

use crate::backend::{
    BResult, Backend, F64Pair, LinearLocs, Loc, LossRows, MatShape, Precision, TokenRole, WeightGrads, Weights,
};
use crate::zero::{Category, MemoryLedger};

/// Logits bytes a chunk may take when `train.loss_chunk_rows` is 0 (automatic). Fewer,
/// larger chunks are faster (each chunk reads and writes the head's whole weight gradient):
/// on an H200 at the Llama-3.2-1B shape, 8 × 2048 rows, one chunk of 4 GiB ran 72.2k
/// tokens/s, two 71.0k, four 70.5k (BENCHMARKS.md run 15); 4 GiB is 3% of an H200, and the
/// planner counts it like every other buffer.
pub const AUTO_CHUNK_BYTES: usize = 4 << 30;

/// Rows per chunk for `n` rows over a vocabulary of `v` at `elem` bytes per logit:
/// `requested` if not 0, else the fewest equal chunks whose logits fit in
/// [`AUTO_CHUNK_BYTES`]. Never more than `n`, never 0 (for `n > 0`).
pub fn chunk_rows(n: usize, v: usize, elem: usize, requested: usize) -> usize {
    if n == 0 {
        return 0;
    }
    if requested > 0 {
        return requested.min(n);
    }
    let chunks = (n * v * elem).div_ceil(AUTO_CHUNK_BYTES).max(1);
    n.div_ceil(chunks)
}

/// The head's buffers for a micro-batch of `n` rows of width `c`.
pub struct LossHead<B: Backend> {
    n: usize,
    c: usize,
    v: usize,
    chunk: usize,
    /// One chunk's logits, `[chunk, V]`; their gradient in place after the loss.
    logits: B::Buf,
    /// With more than one chunk: the chunk's input rows and their gradient, `[chunk, C]`
    /// each (the GEMMs read and write whole buffers from their first row).
    rows: Option<(B::Buf, B::Buf)>,
    losses: B::F32,
    /// Loss summed over the micro-steps since the last [`LossHead::take_mean_loss`], as an
    /// [`F64Pair`] on the device.
    loss_acc: B::F32,
    loss_micro: usize,
    targets: B::Tokens,
}

impl<B: Backend> LossHead<B> {
    /// Buffers for `n` rows of `c` values over a vocabulary of `v`, `chunk_rows` (0 =
    /// automatic) rows of logits at a time, counted in `ledger`.
    pub fn new(
        be: &B,
        n: usize,
        c: usize,
        v: usize,
        chunk_rows_cfg: usize,
        ledger: &mut MemoryLedger,
    ) -> BResult<Self> {
        let sz = be.elem_bytes();
        let chunk = chunk_rows(n, v, sz.buf, chunk_rows_cfg);
        let mut buf = |len: usize, what: &str| -> BResult<B::Buf> {
            ledger.alloc(Category::Activations, len * sz.buf);
            be.alloc_buf(len, what)
        };
        let logits = buf(chunk * v, "logits")?;
        let rows = if chunk < n {
            Some((buf(chunk * c, "head input rows")?, buf(chunk * c, "head gradient rows")?))
        } else {
            None
        };
        let mut f32buf = |len: usize, what: &str| -> BResult<B::F32> {
            ledger.alloc(Category::Activations, len * sz.f32);
            be.alloc_f32(len, what)
        };
        let losses = f32buf(n, "per-token losses")?;
        let mut loss_acc = f32buf(2, "loss sum")?;
        be.upload_f32(&[0.0, 0.0], &mut loss_acc, 0)?;
        ledger.alloc(Category::Workspace, n * 4);
        let targets = be.alloc_tokens(n, TokenRole::Targets)?;
        Ok(LossHead { n, c, v, chunk, logits, rows, losses, loss_acc, loss_micro: 0, targets })
    }

    /// Upload one micro-batch's target token ids.
    pub fn load_targets(&mut self, be: &B, targets: &[u32]) -> BResult<()> {
        be.upload_tokens(targets, &mut self.targets)
    }

    /// Rows per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The loss of `x[N, C]` under the head `w`, added to the device-side sum.
    pub fn forward(&mut self, be: &B, x: &B::Buf, w: Weights<'_, B, LinearLocs>) -> BResult<()> {
        self.run(be, x, w, None)
    }

    /// The loss, and its backward scaled by `dloss_scale`: `dx[N, C]` overwritten, the
    /// head's weight gradient written or added to as `g` says.
    pub fn forward_backward(
        &mut self,
        be: &B,
        x: &B::Buf,
        w: Weights<'_, B, LinearLocs>,
        dloss_scale: f32,
        g: WeightGrads<'_, B, LinearLocs>,
        dx: &mut B::Buf,
    ) -> BResult<()> {
        self.run(be, x, w, Some((dloss_scale, g, dx)))
    }

    fn run(
        &mut self,
        be: &B,
        x: &B::Buf,
        w: Weights<'_, B, LinearLocs>,
        mut bwd: Option<(f32, WeightGrads<'_, B, LinearLocs>, &mut B::Buf)>,
    ) -> BResult<()> {
        let (n, c, v) = (self.n, self.c, self.v);
        // The head's GEMMs stay bf16 whatever train.precision says: its logits span a range
        // e4m3 cannot hold at useful precision, and it is a small share of the FLOPs.
        let w = Weights::new(w.buf, w.at.with_precision(Precision::Bf16));
        let mut first = 0;
        while first < n {
            let rows = self.chunk.min(n - first);
            let s = MatShape { n: rows, c, oc: v };
            let at = Loc::new(first * c, rows * c);
            // The chunk's input: `x` itself when there is one chunk.
            let xin = match self.rows.as_mut() {
                Some((xr, _)) => {
                    be.copy_buf(xr, 0, x, at)?;
                    &*xr
                }
                None => x,
            };
            be.matmul_fwd(&mut self.logits, xin, w, s)?;
            let scale = bwd.as_ref().map_or(0.0, |b| b.0);
            be.cross_entropy_fwd_bwd(
                &mut self.logits,
                &mut self.losses,
                &self.targets,
                LossRows { n: rows, v, first },
                scale,
            )?;
            if let Some((_, g, dx)) = bwd.as_mut() {
                // The first chunk writes a fresh gradient; later chunks add to it.
                let fresh = g.fresh && first == 0;
                let gc = WeightGrads { buf: &mut *g.buf, at: g.at, fresh };
                match self.rows.as_mut() {
                    Some((xr, dr)) => {
                        be.matmul_bwd(dr, gc, &self.logits, xr, w, s)?;
                        be.copy_buf(dx, first * c, dr, Loc::all(rows * c))?;
                    }
                    None => be.matmul_bwd(dx, gc, &self.logits, x, w, s)?,
                }
            }
            first += rows;
        }
        be.sum_into(&self.losses, Loc::all(n), &mut self.loss_acc, 0)?;
        self.loss_micro += 1;
        Ok(())
    }

    /// Mean loss per token over the micro-steps since the last call (one device read).
    pub fn take_mean_loss(&mut self, be: &B) -> BResult<f64> {
        let pair = be.download_f32(&self.loss_acc, Loc::all(2))?;
        let mean = F64Pair::join(&pair) / (self.loss_micro.max(1) * self.n) as f64;
        be.upload_f32(&[0.0, 0.0], &mut self.loss_acc, 0)?;
        self.loss_micro = 0;
        Ok(mean)
    }

    /// A recording of the micro-step was replayed: count its loss as `run` would have.
    pub fn replayed_micro(&mut self) {
        self.loss_micro += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_rows_evenly_under_the_byte_budget() {
        // One chunk while the logits fit.
        assert_eq!(chunk_rows(1024, 50304, 2, 0), 1024);
        // Llama 3 vocabulary, 8 x 2048 rows, bf16: 3.9 GiB of logits, one chunk; twice the
        // rows, two chunks; f32 (the CPU), two chunks too.
        assert_eq!(chunk_rows(16384, 128256, 2, 0), 16384);
        assert_eq!(chunk_rows(32768, 128256, 2, 0), 16384);
        assert_eq!(chunk_rows(16384, 128256, 4, 0), 8192);
        // A requested size is kept, but never beyond the rows there are.
        assert_eq!(chunk_rows(100, 7, 4, 30), 30);
        assert_eq!(chunk_rows(100, 7, 4, 1000), 100);
        assert_eq!(chunk_rows(0, 7, 4, 0), 0);
    }
}
