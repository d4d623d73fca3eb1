//! FP8 linear layers on the GPU (`train.precision = "fp8"`; twin of the FP8 path of
//! `cpu/matmul.rs`, numerics in `backend/fp8.rs`): the operand workspace, the casts of
//! `fp8.cu`, and the three GEMMs of a linear layer through cuBLASLt (`cublaslt.rs`).
//!
//! Hopper's FP8 GEMMs take A transposed and B not ("TN": both with the inner dimension
//! contiguous). With row-major `X[n, c]`, `W[oc, c]`, `dY[n, oc]` (see `matmul.rs`):
//! - forward `Yᵀ(oc×n) = W·Xᵀ`: A = W `[oc, c]`, B = X `[n, c]`, both as they are (e4m3 ×
//!   e4m3, fast accumulation), bias, GELU (aux bf16) or residual (C) in the epilogue;
//! - `dXᵀ(c×n) = Wᵀ·dYᵀ`: A = Wᵀ `[c, oc]` (a transposed cast of the weight), B = dY
//!   `[n, oc]` (e4m3 × e5m2), GELU' in the epilogue where cuBLASLt has it;
//! - `dWᵀ(c×oc) = Xᵀ·dY`: A = Xᵀ `[c, n]`, B = dYᵀ `[oc, n]` (both transposed casts,
//!   e4m3 × e5m2), fp32 written or accumulated (beta 1) into the gradient.
//!
//! Never e5m2 × e5m2 (cuBLASLt has no such GEMM). Each tensor is quantized per tensor with
//! its own current amax: an amax pass (`fp8_amax_bf16`), then a cast that writes the codes
//! and the inverse scale the GEMM reads (`fp8_cast_bf16`, or `fp8_cast_transpose_bf16`
//! for the transposed copies; dY's cast writes both of its layouts in one pass). The
//! input's amax is taken again in the backward (the same tensor, so the same scale): no
//! state is kept between forward and backward. The bias gradient sums the bf16 dY.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::cublaslt::{Act, Fp8Gemm, Gemm, OutType};
use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, cfg, to_i32, BLOCK};
use super::matmul::BwdPtrs;
use super::CudaBackend;
use crate::backend::fp8::{CudaFp8Workspace, ScaleSlot};
use crate::backend::{BResult, BackendError, Fp8Format, LinearExtent, MatShape};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "fp8",
    src: include_str!("fp8.cu"),
    functions: &["fp8_amax_bf16", "fp8_cast_bf16", "fp8_cast_transpose_bf16"],
    big_smem: no_big_smem,
    defines: no_defines,
};

/// Rows and columns of the transposing cast's tile (`FP8_TILE` in fp8.cu).
const TILE: usize = 64;

/// `SHARDTRAIN_FP8_FAST_ACCUM`: `1` (or unset) lets the FP8 forward GEMMs use cuBLASLt's fast
/// accumulation (as Transformer Engine and torchao do), `0` promotes their partial sums like
/// the backward's (for loss-parity experiments); any other value is an error.
pub(super) fn fast_accum_from_env() -> BResult<bool> {
    match std::env::var("SHARDTRAIN_FP8_FAST_ACCUM").as_deref() {
        Err(_) | Ok("") | Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        Ok(v) => Err(bad(format!("SHARDTRAIN_FP8_FAST_ACCUM = {v:?}: expected 1 or 0 (or leave it unset)"))),
    }
}

/// The FP8 operand workspace: its device bytes, what it was sized for and its layout.
pub(super) struct Fp8Ws {
    buf: CudaSlice<u8>,
    extent: LinearExtent,
    layout: CudaFp8Workspace,
}

/// Device pointers into the workspace.
#[derive(Debug, Clone, Copy)]
struct WsPtrs {
    base: u64,
    layout: CudaFp8Workspace,
}

impl WsPtrs {
    fn a(&self) -> u64 {
        self.base + self.layout.a as u64
    }
    fn gt(&self) -> u64 {
        self.base + self.layout.gt as u64
    }
    fn w(&self) -> u64 {
        self.base + self.layout.w as u64
    }
    /// A slot's start: its inverse scale, then its amax (what the casts take).
    fn slot(&self, s: ScaleSlot) -> u64 {
        self.base + self.layout.inv_scale(s) as u64
    }
    fn inv(&self, s: ScaleSlot) -> u64 {
        self.base + self.layout.inv_scale(s) as u64
    }
    /// Whether a layer of shape `s` fits the regions.
    fn fits(&self, s: MatShape, ext: LinearExtent) -> bool {
        s.n <= ext.rows && s.c <= ext.inputs && s.oc <= ext.outputs && s.c * s.oc <= ext.weight
    }
}

/// Where a linear forward's epilogue takes its extra operands.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FwdEpilogue {
    pub bias: Option<u64>,
    /// GELU in the epilogue, the pre-activation written here (bf16, like the output).
    pub gelu_pre: Option<u64>,
    /// Added to the product (cuBLASLt's C, beta 1).
    pub residual: Option<u64>,
}

impl CudaBackend {
    /// Why this GPU cannot run FP8 GEMMs, or `Ok` where it can (compute capability 9.0 and
    /// later: Hopper's FP8 tensor cores, which cuBLASLt's TN FP8 GEMMs use).
    pub(super) fn fp8_supported(&self) -> Result<(), String> {
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

    /// `MatmulOps::prepare_fp8`: refuse an older GPU, and hold a workspace for `largest`
    /// (and for every extent asked before: the regions grow per dimension).
    pub(super) fn fp8_prepare(&self, largest: LinearExtent) -> BResult<usize> {
        self.fp8_supported().map_err(|reason| BackendError::Unavailable { backend: "cuda", reason })?;
        let mut cell = self.fp8_ws.borrow_mut();
        let ext = match cell.as_ref() {
            Some(ws) => LinearExtent {
                rows: ws.extent.rows.max(largest.rows),
                inputs: ws.extent.inputs.max(largest.inputs),
                outputs: ws.extent.outputs.max(largest.outputs),
                weight: ws.extent.weight.max(largest.weight),
            },
            None => largest,
        };
        if cell.as_ref().is_none_or(|ws| ws.extent != ext) {
            let layout = CudaFp8Workspace::new(ext);
            *cell = None; // freed in stream order
            let buf = self.alloc::<u8>(layout.bytes, "FP8 GEMM operands")?;
            *cell = Some(Fp8Ws { buf, extent: ext, layout });
        }
        Ok(cell.as_ref().map_or(0, |ws| ws.layout.bytes))
    }

    /// The workspace's pointers, checked to hold a layer of shape `s`.
    fn fp8_ws(&self, s: MatShape) -> BResult<WsPtrs> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else {
            return Err(bad(format!(
                "an FP8 GEMM (N={} C={} OC={}) before MatmulOps::prepare_fp8 reserved its operands (a bug)",
                s.n, s.c, s.oc
            )));
        };
        let p = WsPtrs { base: self.ptr(&ws.buf, 0), layout: ws.layout };
        if !p.fits(s, ws.extent) {
            return Err(bad(format!(
                "an FP8 GEMM N={} C={} OC={} is larger than the operands prepared for ({:?}) (a bug)",
                s.n, s.c, s.oc, ws.extent
            )));
        }
        Ok(p)
    }

    /// Zero the workspace's amax words (every slot) before the casts of one linear op.
    fn fp8_clear_amax(&self, ws: &WsPtrs) -> BResult<()> {
        // SAFETY: the three scale slots' 48 bytes lie at the start of the workspace (the
        // inverse scales are cleared too: each cast writes its own before its GEMM runs).
        let r = unsafe {
            cudarc::driver::result::memset_d8_async(ws.slot(ScaleSlot::Input), 0, 48, self.stream.cu_stream())
        };
        r.map_err(|e| self.err("zeroing the FP8 amax slots", e))
    }

    /// Quantize `x` (`rows × cols` bf16, row-major) to `fmt` with its current amax in `slot`:
    /// into `dst` as it is laid out and/or into `dst_t` transposed (`cols × rows`).
    ///
    /// # Safety
    /// `x` holds `rows·cols` bf16; `dst` and `dst_t` (16-byte aligned) as many bytes;
    /// `slot` is a workspace slot whose amax is zero.
    #[allow(clippy::too_many_arguments)] // one tensor's pointers, shape, format and slot
    unsafe fn fp8_quantize(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        fmt: Fp8Format,
        slot: u64,
        dst: Option<u64>,
        dst_t: Option<u64>,
    ) -> BResult<()> {
        let n = rows * cols;
        let ni = n as i64;
        let fmt_i = i32::from(fmt.is_e5m2());
        let f = self.f("fp8_amax_bf16")?;
        let mut lb = self.stream.launch_builder(f);
        // The slot's second word is its amax (the first, the inverse scale, 16-byte aligned).
        let amax = slot + 4;
        lb.arg(&amax).arg(&x).arg(&ni);
        // SAFETY: x holds n bf16 (the caller's promise); the amax is the slot's second word.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("fp8_amax_bf16", e))?;
        match dst_t {
            None => {
                let q = dst.expect("a destination");
                let f = self.f("fp8_cast_bf16")?;
                let mut lb = self.stream.launch_builder(f);
                lb.arg(&q).arg(&x).arg(&ni).arg(&slot).arg(&fmt_i);
                // SAFETY: q holds n bytes, x n bf16; the slot two words.
                unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
                    .map_err(|e| self.launch_err("fp8_cast_bf16", e))?;
            }
            Some(qt) => {
                let q = dst.unwrap_or(0);
                let (ri, ci) = (to_i32("rows", rows)?, to_i32("columns", cols)?);
                let grid = (cols.div_ceil(TILE) as u32, rows.div_ceil(TILE) as u32, 1);
                if grid.1 > 65_535 {
                    return Err(bad(format!("FP8 transposing cast: {rows} rows exceed the grid (64 × 65535)")));
                }
                let f = self.f("fp8_cast_transpose_bf16")?;
                let mut lb = self.stream.launch_builder(f);
                lb.arg(&q).arg(&qt).arg(&x).arg(&ri).arg(&ci).arg(&slot).arg(&fmt_i);
                // SAFETY: q (unless 0) and qt hold rows·cols bytes, x as many bf16; the slot two words.
                unsafe { lb.launch(cfg(grid, (256, 1, 1), 0)) }
                    .map_err(|e| self.launch_err("fp8_cast_transpose_bf16", e))?;
            }
        }
        Ok(())
    }

    /// The forward `out = inp · Wᵀ` (+ the epilogue's bias, GELU or residual) in FP8, for an
    /// eligible shape (`fp8::eligible`). `Ok(false)`, with nothing run, where cuBLASLt has no
    /// FP8 algorithm for this epilogue (callers of a fused variant then compose it).
    pub(super) fn fp8_fwd(&self, out: u64, inp: u64, w: u64, s: MatShape, epi: FwdEpilogue) -> BResult<bool> {
        let MatShape { n, c, oc } = s;
        let ws = self.fp8_ws(s)?;
        self.bind()?;
        let g = Gemm {
            transa: true,
            transb: false,
            m: oc,
            n,
            k: c,
            a: ws.w(),
            lda: c,
            b: ws.a(),
            ldb: c,
            d: out,
            ldd: oc,
            out: OutType::Bf16,
            beta: if epi.residual.is_some() { 1.0 } else { 0.0 },
            c: epi.residual,
            bias: epi.bias,
            act: if epi.gelu_pre.is_some() { Act::Gelu } else { Act::None },
            aux: epi.gelu_pre,
            fp8: Some(Fp8Gemm {
                a: Fp8Format::E4M3,
                b: Fp8Format::E4M3,
                a_scale: ws.inv(ScaleSlot::Weight),
                b_scale: ws.inv(ScaleSlot::Input),
                fast_accum: self.fp8_fast_accum,
            }),
        };
        let fused = epi.gelu_pre.is_some() || epi.residual.is_some();
        if fused && !self.lt.supports(&g) {
            return Ok(false);
        }
        self.fp8_clear_amax(&ws)?;
        // SAFETY: inp holds n·c and the weight oc·c bf16 (the callers checked); the
        // workspace's regions hold a layer of this shape (fp8_ws checked).
        unsafe {
            self.fp8_quantize(inp, n, c, Fp8Format::E4M3, ws.slot(ScaleSlot::Input), Some(ws.a()), None)?;
            self.fp8_quantize(w, oc, c, Fp8Format::E4M3, ws.slot(ScaleSlot::Weight), Some(ws.w()), None)?;
        }
        if fused {
            return self.lt.try_gemm(&g, self.lt_stream());
        }
        self.lt.gemm(&g, self.lt_stream())?;
        Ok(true)
    }

    /// The backward of a linear layer in FP8 for an eligible shape: `dinp = dout · W`
    /// (optionally `⊙ GELU'(pre)` in the epilogue), `dW (+)= doutᵀ · inp`, `dbias (+)= Σ dout`.
    /// `Ok(false)`, with nothing written, where the GELU' epilogue has no FP8 algorithm.
    pub(super) fn fp8_bwd(&self, ptr: BwdPtrs, s: MatShape, dgelu_pre: Option<u64>) -> BResult<bool> {
        let MatShape { n, c, oc } = s;
        let ws = self.fp8_ws(s)?;
        self.bind()?;
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        let dx = Gemm {
            transa: true,
            transb: false,
            m: c,
            n,
            k: oc,
            a: ws.w(),
            lda: oc,
            b: ws.a(),
            ldb: oc,
            d: ptr.dinp,
            ldd: c,
            out: OutType::Bf16,
            beta: 0.0,
            c: None,
            bias: None,
            act: if dgelu_pre.is_some() { Act::DGelu } else { Act::None },
            aux: dgelu_pre,
            fp8: Some(Fp8Gemm {
                a: e4,
                b: e5,
                a_scale: ws.inv(ScaleSlot::Weight),
                b_scale: ws.inv(ScaleSlot::Grad),
                fast_accum: false,
            }),
        };
        let dw = Gemm {
            transa: true,
            transb: false,
            m: c,
            n: oc,
            k: n,
            a: ws.a(),
            lda: n,
            b: ws.gt(),
            ldb: n,
            d: ptr.dw,
            ldd: c,
            out: OutType::F32,
            beta: if ptr.fresh { 0.0 } else { 1.0 },
            c: None,
            bias: None,
            act: Act::None,
            aux: None,
            fp8: Some(Fp8Gemm {
                a: e4,
                b: e5,
                a_scale: ws.inv(ScaleSlot::Input),
                b_scale: ws.inv(ScaleSlot::Grad),
                fast_accum: false,
            }),
        };
        if dgelu_pre.is_some() && !self.lt.supports(&dx) {
            return Ok(false);
        }
        let stream = self.lt_stream();
        self.fp8_clear_amax(&ws)?;
        // SAFETY: dout holds n·oc, the weight oc·c, inp n·c bf16 (bwd_ptrs checked); the
        // workspace's regions hold a layer of this shape (fp8_ws checked). The input's cast
        // overwrites region a (dY) only after the dX GEMM that reads it, in stream order.
        unsafe {
            self.fp8_quantize(ptr.dout, n, oc, e5, ws.slot(ScaleSlot::Grad), Some(ws.a()), Some(ws.gt()))?;
            self.fp8_quantize(ptr.w, oc, c, e4, ws.slot(ScaleSlot::Weight), None, Some(ws.w()))?;
            if dgelu_pre.is_some() {
                if !self.lt.try_gemm(&dx, stream)? {
                    return Ok(false);
                }
            } else {
                self.lt.gemm(&dx, stream)?;
            }
            self.fp8_quantize(ptr.inp, n, c, e4, ws.slot(ScaleSlot::Input), None, Some(ws.a()))?;
        }
        self.lt.gemm(&dw, stream)?;
        if let Some(db) = ptr.dbias {
            self.bias_grad(db, ptr.dout, n, oc, ptr.fresh)?;
        }
        Ok(true)
    }
}

impl CudaBackend {
    /// The casts one linear layer's FP8 GEMMs need, alone, on the workspace
    /// (`prepare_fp8` first): the forward's (input and weight, row-major) or the backward's
    /// (the output gradient both ways, the weight and the input transposed), for
    /// `gpu-timing fp8`'s split of the FP8 time into casts and GEMMs. `inp` holds n·c,
    /// `dout` n·oc and `params` from `w` oc·c bf16.
    pub fn fp8_casts_only(
        &self,
        inp: &CudaSlice<half::bf16>,
        dout: &CudaSlice<half::bf16>,
        params: &CudaSlice<half::bf16>,
        w: usize,
        s: MatShape,
        backward: bool,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let check = super::launch::check;
        check("fp8_casts_only inp", inp.len(), 0, n * c)?;
        check("fp8_casts_only dout", dout.len(), 0, n * oc)?;
        check("fp8_casts_only weight", params.len(), w, oc * c)?;
        if !crate::backend::fp8::eligible(s) {
            return Err(bad(format!("fp8_casts_only: N{n} C{c} OC{oc} is not FP8-eligible")));
        }
        let ws = self.fp8_ws(s)?;
        let (x, g, wp) = (self.ptr(inp, 0), self.ptr(dout, 0), self.ptr(params, w));
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        self.fp8_clear_amax(&ws)?;
        // SAFETY: the lengths are checked above, the workspace holds this shape (fp8_ws).
        unsafe {
            if backward {
                self.fp8_quantize(g, n, oc, e5, ws.slot(ScaleSlot::Grad), Some(ws.a()), Some(ws.gt()))?;
                self.fp8_quantize(wp, oc, c, e4, ws.slot(ScaleSlot::Weight), None, Some(ws.w()))?;
                self.fp8_quantize(x, n, c, e4, ws.slot(ScaleSlot::Input), None, Some(ws.a()))
            } else {
                self.fp8_quantize(x, n, c, e4, ws.slot(ScaleSlot::Input), Some(ws.a()), None)?;
                self.fp8_quantize(wp, oc, c, e4, ws.slot(ScaleSlot::Weight), Some(ws.w()), None)
            }
        }
    }
}

/// One tensor quantized by the kernels the FP8 GEMMs use, read back (`CudaBackend::fp8_cast_check`).
#[derive(Debug, Clone)]
pub struct Fp8Cast {
    /// The tensor's amax, as the amax kernel found it.
    pub amax: f32,
    /// The inverse scale the cast wrote for the GEMM (`1 / Fp8Format::scale(amax)`).
    pub inv_scale: f32,
    /// The codes, row-major as the input (`fp8_cast_bf16`).
    pub codes: Vec<u8>,
    /// The codes of the transposed tensor, `[cols, rows]` (`fp8_cast_transpose_bf16`).
    pub codes_t: Vec<u8>,
    /// The row-major codes the transposing cast wrote beside the transposed ones.
    pub codes_beside_t: Vec<u8>,
}

impl CudaBackend {
    /// `rows × cols` bf16 of `x` from element `off`, quantized to `fmt` by the FP8 GEMMs'
    /// kernels (amax, then each cast), and read back: what `tests/gpu_kernels.rs` checks
    /// against `backend/fp8.rs`. `rows` and `cols` multiples of 16 (the transposing cast's
    /// requirement). Allocates its own buffers: for checks, not for the training path.
    pub fn fp8_cast_check(
        &self,
        x: &CudaSlice<half::bf16>,
        off: usize,
        rows: usize,
        cols: usize,
        fmt: Fp8Format,
    ) -> BResult<Fp8Cast> {
        let n = rows * cols;
        super::launch::check("fp8_cast_check x", x.len(), off, n)?;
        if !(rows.is_multiple_of(16) && cols.is_multiple_of(16)) {
            return Err(bad(format!("fp8_cast_check: {rows} × {cols} is not a multiple of 16 both ways")));
        }
        let mut slot = self.alloc::<u32>(2, "FP8 check slot")?;
        let (mut q, mut qt, mut q2) =
            (self.alloc::<u8>(n, "FP8 check")?, self.alloc::<u8>(n, "FP8 check")?, self.alloc::<u8>(n, "FP8 check")?);
        let xp = self.ptr(x, off);
        let (sp, qp, qtp, q2p) =
            (self.ptr_mut(&mut slot, 0), self.ptr_mut(&mut q, 0), self.ptr_mut(&mut qt, 0), self.ptr_mut(&mut q2, 0));
        // SAFETY: x holds n bf16 from off (checked); q, qt, q2 n bytes each (256-byte
        // aligned allocations); the slot two zeroed words.
        unsafe {
            self.fp8_quantize(xp, rows, cols, fmt, sp, Some(qp), None)?;
            let r = cudarc::driver::result::memset_d8_async(sp + 4, 0, 4, self.stream.cu_stream());
            r.map_err(|e| self.err("zeroing the check slot", e))?;
            self.fp8_quantize(xp, rows, cols, fmt, sp, Some(q2p), Some(qtp))?;
        }
        let down = |b: &CudaSlice<u8>| self.stream.clone_dtoh(b).map_err(|e| self.err("reading FP8 codes", e));
        let words = self.stream.clone_dtoh(&slot).map_err(|e| self.err("reading the FP8 slot", e))?;
        Ok(Fp8Cast {
            amax: f32::from_bits(words[1]),
            inv_scale: f32::from_bits(words[0]),
            codes: down(&q)?,
            codes_t: down(&qt)?,
            codes_beside_t: down(&q2)?,
        })
    }
}
