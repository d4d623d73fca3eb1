//! Token embedding, plus learned positions where the model has them (GPT-2's `wte` and
//! `wpe`; Llama has no position table: RoPE rotates queries and keys instead).

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

pub trait EncoderOps: Device {
    /// `out[N,C] = wte[tokens] (+ wpe[t])`.
    fn encoder_fwd(
        &self,
        out: &mut Self::Buf,
        tokens: &Self::Tokens,
        p: Weights<'_, Self, EmbedLocs>,
        s: SeqShape,
    ) -> BResult<()>;
    /// `dwte[tokens] += dout` (`dwpe[t] += dout`); both written when `g.fresh`.
    fn encoder_bwd(
        &self,
        g: WeightGrads<'_, Self, EmbedLocs>,
        dout: &Self::Buf,
        tokens: &Self::Tokens,
        s: SeqShape,
    ) -> BResult<()>;
}
