//! One micro-batch as a model takes it ([`MicroBatch`]: input ids, targets and, with
//! `data.document_mask`, where each row's document starts), and the token buffers every
//! family keeps for it ([`BatchTokens`]).
//!
//! The buffers are allocated once, with the activations, and each micro-step's ids are
//! uploaded into them: their device addresses never change, so a recorded CUDA graph
//! replays with the new values (the trainer uploads before each replay).

use crate::backend::{BResult, Backend, BackendError, Device, EmbedInputs, TokenRole};
use crate::zero::{Category, MemoryLedger};

/// One micro-batch of `B` sequences of `T` tokens: `B·T` input ids, their next-token
/// targets, and with document masking each row's document start (`AttnInputs::docs`;
/// `trainer::documents` makes them from the inputs).
#[derive(Debug, Clone, Copy)]
pub struct MicroBatch<'a> {
    pub inputs: &'a [u32],
    pub targets: &'a [u32],
    pub docs: Option<&'a [u32]>,
}

impl<'a> MicroBatch<'a> {
    /// One document per sequence (no document masking).
    pub fn plain(inputs: &'a [u32], targets: &'a [u32]) -> MicroBatch<'a> {
        MicroBatch { inputs, targets, docs: None }
    }
}

/// A model's input ids and, when it masks documents, their document starts, on the device.
pub struct BatchTokens<B: Device> {
    pub inputs: B::Tokens,
    pub docs: Option<B::Tokens>,
}

impl<B: Backend> BatchTokens<B> {
    /// Buffers for `b` sequences of `t` tokens, document starts too if `document_mask`;
    /// 4 bytes per token each, counted in `ledger`.
    pub fn new(be: &B, b: usize, t: usize, document_mask: bool, ledger: &mut MemoryLedger) -> BResult<Self> {
        let n = b * t;
        ledger.alloc(Category::Workspace, n * 4);
        let inputs = be.alloc_tokens(n, TokenRole::Inputs)?;
        let docs = if document_mask {
            ledger.alloc(Category::Workspace, n * 4);
            Some(be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?)
        } else {
            None
        };
        Ok(BatchTokens { inputs, docs })
    }

    /// Upload `batch`'s input ids and document starts (the model uploads the targets).
    /// A model built with document masking needs the starts, one built without refuses them.
    pub fn upload(&mut self, be: &B, batch: &MicroBatch<'_>) -> BResult<()> {
        be.upload_tokens(batch.inputs, &mut self.inputs)?;
        match (&mut self.docs, batch.docs) {
            (Some(buf), Some(docs)) => be.upload_tokens(docs, buf),
            (None, None) => Ok(()),
            (mine, _) => Err(BackendError::Device(format!(
                "the model was built {} document masking but the micro-batch {} document starts (a bug: \
                 ModelOptions::document_mask and the trainer's data.document_mask disagree)",
                if mine.is_some() { "with" } else { "without" },
                if mine.is_some() { "has no" } else { "has" },
            ))),
        }
    }

    /// The embedding's view: ids and document starts.
    pub fn embed(&self) -> EmbedInputs<'_, B> {
        EmbedInputs { tokens: &self.inputs, docs: self.docs.as_ref() }
    }
}
