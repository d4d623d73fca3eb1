//! Streaming safetensors writes: each tensor's values are produced only when the writer
//! reaches it (read from the device or from checkpoint shards, or borrowed from a host copy),
//! so host memory holds one tensor at a time; the file appears atomically (temporary name,
//! fsync, rename).
//!
//! The format is written here rather than by the `safetensors` crate, whose writer goes
//! through a private temporary file (mode 0600): these files are read by other users and
//! tools, so they get the ordinary mode (0666 less the umask), and a failed write names
//! the file and the OS error once (a full disk during a save is a checkpoint problem).

use super::{io_err, CheckpointError};
use crate::TrainError;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;

/// Produces one tensor's f32 values on demand (made, or borrowed from memory that holds them).
pub(crate) type ReadFn<'a> = Box<dyn Fn() -> Result<Cow<'a, [f32]>, TrainError> + 'a>;

/// Write `(name, shape, read)` f32 tensors to `path` as safetensors, streaming, atomically;
/// the bytes of tensor data written. A failed read or write removes the partial file and
/// returns the error.
pub(crate) fn write_streamed(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, ReadFn<'_>)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<u64, TrainError> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".partial");
    let tmp = path.with_file_name(tmp_name);
    let result = write_file(&tmp, &tensors, metadata);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    let bytes = result?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(bytes)
}

fn write_file(
    tmp: &Path,
    tensors: &[(String, Vec<usize>, ReadFn<'_>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<u64, TrainError> {
    let header = header(tensors, metadata)?;
    let file = fs::File::create(tmp).map_err(io_err(tmp))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io_err(tmp))?;
    w.write_all(&header).map_err(io_err(tmp))?;
    let mut total = 0u64;
    for (name, shape, read) in tensors {
        let values = read()?;
        let want: usize = shape.iter().product();
        if values.len() != want {
            return Err(TrainError::Invalid(format!(
                "writing {}: tensor {name} of shape {shape:?} read {} values (a bug: please report it)",
                tmp.display(),
                values.len()
            )));
        }
        // safetensors is little-endian, as every machine this runs on.
        w.write_all(bytemuck::cast_slice(&values)).map_err(io_err(tmp))?;
        total += 4 * want as u64;
    }
    let file = w.into_inner().map_err(|e| CheckpointError::Io { path: tmp.to_path_buf(), source: e.into_error() })?;
    file.sync_all().map_err(io_err(tmp))?;
    Ok(total)
}

/// The JSON header: every tensor as F32 at consecutive offsets, padded with spaces so the
/// data starts 8-byte aligned (as the `safetensors` crate writes it).
fn header(
    tensors: &[(String, Vec<usize>, ReadFn<'_>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, TrainError> {
    let mut map = serde_json::Map::new();
    if let Some(m) = metadata {
        map.insert("__metadata__".into(), serde_json::json!(m));
    }
    let mut off = 0usize;
    for (name, shape, _) in tensors {
        let len = 4 * shape.iter().product::<usize>();
        map.insert(
            name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [off, off + len] }),
        );
        off += len;
    }
    let mut bytes = serde_json::to_vec(&map)
        .map_err(|e| TrainError::Invalid(format!("cannot encode a safetensors header: {e}")))?;
    while (8 + bytes.len()) % 8 != 0 {
        bytes.push(b' ');
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_valid_safetensors_with_the_ordinary_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.safetensors");
        let tensors: Vec<(String, Vec<usize>, ReadFn)> = vec![
            ("b".into(), vec![2, 3], Box::new(|| Ok((0..6).map(|i| i as f32).collect::<Vec<f32>>().into()))),
            ("a".into(), vec![1], Box::new(|| Ok(Cow::Borrowed(&[-1.5f32][..])))),
        ];
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        assert_eq!(write_streamed(&path, tensors, Some(meta)).expect("write"), 28);
        let bytes = fs::read(&path).expect("read");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid");
        assert_eq!(st.tensor("b").expect("b").shape(), &[2, 3]);
        assert_eq!(st.tensor("a").expect("a").data(), (-1.5f32).to_le_bytes());
        let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).expect("metadata");
        assert_eq!(m.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        let plain = dir.path().join("plain");
        fs::write(&plain, b"").expect("write");
        assert_eq!(mode(&path), mode(&plain), "the mode of any file created here (0666 less the umask), not 0600");
        assert!(!dir.path().join("t.safetensors.partial").exists());

        // A failed read leaves nothing behind.
        let bad: Vec<(String, Vec<usize>, ReadFn)> =
            vec![("x".into(), vec![1], Box::new(|| Err(TrainError::Invalid("boom".into()))))];
        let other = dir.path().join("u.safetensors");
        assert!(write_streamed(&other, bad, None).unwrap_err().to_string().contains("boom"));
        assert!(!other.exists() && !dir.path().join("u.safetensors.partial").exists());
    }
}
