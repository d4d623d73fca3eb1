//! The FP8 scales' bookkeeping: the weights' amaxes per parameter version, the amax sinks
//! producers leave their outputs' amaxes in, the predictions of the casts that predict their
//! scale, and the amax passes (`fp8_amax_bf16`).

use cudarc::driver::PushKernelArg;

use super::{Cast, Prediction};
use crate::backend::cuda::launch::{bad, cfg, BLOCK};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AmaxSink, BResult, Fp8Layer, Fp8Predictions};

impl CudaBackend {
    /// The amax of an uncached weight (`n` bf16 at `w`) into `slot` (its
    /// `WsPtrs::weight_slot`), unless the slot already holds it: its layer's weight was
    /// measured in this parameter version by an earlier use, or the optimizer step that
    /// began the version left it.
    ///
    /// # Safety
    /// `w` holds `n` bf16; `slot` is a scale slot.
    pub(super) unsafe fn fp8_weight_amax(&self, layer: Option<Fp8Layer>, w: u64, n: usize, slot: u64) -> BResult<()> {
        let current = {
            let mut cell = self.fp8_ws.borrow_mut();
            match (cell.as_mut(), layer) {
                (Some(ws), Some(l)) if l.index < ws.weight_amax.len() => {
                    let key = Some(ws.version);
                    // Recorded now, found below: the amax pass is queued before any later use.
                    std::mem::replace(&mut ws.weight_amax[l.index], key) == key
                }
                _ => false,
            }
        };
        if current {
            return Ok(());
        }
        // SAFETY: the caller's promises.
        unsafe { self.fp8_fresh_amax(w, n, slot) }
    }

    /// The amax word of the slot `sink` names, zeroed in stream order for a producer kernel
    /// to max into (by `fp8_clear_sinks` where it zeroed the slot and nothing wrote it since,
    /// else now); 0 (the kernels' "none") without a sink.
    pub(in crate::backend::cuda) fn fp8_sink(&self, sink: Option<AmaxSink>) -> BResult<u64> {
        let Some(s) = sink else { return Ok(0) };
        let slot = self.fp8_sink_slot(s)?;
        let zeroed = self.fp8_ws.borrow_mut().as_mut().is_some_and(|ws| ws.zeroed.remove(&slot));
        if !zeroed {
            self.fp8_clear(slot, 1)?;
        }
        Ok(slot + 4)
    }

    /// For a cast that predicts its scale (`Cast::predicted`) into the slot `sink` names,
    /// scaling with the amax in `reference`'s slot where set: the slot zeroed in stream order
    /// (as for a producer: the cast maxes its amax into it), and where the prediction is.
    pub(super) fn fp8_predict(&self, sink: AmaxSink, reference: Option<AmaxSink>) -> BResult<Prediction> {
        self.fp8_sink(Some(sink))?;
        let cell = self.fp8_ws.borrow();
        let ws = cell
            .as_ref()
            .ok_or_else(|| bad(format!("an FP8 predicted scale ({sink:?}) before prepare_fp8 (a bug)")))?;
        let base = self.ptr(&ws.buf, 0);
        ws.sink_offset(sink)?;
        let reference = match reference {
            Some(r) => base + ws.sink_offset(r)? as u64 + 4,
            None => 0,
        };
        Ok(Prediction { at: base + ws.layout.prediction(sink) as u64, reference })
    }

    /// How often the FP8 casts that predict their scale (`Cast::predicted`) predicted it
    /// right and wrong since `prepare_fp8`, over every layer, the layers' inputs' casts and
    /// their output gradients' apart (a device read: the stream waits); `None` without FP8
    /// layers.
    pub(in crate::backend::cuda) fn fp8_prediction_counts(&self) -> BResult<Option<Fp8Predictions>> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else { return Ok(None) };
        let layers = ws.layout.layers;
        if layers == 0 {
            return Ok(None);
        }
        let start = ws.layout.prediction(AmaxSink::Input(0));
        // The inputs' and gradients' predictions, then the weights' (adjacent).
        let words = 3 * layers * 4;
        let view = ws.buf.slice(start..start + 4 * words);
        let mut bytes = vec![0u8; 4 * words];
        self.stream.memcpy_dtoh(&view, &mut bytes).map_err(|e| self.err("reading FP8 prediction counts", e))?;
        self.stream.synchronize().map_err(|e| self.err("reading FP8 prediction counts", e))?;
        let word = |i: usize| {
            u64::from(u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]))
        };
        // Per layer its input's prediction, then its output gradient's; then each weight's.
        let mut counts = Fp8Predictions::default();
        for p in 0..3 * layers {
            let kind = match p {
                p if p >= 2 * layers => &mut counts.weights,
                p if p % 2 == 0 => &mut counts.inputs,
                _ => &mut counts.grads,
            };
            kind.0 += word(4 * p + 1);
            kind.1 += word(4 * p + 2);
        }
        Ok(Some(counts))
    }

    /// `MatmulOps::fp8_clear_sinks`: layers `layers`' input and output-gradient slots
    /// (adjacent: `CudaFp8Workspace::layer_input`) zeroed in one go and recorded as zeroed.
    pub(in crate::backend::cuda) fn fp8_clear_layer_sinks(&self, layers: std::ops::Range<usize>) -> BResult<()> {
        let (first, count) = {
            let mut cell = self.fp8_ws.borrow_mut();
            let Some(ws) = cell.as_mut() else { return Ok(()) };
            if layers.is_empty() {
                return Ok(());
            }
            if layers.end > ws.layout.layers {
                return Err(bad(format!(
                    "FP8 sinks of layers {layers:?} zeroed, but prepare_fp8 reserved {} (a bug)",
                    ws.layout.layers
                )));
            }
            let base = self.ptr(&ws.buf, 0);
            for i in layers.clone() {
                ws.zeroed.insert(base + ws.layout.layer_input(i) as u64);
                ws.zeroed.insert(base + ws.layout.layer_grad(i) as u64);
            }
            (base + ws.layout.layer_input(layers.start) as u64, 2 * layers.len())
        };
        self.fp8_clear(first, count)
    }

    /// The device address of the slot `s` names.
    pub(super) fn fp8_sink_slot(&self, s: AmaxSink) -> BResult<u64> {
        let cell = self.fp8_ws.borrow();
        let ws = cell.as_ref().ok_or_else(|| bad(format!("an FP8 amax sink ({s:?}) before prepare_fp8 (a bug)")))?;
        Ok(self.ptr(&ws.buf, 0) + ws.sink_offset(s)? as u64)
    }

    /// `MatmulOps::fp8_amax_into`: the amax pass over `n` bf16 at `x` into `sink`'s slot.
    pub(in crate::backend::cuda) fn fp8_amax_into_sink(&self, x: u64, n: usize, sink: AmaxSink) -> BResult<()> {
        let slot = self.fp8_sink_slot(sink)?;
        // SAFETY: the caller checked x holds n bf16; the slot is the sink's.
        unsafe { self.fp8_fresh_amax(x, n, slot) }
    }

    /// The amax of `n` bf16 at `x` into `slot`, zeroed first.
    ///
    /// # Safety
    /// `x` holds `n` bf16; `slot` is a scale slot.
    pub(super) unsafe fn fp8_fresh_amax(&self, x: u64, n: usize, slot: u64) -> BResult<()> {
        self.fp8_clear(slot, 1)?;
        // SAFETY: the caller's promises.
        unsafe { self.fp8_amax(x, n, slot) }
    }

    /// Cast `c` with its amax found now (the slot zeroed, an amax pass), or, where `known`,
    /// with the amax its slot already holds (the forward's, or the one its producer left);
    /// with its column sums into `colsum` unless 0 (see [`CudaBackend::fp8_cast_colsum`]).
    ///
    /// # Safety
    /// As [`CudaBackend::fp8_cast_colsum`].
    pub(super) unsafe fn fp8_cast_amax(&self, c: Cast, known: bool, colsum: u64) -> BResult<()> {
        // SAFETY: the caller's promises.
        unsafe {
            // A predicted cast finds the amax itself.
            if !known && c.predicted.is_none() {
                self.fp8_fresh_amax(c.x, c.rows * c.cols, c.slot)?;
            }
            self.fp8_cast_colsum(c, colsum)
        }
    }

    /// Zero `count` adjacent scale slots from `slot` (their amax before an amax pass adds to
    /// it; the inverse scale too: each cast writes its own before its GEMM runs).
    pub(super) fn fp8_clear(&self, slot: u64, count: usize) -> BResult<()> {
        // SAFETY: slots lie in the workspace's scale region, `count` of them from `slot`.
        let r = unsafe { cudarc::driver::result::memset_d8_async(slot, 0, 16 * count, self.stream.cu_stream()) };
        r.map_err(|e| self.err("zeroing FP8 scale slots", e))
    }

    /// The amax of `n` bf16 at `x` into `slot` (max-ed into its second word).
    ///
    /// # Safety
    /// `x` holds `n` bf16; `slot` is a scale slot.
    pub(in crate::backend::cuda) unsafe fn fp8_amax(&self, x: u64, n: usize, slot: u64) -> BResult<()> {
        // The slot is written now: a producer after it must zero it again. (The weight cache's
        // fill calls this holding the state: its slot is a weight's, never a zeroed sink.)
        if let Ok(mut cell) = self.fp8_ws.try_borrow_mut() {
            if let Some(ws) = cell.as_mut() {
                ws.zeroed.remove(&slot);
            }
        }
        let ni = n as i64;
        let f = self.f("fp8_amax_bf16")?;
        let mut lb = self.stream.launch_builder(f);
        // The slot's second word is its amax (the first, the inverse scale, 16-byte aligned).
        let amax = slot + 4;
        lb.arg(&amax).arg(&x).arg(&ni);
        // SAFETY: x holds n bf16 (the caller's promise); the amax is the slot's second word.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("fp8_amax_bf16", e))?;
        Ok(())
    }
}
