//! The text column of a Parquet file, a document per row, read row group by row group
//! (memory stays at about one row group's column chunk) with the `parquet` crate's column
//! reader: no Arrow, which would cost minutes of build for nothing used here.
//!
//! The column is the top-level field named `--text-field` (default `text`), of Parquet's
//! byte-array type (strings). A null is a malformed record; its UTF-8 is checked per value.
//! Page compression inside the file (Snappy, Zstandard, gzip) is handled by the reader; a
//! file compressed as a whole (`.parquet.gz`, `.parquet.zst`) is first decompressed to a
//! scratch file, because Parquet is read from its end (the footer) backwards.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::file::reader::{FileReader, SerializedFileReader};

use crate::documents::{Bad, BadKind, ReadOptions, Record};
use crate::error::{io_err, DataError, Result};
use crate::inputs::{Compression, InputFile};

/// Values read per call.
const BATCH: usize = 1024;

pub(crate) fn read_parquet(
    file: &InputFile,
    opts: &ReadOptions,
    disk_bytes: Arc<AtomicU64>,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<()> {
    match file.compression {
        Compression::None => {
            let f = File::open(&file.path).map_err(io_err("open", &file.path))?;
            let accounted = read_rows(f, file, opts, &disk_bytes, emit)?;
            // The footer and page headers: the rest of the file, so progress ends at its size.
            disk_bytes.fetch_add(file.bytes.saturating_sub(accounted), Ordering::Relaxed);
            Ok(())
        }
        Compression::Gzip | Compression::Zstd => {
            let scratch = opts.scratch_dir.join(format!(".parquet-{}", crate::shard::unique_suffix()));
            let result = (|| {
                let mut stream = crate::inputs::open_stream(file, disk_bytes.clone())?;
                let mut out = File::create(&scratch).map_err(io_err("create the scratch file", &scratch))?;
                std::io::copy(&mut stream, &mut out).map_err(|e| DataError::Io {
                    action: "decompress",
                    path: file.path.clone(),
                    source: e,
                })?;
                let f = File::open(&scratch).map_err(io_err("open", &scratch))?;
                // Progress already counted the compressed bytes while decompressing.
                read_rows(f, file, opts, &Arc::new(AtomicU64::new(0)), emit).map(|_| ())
            })();
            let _ = std::fs::remove_file(&scratch);
            result
        }
    }
}

fn parquet_err(file: &InputFile, e: parquet::errors::ParquetError) -> DataError {
    let text = e.to_string();
    let hint = if text.contains("Disabled feature") || text.contains("not supported") {
        "; this build reads Snappy, Zstandard and gzip pages: rewrite the file with one of them (pyarrow: \
         pq.write_table(t, path, compression=\"zstd\"))"
    } else {
        ""
    };
    DataError::InvalidArgument(format!("{}: cannot read it as Parquet: {text}{hint}", file.path.display()))
}

/// Emit every row's text; returns the compressed bytes of the row groups read.
fn read_rows(
    f: File,
    file: &InputFile,
    opts: &ReadOptions,
    disk_bytes: &AtomicU64,
    emit: &mut dyn FnMut(Record) -> Result<()>,
) -> Result<u64> {
    let reader = SerializedFileReader::new(f).map_err(|e| parquet_err(file, e))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let field = &opts.text_field;
    let Some(col) = schema.columns().iter().position(|c| c.path().parts() == [field.clone()]) else {
        let names: Vec<String> = schema.root_schema().get_fields().iter().map(|t| t.name().to_string()).collect();
        return Err(DataError::InvalidArgument(format!(
            "{} has no top-level column {field:?} (its columns: {}); name the text column with --text-field",
            file.path.display(),
            names.join(", ")
        )));
    };
    let descr = schema.column(col);
    if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() > 0 {
        return Err(DataError::InvalidArgument(format!(
            "{}: column {field:?} is {}{}, not one string per row; name the text column with --text-field",
            file.path.display(),
            descr.physical_type(),
            if descr.max_rep_level() > 0 { " in a list" } else { "" }
        )));
    }
    let max_def = descr.max_def_level();
    let shown = file.path.display().to_string();
    let (mut row, mut accounted) = (0u64, 0u64);
    let (mut defs, mut values) = (Vec::with_capacity(BATCH), Vec::with_capacity(BATCH));
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| parquet_err(file, e))?;
        let size = group.metadata().compressed_size().max(0) as u64;
        let ColumnReader::ByteArrayColumnReader(mut col_reader) =
            group.get_column_reader(col).map_err(|e| parquet_err(file, e))?
        else {
            return Err(DataError::InvalidArgument(format!("{shown}: column {field:?} is not a byte array")));
        };
        loop {
            defs.clear();
            values.clear();
            let (records, _, _) =
                col_reader.read_records(BATCH, Some(&mut defs), None, &mut values).map_err(|e| parquet_err(file, e))?;
            if records == 0 {
                break;
            }
            let mut next_value = values.drain(..);
            for i in 0..records {
                row += 1;
                let at = || format!("{shown}: row {row}");
                let present = max_def == 0 || defs.get(i).is_some_and(|&d| d == max_def);
                let record = match present.then(|| next_value.next()).flatten() {
                    None => Record::Bad(Bad { kind: BadKind::Malformed, at: at(), why: format!("{field:?} is null") }),
                    Some(v) => match String::from_utf8(v.data().to_vec()) {
                        Err(e) => Record::Bad(Bad {
                            kind: BadKind::InvalidUtf8,
                            at: at(),
                            why: format!("invalid UTF-8 at byte {} of {field:?}", e.utf8_error().valid_up_to()),
                        }),
                        Ok(t) if t.trim().is_empty() => Record::Bad(Bad {
                            kind: BadKind::Empty,
                            at: at(),
                            why: format!("{field:?} holds no text (empty or whitespace only)"),
                        }),
                        Ok(t) => Record::Doc(t),
                    },
                };
                emit(record)?;
            }
        }
        disk_bytes.fetch_add(size, Ordering::Relaxed);
        accounted += size;
    }
    Ok(accounted)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use parquet::basic::Compression as Codec;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::path::Path;

    /// Write `rows` (None = null) as a Parquet file with an optional string column `text`
    /// and an int column `id`, in row groups of `group` rows, pages compressed with `codec`.
    pub(crate) fn write_parquet(path: &Path, rows: &[Option<&[u8]>], group: usize, codec: Codec) {
        let schema = Arc::new(
            parse_message_type("message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }").unwrap(),
        );
        let props = Arc::new(WriterProperties::builder().set_compression(codec).build());
        let mut w = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
        for (g, chunk) in rows.chunks(group).enumerate() {
            let mut rg = w.next_row_group().unwrap();
            let ids: Vec<i64> = (0..chunk.len()).map(|i| (g * group + i) as i64).collect();
            let mut c = rg.next_column().unwrap().unwrap();
            c.typed::<Int64Type>().write_batch(&ids, None, None).unwrap();
            c.close().unwrap();
            let defs: Vec<i16> = chunk.iter().map(|r| i16::from(r.is_some())).collect();
            let vals: Vec<ByteArray> = chunk.iter().flatten().map(|b| ByteArray::from(b.to_vec())).collect();
            let mut c = rg.next_column().unwrap().unwrap();
            c.typed::<ByteArrayType>().write_batch(&vals, Some(&defs), None).unwrap();
            c.close().unwrap();
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    fn read_all(path: &Path, field: &str) -> Result<(Vec<String>, u64)> {
        let file = crate::inputs::expand(&[path.to_owned()])?.files.remove(0);
        let opts = ReadOptions {
            txt_docs: crate::documents::TxtDocs::File,
            text_field: field.into(),
            scratch_dir: path.parent().unwrap().to_owned(),
        };
        let disk = Arc::new(AtomicU64::new(0));
        let mut out = Vec::new();
        read_parquet(&file, &opts, disk.clone(), &mut |r| {
            out.push(match r {
                Record::Doc(t) => t,
                Record::Bad(b) => format!("{:?}: {b}", b.kind),
            });
            Ok(())
        })?;
        Ok((out, disk.load(Ordering::Relaxed)))
    }

    #[test]
    fn rows_become_documents_and_nulls_are_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<Option<&[u8]>> =
            vec![Some(b"first row"), None, Some(b""), Some(b"caf\xe9"), Some(b"fifth"), Some(b"sixth")];
        for (name, codec) in [
            ("s.parquet", Codec::SNAPPY),
            ("z.parquet", Codec::ZSTD(Default::default())),
            ("g.parquet", Codec::GZIP(Default::default())),
            ("u.parquet", Codec::UNCOMPRESSED),
        ] {
            let path = dir.path().join(name);
            write_parquet(&path, &rows, 4, codec);
            let (got, disk) = read_all(&path, "text").unwrap();
            let shown = path.display();
            assert_eq!(
                got,
                [
                    "first row".to_string(),
                    format!("Malformed: {shown}: row 2: \"text\" is null"),
                    format!("Empty: {shown}: row 3: \"text\" holds no text (empty or whitespace only)"),
                    format!("InvalidUtf8: {shown}: row 4: invalid UTF-8 at byte 3 of \"text\""),
                    "fifth".into(),
                    "sixth".into(),
                ]
            );
            assert_eq!(disk, std::fs::metadata(&path).unwrap().len(), "progress ends at the file size");
        }
        let path = dir.path().join("s.parquet");
        let e = read_all(&path, "body").unwrap_err().to_string();
        assert!(e.contains("no top-level column \"body\"") && e.contains("id, text"), "{e}");
        let e = read_all(&path, "id").unwrap_err().to_string();
        assert!(e.contains("INT64") && e.contains("--text-field"), "{e}");
        let junk = dir.path().join("junk.parquet");
        std::fs::write(&junk, b"not parquet at all").unwrap();
        assert!(read_all(&junk, "text").unwrap_err().to_string().contains("cannot read it as Parquet"));
    }

    #[test]
    fn a_compressed_parquet_file_is_read_through_a_scratch_copy() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("p.parquet");
        write_parquet(&plain, &[Some(b"one"), Some(b"two")], 10, Codec::SNAPPY);
        let bytes = std::fs::read(&plain).unwrap();
        let zst = dir.path().join("p.parquet.zst");
        std::fs::write(&zst, zstd::encode_all(&bytes[..], 3).unwrap()).unwrap();
        let (got, disk) = read_all(&zst, "text").unwrap();
        assert_eq!(got, ["one", "two"]);
        assert_eq!(disk, std::fs::metadata(&zst).unwrap().len());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "the scratch copy is gone: {names:?}");
    }
}
