//! `data.document_mask` on the training side: which token id starts a document in the
//! data ([`end_of_text`]), and each micro-batch's document starts ([`DocumentMask`]),
//! which the models hand to attention, RoPE and GPT-2's learned positions.
//!
//! Documents in shards from `prepare-data` and llm.c's scripts begin with the end-of-text
//! token, so a row's document starts at the last end-of-text input at or before it in its
//! sequence, or at the sequence's first token ([`data::doc_starts_from_eot`]).

use crate::config::Config;
use crate::model::MicroBatch;
use crate::TrainError;
use data::Dataset;
use std::path::Path;

/// GPT-2's end-of-text id, assumed for shards without a tokenizer record when the model
/// has GPT-2's vocabulary.
pub const GPT2_EOT: u32 = data::EOT_TOKEN as u32;
/// The vocabulary sizes taken as GPT-2's: its 50257 ids, padded up to 50304 at most
/// (the padding the configs use for faster GEMMs).
pub const GPT2_VOCAB_SIZES: std::ops::RangeInclusive<usize> = data::GPT2_VOCAB..=50304;

/// The end-of-text id that begins the documents of `dataset` when `data.document_mask` is
/// on (`None` when it is off): the shards' tokenizer record's (`prepare-data` writes one;
/// the built-in corpus is GPT-2's, 50256). Shards without a record (llm.c's, older ones)
/// get GPT-2's 50256 only when `model.vocab_size` is GPT-2's; otherwise the mask is refused,
/// naming why, rather than guessing where documents start.
pub fn end_of_text(cfg: &Config, dataset: &Dataset, data_path: &Path) -> Result<Option<u32>, TrainError> {
    if !cfg.data.document_mask {
        return Ok(None);
    }
    if let Some(info) = dataset.tokenizer()? {
        return Ok(Some(info.eot_id));
    }
    let v = cfg.model.vocab_size;
    if GPT2_VOCAB_SIZES.contains(&v) {
        return Ok(Some(GPT2_EOT));
    }
    Err(TrainError::Invalid(format!(
        "data.document_mask = true needs the data's end-of-text token, which starts each document, but the {} \
         shards of {} carry no tokenizer record (llm.c's or older shards) and model.vocab_size = {v} is not GPT-2's \
         ({} to {}), so GPT-2's {GPT2_EOT} cannot be assumed: re-create the shards with `launcher prepare-data \
         INPUT... OUT_DIR --tokenizer PATH/tokenizer.json`, which records it, or set data.document_mask = false",
        dataset.split(),
        data_path.display(),
        GPT2_VOCAB_SIZES.start(),
        GPT2_VOCAB_SIZES.end(),
    )))
}

/// Each micro-batch's document starts, made from its inputs when masking is on, in a buffer
/// reused from one micro-batch to the next.
#[derive(Debug, Clone)]
pub struct DocumentMask {
    /// The end-of-text id (`None`: masking off).
    eot: Option<u32>,
    seq_len: usize,
    starts: Vec<u32>,
}

impl DocumentMask {
    /// Starts of sequences of `seq_len` tokens, documents beginning at `eot` ([`end_of_text`]).
    pub fn new(eot: Option<u32>, seq_len: usize) -> DocumentMask {
        DocumentMask { eot, seq_len, starts: Vec::new() }
    }

    /// Whether documents are masked.
    pub fn on(&self) -> bool {
        self.eot.is_some()
    }

    /// The micro-batch of `inputs` and `targets`, with their document starts when masking
    /// is on (made here, from `inputs`).
    pub fn batch<'a>(&'a mut self, inputs: &'a [u32], targets: &'a [u32]) -> MicroBatch<'a> {
        let docs = self.eot.map(|eot| {
            data::doc_starts_from_eot(inputs, self.seq_len, eot, &mut self.starts);
            &self.starts[..]
        });
        MicroBatch { inputs, targets, docs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check_doc_starts;

    #[test]
    fn starts_come_from_the_end_of_text_inputs() {
        let mut m = DocumentMask::new(Some(7), 4);
        let (x, y) = ([1u32, 7, 2, 7, 3, 4, 7, 5], [0u32; 8]);
        let b = m.batch(&x, &y);
        let docs = b.docs.expect("masking is on");
        assert_eq!(docs, &[0, 1, 1, 3, 0, 0, 2, 2]);
        check_doc_starts(docs, 4).expect("valid starts");
        let mut off = DocumentMask::new(None, 4);
        assert!(off.batch(&x, &y).docs.is_none() && !off.on());
    }
}
