//! Causal multi-head self-attention over a fused `qkv` projection, with grouped-query
//! attention (several query heads share one key/value head) and rotary position
//! embeddings (RoPE) applied in place to the projection's query and key heads; both
//! optionally document-aware: in a packed sequence (several documents in one row of `T`
//! tokens, `data.document_mask`), attention stops at document boundaries and positions
//! restart at each document's first token.

use super::{AmaxSink, BResult, Device};

/// Shapes for one attention call. A row of `qkv` holds the `nh` query heads, then the
/// `nkv` key heads, then the `nkv` value heads, `hs = c / nh` values each: query head `h`
/// reads key/value head `h / (nh / nkv)` (GPT-2 and other multi-head models: `nkv = nh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    /// Query width (and the output's): `nh · hs`.
    pub c: usize,
    pub nh: usize,
    /// Key/value heads; divides `nh`.
    pub nkv: usize,
}

impl AttnShape {
    /// Multi-head attention: as many key/value heads as query heads.
    pub fn mha(b: usize, t: usize, c: usize, nh: usize) -> AttnShape {
        AttnShape { b, t, c, nh, nkv: nh }
    }
    /// Head size.
    pub fn hs(&self) -> usize {
        self.c / self.nh
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.nh / self.nkv
    }
    /// Values per row of `qkv`: `(nh + 2·nkv) · hs`.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs()
    }
    /// Offset of the key heads (then the value heads, `nkv · hs` later) in a `qkv` row.
    pub fn k_off(&self) -> usize {
        self.c
    }
    pub fn v_off(&self) -> usize {
        self.c + self.nkv * self.hs()
    }
}

/// What attention reads: the fused projection, and where each row's document starts.
///
/// `docs` (document-aware attention, `data.document_mask`): for each of the `B·T` rows, the
/// position within its own sequence (`0..T`) at which its document starts, as token ids of
/// role [`TokenRole::DocStarts`](super::TokenRole::DocStarts) ([`doc_starts`] builds them from
/// document lengths; [`check_doc_starts`] says what is valid). The query at position `q`
/// then attends the keys `k` with `docs[q] <= k <= q`, so a packed sequence is attended as
/// its documents would be one by one. `None` is one document per sequence: plain causal
/// attention, the same bits as before the option existed (as is a buffer of zeros, up to
/// the kernels a backend picks for it).
pub struct AttnInputs<'a, B: Device + ?Sized> {
    pub qkv: &'a B::Buf,
    pub docs: Option<&'a B::Tokens>,
}

impl<B: Device + ?Sized> Clone for AttnInputs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Device + ?Sized> Copy for AttnInputs<'_, B> {}

pub trait AttentionOps: Device {
    /// fp32 elements of saved softmax state `attention_fwd` needs for backward.
    fn attention_saved_len(&self, s: AttnShape) -> usize;
    /// Causal self-attention, within documents where `x.docs` says ([`AttnInputs`]):
    /// `x.qkv[N, qkv_width]` → `out[N, C]`; the amax of `out` in `amax` where set (for the
    /// FP8 GEMM that reads it next: the output projection).
    fn attention_fwd(
        &self,
        out: &mut Self::Buf,
        saved: &mut Self::F32,
        x: AttnInputs<'_, Self>,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
    /// `dqkv` overwritten from `dout` (a key/value head's gradient sums its query heads');
    /// `x` as the forward had it; the amax of `dqkv` in `amax` where set (the qkv layer's
    /// output gradient, where nothing comes between: not under RoPE).
    #[allow(clippy::too_many_arguments)] // attention's own six, and where its output's amax goes
    fn attention_bwd(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        x: AttnInputs<'_, Self>,
        out: &Self::Buf,
        saved: &Self::F32,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;

    /// Rotary position embedding, in place on the query and key heads of `qkv` (values
    /// untouched): in every head, the pair of dimensions `(i, i + hs/2)` of the token at
    /// position `p` is rotated by the angle whose cosine and sine are `table[p·hs/2 + i]`
    /// and `table[T·hs/2 + p·hs/2 + i]` ([`rope_table`]). The position is the row's within
    /// its sequence, `p = row mod T`, or with `docs` ([`AttnInputs::docs`]) within its
    /// document, `p = row mod T - docs[row]`. This is Hugging Face transformers' convention
    /// (`rotate_half`), so their checkpoints load without permuting rows.
    fn rope_fwd(
        &self,
        qkv: &mut Self::Buf,
        table: &Self::F32,
        docs: Option<&Self::Tokens>,
        s: AttnShape,
    ) -> BResult<()>;
    /// The backward of [`AttentionOps::rope_fwd`]: the inverse rotation, in place on the
    /// query and key gradients of `dqkv`.
    fn rope_bwd(
        &self,
        dqkv: &mut Self::Buf,
        table: &Self::F32,
        docs: Option<&Self::Tokens>,
        s: AttnShape,
    ) -> BResult<()>;
}

/// Document starts ([`AttnInputs::docs`]) from the lengths of the documents packed one
/// after the other into `B` sequences of `t` tokens (`rows = B·t`; the last document may
/// run past the end, and rows past the lengths' sum are one more document). A document that crosses into the next
/// sequence continues there as a new document starting at position 0: sequences never see
/// each other.
pub fn doc_starts(lengths: &[usize], t: usize, rows: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(rows);
    let mut docs = lengths.iter().copied().filter(|&l| l > 0);
    let mut left = 0usize;
    let mut start = 0usize;
    for row in 0..rows {
        let p = row % t;
        if p == 0 {
            start = 0;
        }
        if left == 0 {
            left = docs.next().unwrap_or(usize::MAX);
            start = p;
        }
        out.push(start as u32);
        left -= 1;
    }
    out
}

/// Whether `docs` holds valid document starts for sequences of `t` tokens: at position 0 of
/// each sequence 0, and at position `p > 0` either the previous row's start (the same
/// document) or `p` (a new one). The error names the first row that breaks it.
pub fn check_doc_starts(docs: &[u32], t: usize) -> Result<(), String> {
    if t == 0 || !docs.len().is_multiple_of(t) {
        return Err(format!("{} document starts are not whole sequences of T = {t}", docs.len()));
    }
    for (row, &d) in docs.iter().enumerate() {
        let p = row % t;
        let ok = if p == 0 { d == 0 } else { d == docs[row - 1] || d as usize == p };
        if !ok {
            return Err(if p == 0 {
                format!("document start {d} at row {row}: a sequence's first token starts its document (0)")
            } else {
                format!(
                    "document start {d} at row {row} (position {p} of a sequence of {t}) is neither the previous \
                     row's start ({}) nor the row's own position",
                    docs[row - 1]
                )
            });
        }
    }
    Ok(())
}

/// Llama 3.1's frequency scaling of RoPE (`rope_scaling` with `rope_type = "llama3"`):
/// wavelengths longer than the original context / `low_freq_factor` are divided by
/// `factor`, shorter than it / `high_freq_factor` kept, and those between blended.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// The inverse frequencies `theta^(-2i/hs)`, `i < hs/2`, with the Llama 3.1 scaling, as
/// transformers (and Meta's reference code) hold them: in fp32.
pub fn rope_inv_freq(hs: usize, theta: f64, scaling: Option<RopeScaling>) -> Vec<f32> {
    let half = hs / 2;
    (0..half)
        .map(|i| {
            // transformers: 1 / base ** (arange(0, dim, 2).float() / dim)
            let f = 1.0 / theta.powf((2 * i) as f64 / hs as f64);
            let Some(sc) = scaling else { return f as f32 };
            let old = sc.original_max_position_embeddings as f64;
            let (low_wl, high_wl) = (old / sc.low_freq_factor, old / sc.high_freq_factor);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let scaled = if wavelen < high_wl {
                f
            } else if wavelen > low_wl {
                f / sc.factor
            } else {
                let smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
                (1.0 - smooth) * f / sc.factor + smooth * f
            };
            scaled as f32
        })
        .collect()
}

/// The table [`AttentionOps::rope_fwd`] reads: `cos` of the angle `p · inv_freq[i]` for
/// positions `p < t`, `[t, hs/2]`, then its `sin`, `[t, hs/2]`. The angle is an fp32
/// product, as transformers and Meta's code compute it (at position 8191 that product is
/// off by up to 5e-4 rad, and a pretrained model learned with it); its cosine and sine
/// are exact to f32.
pub fn rope_table(t: usize, hs: usize, theta: f64, scaling: Option<RopeScaling>) -> Vec<f32> {
    let inv = rope_inv_freq(hs, theta, scaling);
    let half = hs / 2;
    let mut out = vec![0.0f32; 2 * t * half];
    for p in 0..t {
        for (i, f) in inv.iter().enumerate() {
            let a = (p as f32 * f) as f64;
            out[p * half + i] = a.cos() as f32;
            out[t * half + p * half + i] = a.sin() as f32;
        }
    }
    out
}
