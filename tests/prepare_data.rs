//! `data::prepare` end to end on small inputs: every input kind and compression gives the
//! same documents, the text field, bad records under both policies, `u16` and `u32`
//! shards (the latter read by llm.c's Llama 3 loading rules), document offsets across
//! shards, the validation split by documents, appending, and a refused run writing nothing.

#[path = "common/wordlevel.rs"]
mod wordlevel;

use data::{
    DataError, Dataset, Existing, Ids, OnBad, PrepareOptions, PrepareProgress, Split, TokenShard, TokenizerSpec,
    TxtDocs, Width,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Compression as Codec;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

fn docs() -> Vec<String> {
    (0..40)
        .map(|i| {
            format!("Document {i}: the fox counted {} apples, café ünï 🦀, and gave {} to the owl.", i * 7 % 13, i % 5)
        })
        .collect()
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).expect("gzip");
    e.finish().expect("gzip")
}

fn zst(bytes: &[u8]) -> Vec<u8> {
    zstd::encode_all(bytes, 3).expect("zstd")
}

fn jsonl(texts: &[String], field: &str) -> Vec<u8> {
    texts.iter().map(|t| serde_json::json!({ "id": 1, field: t }).to_string() + "\n").collect::<String>().into_bytes()
}

fn parquet(path: &Path, column: &str, rows: &[Option<&[u8]>]) {
    let schema =
        Arc::new(parse_message_type(&format!("message d {{ OPTIONAL BYTE_ARRAY {column} (UTF8); }}")).expect("schema"));
    let props = Arc::new(WriterProperties::builder().set_compression(Codec::SNAPPY).build());
    let mut w = SerializedFileWriter::new(std::fs::File::create(path).expect("create"), schema, props).expect("writer");
    for chunk in rows.chunks(7) {
        let mut rg = w.next_row_group().expect("row group");
        let defs: Vec<i16> = chunk.iter().map(|r| i16::from(r.is_some())).collect();
        let vals: Vec<ByteArray> = chunk.iter().flatten().map(|b| ByteArray::from(b.to_vec())).collect();
        let mut c = rg.next_column().expect("column").expect("column");
        c.typed::<ByteArrayType>().write_batch(&vals, Some(&defs), None).expect("write");
        c.close().expect("close");
        rg.close().expect("close");
    }
    w.close().expect("close");
}

fn opts(name: &str) -> PrepareOptions {
    let mut o = PrepareOptions::new(name);
    o.val_fraction = 0.0;
    o
}

fn run(inputs: &[PathBuf], out: &Path, o: &PrepareOptions) -> data::error::Result<data::PrepareSummary> {
    data::prepare(inputs, out, o, &PrepareProgress::default())
}

/// Every document of a split, in order, as its ids (each begins with the separator).
fn documents_of(dir: &Path, split: Split) -> Vec<Vec<u32>> {
    let ds = Dataset::open(dir, split).expect("split");
    let mut docs: Vec<Vec<u32>> = Vec::new();
    for s in ds.shards() {
        let starts = s.doc_starts().expect("prepare-data writes a document index");
        let ids: Vec<u32> = s.ids().iter().collect();
        let first = starts.first().map_or(ids.len(), |&o| o as usize);
        if first > 0 {
            docs.last_mut().expect("a continuation follows a document").extend_from_slice(&ids[..first]);
        }
        for (k, &o) in starts.iter().enumerate() {
            let end = starts.get(k + 1).map_or(ids.len(), |&e| e as usize);
            docs.push(ids[o as usize..end].to_vec());
        }
    }
    docs
}

fn decode(doc: &[u32]) -> String {
    assert_eq!(doc[0], 50256, "every document begins with <|endoftext|>");
    data::text::detokenize(&doc[1..]).expect("decode")
}

#[test]
fn every_input_kind_and_compression_gives_the_same_documents() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = &dir.path().join("in");
    std::fs::create_dir_all(d).expect("mkdir");
    let texts = docs();
    let lines = texts.join("\n") + "\n";
    let js = jsonl(&texts, "text");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("a.txt", lines.clone().into_bytes()),
        ("b.txt.gz", gz(lines.as_bytes())),
        ("c.txt.zst", zst(lines.as_bytes())),
        ("d.jsonl", js.clone()),
        ("e.jsonl.gz", gz(&js)),
        ("f.jsonl.zst", zst(&js)),
    ];
    for (name, bytes) in &files {
        std::fs::write(d.join(name), bytes).expect("write");
    }
    let rows: Vec<Option<&[u8]>> = texts.iter().map(|t| Some(t.as_bytes())).collect();
    parquet(&d.join("g.parquet"), "text", &rows);
    let pq = std::fs::read(d.join("g.parquet")).expect("read");
    std::fs::write(d.join("h.parquet.gz"), gz(&pq)).expect("write");

    for name in ["a.txt", "b.txt.gz", "c.txt.zst", "d.jsonl", "e.jsonl.gz", "f.jsonl.zst", "g.parquet", "h.parquet.gz"]
    {
        let out = dir.path().join(format!("out-{name}"));
        let mut o = opts("x");
        o.txt_docs = TxtDocs::Line;
        let sum = run(&[d.join(name)], &out, &o).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((sum.documents, sum.bad.total()), (40, 0), "{name}");
        let got: Vec<String> = documents_of(&out, Split::Train).iter().map(|doc| decode(doc)).collect();
        assert_eq!(got, texts, "{name}");
        let left: Vec<_> = std::fs::read_dir(&out).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert!(left.iter().all(|n| !n.to_string_lossy().starts_with('.')), "{name}: no staging left: {left:?}");
    }

    // A directory of them all: every file once, in path order; a file of another kind is skipped and said.
    std::fs::write(d.join("notes.md"), "not an input").expect("write");
    let all = dir.path().join("all");
    let sum = run(&[d.to_owned()], &all, &opts("all")).expect("directory");
    assert_eq!((sum.input_files, sum.documents), (8, 3 + 5 * 40), "a .txt file is one document by default");
    assert_eq!(sum.skipped_files, [d.join("notes.md")]);
    assert!(sum.to_string().contains("not read: 1 file(s)"), "{sum}");
}

#[test]
fn the_text_field_names_the_json_field_and_the_parquet_column() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let texts = docs();
    std::fs::write(d.join("a.jsonl"), jsonl(&texts[..5], "body")).expect("write");
    let rows: Vec<Option<&[u8]>> = texts[5..9].iter().map(|t| Some(t.as_bytes())).collect();
    parquet(&d.join("b.parquet"), "content", &rows);
    let mut o = opts("f");
    o.text_field = "body".into();
    let sum = run(&[d.join("a.jsonl")], &d.join("o1"), &o).expect("body");
    assert_eq!(sum.documents, 5);
    o.text_field = "content".into();
    let sum = run(&[d.join("b.parquet")], &d.join("o2"), &o).expect("content");
    assert_eq!(sum.documents, 4);
    // The default field is missing from every line: all malformed, and no document is an error.
    let e = run(&[d.join("a.jsonl")], &d.join("o3"), &opts("f")).unwrap_err();
    assert!(matches!(e, DataError::NoDocuments { .. }), "{e}");
    assert!(e.to_string().contains("5 malformed records"), "{e}");
    let e = run(&[d.join("b.parquet")], &d.join("o4"), &opts("f")).unwrap_err();
    assert!(e.to_string().contains("no top-level column \"text\"") && e.to_string().contains("content"), "{e}");
}

#[test]
fn bad_records_are_counted_and_skipped_or_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let mut bytes = jsonl(&docs()[..3], "text");
    bytes.extend_from_slice(b"{\"text\": \"cut\n{\"text\": \"caf\xe9\"}\n{\"text\": \"   \"}\n{\"other\": 1}\n");
    bytes.extend_from_slice(&jsonl(&docs()[3..4], "text"));
    std::fs::write(d.join("bad.jsonl"), &bytes).expect("write");

    let sum = run(&[d.join("bad.jsonl")], &d.join("skip"), &opts("b")).expect("skip");
    assert_eq!(sum.documents, 4);
    assert_eq!((sum.bad.malformed, sum.bad.invalid_utf8, sum.bad.empty), (2, 1, 1));
    let text = sum.to_string();
    assert!(text.contains("skipped 2 malformed records, 1 record of invalid UTF-8, 1 empty document"), "{text}");
    assert!(text.contains("bad.jsonl: line 4: not JSON") && text.contains("line 7: no field \"text\""), "{text}");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("skip/dataset.json")).expect("record")).expect("json");
    assert_eq!(record["sources"][0]["bad"]["malformed"], 2);
    assert_eq!(record["sources"][0]["bad"]["examples"].as_array().map(Vec::len), Some(4));
    assert_eq!(record["sources"][0]["options"]["on_bad"], "skip");

    let mut o = opts("b");
    o.on_bad = OnBad::Refuse;
    let out = d.join("refuse");
    let e = run(&[d.join("bad.jsonl")], &out, &o).unwrap_err();
    assert!(matches!(e, DataError::BadRecord { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("bad.jsonl: line 4") && msg.contains("nothing was written") && msg.contains("--on-bad skip"),
        "{msg}"
    );
    assert!(!out.exists(), "a refused run leaves nothing, not even the directory it would have made");

    // An empty .txt is an empty document: refused under refuse, and no document at all under skip.
    std::fs::write(d.join("empty.txt"), " \n").expect("write");
    assert!(run(&[d.join("empty.txt")], &d.join("e1"), &o).unwrap_err().to_string().contains("empty"));
    let e = run(&[d.join("empty.txt")], &d.join("e2"), &opts("e")).unwrap_err();
    assert!(e.to_string().contains("hold no document") && e.to_string().contains("1 empty document"), "{e}");
}

/// llm.c's `train_llama3.py::_load_data_shard`: magic 20240801, version 7, then exactly
/// `header[2]` uint32 ids.
fn llmc_load_llama3_shard(path: &Path) -> Vec<u32> {
    let bytes = std::fs::read(path).expect("read");
    let header: Vec<i32> = bytes[..1024].chunks(4).map(|b| i32::from_le_bytes(b.try_into().expect("4"))).collect();
    assert_eq!(header[0], 20240801, "magic number mismatch in the data .bin file");
    assert_eq!(header[1], 7, "unsupported version");
    let tokens: Vec<u32> = bytes[1024..].chunks(4).map(|b| u32::from_le_bytes(b.try_into().expect("4"))).collect();
    assert_eq!(tokens.len(), header[2] as usize, "number of tokens read does not match header?");
    tokens
}

#[test]
fn large_vocabularies_write_u32_shards_in_llm_c_llama_3_layout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("tokenizer.json"), wordlevel::wordlevel(70_000)).expect("write");
    std::fs::write(d.join("in.txt"), "w3 w65536 w69999\n\nw2 w2 nothere\n").expect("write");
    let mut o = opts("big");
    o.tokenizer = TokenizerSpec::File(d.join("tokenizer.json"));
    o.txt_docs = TxtDocs::Paragraph;
    o.shard_tokens = 4;
    let sum = run(&[d.join("in.txt")], &d.join("out"), &o).expect("prepare");
    assert_eq!((sum.tokenizer.vocab_size, sum.tokenizer.eot_id, sum.documents), (70_000, 1, 2));
    let mut all = Vec::new();
    for f in &sum.files {
        let s = TokenShard::open(f).expect("open");
        assert_eq!(s.width(), Width::U32);
        assert_eq!(s.info().map(|i| i.vocab_size), Some(70_000));
        let by_llmc = llmc_load_llama3_shard(f);
        assert_eq!(s.ids(), Ids::U32(&by_llmc), "we and llm.c's rules read the same ids");
        all.extend(by_llmc);
    }
    assert_eq!(all, [1, 3, 65536, 69999, 1, 2, 2, 0]);
    assert_eq!(documents_of(&d.join("out"), Split::Train), [vec![1, 3, 65536, 69999], vec![1, 2, 2, 0]]);
    assert_eq!(Dataset::open(d.join("out"), Split::Train).expect("open").max_token(), 69999);
    // Appending GPT-2 text to these shards is refused: the ids would mean other text.
    let e = run(&[d.join("in.txt")], &d.join("out"), &PrepareOptions { existing: Existing::Append, ..opts("gpt") })
        .unwrap_err();
    assert!(matches!(e, DataError::TokenizerMismatch { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.json") && e.to_string().contains("gpt2"), "{e}");
}

#[test]
fn documents_are_indexed_across_shards_and_the_split_takes_every_tenth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let texts: Vec<String> = (0..100).map(|i| format!("doc {i} {}", "word ".repeat(i % 7))).collect();
    std::fs::write(d.join("in.jsonl"), jsonl(&texts, "text")).expect("write");
    let mut o = opts("s");
    o.val_fraction = 0.1;
    o.shard_tokens = 7;
    let sum = run(&[d.join("in.jsonl")], &d.join("out"), &o).expect("prepare");
    assert_eq!((sum.documents, sum.val_documents), (100, 10));
    assert!(sum.files.len() > 20, "small shards: documents span them");
    let val: Vec<String> = documents_of(&d.join("out"), Split::Val).iter().map(|doc| decode(doc)).collect();
    let train: Vec<String> = documents_of(&d.join("out"), Split::Train).iter().map(|doc| decode(doc)).collect();
    let want_val: Vec<String> = (0..100).filter(|i| i % 10 == 9).map(|i| texts[i].clone()).collect();
    let want_train: Vec<String> = (0..100).filter(|i| i % 10 != 9).map(|i| texts[i].clone()).collect();
    assert_eq!((val, train), (want_val, want_train));
    assert_eq!(sum.val_tokens + sum.train_tokens, sum.total_tokens);
    for i in 0..1000u64 {
        let f = 0.37;
        let before = (0..i).filter(|&k| data::prepare::is_val_document(k, f)).count() as f64;
        assert!((before - (i as f64 * f).floor()).abs() < 1e-9, "exactly floor(n f) of the first n");
    }
    // The same inputs again are refused when appended; other inputs are added as a source.
    let again = PrepareOptions { existing: Existing::Append, ..opts("t") };
    let e = run(&[d.join("in.jsonl")], &d.join("out"), &again).unwrap_err();
    assert!(matches!(e, DataError::AlreadyPrepared { .. }), "{e}");
    std::fs::write(d.join("more.txt"), "more text").expect("write");
    let sum = run(&[d.join("more.txt")], &d.join("out"), &again).expect("append");
    assert_eq!(sum.sources, 2);
}

#[test]
fn shards_without_a_record_still_read_and_get_one_at_the_first_append() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    // As llm.c or an older prepare-data wrote them: u16, no record, no index.
    data::write_shard(out.join("old_train_000000.bin"), &[15496, 995, 50256, 15496]).expect("write");
    let ds = Dataset::open(&out, Split::Train).expect("open");
    assert!(ds.tokenizer().expect("one tokenizer").is_none() && ds.shards()[0].doc_starts().is_none());
    assert_eq!(ds.max_token(), 50256);
    std::fs::write(dir.path().join("new.txt"), "Hello world").expect("write");
    let o = PrepareOptions { existing: Existing::Append, ..opts("new") };
    run(&[dir.path().join("new.txt")], &out, &o).expect("append beside old shards");
    let ds = Dataset::open(&out, Split::Train).expect("open");
    assert_eq!(ds.shards().len(), 2);
    assert_eq!(ds.tokenizer().expect("one").map(|t| t.tokenizer.as_str()), Some("gpt2"));
}
