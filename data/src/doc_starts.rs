//! Where each token's document starts inside a packed training window, read from the
//! window's own input tokens (`data.document_mask`).
//!
//! Documents in shards from `prepare-data` (and in llm.c's) are end-of-text–prefixed:
//! each document's span begins with the end-of-text token ([`crate::docindex`]). So inside
//! a window a document starts at every position whose input is that token, and the
//! window's first position always starts one (the tail of a document begun before the
//! window, or a whole one). Reading the starts from the tokens, rather than from the
//! `.idx` sidecar, works for every shard (llm.c's have no sidecar), costs one pass over
//! the micro-batch, and gives the same starts wherever the window was sampled from.

/// For each of the `inputs.len()` rows (whole sequences of `t` tokens), the position
/// within its sequence at which its document starts, into `out` (cleared first): 0 at a
/// sequence's first token, the row's own position where its input is `eot`, and the row
/// before's start otherwise. The result passes the trainer's `check_doc_starts`.
///
/// # Panics
/// If `t` is 0 or `inputs` is not whole sequences of `t` (a caller's bug, not bad data).
pub fn doc_starts_from_eot(inputs: &[u32], t: usize, eot: u32, out: &mut Vec<u32>) {
    assert!(t > 0 && inputs.len().is_multiple_of(t), "{} inputs are not whole sequences of {t}", inputs.len());
    out.clear();
    out.reserve(inputs.len());
    for seq in inputs.chunks_exact(t) {
        let mut start = 0u32;
        for (p, &tok) in seq.iter().enumerate() {
            if tok == eot {
                start = p as u32;
            }
            out.push(start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_start_at_end_of_text_and_at_each_sequence() {
        const E: u32 = 9;
        let mut out = Vec::new();
        // Two sequences of 5: a document's tail then one beginning at 2; an end-of-text
        // first (still position 0), then another at 3 and one at 4.
        doc_starts_from_eot(&[1, 2, E, 3, 4, E, 5, 6, E, E], 5, E, &mut out);
        assert_eq!(out, vec![0, 0, 2, 2, 2, 0, 0, 0, 3, 4]);
        // No end-of-text: one document per sequence, as unmasked.
        doc_starts_from_eot(&[1, 2, 3, 4, 5, 6], 3, E, &mut out);
        assert_eq!(out, vec![0; 6]);
        doc_starts_from_eot(&[], 4, E, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    #[should_panic(expected = "not whole sequences")]
    fn a_partial_sequence_is_a_bug() {
        doc_starts_from_eot(&[1, 2, 3], 2, 0, &mut Vec::new());
    }
}
