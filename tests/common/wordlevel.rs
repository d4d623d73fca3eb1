//! A small Hugging Face `tokenizer.json` written by the tests themselves (nothing is
//! downloaded), shared by tests/launcher.rs and tests/prepare_data.rs (which belong to
//! different crates, so this file is included by path rather than through `common`).

/// A WordLevel tokenizer.json of `n` words `w0`, `w1`, ... with `<|endoftext|>` as word 1.
pub fn wordlevel(n: usize) -> String {
    let mut vocab = serde_json::Map::new();
    for i in 0..n {
        let w = if i == 1 { "<|endoftext|>".to_string() } else { format!("w{i}") };
        vocab.insert(w, serde_json::json!(i));
    }
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 1, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    })
    .to_string()
}
