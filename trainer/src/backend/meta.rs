//! The meta backend: buffers that hold only a length, operations that do nothing.
//!
//! Like PyTorch's `meta` device, it runs the real engine and model code paths — every
//! allocation, gather, release and reduction in the real order — without memory or
//! arithmetic, so [`crate::zero::plan`] can predict a rank's memory before launch. Every
//! op group is implemented here as a no-op (the fused-op hooks keep their defaults).

use super::{
    ActivationOps, AdamWOps, AdamWSegment, AdamWStep, AdamWTensors, AmaxSink, AttentionOps, AttnInputs, AttnShape,
    BResult, CrossEntropyOps, Device, ElemBytes, EmbedInputs, EmbedLocs, EncoderOps, Fp8Bytes, Fp8Layers, LayerNormOps,
    LinearLocs, LnSaved, LnStats, Loc, LossRows, MatShape, MatmulOps, MemoryOps, NormLocs, ReduceOps, RmsSaved, Rows,
    SeqShape, TokenRole, TransferOps, WeightGrads, Weights,
};
use super::{HostRead, HostValues, HostWrite};
use collectives::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};

/// A buffer that remembers only its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaBuf(pub usize);

// Host buffers of the meta backend hold no values (nothing reads them: `holds_values`).
impl HostRead for MetaBuf {
    fn values(&self) -> Result<&[f32], String> {
        Ok(&[])
    }
    fn writable(&mut self) -> Result<&mut [f32], String> {
        Ok(&mut [])
    }
}

impl HostWrite for MetaBuf {
    fn values_mut(&mut self) -> Result<HostValues<'_>, String> {
        Ok(HostValues::F32(&mut []))
    }
}

/// Counts as a backend with the element sizes of the backend it stands in for.
#[derive(Debug)]
pub struct MetaBackend {
    pub sizes: ElemBytes,
    /// fp32 elements of attention state per (b, t, nh) of the modelled backend.
    pub attention_saved: fn(AttnShape) -> usize,
    /// Bytes the modelled backend reserves for FP8 layers (`MatmulOps::prepare_fp8`).
    pub fp8: fn(&Fp8Layers) -> Fp8Bytes,
    /// How many buffers were allocated so far (proves the steady state allocates nothing).
    pub allocations: std::cell::Cell<usize>,
}

impl MetaBackend {
    pub fn new(
        sizes: ElemBytes,
        attention_saved: fn(AttnShape) -> usize,
        fp8: fn(&Fp8Layers) -> Fp8Bytes,
    ) -> MetaBackend {
        MetaBackend { sizes, attention_saved, fp8, allocations: std::cell::Cell::new(0) }
    }
    fn counted(&self, n: usize) -> BResult<MetaBuf> {
        self.allocations.set(self.allocations.get() + 1);
        Ok(MetaBuf(n))
    }
}

impl Device for MetaBackend {
    type Buf = MetaBuf;
    type Grad = MetaBuf;
    type F32 = MetaBuf;
    type Tokens = MetaBuf;
    fn name(&self) -> String {
        "meta".into()
    }
    fn elem_bytes(&self) -> ElemBytes {
        self.sizes
    }
    fn synchronize(&self) -> BResult<()> {
        Ok(())
    }
}

impl MemoryOps for MetaBackend {
    fn alloc_buf(&self, n: usize, _: &str) -> BResult<MetaBuf> {
        self.counted(n)
    }
    fn alloc_grad(&self, n: usize, _: &str) -> BResult<MetaBuf> {
        self.counted(n)
    }
    fn alloc_f32(&self, n: usize, _: &str) -> BResult<MetaBuf> {
        self.counted(n)
    }
    fn alloc_tokens(&self, n: usize, _: TokenRole) -> BResult<MetaBuf> {
        self.counted(n)
    }
    fn upload_tokens(&self, _: &[u32], _: &mut MetaBuf) -> BResult<()> {
        Ok(())
    }
    fn upload_buf(&self, _: &[f32], _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn upload_f32(&self, _: &[f32], _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn download_f32(&self, _: &MetaBuf, at: Loc) -> BResult<Vec<f32>> {
        Ok(vec![0.0; at.len])
    }
    fn download_buf(&self, _: &MetaBuf, at: Loc) -> BResult<Vec<f32>> {
        Ok(vec![0.0; at.len])
    }
    fn download_grad(&self, _: &MetaBuf, at: Loc) -> BResult<Vec<f32>> {
        Ok(vec![0.0; at.len])
    }
    fn cast_to_buf(&self, _: &mut MetaBuf, _: usize, _: &MetaBuf, _: Loc) -> BResult<()> {
        Ok(())
    }
    fn zero_buf(&self, _: &mut MetaBuf, _: Loc) -> BResult<()> {
        Ok(())
    }
    fn zero_grad(&self, _: &mut MetaBuf, _: Loc) -> BResult<()> {
        Ok(())
    }
    fn add_grad(&self, _: &mut MetaBuf, _: usize, _: &MetaBuf, _: Loc) -> BResult<()> {
        Ok(())
    }
    fn copy_buf(&self, _: &mut MetaBuf, _: usize, _: &MetaBuf, _: Loc) -> BResult<()> {
        Ok(())
    }
}

impl EncoderOps for MetaBackend {
    fn encoder_fwd(
        &self,
        _: &mut MetaBuf,
        _: EmbedInputs<'_, Self>,
        _: Weights<'_, Self, EmbedLocs>,
        _: SeqShape,
    ) -> BResult<()> {
        Ok(())
    }
    fn encoder_bwd(
        &self,
        _: WeightGrads<'_, Self, EmbedLocs>,
        _: &MetaBuf,
        _: EmbedInputs<'_, Self>,
        _: SeqShape,
    ) -> BResult<()> {
        Ok(())
    }
}

impl LayerNormOps for MetaBackend {
    fn layernorm_fwd(
        &self,
        _: &mut MetaBuf,
        _: LnStats<'_, Self>,
        _: &MetaBuf,
        _: Weights<'_, Self, NormLocs>,
        _: Rows,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn layernorm_stats(
        &self,
        _: LnStats<'_, Self>,
        _: &MetaBuf,
        _: Weights<'_, Self, NormLocs>,
        _: Rows,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn rmsnorm_stats(
        &self,
        _: &mut MetaBuf,
        _: &MetaBuf,
        _: Weights<'_, Self, Loc>,
        _: Rows,
        _: f32,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn layernorm_bwd(
        &self,
        _: &mut MetaBuf,
        _: WeightGrads<'_, Self, NormLocs>,
        _: &MetaBuf,
        _: LnSaved<'_, Self>,
        _: Weights<'_, Self, NormLocs>,
        _: Rows,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn rmsnorm_fwd(
        &self,
        _: &mut MetaBuf,
        _: &mut MetaBuf,
        _: &MetaBuf,
        _: Weights<'_, Self, Loc>,
        _: Rows,
        _: f32,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn rmsnorm_bwd(
        &self,
        _: &mut MetaBuf,
        _: WeightGrads<'_, Self, Loc>,
        _: &MetaBuf,
        _: RmsSaved<'_, Self>,
        _: Weights<'_, Self, Loc>,
        _: Rows,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
}

impl MatmulOps for MetaBackend {
    fn prepare_fp8(&self, layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        self.allocations.set(self.allocations.get() + 1);
        Ok((self.fp8)(layers))
    }
    fn fp8_amax_into(&self, _: &MetaBuf, _: usize, _: AmaxSink) -> BResult<()> {
        Ok(())
    }
    fn matmul_fwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: Weights<'_, Self, LinearLocs>, _: MatShape) -> BResult<()> {
        Ok(())
    }
    fn matmul_bwd(
        &self,
        _: &mut MetaBuf,
        _: WeightGrads<'_, Self, LinearLocs>,
        _: &MetaBuf,
        _: &MetaBuf,
        _: Weights<'_, Self, LinearLocs>,
        _: MatShape,
    ) -> BResult<()> {
        Ok(())
    }
    fn matmul_fwd_of_norm(
        &self,
        _: &mut MetaBuf,
        _: &MetaBuf,
        _: crate::backend::NormOfInput<'_, Self>,
        _: Weights<'_, Self, LinearLocs>,
        _: MatShape,
    ) -> BResult<()> {
        Ok(())
    }
    fn matmul_residual_fwd_of_gelu(
        &self,
        _: &mut MetaBuf,
        _: &MetaBuf,
        _: &MetaBuf,
        _: Weights<'_, Self, LinearLocs>,
        _: MatShape,
        _: &mut MetaBuf,
    ) -> BResult<()> {
        Ok(())
    }
    fn matmul_bwd_kept(
        &self,
        _: &mut MetaBuf,
        _: WeightGrads<'_, Self, LinearLocs>,
        _: &MetaBuf,
        _: Weights<'_, Self, LinearLocs>,
        _: MatShape,
    ) -> BResult<()> {
        Ok(())
    }
}

impl super::Fp8GatherOps for MetaBackend {
    fn amax_parts(&self, _: &MetaBuf, parts: &[Loc]) -> BResult<Vec<f32>> {
        Ok(vec![0.0; parts.len()])
    }
    fn fp8_gather_pack(
        &self,
        _: &super::Fp8GatherLayout,
        _: usize,
        _: &MetaBuf,
        _: &MetaBuf,
        _: &mut MetaBuf,
    ) -> BResult<()> {
        Ok(())
    }
    fn fp8_gather_unpack(&self, _: &super::Fp8GatherLayout, _: &MetaBuf, _: &MetaBuf, _: &mut MetaBuf) -> BResult<()> {
        Ok(())
    }
}

impl AttentionOps for MetaBackend {
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        (self.attention_saved)(s)
    }
    fn attention_fwd(
        &self,
        _: &mut MetaBuf,
        _: &mut MetaBuf,
        _: AttnInputs<'_, Self>,
        _: AttnShape,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn attention_bwd(
        &self,
        _: &mut MetaBuf,
        _: &MetaBuf,
        _: AttnInputs<'_, Self>,
        _: &MetaBuf,
        _: &MetaBuf,
        _: AttnShape,
        _: Option<AmaxSink>,
    ) -> BResult<()> {
        Ok(())
    }
    fn rope_fwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: Option<&MetaBuf>, _: AttnShape) -> BResult<()> {
        Ok(())
    }
    fn rope_bwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: Option<&MetaBuf>, _: AttnShape) -> BResult<()> {
        Ok(())
    }
}

impl ActivationOps for MetaBackend {
    fn gelu_fwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: usize, _: Option<AmaxSink>) -> BResult<()> {
        Ok(())
    }
    fn gelu_bwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: usize, _: Option<AmaxSink>) -> BResult<()> {
        Ok(())
    }
    fn residual_fwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: &MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn swiglu_fwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: Rows, _: Option<AmaxSink>) -> BResult<()> {
        Ok(())
    }
    fn swiglu_bwd(&self, _: &mut MetaBuf, _: &MetaBuf, _: &MetaBuf, _: Rows, _: Option<AmaxSink>) -> BResult<()> {
        Ok(())
    }
}

impl CrossEntropyOps for MetaBackend {
    fn cross_entropy_fwd_bwd(&self, _: &mut MetaBuf, _: &mut MetaBuf, _: &MetaBuf, _: LossRows, _: f32) -> BResult<()> {
        Ok(())
    }
}

impl ReduceOps for MetaBackend {
    fn grad_sumsq_into(&self, _: &MetaBuf, _: Loc, _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn sum_into(&self, _: &MetaBuf, _: Loc, _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
}

impl AdamWOps for MetaBackend {
    fn adamw(&self, _: AdamWTensors<'_, Self>, _: &[AdamWSegment], _: AdamWStep) -> BResult<()> {
        Ok(())
    }
}

/// The planner only counts bytes: nothing to record.
impl crate::backend::GraphOps for MetaBackend {
    type Graph = ();
}

impl TransferOps for MetaBackend {
    type HostF32 = MetaBuf;
    type HostBuf = MetaBuf;
    type Event = ();
    fn holds_values(&self) -> bool {
        false
    }
    fn alloc_host_f32(&self, n: usize, _: &str) -> BResult<MetaBuf> {
        Ok(MetaBuf(n))
    }
    fn alloc_host_buf(&self, n: usize, _: &str) -> BResult<MetaBuf> {
        Ok(MetaBuf(n))
    }
    fn grad_to_host(&self, _: &MetaBuf, _: Loc, _: &mut MetaBuf) -> BResult<()> {
        Ok(())
    }
    fn f32_to_host(&self, _: &MetaBuf, _: Loc, _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn buf_from_host(&self, _: &MetaBuf, _: Loc, _: &mut MetaBuf, _: usize) -> BResult<()> {
        Ok(())
    }
    fn wait_event(&self, _: &()) -> BResult<()> {
        Ok(())
    }
    fn order_compute_after(&self, _: &()) -> BResult<()> {
        Ok(())
    }
}

/// A communicator for one modelled rank of a `world`-rank job: collectives check sizes
/// like the real ones and move nothing.
#[derive(Debug, Clone, Copy)]
pub struct MetaComm {
    pub rank: usize,
    pub world: usize,
}

impl Group for MetaComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}

impl Communicator<MetaBuf> for MetaComm {
    fn all_gather(&mut self, send: &MetaBuf, recv: &mut MetaBuf) -> Result<(), CommError> {
        check(send.0 * self.world == recv.0, "all_gather", self.world, send.0, recv.0)
    }
    fn reduce_scatter(&mut self, send: &MetaBuf, recv: &mut MetaBuf, _: ReduceOp) -> Result<(), CommError> {
        check(recv.0 * self.world == send.0, "reduce_scatter", self.world, send.0, recv.0)
    }
    fn all_reduce(&mut self, _: &mut MetaBuf, _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut MetaBuf, _: usize) -> Result<(), CommError> {
        Ok(())
    }
}

impl AllGatherInPlace<MetaBuf> for MetaComm {
    fn all_gather_in_place_start(&mut self, buf: &mut MetaBuf) -> Result<Pending, CommError> {
        check(buf.0.is_multiple_of(self.world), "all_gather_in_place", self.world, buf.0, buf.0)?;
        Ok(Pending::DONE)
    }
}

impl Communicator<[f32]> for MetaComm {
    fn all_gather(&mut self, _: &[f32], _: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn reduce_scatter(&mut self, _: &[f32], _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn all_reduce(&mut self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut [f32], _: usize) -> Result<(), CommError> {
        Ok(())
    }
}

fn check(ok: bool, op: &'static str, world: usize, send: usize, recv: usize) -> Result<(), CommError> {
    if ok {
        Ok(())
    } else {
        Err(CommError::BadSize { op, world, detail: format!("send {send} / recv {recv} elements") })
    }
}
