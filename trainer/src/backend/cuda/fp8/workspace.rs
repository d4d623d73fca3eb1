//! The FP8 layers' device state (`CudaBackend::fp8_ws`): whether the GPU runs FP8 GEMMs,
//! the workspace `prepare_fp8` reserves, the parameter versions, and where a layer's
//! cached weight and kept input codes are.

use super::{Cast, CastOp, Fp8Ws, WeightCache, WeightCodes, WsPtrs};
use crate::backend::cuda::launch::bad;
use crate::backend::cuda::CudaBackend;
use crate::backend::fp8::{CudaFp8KeptInputs, CudaFp8WeightCache, CudaFp8Workspace};
use crate::backend::{BResult, BackendError, Fp8Bytes, Fp8Format, Fp8Layer, Fp8Layers, LinearExtent, MatShape};

impl CudaBackend {
    /// Why this GPU cannot run FP8 GEMMs, or `Ok` where it can (compute capability 9.0 and
    /// later: Hopper's FP8 tensor cores, which cuBLASLt's TN FP8 GEMMs use).
    pub(in crate::backend::cuda) fn fp8_supported(&self) -> Result<(), String> {
        let (major, minor) = self.compute_capability;
        if major >= 9 {
            return Ok(());
        }
        Err(format!(
            "FP8 GEMMs need a GPU of compute capability 9.0 (Hopper) or later; {} has compute capability \
             {major}.{minor}. Set train.precision = \"bf16\" on this GPU",
            self.device
        ))
    }

    /// `MatmulOps::prepare_fp8`: refuse an older GPU, hold a workspace for the largest layer
    /// (and for every extent asked before: the operand regions grow per dimension) with
    /// `layers`' slots, and their weight cache where asked (replacing the last call's).
    pub(in crate::backend::cuda) fn fp8_prepare(&self, layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        self.fp8_supported().map_err(|reason| BackendError::Unavailable { backend: "cuda", reason })?;
        let mut cell = self.fp8_ws.borrow_mut();
        let largest = layers.largest;
        let ext = match cell.as_ref() {
            Some(ws) => LinearExtent {
                rows: ws.extent.rows.max(largest.rows),
                inputs: ws.extent.inputs.max(largest.inputs),
                outputs: ws.extent.outputs.max(largest.outputs),
                weight: ws.extent.weight.max(largest.weight),
            },
            None => largest,
        };
        let version = cell.as_ref().map_or(0, |ws| ws.version);
        *cell = None; // freed in stream order
        let layout = CudaFp8Workspace::new(ext, layers.weights.len());
        let buf = self.alloc::<u8>(layout.bytes, "FP8 GEMM operands")?;
        let cached = layers.cached();
        let cache_layout = CudaFp8WeightCache::new(cached);
        // No cache where no cached layer has a weight (none cached, or every one of them kept
        // in bf16: `train.fp8_bf16_layers`).
        let cache = match cache_layout.bytes {
            0 => None,
            bytes => {
                let buf = self.alloc::<u8>(bytes, "cached FP8 weights")?;
                Some(WeightCache {
                    buf,
                    layout: cache_layout,
                    weights: cached.to_vec(),
                    made: vec![None; cached.len()],
                })
            }
        };
        let weight_cache = cache.as_ref().map_or(0, |c| c.layout.bytes);
        // Sized for the grown extent's rows: a model built later for fewer rows (an eval)
        // must not shrink what an earlier one's forward writes.
        let kept_layout = CudaFp8KeptInputs::new(&layers.kept_input_codes_at(ext.rows));
        let kept_inputs = kept_layout.bytes;
        let kept = match kept_inputs {
            0 => None,
            bytes => Some((self.alloc::<u8>(bytes, "kept FP8 inputs")?, kept_layout)),
        };
        // A new workspace holds no amax: every weight's is found again.
        let (weight_amax, step_amax) = (vec![None; layers.weights.len()], vec![false; layers.weights.len()]);
        let step_codes = vec![false; layers.weights.len()];
        let backward = layers.backward;
        let zeroed = Default::default();
        *cell = Some(Fp8Ws {
            buf,
            extent: ext,
            layout,
            cache,
            kept,
            weight_amax,
            step_amax,
            step_codes_on: layers.step_codes,
            step_codes,
            version,
            backward,
            zeroed,
        });
        Ok(Fp8Bytes { workspace: layout.bytes, weight_cache, kept_inputs })
    }

    /// `MatmulOps::fp8_weights_changed`: a new parameter version, whose weights' amaxes the
    /// last optimizer step left where `by_step` (else they are dropped).
    pub(in crate::backend::cuda) fn fp8_new_version(&self, by_step: bool) {
        if let Some(ws) = self.fp8_ws.borrow_mut().as_mut() {
            ws.version += 1;
            for (known, left) in ws.weight_amax.iter_mut().zip(ws.step_amax.iter_mut()) {
                if !by_step {
                    *left = false;
                } else if *left {
                    *known = Some(ws.version);
                }
            }
            // The codes the step wrote are this version's (nothing wrote the parameters since).
            for (l, coded) in ws.step_codes.iter_mut().enumerate() {
                if !by_step {
                    *coded = false;
                } else if *coded {
                    if let Some(made) = ws.cache.as_mut().and_then(|c| c.made.get_mut(l)) {
                        *made = Some(ws.version);
                    }
                }
            }
        }
    }

    /// Whether the FP8 layers' dW GEMMs read FP8 codes (`Fp8Layers::backward`; false
    /// before `prepare_fp8`).
    pub(in crate::backend::cuda) fn fp8_weight_grad_in_fp8(&self) -> bool {
        self.fp8_ws.borrow().as_ref().is_some_and(|ws| ws.backward.weight_grad_in_fp8())
    }

    /// The workspace's pointers, checked to hold a layer of shape `s`.
    pub(super) fn fp8_ws(&self, s: MatShape) -> BResult<WsPtrs> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else {
            return Err(bad(format!(
                "an FP8 GEMM (N={} C={} OC={}) before MatmulOps::prepare_fp8 reserved its operands (a bug)",
                s.n, s.c, s.oc
            )));
        };
        let p = WsPtrs { base: self.ptr(&ws.buf, 0), layout: ws.layout, backward: ws.backward };
        if !p.fits(s, ws.extent) {
            return Err(bad(format!(
                "an FP8 GEMM N={} C={} OC={} is larger than the operands prepared for ({:?}) (a bug)",
                s.n, s.c, s.oc, ws.extent
            )));
        }
        Ok(p)
    }

    /// Layer `layer`'s cached weight (`w`: the bf16 weight, `[oc, c]` of `s`), cast now if
    /// the parameters changed since it was made or it was made from another buffer; `None`
    /// where weights are not cached (or there is no layer): the caller casts at this use.
    pub(super) fn fp8_cached_weight(
        &self,
        layer: Option<Fp8Layer>,
        w: u64,
        s: MatShape,
    ) -> BResult<Option<WeightCodes>> {
        let Some(l) = layer else { return Ok(None) };
        let mut cell = self.fp8_ws.borrow_mut();
        let Some(ws) = cell.as_mut() else { return Ok(None) };
        let (version, layers) = (ws.version, ws.layout.layers);
        if l.index >= layers {
            return Err(bad(format!("FP8 layer {} used, but prepare_fp8 reserved {layers} (a bug)", l.index)));
        }
        let slot = self.ptr(&ws.buf, 0) + ws.layout.layer_weight(l.index) as u64;
        let amax_known = ws.weight_amax[l.index] == Some(version);
        let Some(cache) = ws.cache.as_mut() else { return Ok(None) };
        // Layers past the cached ones cast at each use.
        let Some(&reserved) = cache.weights.get(l.index) else { return Ok(None) };
        if reserved != (s.c, s.oc) {
            return Err(bad(format!(
                "FP8 layer {} used with a C{} × OC{} weight, but prepare_fp8 reserved {reserved:?} (a bug)",
                l.index, s.c, s.oc
            )));
        }
        let base = self.ptr(&cache.buf, 0);
        let (rw, rwt) = cache.layout.regions[l.index];
        let codes = WeightCodes { w: base + rw as u64, wt: base + rwt as u64, slot };
        if cache.made[l.index] != Some(version) {
            let cast = Cast {
                x: w,
                rows: s.oc,
                cols: s.c,
                fmt: Fp8Format::E4M3,
                slot,
                dst: Some(codes.w),
                dst_t: Some(codes.wt),
                op: CastOp::None,
                norm: None,
                predicted: None,
            };
            // SAFETY: the weight holds oc·c bf16 (the callers checked); the cache's regions
            // hold oc·c bytes each for this layer (its shape checked above); the slot is the
            // layer's, and holds this version's amax where `amax_known`.
            unsafe { self.fp8_cast_amax(cast, amax_known, 0)? };
            cache.made[l.index] = Some(version);
            ws.weight_amax[l.index] = Some(version);
        }
        Ok(Some(codes))
    }

    /// Where layer `layer` keeps its input's codes (`[c, n]` e4m3) where it keeps them
    /// (`Fp8Layer::keeps_input`), else `None`; a layer `prepare_fp8` reserved none for is
    /// an error (a bug).
    pub(super) fn fp8_kept_input(&self, layer: Option<Fp8Layer>) -> BResult<Option<u64>> {
        let Some(l) = layer.filter(|l| l.keeps_input) else { return Ok(None) };
        let cell = self.fp8_ws.borrow();
        let region = cell.as_ref().and_then(|ws| ws.kept.as_ref()).and_then(|(buf, k)| {
            let at = k.regions.get(l.index).copied().flatten()?;
            Some(self.ptr(buf, 0) + at as u64)
        });
        match region {
            Some(r) => Ok(Some(r)),
            None => Err(bad(format!(
                "FP8 layer {} keeps its input, but prepare_fp8 reserved no codes for it (a bug)",
                l.index
            ))),
        }
    }
}
