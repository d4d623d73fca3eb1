//! Token embedding, plus learned positions where the model has them (GPT-2's `wte` and
//! `wpe`; Llama has no position table: RoPE rotates queries and keys instead), the
//! positions optionally within documents (`data.document_mask`).

use super::{BResult, Device, Loc, WeightGrads, Weights};

/// The token table `[V, C]` and the position table `[T_max, C]`, if any, in a flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedLocs {
    pub wte: Loc,
    pub wpe: Option<Loc>,
}

/// `b` sequences of `t` tokens, `c` channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
}

/// What the embedding reads: the token ids, and where each row's document starts
/// ([`AttnInputs::docs`](super::AttnInputs::docs), `data.document_mask`): with them a
/// learned position is the row's position within its document, `p = row mod T - docs[row]`,
/// as if each document began its own sequence; without them `p = row mod T`.
pub struct EmbedInputs<'a, B: Device + ?Sized> {
    pub tokens: &'a B::Tokens,
    pub docs: Option<&'a B::Tokens>,
}

impl<B: Device + ?Sized> Clone for EmbedInputs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Device + ?Sized> Copy for EmbedInputs<'_, B> {}

pub trait EncoderOps: Device {
    /// `out[N,C] = wte[tokens] (+ wpe[p])`, `p` the row's position ([`EmbedInputs`]).
    fn encoder_fwd(
        &self,
        out: &mut Self::Buf,
        x: EmbedInputs<'_, Self>,
        p: Weights<'_, Self, EmbedLocs>,
        s: SeqShape,
    ) -> BResult<()>;
    /// `dwte[tokens] += dout` (`dwpe[p] += dout`); both written when `g.fresh`. `x` as the
    /// forward had it.
    fn encoder_bwd(
        &self,
        g: WeightGrads<'_, Self, EmbedLocs>,
        dout: &Self::Buf,
        x: EmbedInputs<'_, Self>,
        s: SeqShape,
    ) -> BResult<()>;
}
