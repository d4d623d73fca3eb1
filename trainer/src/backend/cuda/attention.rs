//! Causal self-attention on the GPU (twin of cpu/attention.rs; kernels in attention.cu and
//! one file per generation, `attention_simt.cu`, `attention_mma.cu`, `attention_wgmma.cu`,
//! each its own NVRTC module with `attention.cuh` (and the tensor-core ones
//! `attention_mma.cuh`) prepended: [`KERNELS`] and the three after it):
//! flash style, saving only the per-row log-sum-exp. Three families of kernels compute the
//! same function and save the same state: tensor-core (mma.sync) kernels for head sizes
//! 64, 80, 96 and 128; on Hopper (kernels built for sm_90a) wgmma kernels for 64 and 128;
//! and fp32 SIMT kernels for 32, 64 and 128 (the fallback for head size 32, and the
//! cross-check). Every family does grouped-query attention in place (key/value heads read
//! where they are, never repeated; see attention.cu), and every kernel comes twice: plain
//! causal, and within documents (`AttnInputs::docs`: the `*_docs` kernels, which skip the
//! key/query tiles no row of a block attends and mask the rest per element). RoPE, the
//! group's rotation of the query and key heads, is in rope.rs (kernels in rope.cu); the
//! `AttentionOps` impl here forwards to it.

use cudarc::driver::PushKernelArg;

use super::kernels::KernelFile;
use super::launch::{bad, cfg, check, to_i32, BLOCK};
use super::{CudaBackend, DeviceTokens};
use crate::backend::{AmaxSink, AttentionOps, AttnInputs, AttnShape, BResult};

/// Which attention kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionImpl {
    /// Tensor cores (bf16 operands, fp32 accumulation) for head sizes 64, 80, 96 and 128:
    /// the wgmma kernels where they exist (on Hopper, head sizes 64 and 128), mma.sync
    /// otherwise; the fp32 SIMT kernels (with a note on stderr) for 32. The default.
    TensorCore,
    /// The mma.sync kernels even where a wgmma one exists (the portable path, for
    /// cross-checks on Hopper).
    MmaSync,
    /// fp32 SIMT kernels where they exist (head sizes 32, 64, 128; the tensor-core
    /// kernels otherwise): the slower cross-check.
    Simt,
}

/// Query/key rows per tile, threads per SIMT block, and the padded row length (floats) of
/// a SIMT score tile: `TILE`, `NTHREADS`, `LDP` in the kernel files (`defines`).
const TILE: usize = 64;
const SIMT_THREADS: usize = 256;
const LDP: usize = 80;
/// Threads of a tensor-core block (4 warps of 16 query or key rows).
const MMA_THREADS: u32 = 128;

/// The three passes of attention: forward, the dK/dV backward, the dQ backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Fwd,
    Dkv,
    Dq,
}

/// A kernel family at a head size: fp32 SIMT, or tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Simt(usize),
    Mma(usize),
    /// The wgmma kernels (sm_90a).
    Wg(usize),
}

impl Variant {
    /// The kernel file of the family (`GEN_SIMT`, `GEN_MMA`, `GEN_WG`).
    const fn generation(self) -> usize {
        match self {
            Variant::Simt(_) => GEN_SIMT,
            Variant::Mma(_) => GEN_MMA,
            Variant::Wg(_) => GEN_WG,
        }
    }
}

/// The kernel generations, one file each.
const GEN_SIMT: usize = 0;
const GEN_MMA: usize = 1;
const GEN_WG: usize = 2;

/// Head sizes of each family.
const SIMT_HEAD_SIZES: [usize; 3] = [32, 64, 128];
const MMA_HEAD_SIZES: [usize; 4] = [64, 80, 96, 128];
/// Head sizes with wgmma kernels (every pass).
const WG_HEAD_SIZES: [usize; 2] = [64, 128];

/// Every attention kernel of a pass and variant: the one list of their names, plain and
/// within documents (`*_docs`: one more argument, the document starts).
const TABLE: [(Pass, Variant, &str, &str); 27] = [
    (Pass::Fwd, Variant::Simt(32), "attn_fwd_32", "attn_fwd_32_docs"),
    (Pass::Dkv, Variant::Simt(32), "attn_bwd_dkv_32", "attn_bwd_dkv_32_docs"),
    (Pass::Dq, Variant::Simt(32), "attn_bwd_dq_32", "attn_bwd_dq_32_docs"),
    (Pass::Fwd, Variant::Simt(64), "attn_fwd_64", "attn_fwd_64_docs"),
    (Pass::Dkv, Variant::Simt(64), "attn_bwd_dkv_64", "attn_bwd_dkv_64_docs"),
    (Pass::Dq, Variant::Simt(64), "attn_bwd_dq_64", "attn_bwd_dq_64_docs"),
    (Pass::Fwd, Variant::Simt(128), "attn_fwd_128", "attn_fwd_128_docs"),
    (Pass::Dkv, Variant::Simt(128), "attn_bwd_dkv_128", "attn_bwd_dkv_128_docs"),
    (Pass::Dq, Variant::Simt(128), "attn_bwd_dq_128", "attn_bwd_dq_128_docs"),
    (Pass::Fwd, Variant::Mma(64), "attn_fwd_mma64", "attn_fwd_mma64_docs"),
    (Pass::Dkv, Variant::Mma(64), "attn_bwd_dkv_mma64", "attn_bwd_dkv_mma64_docs"),
    (Pass::Dq, Variant::Mma(64), "attn_bwd_dq_mma64", "attn_bwd_dq_mma64_docs"),
    (Pass::Fwd, Variant::Mma(80), "attn_fwd_mma80", "attn_fwd_mma80_docs"),
    (Pass::Dkv, Variant::Mma(80), "attn_bwd_dkv_mma80", "attn_bwd_dkv_mma80_docs"),
    (Pass::Dq, Variant::Mma(80), "attn_bwd_dq_mma80", "attn_bwd_dq_mma80_docs"),
    (Pass::Fwd, Variant::Mma(96), "attn_fwd_mma96", "attn_fwd_mma96_docs"),
    (Pass::Dkv, Variant::Mma(96), "attn_bwd_dkv_mma96", "attn_bwd_dkv_mma96_docs"),
    (Pass::Dq, Variant::Mma(96), "attn_bwd_dq_mma96", "attn_bwd_dq_mma96_docs"),
    (Pass::Fwd, Variant::Mma(128), "attn_fwd_mma128", "attn_fwd_mma128_docs"),
    (Pass::Dkv, Variant::Mma(128), "attn_bwd_dkv_mma128", "attn_bwd_dkv_mma128_docs"),
    (Pass::Dq, Variant::Mma(128), "attn_bwd_dq_mma128", "attn_bwd_dq_mma128_docs"),
    (Pass::Fwd, Variant::Wg(64), "attn_fwd_wg64", "attn_fwd_wg64_docs"),
    (Pass::Fwd, Variant::Wg(128), "attn_fwd_wg128", "attn_fwd_wg128_docs"),
    (Pass::Dkv, Variant::Wg(64), "attn_bwd_dkv_wg64", "attn_bwd_dkv_wg64_docs"),
    (Pass::Dq, Variant::Wg(64), "attn_bwd_dq_wg64", "attn_bwd_dq_wg64_docs"),
    (Pass::Dkv, Variant::Wg(128), "attn_bwd_dkv_wg128", "attn_bwd_dkv_wg128_docs"),
    (Pass::Dq, Variant::Wg(128), "attn_bwd_dq_wg128", "attn_bwd_dq_wg128_docs"),
];

/// D = rowsum(dO ⊙ O), the backward's first kernel (the mma.sync and SIMT variants', and the
/// wgmma one's where dO or O is not 16-byte aligned; otherwise its dQ pass computes D, to
/// the bit, in `attention_wgmma.cu`'s `d_row_quad`): a warp a row, or (`BWD_D8`, where the head
/// size allows: [`bwd_d8_threads`]) 8 values a thread.
const BWD_D: &str = "attn_bwd_d";
const BWD_D8: &str = "attn_bwd_d8";
/// The sum of a split grouped dK/dV pass's partial sums (shared by every variant).
const DKV_REDUCE: &str = "attn_dkv_reduce";

/// The kernels of generation `generation` in `TABLE`, plain and within documents (`N`: twice
/// their count).
const fn function_names<const N: usize>(generation: usize) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut i, mut k) = (0, 0);
    while i < TABLE.len() {
        if TABLE[i].1.generation() == generation {
            out[k] = TABLE[i].2;
            out[k + 1] = TABLE[i].3;
            k += 2;
        }
        i += 1;
    }
    assert!(k == N, "every kernel of the generation named once");
    out
}
const SIMT_FUNCTIONS: [&str; 18] = function_names(GEN_SIMT);
const MMA_FUNCTIONS: [&str; 24] = function_names(GEN_MMA);
const WG_FUNCTIONS: [&str; 12] = function_names(GEN_WG);

/// Threads per (b, t, h) row of `attn_bwd_d8` (8 values each, 16-byte loads, the row's sum
/// by shuffles within a warp), where head size `hs` allows it: a multiple of 8 whose eighth
/// is a power of two up to 32.
fn bwd_d8_threads(hs: usize) -> Option<usize> {
    let per = hs / 8;
    (hs.is_multiple_of(8) && per.is_power_of_two() && per <= 32).then_some(per)
}

/// Every tiled kernel carves its tiles out of dynamic shared memory, more than 48 KiB at
/// the larger head sizes.
fn big_smem(name: &str) -> bool {
    TABLE.iter().any(|&(_, _, n, nd)| n == name || nd == name)
}

/// The constants the kernels share with this file.
fn defines() -> Vec<(&'static str, String)> {
    vec![("TILE", TILE.to_string()), ("NTHREADS", SIMT_THREADS.to_string()), ("LDP", LDP.to_string())]
}

/// The kernels every generation launches (D's, the split dK/dV pass's sum).
pub(super) const KERNELS: KernelFile = KernelFile {
    name: "attention",
    src: concat!(
        "#line 1 \"attention.cuh\"\n",
        include_str!("attention.cuh"),
        "#line 1 \"attention.cu\"\n",
        include_str!("attention.cu")
    ),
    functions: &[BWD_D, DKV_REDUCE, BWD_D8],
    big_smem,
    defines,
};

/// The fp32 SIMT kernels.
pub(super) const SIMT_KERNELS: KernelFile = KernelFile {
    name: "attention_simt",
    src: concat!(
        "#line 1 \"attention.cuh\"\n",
        include_str!("attention.cuh"),
        "#line 1 \"attention_simt.cu\"\n",
        include_str!("attention_simt.cu")
    ),
    functions: &SIMT_FUNCTIONS,
    big_smem,
    defines,
};

/// The tensor-core kernels on mma.sync.
pub(super) const MMA_KERNELS: KernelFile = KernelFile {
    name: "attention_mma",
    src: concat!(
        "#line 1 \"attention.cuh\"\n",
        include_str!("attention.cuh"),
        "#line 1 \"attention_mma.cuh\"\n",
        include_str!("attention_mma.cuh"),
        "#line 1 \"attention_mma.cu\"\n",
        include_str!("attention_mma.cu")
    ),
    functions: &MMA_FUNCTIONS,
    big_smem,
    defines,
};

/// The Hopper kernels on wgmma (built for sm_90a; elsewhere entry points that trap).
pub(super) const WGMMA_KERNELS: KernelFile = KernelFile {
    name: "attention_wgmma",
    src: concat!(
        "#line 1 \"attention.cuh\"\n",
        include_str!("attention.cuh"),
        "#line 1 \"attention_mma.cuh\"\n",
        include_str!("attention_mma.cuh"),
        "#line 1 \"attention_wgmma.cu\"\n",
        include_str!("attention_wgmma.cu")
    ),
    functions: &WG_FUNCTIONS,
    big_smem,
    defines,
};

/// The kernel of a pass and variant, plain or within documents.
fn kernel_name(pass: Pass, v: Variant, docs: bool) -> &'static str {
    TABLE
        .iter()
        .find(|&&(p, vv, ..)| p == pass && vv == v)
        .map(|&(_, _, n, nd)| if docs { nd } else { n })
        .expect("every variant has every pass")
}

/// m-tiles of 16 query rows per warp in the tensor-core forward (`FWD_MT` in attention_mma.cuh):
/// a block is 4 warps, 64 * this many query rows.
fn fwd_m_tiles(hs: usize) -> usize {
    if hs <= 64 {
        1
    } else {
        2
    }
}

/// Dynamic shared memory of a tensor-core kernel: its 64-row bf16 tiles, rows padded to
/// `hs + 8` (`Mg<HS>` in attention_mma.cuh). Four double-buffered stream tiles; each kernel
/// keeps its own rows (the forward's query tiles, the backward's key or query tile) in
/// tiles of their own where their fragments do not fit in registers (`FWD_Q_IN_REGS`:
/// one m-tile per warp, or head size 80 and below; `OWN_IN_REGS`: 64 and below). The
/// kernels trap if given less.
fn mma_smem(hs: usize, pass: Pass) -> usize {
    let own_tiles = match pass {
        Pass::Fwd if fwd_m_tiles(hs) == 1 || hs <= 80 => 0,
        Pass::Fwd => fwd_m_tiles(hs),
        Pass::Dkv | Pass::Dq if hs <= 64 => 0,
        Pass::Dkv | Pass::Dq => 2,
    };
    (4 + own_tiles) * TILE * (hs + 8) * 2
}

/// Dynamic shared memory of a SIMT kernel: its float tiles (rows padded to `hs + 4`), and
/// in the backward kernels within documents a query tile's document starts.
fn simt_smem(hs: usize, pass: Pass, docs: bool) -> usize {
    let ld = hs + 4;
    let starts = if docs { TILE } else { 0 };
    let floats = match pass {
        Pass::Fwd => 3 * TILE * ld + TILE * LDP,
        Pass::Dkv => 4 * TILE * ld + 2 * TILE * LDP + 2 * TILE + starts,
        Pass::Dq => 4 * TILE * ld + TILE * LDP + 2 * TILE + starts,
    };
    floats * 4
}

/// How many blocks share each (key tile, key/value head, batch) of the grouped dK/dV pass:
/// the smallest count that keeps the kernel's longest block within a quarter of the
/// ideal time per block slot, at most the group size `g`.
///
/// A grouped block does `g` times the work of a multi-head one (key tile `kt` of `nt` meets
/// `g (nt - kt)` query tiles) and there are `g` times fewer blocks: `pairs` (key/value
/// heads × batch) per key tile. Launched longest first (attention.cuh: `dkv_block`) onto
/// `slots` blocks at once (SMs × blocks per SM), the kernel takes about the longer of its
/// longest block, `g nt / s` query tiles, and the ideal `g pairs nt (nt + 1) / 2 / slots`.
/// Llama 3.2 1B shapes on an H100/H200 (T = 2048, B = 8, 8 key/value heads of 64, g = 4,
/// 396 slots of 3 wgmma blocks: 2,048 blocks): longest 128, ideal 341, no split. 8B shapes
/// (T = 4096, B = 1, 8 heads of 128, g = 4, 264 slots: 512 blocks): 256 against 252, no
/// split. With B = 1 at T = 2048 the longest block would be twice (8B) or three times (1B)
/// the ideal: split 2 or 3 ways. A split writes fp32 partial sums, `s` per key (2 HS floats
/// each), which `attn_dkv_reduce` adds in split order: no atomics, the same bits every run.
fn dkv_splits(g: usize, nt: usize, pairs: usize, slots: usize) -> usize {
    let ideal = (g * pairs * nt * (nt + 1)) as f64 / 2.0 / slots.max(1) as f64;
    (1..=g).find(|&s| (g * nt) as f64 / s as f64 <= 1.25 * ideal).unwrap_or(g)
}

impl CudaBackend {
    /// The kernel family for a shape, and the softmax scale.
    fn attn_variant(&self, s: AttnShape) -> BResult<(Variant, f32)> {
        if s.nh == 0 || !s.c.is_multiple_of(s.nh) {
            return Err(bad(format!("attention: C = {} is not a multiple of the {} heads", s.c, s.nh)));
        }
        if s.nkv == 0 || !s.nh.is_multiple_of(s.nkv) {
            return Err(bad(format!(
                "attention: {} query heads do not form groups over {} key/value heads \
                 (the key/value head count must divide the query head count)",
                s.nh, s.nkv
            )));
        }
        let hs = s.c / s.nh;
        let which = self.attention.get();
        let tc = which != AttentionImpl::Simt || !SIMT_HEAD_SIZES.contains(&hs);
        let v = if which == AttentionImpl::TensorCore && self.kernels.wgmma && WG_HEAD_SIZES.contains(&hs) {
            Variant::Wg(hs)
        } else if tc && MMA_HEAD_SIZES.contains(&hs) {
            Variant::Mma(hs)
        } else if SIMT_HEAD_SIZES.contains(&hs) {
            if tc && !self.attention_fallback_noted.replace(true) {
                crate::log_line!(
                    "note: head size {hs} has no tensor-core attention kernels (they cover {MMA_HEAD_SIZES:?}); \
                     using the fp32 SIMT kernels"
                );
            }
            Variant::Simt(hs)
        } else {
            return Err(bad(format!(
                "attention: head size {hs} (n_embd / n_head) is not supported by the CUDA kernels: \
                 tensor cores cover {MMA_HEAD_SIZES:?}, the SIMT kernels {SIMT_HEAD_SIZES:?}; \
                 choose model.n_head so that n_embd / n_head is one of them"
            )));
        };
        Ok((v, 1.0 / (hs as f32).sqrt()))
    }

    /// Splits of the dK/dV pass for a shape on kernel family `v`, plain or within documents
    /// (1: none). Within documents a block has at most the plain one's work (its key tile's
    /// documents bound it), so the same rule keeps it no worse than plain; the grid never
    /// depends on where documents start (a recorded CUDA graph replays it for every batch).
    fn dkv_split_for(&self, s: AttnShape, v: Variant, docs: bool) -> BResult<usize> {
        if s.nkv == s.nh {
            return Ok(1);
        }
        let g = s.group();
        if let Some(forced) = self.attention_dkv_split.get() {
            return Ok(forced.clamp(1, g));
        }
        let name = kernel_name(Pass::Dkv, v, docs);
        let known = self.attention_dkv_per_sm.borrow().iter().find(|&&(n, _)| n == name).map(|&(_, k)| k);
        let per_sm = match known {
            Some(k) => k,
            None => {
                let (threads, smem) = Self::attn_launch(v, Pass::Dkv, docs);
                // Blocks of the kernel per SM (1 if the driver cannot say: fewer splits, never wrong).
                let k = self
                    .f(name)?
                    .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
                    .unwrap_or(1)
                    .max(1) as usize;
                self.attention_dkv_per_sm.borrow_mut().push((name, k));
                k
            }
        };
        Ok(dkv_splits(g, s.t.div_ceil(TILE), s.nkv * s.b, self.sm_count * per_sm))
    }

    /// How many ways `attention_bwd` splits the dK/dV pass of a shape with the kernels in use,
    /// plain or within documents (1 for multi-head attention; see
    /// [`CudaBackend::set_attention_dkv_split`]).
    pub fn attention_dkv_splits(&self, s: AttnShape, docs: bool) -> BResult<usize> {
        let (v, _) = self.attn_variant(s)?;
        self.dkv_split_for(s, v, docs)
    }

    /// The device address of the document starts `AttnInputs::docs` (or `EmbedInputs::docs`)
    /// hands an op (0: none), after checking they were allocated as document starts of
    /// sequences of `t` (`TokenRole::DocStarts`, checked at upload) and cover `b·t` rows.
    pub(super) fn docs_ptr(&self, op: &str, docs: Option<&DeviceTokens>, b: usize, t: usize) -> BResult<u64> {
        let Some(d) = docs else { return Ok(0) };
        if d.doc_seq_len != Some(t) {
            return Err(bad(format!(
                "{op}: the document starts must be token ids allocated as TokenRole::DocStarts {{ seq_len: {} }} \
                 (these were allocated as {})",
                t,
                match d.doc_seq_len {
                    Some(t) => format!("document starts of T = {t}"),
                    None => "token ids or targets".to_string(),
                }
            )));
        }
        check(&format!("{op} document starts"), d.dev.len(), 0, b * t)?;
        Ok(self.ptr(&d.dev, 0))
    }

    /// Block size and dynamic shared memory of a pass, plain or within documents.
    fn attn_launch(v: Variant, pass: Pass, docs: bool) -> (u32, usize) {
        match (v, pass) {
            // The block's own tile(s) and two double-buffered streamed tiles of 64 rows, plus
            // room to align them to 1024 bytes: Q, K x 2, V x 3 (forward: V of the tile before
            // is still read while the next loads); K, V, Q x 2, dO x 2 (dK/dV); Q, dO, K x 2,
            // V x 2 (dQ).
            (Variant::Wg(hs), Pass::Fwd) => (MMA_THREADS, 6 * TILE * hs * 2 + 1024),
            (Variant::Wg(hs), Pass::Dkv | Pass::Dq) => (MMA_THREADS, 6 * TILE * hs * 2 + 1024),
            (Variant::Mma(hs), _) => (MMA_THREADS, mma_smem(hs, pass)),
            (Variant::Simt(hs), _) => (SIMT_THREADS as u32, simt_smem(hs, pass, docs)),
        }
    }
}

impl AttentionOps for CudaBackend {
    /// Only the per-row log-sum-exp: `B * NH * T` floats (the backward recomputes the
    /// probabilities).
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        s.b * s.nh * s.t
    }

    fn attention_fwd(
        &self,
        out: &mut Self::Buf,
        saved: &mut Self::F32,
        x: AttnInputs<'_, Self>,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let (v, scale) = self.attn_variant(s)?;
        let n = s.b * s.t;
        check("attention_fwd out", out.len(), 0, n * s.c)?;
        check("attention_fwd qkv", x.qkv.len(), 0, n * s.qkv_width())?;
        check("attention_fwd saved", saved.len(), 0, s.b * s.nh * s.t)?;
        let docs = self.docs_ptr("attention_fwd", x.docs, s.b, s.t)?;
        if n == 0 {
            return Ok(());
        }
        let name = kernel_name(Pass::Fwd, v, x.docs.is_some());
        let f = self.f(name)?;
        let (o, l, q) = (self.ptr_mut(out, 0), self.ptr_mut(saved, 0), self.ptr(x.qkv, 0));
        let (ti, nhi, nkvi) = (to_i32("T", s.t)?, to_i32("NH", s.nh)?, to_i32("NKV", s.nkv)?);
        // The Hopper kernels leave the output's amax as they write it; the others, a pass after.
        let fused = matches!(v, Variant::Wg(_));
        let am = if fused { self.fp8_sink(amax)? } else { 0 };
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&l).arg(&q).arg(&ti).arg(&nhi).arg(&nkvi).arg(&scale);
        if fused {
            lb.arg(&am);
        }
        if x.docs.is_some() {
            lb.arg(&docs);
        }
        let rows = match v {
            Variant::Mma(hs) => TILE * fwd_m_tiles(hs),
            Variant::Wg(_) | Variant::Simt(_) => TILE,
        };
        let grid = (s.t.div_ceil(rows) as u32, s.nh as u32, s.b as u32);
        let (threads, smem) = Self::attn_launch(v, Pass::Fwd, x.docs.is_some());
        // SAFETY: ranges checked above (the document starts: B·T of them, checked at upload,
        // and the kernels clamp them to their rows); the kernel guards rows >= T.
        unsafe { lb.launch(cfg(grid, (threads, 1, 1), smem)) }.map_err(|e| self.launch_err(name, e))?;
        match amax {
            Some(sink) if !fused => self.fp8_amax_into_sink(o, n * s.c, sink),
            _ => Ok(()),
        }
    }

    fn attention_bwd(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        x: AttnInputs<'_, Self>,
        out: &Self::Buf,
        saved: &Self::F32,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let (v, scale) = self.attn_variant(s)?;
        let hs = s.c / s.nh;
        let (n, w) = (s.b * s.t, s.qkv_width());
        check("attention_bwd dqkv", dqkv.len(), 0, n * w)?;
        check("attention_bwd dout", dout.len(), 0, n * s.c)?;
        check("attention_bwd qkv", x.qkv.len(), 0, n * w)?;
        check("attention_bwd out", out.len(), 0, n * s.c)?;
        check("attention_bwd saved", saved.len(), 0, s.b * s.nh * s.t)?;
        let docs = self.docs_ptr("attention_bwd", x.docs, s.b, s.t)?;
        let masked = x.docs.is_some();
        if n == 0 {
            return Ok(());
        }
        let (bi, ti, nhi, nkvi, hsi) =
            (to_i32("B", s.b)?, to_i32("T", s.t)?, to_i32("NH", s.nh)?, to_i32("NKV", s.nkv)?, hs as i32);
        // The dK/dV grid (attention.cuh: dkv_block): multi-head as the other passes; grouped
        // with the key tile slowest (longest blocks first), split `splits` ways per shape.
        let nt = s.t.div_ceil(TILE);
        let (dkv_threads, dkv_smem) = Self::attn_launch(v, Pass::Dkv, masked);
        let dkv_name = kernel_name(Pass::Dkv, v, masked);
        let splits = self.dkv_split_for(s, v, masked)?;
        let dkv_grid = if s.nkv == s.nh {
            (nt as u32, s.nh as u32, s.b as u32)
        } else {
            if nt > 65535 {
                return Err(bad(format!(
                    "attention: T = {} is too long for the grouped dK/dV grid (at most 65535 tiles of {TILE})",
                    s.t
                )));
            }
            ((s.nkv * s.b * splits) as u32, nt as u32, 1)
        };
        // Scratch: D (B NH T floats), then a split pass's partial sums (B NKV splits T 2HS).
        let rows = s.b * s.nh * s.t;
        let part_off = rows.next_multiple_of(64);
        let part_len = if splits > 1 { s.b * s.nkv * splits * s.t * 2 * hs } else { 0 };
        let d = self.scratch_f32(part_off + part_len)?;
        let part = d + (part_off * 4) as u64;
        let si = splits as i32;
        // The Hopper kernels take a sink and leave dqkv's amax as they write it (dK/dV only
        // without a split: a split's sums are written by attn_dkv_reduce); otherwise a pass after.
        let wg = matches!(v, Variant::Wg(_));
        let fused = wg && splits == 1;
        let am = if fused { self.fp8_sink(amax)? } else { 0 };
        let (dq, dy, q, o, l) =
            (self.ptr_mut(dqkv, 0), self.ptr(dout, 0), self.ptr(x.qkv, 0), self.ptr(out, 0), self.ptr(saved, 0));
        // 16-byte loads where the head size and the pointers allow them.
        let aligned = dy.is_multiple_of(16) && o.is_multiple_of(16);
        // The wgmma dQ pass computes D itself where it can load 16 bytes at a time (and then
        // runs first: the dK/dV pass reads D); otherwise D's own kernel runs first.
        let d_in_dq = wg && aligned;
        if !d_in_dq {
            let per = bwd_d8_threads(hs).filter(|_| aligned);
            let (name, grid) = match per {
                Some(per) => (BWD_D8, (rows * per).div_ceil(256)),
                None => (BWD_D, rows.div_ceil(8)),
            };
            let f = self.f(name)?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&d).arg(&dy).arg(&o).arg(&bi).arg(&ti).arg(&nhi).arg(&hsi);
            // SAFETY: one warp (attn_bwd_d8: HS / 8 threads) per (b, t, h) row, rows < B*T*NH; D
            // holds that many floats.
            unsafe { lb.launch(cfg((grid as u32, 1, 1), (256, 1, 1), 0)) }.map_err(|e| self.launch_err(name, e))?;
        }
        {
            let name = kernel_name(Pass::Dq, v, masked);
            let f = self.f(name)?;
            let mut lb = self.stream.launch_builder(f);
            let o_for_d: u64 = if d_in_dq { o } else { 0 };
            lb.arg(&dq).arg(&dy);
            if wg {
                lb.arg(&o_for_d);
            }
            lb.arg(&q).arg(&l).arg(&d).arg(&ti).arg(&nhi).arg(&nkvi).arg(&scale);
            if wg {
                lb.arg(&am);
            }
            if masked {
                lb.arg(&docs);
            }
            let (threads, smem) = Self::attn_launch(v, Pass::Dq, masked);
            let grid = (nt as u32, s.nh as u32, s.b as u32);
            // SAFETY: ranges checked above; dK/dV and dQ are disjoint columns of dqkv; with
            // o_for_d the kernel writes D's B*NH*T floats (the scratch holds them).
            unsafe { lb.launch(cfg(grid, (threads, 1, 1), smem)) }.map_err(|e| self.launch_err(name, e))?;
        }
        {
            let f = self.f(dkv_name)?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&dq).arg(&dy).arg(&q).arg(&l).arg(&d).arg(&ti).arg(&nhi).arg(&nkvi).arg(&scale).arg(&part).arg(&si);
            if wg {
                lb.arg(&am);
            }
            if masked {
                lb.arg(&docs);
            }
            // SAFETY: ranges checked above; the partial sums (splits > 1) fit the scratch.
            unsafe { lb.launch(cfg(dkv_grid, (dkv_threads, 1, 1), dkv_smem)) }
                .map_err(|e| self.launch_err(dkv_name, e))?;
        }
        if splits > 1 {
            let f = self.f(DKV_REDUCE)?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&dq).arg(&part).arg(&bi).arg(&ti).arg(&nhi).arg(&nkvi).arg(&hsi).arg(&si).arg(&scale);
            let grid = self.grid_for(s.b * s.nkv * s.t * hs / 2);
            // SAFETY: reads the B NKV splits T 2HS partial floats written above, writes the
            // dK/dV columns of dqkv (checked above).
            unsafe { lb.launch(cfg((grid, 1, 1), (BLOCK, 1, 1), 0)) }.map_err(|e| self.launch_err(DKV_REDUCE, e))?;
        }
        match amax {
            Some(sink) if !fused => self.fp8_amax_into_sink(dq, n * w, sink),
            _ => Ok(()),
        }
    }

    /// In rope.rs (kernels in rope.cu).
    fn rope_fwd(
        &self,
        qkv: &mut Self::Buf,
        table: &Self::F32,
        docs: Option<&DeviceTokens>,
        s: AttnShape,
    ) -> BResult<()> {
        let docs = self.docs_ptr("rope_fwd", docs, s.b, s.t)?;
        self.rope("rope_fwd", qkv, table, docs, s, false)
    }
    fn rope_bwd(
        &self,
        dqkv: &mut Self::Buf,
        table: &Self::F32,
        docs: Option<&DeviceTokens>,
        s: AttnShape,
    ) -> BResult<()> {
        let docs = self.docs_ptr("rope_bwd", docs, s.b, s.t)?;
        self.rope("rope_bwd", dqkv, table, docs, s, true)
    }
}

#[cfg(test)]
mod tests {
    use super::dkv_splits;

    #[test]
    fn grouped_dkv_splits_per_shape() {
        // Llama 3.2 1B (T 2048, B 8, 8 kv heads, g 4) and 8B (T 4096, B 1) on 132 SMs: no split.
        assert_eq!(dkv_splits(4, 32, 64, 396), 1);
        assert_eq!(dkv_splits(4, 64, 8, 264), 1);
        // B = 1 at T = 2048: the longest block would be 2x (8B) or 3x (1B) the ideal.
        assert_eq!(dkv_splits(4, 32, 8, 264), 2);
        assert_eq!(dkv_splits(4, 32, 8, 396), 3);
        // Never more than the group; a tiny grid takes every split.
        assert_eq!(dkv_splits(8, 2, 1, 264), 8);
        assert_eq!(dkv_splits(1, 2, 1, 264), 1);
    }
}
