//! Splitting one input file into documents, and naming the records that are not one.
//!
//! * `.txt`: by default the whole file is one document, except that the literal
//!   `<|endoftext|>` (the separator of llm.c's and tiktoken's text dumps) separates
//!   documents inside it; `--txt-docs line` makes every non-blank line a document,
//!   `--txt-docs paragraph` every run of non-blank lines (blank lines only separate).
//! * `.jsonl`: one JSON object per line, the text in `--text-field` (default `text`);
//!   blank lines are not records.
//! * `.parquet`: one row per document, the text in that column (`parquet_text.rs`).
//!
//! A record that cannot become a document is a [`Bad`] of one of three kinds:
//! malformed (a JSON line that does not parse, or whose field is missing, null or not a
//! string; a null Parquet value), invalid UTF-8, or empty (nothing but whitespace).
//! The caller counts, reports, skips or refuses them (`--on-bad`); nothing here drops one.

use std::fmt;
use std::io::{BufRead, Read};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Serialize;

use crate::error::{io_err, DataError, Result};
use crate::inputs::{Format, InputFile};

/// The separator of documents inside a `.txt` file (in the default mode).
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// The largest document read (1 GiB): past it the input must be split into documents.
pub const MAX_DOC_BYTES: usize = 1 << 30;

/// How a `.txt` file is cut into documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TxtDocs {
    /// The whole file (split at a literal `<|endoftext|>`).
    File,
    /// Every non-blank line.
    Line,
    /// Every run of non-blank lines.
    Paragraph,
}

/// Why a record is not a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BadKind {
    Malformed,
    InvalidUtf8,
    Empty,
}

impl BadKind {
    pub const ALL: [BadKind; 3] = [BadKind::Malformed, BadKind::InvalidUtf8, BadKind::Empty];

    /// Plural words for summaries: "3 malformed records".
    pub fn words(self) -> &'static str {
        match self {
            BadKind::Malformed => "malformed records",
            BadKind::InvalidUtf8 => "records of invalid UTF-8",
            BadKind::Empty => "empty documents",
        }
    }
}

/// A record that is not a document: where it is and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bad {
    pub kind: BadKind,
    /// `path: line 17`, `path: row 3`, `path: document 2 (byte 1234)`.
    pub at: String,
    pub why: String,
}

impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.at, self.why)
    }
}

/// One record of an input: a document's text, or why it is not one.
#[derive(Debug)]
pub enum Record {
    Doc(String),
    Bad(Bad),
}

/// How to read inputs.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    pub txt_docs: TxtDocs,
    /// The JSON field / Parquet column holding the text.
    pub text_field: String,
    /// Where a compressed `.parquet` is decompressed to while it is read (it needs random access).
    pub scratch_dir: std::path::PathBuf,
}

/// Every record of `file`, in order, to `emit` (which may stop the read with an error);
/// every byte taken from disk is added to `disk_bytes`.
pub fn read_file(
    file: &InputFile,
    opts: &ReadOptions,
    disk_bytes: Arc<AtomicU64>,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<()> {
    let shown = file.path.display().to_string();
    match file.format {
        Format::Parquet => crate::parquet_text::read_parquet(file, opts, disk_bytes, emit),
        Format::Jsonl => {
            let reader = crate::inputs::open_stream(file, disk_bytes)?;
            read_jsonl(reader, &shown, &opts.text_field, emit).map_err(|e| at_file(e, file))
        }
        Format::Txt => {
            let reader = crate::inputs::open_stream(file, disk_bytes)?;
            match opts.txt_docs {
                TxtDocs::File => read_txt_file(reader, &shown, emit),
                TxtDocs::Line | TxtDocs::Paragraph => read_txt_lines(reader, &shown, opts.txt_docs, emit),
            }
            .map_err(|e| at_file(e, file))
        }
    }
}

/// An I/O error from a stream (a corrupt `.gz` included) gains the file's name.
fn at_file(e: DataError, file: &InputFile) -> DataError {
    match e {
        DataError::Io { action: "read", path, source } if path.as_os_str().is_empty() => {
            DataError::Io { action: "read", path: file.path.clone(), source }
        }
        other => other,
    }
}

fn read_err(e: std::io::Error) -> DataError {
    io_err("read", "")(e)
}

/// A document from its bytes: invalid UTF-8 and blank text are [`Bad`].
fn classify(bytes: Vec<u8>, at: impl FnOnce() -> String) -> Record {
    match String::from_utf8(bytes) {
        Ok(text) if text.trim().is_empty() => {
            Record::Bad(Bad { kind: BadKind::Empty, at: at(), why: "no text (empty or whitespace only)".into() })
        }
        Ok(text) => Record::Doc(text),
        Err(e) => Record::Bad(Bad {
            kind: BadKind::InvalidUtf8,
            at: at(),
            why: format!("invalid UTF-8 at byte {} of it", e.utf8_error().valid_up_to()),
        }),
    }
}

fn too_large(shown: &str, at: &str, hint: &str) -> DataError {
    DataError::InvalidArgument(format!(
        "{shown}: {at} is larger than {} GiB, the largest document prepare-data reads; {hint}",
        MAX_DOC_BYTES >> 30
    ))
}

/// The whole stream as documents separated by [`ENDOFTEXT`]; a separator at the very start
/// or end (followed or preceded by whitespace only) does not make an empty document.
fn read_txt_file(
    mut r: Box<dyn BufRead + Send>,
    shown: &str,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<()> {
    let sep = ENDOFTEXT.as_bytes();
    let mut buf: Vec<u8> = Vec::new();
    let (mut doc, mut consumed, mut scan) = (0usize, 0u64, 0usize);
    let mut chunk = vec![0u8; 1 << 20];
    let mut eof = false;
    loop {
        // Emit every complete document in `buf`.
        while let Some(i) = find(&buf[scan..], sep).map(|i| i + scan) {
            let rest = buf.split_off(i + sep.len());
            let mut text = std::mem::replace(&mut buf, rest);
            text.truncate(i);
            let leading_blank = doc == 0 && text.iter().all(u8::is_ascii_whitespace);
            if !leading_blank {
                doc += 1;
                let start = consumed;
                emit(classify(text, || format!("{shown}: document {doc} (byte {start})")))?;
            }
            consumed += (i + sep.len()) as u64;
            scan = 0;
        }
        if eof {
            break;
        }
        scan = buf.len().saturating_sub(sep.len() - 1);
        let n = r.read(&mut chunk).map_err(read_err)?;
        if n == 0 {
            eof = true;
            continue;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_DOC_BYTES {
            return Err(too_large(
                shown,
                &format!("document {}", doc + 1),
                "make it several documents: --txt-docs line or paragraph, or <|endoftext|> between them",
            ));
        }
    }
    let trailing_blank = doc > 0 && buf.iter().all(u8::is_ascii_whitespace);
    if !trailing_blank {
        doc += 1;
        emit(classify(buf, || format!("{shown}: document {doc} (byte {consumed})")))?;
    }
    Ok(())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    // The separator starts with '<': jump between its occurrences.
    let first = needle[0];
    let mut from = 0;
    while let Some(p) = hay[from..].iter().position(|&b| b == first) {
        let i = from + p;
        if hay[i..].starts_with(needle) {
            return Some(i);
        }
        from = i + 1;
    }
    None
}

/// Read one line (with its terminator) of at most [`MAX_DOC_BYTES`]; false at the end.
fn next_line(r: &mut dyn BufRead, line: &mut Vec<u8>, shown: &str, number: u64, hint: &str) -> Result<bool> {
    line.clear();
    let n = r.take(MAX_DOC_BYTES as u64 + 1).read_until(b'\n', line).map_err(read_err)?;
    if line.len() > MAX_DOC_BYTES {
        return Err(too_large(shown, &format!("line {number}"), hint));
    }
    Ok(n > 0)
}

fn trim_newline(line: &mut Vec<u8>) {
    if line.last() == Some(&b'\n') {
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
    }
}

fn read_txt_lines(
    mut r: Box<dyn BufRead + Send>,
    shown: &str,
    mode: TxtDocs,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<()> {
    let mut line = Vec::new();
    let mut para: Vec<u8> = Vec::new();
    let (mut number, mut para_start) = (0u64, 0u64);
    let hint = "split it into lines";
    loop {
        let more = next_line(&mut *r, &mut line, shown, number + 1, hint)?;
        if more {
            number += 1;
        }
        let blank = !more || line.iter().all(u8::is_ascii_whitespace);
        match mode {
            TxtDocs::Line if more && !blank => {
                trim_newline(&mut line);
                let n = number;
                emit(classify(std::mem::take(&mut line), || format!("{shown}: line {n}")))?;
            }
            TxtDocs::Paragraph if !blank => {
                if para.is_empty() {
                    para_start = number;
                }
                para.extend_from_slice(&line);
                if para.len() > MAX_DOC_BYTES {
                    return Err(too_large(shown, &format!("the paragraph at line {para_start}"), hint));
                }
            }
            TxtDocs::Paragraph if !para.is_empty() => {
                trim_newline(&mut para);
                let n = para_start;
                emit(classify(std::mem::take(&mut para), || format!("{shown}: paragraph at line {n}")))?;
            }
            _ => {}
        }
        if !more {
            return Ok(());
        }
    }
}

fn read_jsonl(
    mut r: Box<dyn BufRead + Send>,
    shown: &str,
    field: &str,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<()> {
    let mut line = Vec::new();
    let mut number = 0u64;
    while next_line(&mut *r, &mut line, shown, number + 1, "a JSON line holds one document")? {
        number += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        trim_newline(&mut line);
        let at = || format!("{shown}: line {number}");
        let record = match std::str::from_utf8(&line) {
            Err(e) => Record::Bad(Bad {
                kind: BadKind::InvalidUtf8,
                at: at(),
                why: format!("invalid UTF-8 at byte {} of the line", e.valid_up_to()),
            }),
            Ok(text) => match parse_field(text, field) {
                Ok(Found::Text(t)) if t.trim().is_empty() => Record::Bad(Bad {
                    kind: BadKind::Empty,
                    at: at(),
                    why: format!("field {field:?} holds no text (empty or whitespace only)"),
                }),
                Ok(Found::Text(t)) => Record::Doc(t),
                Ok(Found::Missing) => {
                    Record::Bad(Bad { kind: BadKind::Malformed, at: at(), why: format!("no field {field:?}") })
                }
                Ok(Found::Other(kind)) => Record::Bad(Bad {
                    kind: BadKind::Malformed,
                    at: at(),
                    why: format!("field {field:?} is {kind}, not a string"),
                }),
                Err(e) => Record::Bad(Bad { kind: BadKind::Malformed, at: at(), why: format!("not JSON: {e}") }),
            },
        };
        emit(record)?;
    }
    Ok(())
}

/// What a JSON object holds under the text field.
#[derive(Debug, PartialEq)]
enum Found {
    Text(String),
    Missing,
    /// Another kind of value: "null", "a number", ...
    Other(&'static str),
}

/// The text field of one JSON object, without building the rest of it.
fn parse_field(line: &str, field: &str) -> std::result::Result<Found, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(line);
    let found = ObjectField(field).deserialize(&mut de)?;
    de.end()?;
    Ok(found)
}

struct ObjectField<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for ObjectField<'_> {
    type Value = Found;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Found, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ObjectField<'_> {
    type Value = Found;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Found, A::Error> {
        let mut found = Found::Missing;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == self.0 && found == Found::Missing {
                found = map.next_value_seed(TextValue)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// A value kept if it is a string, else named (and skipped).
struct TextValue;

impl<'de> DeserializeSeed<'de> for TextValue {
    type Value = Found;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Found, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextValue {
    type Value = Found;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Found, E> {
        Ok(Found::Text(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Found, E> {
        Ok(Found::Text(v))
    }
    fn visit_unit<E>(self) -> std::result::Result<Found, E> {
        Ok(Found::Other("null"))
    }
    fn visit_none<E>(self) -> std::result::Result<Found, E> {
        Ok(Found::Other("null"))
    }
    fn visit_bool<E>(self, _: bool) -> std::result::Result<Found, E> {
        Ok(Found::Other("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> std::result::Result<Found, E> {
        Ok(Found::Other("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> std::result::Result<Found, E> {
        Ok(Found::Other("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> std::result::Result<Found, E> {
        Ok(Found::Other("a number"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Found, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Found::Other("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Found, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Found::Other("an object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(
        bytes: &[u8],
        f: impl Fn(Box<dyn BufRead + Send>, &mut dyn FnMut(Record) -> Result<()>) -> Result<()>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let r: Box<dyn BufRead + Send> = Box::new(std::io::Cursor::new(bytes.to_vec()));
        f(r, &mut |rec| {
            out.push(match rec {
                Record::Doc(t) => format!("doc {t:?}"),
                Record::Bad(b) => format!("{:?} {} | {}", b.kind, b.at, b.why),
            });
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn txt_files_are_one_document_split_at_endoftext() {
        let read = |b: &[u8]| records(b, |r, e| read_txt_file(r, "f.txt", e));
        assert_eq!(read(b"just one\n"), ["doc \"just one\\n\""]);
        assert_eq!(read(b"a<|endoftext|>b<|endoftext|>"), ["doc \"a\"", "doc \"b\""]);
        assert_eq!(
            read(b"<|endoftext|>a<|endoftext|> \n<|endoftext|>b\n<|endoftext|>\n"),
            ["doc \"a\"", "Empty f.txt: document 2 (byte 27) | no text (empty or whitespace only)", "doc \"b\\n\"",]
        );
        assert_eq!(read(b""), ["Empty f.txt: document 1 (byte 0) | no text (empty or whitespace only)"]);
        let bad = read(b"ok<|endoftext|>caf\xe9");
        assert_eq!(bad[1], "InvalidUtf8 f.txt: document 2 (byte 15) | invalid UTF-8 at byte 3 of it");
        // A separator split across reads is still found.
        let long = format!("{}{ENDOFTEXT}{}", "x".repeat((1 << 20) - 5), "y");
        assert_eq!(read(long.as_bytes()).len(), 2);
    }

    #[test]
    fn lines_and_paragraphs() {
        let text = b"one\r\ntwo\n\n  \nthree\nfour\n\xff\n";
        let lines = records(text, |r, e| read_txt_lines(r, "f.txt", TxtDocs::Line, e));
        assert_eq!(lines[..4], ["doc \"one\"", "doc \"two\"", "doc \"three\"", "doc \"four\""]);
        assert_eq!(lines[4], "InvalidUtf8 f.txt: line 7 | invalid UTF-8 at byte 0 of it");
        let paras = records(text, |r, e| read_txt_lines(r, "f.txt", TxtDocs::Paragraph, e));
        assert_eq!(
            paras,
            ["doc \"one\\r\\ntwo\"", "InvalidUtf8 f.txt: paragraph at line 5 | invalid UTF-8 at byte 11 of it"]
        );
        let no_newline = records(b"a\n\nb", |r, e| read_txt_lines(r, "f.txt", TxtDocs::Paragraph, e));
        assert_eq!(no_newline, ["doc \"a\"", "doc \"b\""]);
    }

    #[test]
    fn jsonl_takes_one_field_and_names_every_bad_line() {
        let text = concat!(
            "{\"id\": 1, \"text\": \"first \\\"doc\\\"\", \"meta\": {\"text\": \"nested\"}}\n",
            "\n",
            "{\"body\": \"no text\"}\n",
            "{\"text\": 5}\n",
            "{\"text\": null}\n",
            "{\"text\": \"  \"}\n",
            "{\"text\": \"cut\n",
            "[1, 2]\n",
            "{\"text\": \"a\"} trailing\n",
            "{\"text\": [\"x\"], \"text\": \"second wins not\"}\n",
            "{\"text\":\"last\"}"
        );
        let got = records(text.as_bytes(), |r, e| read_jsonl(r, "f.jsonl", "text", e));
        assert_eq!(got[0], "doc \"first \\\"doc\\\"\"");
        assert_eq!(got[1], "Malformed f.jsonl: line 3 | no field \"text\"");
        assert_eq!(got[2], "Malformed f.jsonl: line 4 | field \"text\" is a number, not a string");
        assert_eq!(got[3], "Malformed f.jsonl: line 5 | field \"text\" is null, not a string");
        assert!(got[4].starts_with("Empty f.jsonl: line 6"), "{}", got[4]);
        assert!(got[5].starts_with("Malformed f.jsonl: line 7 | not JSON: EOF while parsing"), "{}", got[5]);
        assert!(got[6].starts_with("Malformed f.jsonl: line 8 | not JSON: invalid type: sequence"), "{}", got[6]);
        assert!(got[7].starts_with("Malformed f.jsonl: line 9 | not JSON: trailing characters"), "{}", got[7]);
        assert_eq!(got[8], "Malformed f.jsonl: line 10 | field \"text\" is an array, not a string");
        assert_eq!(got[9], "doc \"last\"");
        assert_eq!(got.len(), 10);
        let other = records(b"{\"body\": \"x\"}\n{\"text\": 1}", |r, e| read_jsonl(r, "f.jsonl", "body", e));
        assert_eq!(other[0], "doc \"x\"");
        let bad = records(b"{\"text\": \"caf\xe9\"}\n", |r, e| read_jsonl(r, "f.jsonl", "text", e));
        assert_eq!(bad, ["InvalidUtf8 f.jsonl: line 1 | invalid UTF-8 at byte 13 of the line"]);
    }
}
