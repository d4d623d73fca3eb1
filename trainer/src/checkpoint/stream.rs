//! Streaming safetensors writes: each tensor's values are produced only when the writer
//! reaches it (read from the device or from checkpoint shards), so host memory holds one
//! tensor at a time; the file appears atomically (temporary name, fsync, rename).

use super::io_err;
use crate::TrainError;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs;
use std::path::Path;

/// Produces one tensor's f32 values on demand.
pub(crate) type ReadFn<'a> = Box<dyn Fn() -> Result<Vec<f32>, TrainError> + 'a>;

/// An f32 tensor whose values are read when the safetensors writer asks for them.
struct LazyF32<'a> {
    shape: Vec<usize>,
    read: ReadFn<'a>,
    /// The first read error; `View::data` cannot fail, so the writer checks this afterwards.
    failed: &'a RefCell<Option<String>>,
}

impl View for LazyF32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match (self.read)() {
            Ok(v) if v.len() * 4 == self.data_len() => Cow::Owned(bytemuck::cast_slice(&v).to_vec()),
            Ok(v) => {
                let msg = format!("a tensor of shape {:?} read {} values", self.shape, v.len());
                self.failed.borrow_mut().get_or_insert(msg);
                Cow::Owned(vec![0u8; self.data_len()])
            }
            Err(e) => {
                self.failed.borrow_mut().get_or_insert(e.to_string());
                Cow::Owned(vec![0u8; self.data_len()])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Write `(name, shape, read)` tensors to `path` as safetensors, streaming, atomically.
/// A failed read removes the partial file and returns the error.
pub(crate) fn write_streamed(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, ReadFn<'_>)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), TrainError> {
    let failed = RefCell::new(None);
    let views: Vec<(String, LazyF32)> =
        tensors.into_iter().map(|(name, shape, read)| (name, LazyF32 { shape, read, failed: &failed })).collect();
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".partial");
    let tmp = path.with_file_name(tmp_name);
    safetensors::serialize_to_file(views, metadata, &tmp)
        .map_err(|e| TrainError::Invalid(format!("writing {}: {e}", tmp.display())))?;
    if let Some(e) = failed.into_inner() {
        let _ = fs::remove_file(&tmp);
        return Err(TrainError::Invalid(format!("writing {}: {e}", path.display())));
    }
    fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(())
}
