//! The shape of a linear layer's GEMM, a leaf that the matmul and FP8 op groups both name
//! (FP8's per-layer decisions take it without importing the matmul group).

/// `n` rows of `c` inputs to `oc` outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatShape {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
}
