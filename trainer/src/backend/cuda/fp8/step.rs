//! What the optimizer step leaves an FP8 layer (`adamw.rs`): the cached weights' codes it
//! writes, checked by `fp8_step_codes` (fp8.cu), and the weight amaxes it leaves in the
//! weight slots.

use cudarc::driver::PushKernelArg;

use super::{StepCodes, StepCodesTable, STEP_TILE_R, STEP_WEIGHTS, TILE_C};
use crate::backend::cuda::launch::{bad, cfg, to_i32};
use crate::backend::cuda::CudaBackend;
use crate::backend::BResult;

impl CudaBackend {
    /// Where an optimizer step that writes layer `l`'s whole weight writes its cached codes
    /// (`adamw.rs`), or `None` where it does not: FP8 not prepared, the step's codes off
    /// (`Fp8Layers::step_codes`), or the layer not cached.
    pub(in crate::backend::cuda) fn fp8_step_codes_target(&self, l: usize) -> BResult<Option<StepCodes>> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref().filter(|ws| ws.step_codes_on) else { return Ok(None) };
        let Some(cache) = ws.cache.as_ref() else { return Ok(None) };
        let Some(&(c, oc)) = cache.weights.get(l) else { return Ok(None) };
        if l >= ws.layout.layers {
            return Err(bad(format!(
                "an optimizer step writes FP8 layer {l}, but prepare_fp8 reserved {} (a bug)",
                ws.layout.layers
            )));
        }
        if c * oc == 0 {
            return Ok(None);
        }
        let (base, cbase) = (self.ptr(&ws.buf, 0), self.ptr(&cache.buf, 0));
        let (rw, rwt) = cache.layout.regions[l];
        Ok(Some(StepCodes {
            q: cbase + rw as u64,
            qt: cbase + rwt as u64,
            slot: base + ws.layout.layer_weight(l) as u64,
            pred: base + ws.layout.weight_prediction(l) as u64,
            rows: oc,
            cols: c,
        }))
    }

    /// After an optimizer step wrote cached weights' codes as laid out with a predicted scale
    /// (`adamw.rs`; each weight's bf16 values at its `x`, its amax in its slot): for each, the
    /// check of the scale, and the transposed codes made from them where it held, else the
    /// weight cast again, both layouts (fp8.cu: `fp8_step_codes`, a few weights a launch); the
    /// inverse scale, the next prediction and a count written either way.
    ///
    /// # Safety
    /// Each `x` holds its `codes.rows · codes.cols` bf16; each `codes` is `fp8_step_codes_target`'s.
    pub(in crate::backend::cuda) unsafe fn fp8_step_codes_check(&self, weights: &[(StepCodes, u64)]) -> BResult<()> {
        for group in weights.chunks(STEP_WEIGHTS) {
            let mut t = StepCodesTable {
                tile_start: [0; STEP_WEIGHTS + 1],
                q: [0; STEP_WEIGHTS],
                qt: [0; STEP_WEIGHTS],
                x: [0; STEP_WEIGHTS],
                slot: [0; STEP_WEIGHTS],
                pred: [0; STEP_WEIGHTS],
                rows: [0; STEP_WEIGHTS],
                cols: [0; STEP_WEIGHTS],
                n: group.len() as i32,
            };
            for (k, &(c, x)) in group.iter().enumerate() {
                let tiles = c.cols.div_ceil(TILE_C) * c.rows.div_ceil(STEP_TILE_R);
                t.tile_start[k + 1] = t.tile_start[k] + tiles as i64;
                (t.q[k], t.qt[k], t.x[k], t.slot[k], t.pred[k]) = (c.q, c.qt, x, c.slot, c.pred);
                (t.rows[k], t.cols[k]) = (to_i32("rows", c.rows)?, to_i32("columns", c.cols)?);
                if !(c.rows.is_multiple_of(16) && c.cols.is_multiple_of(16)) {
                    return Err(bad(format!(
                        "FP8 step codes of a {} × {} weight, not multiples of 16 (a bug)",
                        c.rows, c.cols
                    )));
                }
            }
            let tiles = u32::try_from(t.tile_start[group.len()])
                .map_err(|_| bad("FP8 step codes: too many tiles in one launch".into()))?;
            let f = self.f("fp8_step_codes")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&t);
            // SAFETY: the caller's promises: each x holds rows·cols bf16, q and qt as many bytes
            // (the layer's cache regions), the slot and the prediction four words each.
            unsafe { lb.launch(cfg((tiles.max(1), 1, 1), (256, 1, 1), 0)) }
                .map_err(|e| self.launch_err("fp8_step_codes", e))?;
        }
        Ok(())
    }

    /// An optimizer step updated the weights of `layers` (`AdamWSegment::fp8_layer`), writing
    /// the cached codes of those marked true: for the version `fp8_weights_changed(by_step)`
    /// begins.
    pub(in crate::backend::cuda) fn fp8_step_codes_written(&self, layers: &[(usize, bool)]) -> BResult<()> {
        let mut cell = self.fp8_ws.borrow_mut();
        let Some(ws) = cell.as_mut() else { return Ok(()) };
        for &(l, coded) in layers {
            let n = ws.step_codes.len();
            *ws.step_codes.get_mut(l).ok_or_else(|| {
                bad(format!("an optimizer step wrote FP8 layer {l}, but prepare_fp8 reserved {n} (a bug)"))
            })? = coded;
        }
        Ok(())
    }

    /// For an optimizer step that leaves the amax of each of `layers`' weights
    /// (`AdamWSegment::fp8_layer`): their weight slots zeroed in stream order (adjacent
    /// ones together) and recorded as left by the step; returns each one's amax word, in
    /// order, for the kernel to max into.
    pub(in crate::backend::cuda) fn fp8_step_amax_words(&self, layers: &[usize]) -> BResult<Vec<u64>> {
        let mut cell = self.fp8_ws.borrow_mut();
        let ws = cell.as_mut().ok_or_else(|| {
            bad(format!("an optimizer step leaves FP8 layer amaxes ({layers:?}) before prepare_fp8 (a bug)"))
        })?;
        let base = self.ptr(&ws.buf, 0);
        let mut sorted = layers.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if let Some(&l) = sorted.last().filter(|&&l| l >= ws.layout.layers) {
            return Err(bad(format!(
                "an optimizer step leaves FP8 layer {l}'s amax, but prepare_fp8 reserved {} (a bug)",
                ws.layout.layers
            )));
        }
        // Runs of adjacent layers: one clear each.
        let mut k = 0;
        while k < sorted.len() {
            let mut e = k + 1;
            while e < sorted.len() && sorted[e] == sorted[e - 1] + 1 {
                e += 1;
            }
            self.fp8_clear(base + ws.layout.layer_weight(sorted[k]) as u64, e - k)?;
            k = e;
        }
        for &l in &sorted {
            ws.step_amax[l] = true;
        }
        Ok(layers.iter().map(|&l| base + ws.layout.layer_weight(l) as u64 + 4).collect())
    }
}
