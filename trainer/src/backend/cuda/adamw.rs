//! AdamW on the GPU (twin of cpu/adamw.rs; kernel in adamw.cu): fp32 master weights and
//! moments updated in place, the result rounded into the bf16 parameters. One launch takes
//! up to 16 segments (a unit's tensors), so a step is one launch per unit, not per tensor;
//! four elements a thread (16-byte accesses) wherever the segments' offsets allow it. A
//! segment that is an FP8 layer's whole weight (`AdamWSegment::fp8_layer`) also leaves the
//! amax of the bf16 values it writes in the layer's weight slot (`fp8.rs`), so the next
//! parameter version's casts of that weight run no amax pass; where that layer's weight is
//! cached in FP8 (`Fp8Layers::step_codes`), the update also writes the cache's codes as laid
//! out (with a predicted scale), and one transposing pass after it checks the scale and makes
//! the transposed codes from them (`fp8.rs`: `fp8_step_codes_check`; the codes of a cast with
//! the weight's own amax, bit for bit), so the version reads the weight no more: 31 bytes an
//! element and 2 for the transpose, where casting after the step reads the bf16 weight again
//! (4 bytes an element with both layouts written). An update by tiles of the weight that wrote
//! both layouts itself ran slower than that (BENCHMARKS.md run 26).

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::fp8::StepCodes;
use super::kernels::{no_big_smem, KernelFile};
use super::launch::{cfg, check, BLOCK};
use super::CudaBackend;
use crate::backend::{AdamWOps, AdamWSegment, AdamWStep, AdamWTensors, BResult};

/// Segments one launch updates (a GPT-2 block has 12 tensors: one launch per unit).
const SEGS: usize = 16;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "adamw",
    src: include_str!("adamw.cu"),
    functions: &["adamw", "adamw4"],
    big_smem: no_big_smem,
    defines: || vec![("ADAMW_SEGS", SEGS.to_string())],
};

/// The kernel's `AdamWSegs`, passed by value (same layout: `repr(C)`, the same field order).
#[repr(C)]
#[derive(Clone, Copy)]
struct SegTable {
    start: [i64; SEGS + 1],
    poff: [i64; SEGS],
    moff: [i64; SEGS],
    goff: [i64; SEGS],
    /// Each segment's FP8 amax word (0: none).
    amax: [u64; SEGS],
    /// Where each segment writes its values' FP8 codes (0: none), and its weight's prediction.
    codes: [u64; SEGS],
    pred: [u64; SEGS],
    wd: [f32; SEGS],
    n: i32,
}

/// Elements of a launch (the end of its last segment).
fn total_of(t: &SegTable) -> usize {
    t.start[t.n as usize] as usize
}

// SAFETY: plain numbers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for SegTable {}

/// A cached FP8 weight whose codes the step writes: where they go, and where the weight starts
/// in the parameters.
#[derive(Debug, Clone, Copy)]
struct CodedWeight {
    layer: usize,
    codes: StepCodes,
    poff: usize,
}

impl AdamWOps for CudaBackend {
    fn adamw(&self, mut t: AdamWTensors<'_, Self>, segs: &[AdamWSegment], h: AdamWStep) -> BResult<()> {
        // Exactly as cpu/adamw.rs computes them.
        let (bc1, bc2) = h.bias_corrections();
        for s in segs {
            if let Some(p) = t.params.as_deref() {
                check("adamw params", p.len(), s.poff, s.len)?;
            }
            check("adamw master", t.master.len(), s.moff, s.len)?;
            check("adamw m", t.m.len(), s.moff, s.len)?;
            check("adamw v", t.v.len(), s.moff, s.len)?;
            check("adamw grads", t.grads.len(), s.goff, s.len)?;
        }
        // Null: no compute copy to round into (the kernel skips the write).
        let p = t.params.as_deref_mut().map_or(0, |p| self.ptr_mut(p, 0));
        let (w, mp, vp, g) =
            (self.ptr_mut(t.master, 0), self.ptr_mut(t.m, 0), self.ptr_mut(t.v, 0), self.ptr(t.grads, 0));
        let nonempty: Vec<&AdamWSegment> = segs.iter().filter(|s| s.len > 0).collect();
        // The FP8 weights' amax words (their slots zeroed first), where the rounded values
        // are written; in `nonempty`'s order.
        let fp8: Vec<usize> = nonempty.iter().filter_map(|s| s.fp8_layer).collect();
        let mut words =
            if p != 0 && !fp8.is_empty() { self.fp8_step_amax_words(&fp8)? } else { Vec::new() }.into_iter();
        let paired: Vec<(&AdamWSegment, u64)> = nonempty
            .iter()
            .map(|&s| {
                let word = match s.fp8_layer {
                    Some(_) if p != 0 => words.next().expect("one amax word per FP8 segment"),
                    _ => 0,
                };
                (s, word)
            })
            .collect();
        // The cached FP8 weights whose codes this step writes.
        let coded = if p != 0 { self.coded_weights(segs)? } else { Vec::new() };
        let coded_of = |s: &AdamWSegment| s.fp8_layer.and_then(|l| coded.iter().find(|c| c.layer == l));
        let fp8_layers: Vec<(usize, bool)> = fp8.iter().map(|&l| (l, coded.iter().any(|c| c.layer == l))).collect();
        self.fp8_step_codes_written(&fp8_layers)?;
        for group in paired.chunks(SEGS) {
            let mut table = SegTable {
                start: [0; SEGS + 1],
                poff: [0; SEGS],
                moff: [0; SEGS],
                goff: [0; SEGS],
                amax: [0; SEGS],
                codes: [0; SEGS],
                pred: [0; SEGS],
                wd: [0.0; SEGS],
                n: 0,
            };
            for (k, &(s, word)) in group.iter().enumerate() {
                table.start[k + 1] = table.start[k] + s.len as i64;
                table.poff[k] = s.poff as i64;
                table.moff[k] = s.moff as i64;
                table.goff[k] = s.goff as i64;
                table.amax[k] = word;
                if let Some(c) = coded_of(s) {
                    // The segment's place in its weight's codes.
                    table.codes[k] = c.codes.q + (s.poff - c.poff) as u64;
                    table.pred[k] = c.codes.pred;
                }
                table.wd[k] = if s.decay { h.weight_decay } else { 0.0 };
            }
            table.n = group.len() as i32;
            // Four elements a thread where every segment starts and ends on a multiple of 4
            // and each array is 16-byte aligned there (bf16 parameters: 8-byte).
            let four = |x: usize| x.is_multiple_of(4);
            let vec4 = group.iter().all(|(s, _)| four(s.len) && four(s.poff) && four(s.moff) && four(s.goff))
                && [w, mp, vp, g].iter().all(|&a| a.is_multiple_of(16))
                && p.is_multiple_of(8);
            let (name, threads) = if vec4 { ("adamw4", total_of(&table) / 4) } else { ("adamw", total_of(&table)) };
            let f = self.f(name)?;
            // Past the last segment: the kernel's segment search stops there.
            for k in group.len() + 1..=SEGS {
                table.start[k] = table.start[group.len()];
            }
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&p)
                .arg(&w)
                .arg(&mp)
                .arg(&vp)
                .arg(&g)
                .arg(&table)
                .arg(&h.lr)
                .arg(&h.beta1)
                .arg(&h.beta2)
                .arg(&h.eps)
                .arg(&bc1)
                .arg(&bc2)
                .arg(&h.grad_scale);
            // SAFETY: every segment's ranges were checked above.
            unsafe { lb.launch(cfg((self.grid_for(threads), 1, 1), (BLOCK, 1, 1), 0)) }
                .map_err(|e| self.launch_err(name, e))?;
        }
        // The coded weights' checks and transposed codes (or their casts again).
        let checks: Vec<_> = coded.iter().map(|c| (c.codes, p + 2 * c.poff as u64)).collect();
        // SAFETY: each weight's rows·cols bf16 lie at its start in the parameters (one run of
        // checked segments); its codes' regions hold as many bytes, its slot and prediction four
        // words (`fp8_step_codes_target`).
        unsafe { self.fp8_step_codes_check(&checks)? };
        Ok(())
    }
}

impl CudaBackend {
    /// The FP8 layers among `segs` whose weight's codes the step writes
    /// (`fp8_step_codes_target`): each layer's segments one run of its whole weight in the
    /// parameters (`AdamWSegment::fp8_weight_run`); the others are cast at their first use.
    fn coded_weights(&self, segs: &[AdamWSegment]) -> BResult<Vec<CodedWeight>> {
        let mut layers: Vec<usize> = segs.iter().filter_map(|s| s.fp8_layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut coded = Vec::new();
        for layer in layers {
            let Some(codes) = self.fp8_step_codes_target(layer)? else { continue };
            if let Some(poff) = AdamWSegment::fp8_weight_run(segs, layer, codes.rows * codes.cols) {
                coded.push(CodedWeight { layer, codes, poff });
            }
        }
        Ok(coded)
    }
}
