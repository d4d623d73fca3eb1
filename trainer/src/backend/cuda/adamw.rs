//! AdamW on the GPU (twin of cpu/adamw.rs; kernel in adamw.cu): fp32 master weights and
//! moments updated in place, the result rounded into the bf16 parameters. One launch takes
//! up to 16 segments (a unit's tensors), so a step is one launch per unit, not per tensor;
//! four elements a thread (16-byte accesses) wherever the segments' offsets allow it. A
//! segment that is an FP8 layer's whole weight (`AdamWSegment::fp8_layer`) also leaves the
//! amax of the bf16 values it writes in the layer's weight slot (`fp8.rs`), so the next
//! parameter version's casts of that weight run no amax pass; where that layer's weight is
//! cached in FP8 (`Fp8Layers::step_codes`), its update runs by tiles of the weight and writes
//! the cache's codes too (`adamw_fp8`, with a predicted scale and a check: the codes of a cast
//! with the weight's own amax), so the version needs no cast of it at all.

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::fp8::StepCodes;
use super::kernels::{no_big_smem, KernelFile};
use super::launch::{cfg, check, BLOCK};
use super::CudaBackend;
use crate::backend::{AdamWOps, AdamWSegment, AdamWStep, AdamWTensors, BResult};

/// Segments one launch updates (a GPT-2 block has 12 tensors: one launch per unit).
const SEGS: usize = 16;
/// FP8 weights one `adamw_fp8` launch updates (a block has 4).
const FP8_WEIGHTS: usize = 8;
/// `adamw_fp8`'s modes (`ADAMW_FP8_*` in adamw.cu).
const FP8_UPDATE: i32 = 0;
const FP8_CHECK: i32 = 1;
/// The tile of `adamw_fp8`: rows and columns of a weight (`Fp8TileOf` in common.cuh: 256
/// threads of 4 rows × 8 columns, so `TILE_R · TILE_C / 32 = 256`).
const TILE_R: usize = 128;
const TILE_C: usize = 64;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "adamw",
    src: include_str!("adamw.cu"),
    functions: &["adamw", "adamw4", "adamw_fp8"],
    big_smem: no_big_smem,
    defines: || {
        vec![
            ("ADAMW_SEGS", SEGS.to_string()),
            ("ADAMW_FP8_WEIGHTS", FP8_WEIGHTS.to_string()),
            ("ADAMW_FP8_TILE_C", TILE_C.to_string()),
            ("ADAMW_FP8_TILE_R", TILE_R.to_string()),
        ]
    },
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
    wd: [f32; SEGS],
    n: i32,
}

/// Elements of a launch (the end of its last segment).
fn total_of(t: &SegTable) -> usize {
    t.start[t.n as usize] as usize
}

// SAFETY: plain numbers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for SegTable {}

/// The kernel's `AdamWFp8` (same layout: `repr(C)`, the same field order): up to
/// `FP8_WEIGHTS` weights updated by tiles, with their codes.
#[repr(C)]
#[derive(Clone, Copy)]
struct Fp8Table {
    tile_start: [i64; FP8_WEIGHTS + 1],
    poff: [i64; FP8_WEIGHTS],
    moff: [i64; FP8_WEIGHTS],
    goff: [i64; FP8_WEIGHTS],
    q: [u64; FP8_WEIGHTS],
    qt: [u64; FP8_WEIGHTS],
    slot: [u64; FP8_WEIGHTS],
    pred: [u64; FP8_WEIGHTS],
    rows: [i32; FP8_WEIGHTS],
    cols: [i32; FP8_WEIGHTS],
    wd: [f32; FP8_WEIGHTS],
    n: i32,
}

// SAFETY: plain numbers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Fp8Table {}

/// One FP8 weight the step updates by tiles and writes the codes of: where its cache is, and
/// where its elements start in the params, state and gradient arrays.
#[derive(Debug, Clone, Copy)]
struct CodedWeight {
    layer: usize,
    codes: StepCodes,
    poff: usize,
    moff: usize,
    goff: usize,
    decay: bool,
}

/// Whether `segs` (the segments of one FP8 layer's weight, in any order) are its `rows × cols`
/// weight as one run in every array with one weight decay and offsets that allow the
/// tiles' 16-byte accesses (8 bf16, 4 fp32); the run's offsets where they are.
fn one_run(segs: &[&AdamWSegment], rows: usize, cols: usize) -> Option<(usize, usize, usize, bool)> {
    let mut sorted = segs.to_vec();
    sorted.sort_by_key(|s| s.moff);
    let first = sorted.first()?;
    let mut end = (first.poff, first.moff, first.goff);
    for s in &sorted {
        if (s.poff, s.moff, s.goff) != end || s.decay != first.decay {
            return None;
        }
        end = (s.poff + s.len, s.moff + s.len, s.goff + s.len);
    }
    let whole = end.1 - first.moff == rows * cols;
    let aligned = first.poff.is_multiple_of(8) && first.moff.is_multiple_of(4) && first.goff.is_multiple_of(4);
    let shape = rows.is_multiple_of(16) && cols.is_multiple_of(16);
    (whole && aligned && shape).then_some((first.poff, first.moff, first.goff, first.decay))
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
        // The cached FP8 weights this step writes the codes of (by tiles), and the rest.
        let aligned = [w, mp, vp, g, p].iter().all(|&a| a.is_multiple_of(16));
        let coded = if p != 0 && aligned { self.coded_weights(&nonempty)? } else { Vec::new() };
        let flat: Vec<(&AdamWSegment, u64)> = paired
            .into_iter()
            .filter(|(s, _)| !s.fp8_layer.is_some_and(|l| coded.iter().any(|c| c.layer == l)))
            .collect();
        let fp8_layers: Vec<(usize, bool)> = fp8.iter().map(|&l| (l, coded.iter().any(|c| c.layer == l))).collect();
        self.fp8_step_codes_written(&fp8_layers)?;
        for group in coded.chunks(FP8_WEIGHTS) {
            self.adamw_fp8_launch(group, (p, w, mp, vp, g), h)?;
        }
        for group in flat.chunks(SEGS) {
            let mut table = SegTable {
                start: [0; SEGS + 1],
                poff: [0; SEGS],
                moff: [0; SEGS],
                goff: [0; SEGS],
                amax: [0; SEGS],
                wd: [0.0; SEGS],
                n: 0,
            };
            for (k, &(s, word)) in group.iter().enumerate() {
                table.start[k + 1] = table.start[k] + s.len as i64;
                table.poff[k] = s.poff as i64;
                table.moff[k] = s.moff as i64;
                table.goff[k] = s.goff as i64;
                table.amax[k] = word;
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
        Ok(())
    }
}

impl CudaBackend {
    /// The FP8 layers among `segs` whose weight the step may update by tiles and write the
    /// cached codes of (`fp8_step_codes_target`): each layer's segments one run of its whole
    /// weight ([`one_run`]); the others are updated as plain segments (their amax left all the
    /// same) and cast at their first use.
    fn coded_weights(&self, segs: &[&AdamWSegment]) -> BResult<Vec<CodedWeight>> {
        let mut layers: Vec<usize> = segs.iter().filter_map(|s| s.fp8_layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut coded = Vec::new();
        for layer in layers {
            let Some(codes) = self.fp8_step_codes_target(layer)? else { continue };
            let mine: Vec<&AdamWSegment> = segs.iter().copied().filter(|s| s.fp8_layer == Some(layer)).collect();
            if let Some((poff, moff, goff, decay)) = one_run(&mine, codes.rows, codes.cols) {
                coded.push(CodedWeight { layer, codes, poff, moff, goff, decay });
            }
        }
        Ok(coded)
    }

    /// `adamw_fp8` over `group`'s weights: the update by tiles writing their codes with the
    /// predicted scale, then the check (cast again where the scale moved).
    fn adamw_fp8_launch(
        &self,
        group: &[CodedWeight],
        (p, w, mp, vp, g): (u64, u64, u64, u64, u64),
        h: AdamWStep,
    ) -> BResult<()> {
        let (bc1, bc2) = h.bias_corrections();
        let mut table = Fp8Table {
            tile_start: [0; FP8_WEIGHTS + 1],
            poff: [0; FP8_WEIGHTS],
            moff: [0; FP8_WEIGHTS],
            goff: [0; FP8_WEIGHTS],
            q: [0; FP8_WEIGHTS],
            qt: [0; FP8_WEIGHTS],
            slot: [0; FP8_WEIGHTS],
            pred: [0; FP8_WEIGHTS],
            rows: [0; FP8_WEIGHTS],
            cols: [0; FP8_WEIGHTS],
            wd: [0.0; FP8_WEIGHTS],
            n: group.len() as i32,
        };
        for (k, c) in group.iter().enumerate() {
            let StepCodes { q, qt, slot, pred, rows, cols } = c.codes;
            let tiles = rows.div_ceil(TILE_R) * cols.div_ceil(TILE_C);
            table.tile_start[k + 1] = table.tile_start[k] + tiles as i64;
            (table.poff[k], table.moff[k], table.goff[k]) = (c.poff as i64, c.moff as i64, c.goff as i64);
            (table.q[k], table.qt[k], table.slot[k], table.pred[k]) = (q, qt, slot, pred);
            table.rows[k] =
                i32::try_from(rows).map_err(|_| super::launch::bad(format!("an FP8 weight of {rows} rows")))?;
            table.cols[k] =
                i32::try_from(cols).map_err(|_| super::launch::bad(format!("an FP8 weight of {cols} columns")))?;
            table.wd[k] = if c.decay { h.weight_decay } else { 0.0 };
        }
        let tiles = table.tile_start[group.len()];
        let tiles = u32::try_from(tiles).map_err(|_| super::launch::bad(format!("adamw_fp8: {tiles} tiles")))?;
        // The update a tile a block; the check a few blocks an SM (they return at once where
        // every prediction held).
        for (mode, grid) in [(FP8_UPDATE, tiles), (FP8_CHECK, tiles.min(8 * self.sm_count as u32).max(1))] {
            let f = self.f("adamw_fp8")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&p)
                .arg(&w)
                .arg(&mp)
                .arg(&vp)
                .arg(&g)
                .arg(&table)
                .arg(&mode)
                .arg(&h.lr)
                .arg(&h.beta1)
                .arg(&h.beta2)
                .arg(&h.eps)
                .arg(&bc1)
                .arg(&bc2)
                .arg(&h.grad_scale);
            // SAFETY: each weight's rows·cols elements lie in the arrays (the segments were
            // checked, and are one run of them: `one_run`), at offsets the 16-byte accesses
            // allow; its codes' regions hold rows·cols bytes each, its slot and prediction
            // four words (`fp8_step_codes_target`).
            unsafe { lb.launch(cfg((grid, 1, 1), (256, 1, 1), 0)) }.map_err(|e| self.launch_err("adamw_fp8", e))?;
        }
        Ok(())
    }
}
