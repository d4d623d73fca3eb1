//! Stored GEMM tuning: the cuBLASLt algorithm timed tuning chose for each GEMM of a run
//! (`train.gemm_tuning = "timed"` or `"searched"`), written with the run (`OUTPUT_DIR/gemm_tuning.json`, and
//! in every checkpoint's manifest) so that a rerun (`train.gemm_tuning_from`) or a resume runs
//! exactly those algorithms and gets the same bits, without timing anything.
//!
//! Everything here is plain data and pure functions (no device): the table's format, what
//! identifies a GEMM (shape, transposes, leading dimensions, operand and output types, bias
//! and epilogue, pointer alignments), what identifies the environment the algorithms were
//! timed in (GPU name, compute capability, cuBLASLt version: cuBLASLt documents an algorithm
//! as reusable with the same library version only, and another GPU runs other kernels), the
//! decision when a stored table does not fit ([`OnMismatch`]), and the packing that carries a
//! table from rank 0 to every rank over the host collectives. The CUDA backend
//! (`cuda/cublaslt/`) turns a [`GemmShape`] into its plan key and an algorithm's 64 bytes
//! into `cublasLtMatmulAlgo_t`.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Bumped when the file's meaning changes; a table of another format is refused.
pub const TABLE_FORMAT: u32 = 1;
/// The file a run writes into its `output.dir` (and `train.gemm_tuning_from` finds in a run
/// directory).
pub const TABLE_FILE: &str = "gemm_tuning.json";

/// An element type of a GEMM operand or output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmType {
    Bf16,
    F32,
    E4m3,
    E5m2,
}

/// What the GEMM's epilogue does besides the optional bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmEpilogue {
    None,
    /// GELU of the output, the pre-activation kept as aux.
    Gelu,
    /// The output multiplied by GELU' of the aux matrix.
    Dgelu,
}

/// Everything a cuBLASLt plan is made from: one stored algorithm applies to exactly the
/// GEMMs with this shape (column-major, as cuBLASLt sees it). Compute is fp32 with fp32
/// scales for every GEMM of this project, so it is not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmShape {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldd: usize,
    pub a_type: GemmType,
    pub b_type: GemmType,
    /// C and D (the same type).
    pub d_type: GemmType,
    pub bias: bool,
    pub epilogue: GemmEpilogue,
    /// FP8 GEMMs: partial sums kept in the tensor cores' precision.
    pub fast_accum: bool,
    /// The largest power of two (≤ 256) dividing the addresses of A, B, D, bias, aux and C:
    /// cuBLASLt may pick kernels that assume them.
    pub align: [u32; 6],
}

impl std::fmt::Display for GemmShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |x: bool| if x { 'T' } else { 'N' };
        write!(
            f,
            "m={} n={} k={} {}{} {:?}x{:?}->{:?} bias={} epilogue={:?}",
            self.m,
            self.n,
            self.k,
            t(self.transa),
            t(self.transb),
            self.a_type,
            self.b_type,
            self.d_type,
            self.bias,
            self.epilogue
        )
    }
}

/// The device and library an algorithm was timed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmEnvironment {
    /// The GPU's name as the driver gives it (e.g. "NVIDIA H200").
    pub device: String,
    /// (major, minor).
    pub compute_capability: [u32; 2],
    /// `cublasLtGetVersion()` (e.g. 130100 for 13.1.0).
    pub cublaslt_version: u64,
}

impl std::fmt::Display for GemmEnvironment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [ma, mi] = self.compute_capability;
        write!(f, "{} (compute capability {ma}.{mi}) with cuBLASLt {}", self.device, self.cublaslt_version)
    }
}

/// One GEMM's stored choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredGemm {
    pub shape: GemmShape,
    /// The `cublasLtMatmulAlgo_t` itself (its 8 words): what cuBLASLt documents as
    /// serializable for reuse with the same library version.
    pub algo: [u64; 8],
    /// Its configuration in words (tile, stages, split-K ...), for people.
    pub config: String,
    /// Its place among the heuristic's candidates timed (0 = the heuristic's first), of how many.
    pub candidate: usize,
    pub candidates: usize,
    /// Mean ms of one call with the heuristic's first and with this one, when timed (for
    /// people: read back, they may differ from the written value in the last bit).
    pub heuristic_ms: f64,
    pub chosen_ms: f64,
}

/// A run's GEMM choices and where they were timed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmTuningTable {
    pub format: u32,
    pub environment: GemmEnvironment,
    pub gemms: Vec<StoredGemm>,
}

/// A stored table that cannot be used.
#[derive(Debug, Error, PartialEq)]
pub enum TuningError {
    #[error("cannot read the GEMM tuning {path}: {problem}")]
    Read { path: PathBuf, problem: String },
    #[error(
        "{origin}: its GEMM algorithms were timed on {stored}, but this rank runs {here}: cuBLASLt \
         algorithms are only reusable with the same GPU and library version, so the losses could not match \
         the stored run's. Run on the GPU and library it names, or remove train.gemm_tuning_from to time the \
         GEMMs anew here"
    )]
    Environment { origin: String, stored: Box<GemmEnvironment>, here: Box<GemmEnvironment> },
    #[error(
        "{origin}: cuBLASLt on {here} no longer offers the stored algorithm for the GEMM {shape} ({config}). \
         Remove train.gemm_tuning_from to time the GEMMs anew"
    )]
    Unavailable { origin: String, here: Box<GemmEnvironment>, shape: Box<GemmShape>, config: String },
    #[error("{origin}: the carried GEMM tuning is damaged ({problem}; a bug: please report it)")]
    Carried { origin: String, problem: String },
}

/// What to do with a stored table (or one of its algorithms) that does not fit this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMismatch {
    /// `train.gemm_tuning_from`: the user asked for these algorithms, so a table that cannot
    /// give them is an error ([`TuningError`]) rather than a run with other bits.
    Refuse,
    /// A resume's checkpoint, or rank 0's choices on a rank with another GPU: continuing
    /// matters more than bits that cannot match anyway on other hardware, so the table is
    /// set aside (the caller times anew, or runs the heuristic's algorithm) and says so.
    SetAside,
}

impl GemmTuningTable {
    /// An empty table of this environment.
    pub fn new(environment: GemmEnvironment) -> GemmTuningTable {
        GemmTuningTable { format: TABLE_FORMAT, environment, gemms: Vec::new() }
    }

    /// The stored choice for `shape`, if any.
    pub fn lookup(&self, shape: &GemmShape) -> Option<&StoredGemm> {
        self.gemms.iter().find(|g| g.shape == *shape)
    }

    /// How many of the stored choices are not the heuristic's first.
    pub fn changed(&self) -> usize {
        self.gemms.iter().filter(|g| g.candidate != 0).count()
    }

    /// Whether this table may be used on `here`: `Ok(true)` yes; `Ok(false)` it was timed
    /// elsewhere and is set aside (`OnMismatch::SetAside`); an error when it must be refused.
    pub fn fits(&self, here: &GemmEnvironment, origin: &str, on: OnMismatch) -> Result<bool, TuningError> {
        if self.environment == *here {
            return Ok(true);
        }
        match on {
            OnMismatch::SetAside => Ok(false),
            OnMismatch::Refuse => Err(TuningError::Environment {
                origin: origin.to_string(),
                stored: Box::new(self.environment.clone()),
                here: Box::new(here.clone()),
            }),
        }
    }

    /// For a stored algorithm cuBLASLt would not run here (its check failed): the error when
    /// refusing, `Ok(())` when the shape is to run the heuristic's algorithm instead.
    pub fn unavailable(
        entry: &StoredGemm,
        here: &GemmEnvironment,
        origin: &str,
        on: OnMismatch,
    ) -> Result<(), TuningError> {
        match on {
            OnMismatch::SetAside => Ok(()),
            OnMismatch::Refuse => Err(TuningError::Unavailable {
                origin: origin.to_string(),
                here: Box::new(here.clone()),
                shape: Box::new(entry.shape),
                config: entry.config.clone(),
            }),
        }
    }

    /// The table as its file holds it (pretty JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a table of plain values always encodes")
    }

    /// Parse a table (`origin` names it in errors); a format this build does not know is refused.
    pub fn from_json(text: &str, origin: &Path) -> Result<GemmTuningTable, TuningError> {
        let bad = |problem: String| TuningError::Read { path: origin.to_path_buf(), problem };
        let t: GemmTuningTable = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if t.format != TABLE_FORMAT {
            return Err(bad(format!(
                "format {} but this build reads format {TABLE_FORMAT}: time the GEMMs anew (remove \
                 train.gemm_tuning_from)",
                t.format
            )));
        }
        Ok(t)
    }

    /// The table `train.gemm_tuning_from` names: a `gemm_tuning.json` file, a run directory
    /// holding one, or a checkpoint directory (its manifest carries the table).
    pub fn load(path: &Path) -> Result<GemmTuningTable, TuningError> {
        let bad = |problem: String| TuningError::Read { path: path.to_path_buf(), problem };
        if path.is_dir() {
            let file = path.join(TABLE_FILE);
            if file.is_file() {
                return Self::load(&file);
            }
            let manifest = path.join("manifest.json");
            if manifest.is_file() {
                let text =
                    std::fs::read_to_string(&manifest).map_err(|e| bad(format!("{}: {e}", manifest.display())))?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", manifest.display())))?;
                return match v.get("gemm_tuning") {
                    Some(t) if !t.is_null() => Self::from_json(&t.to_string(), &manifest),
                    _ => Err(bad(
                        "this checkpoint holds no GEMM tuning (its run used train.gemm_tuning = \"heuristic\", \
                         or predates stored tuning)"
                            .into(),
                    )),
                };
            }
            return Err(bad(format!(
                "a directory without {TABLE_FILE} or a checkpoint manifest: name a run's output.dir, its \
                 {TABLE_FILE}, or a checkpoint directory"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::from_json(&text, path)
    }

    /// Write the table to `path` (through a temporary file, so a reader never sees half of it).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.partial");
        std::fs::write(&tmp, self.to_json())?;
        std::fs::rename(&tmp, path)
    }
}

/// A table (or none) as f32 words for a host broadcast: its JSON, two bytes a word, each
/// word an integer below 2^16 (exact in f32, never a NaN whose payload a transport could
/// change). No table packs to no words; callers send the word count first.
pub fn pack(table: Option<&GemmTuningTable>) -> Vec<f32> {
    let bytes =
        table.map(|t| serde_json::to_vec(t).expect("a table of plain values always encodes")).unwrap_or_default();
    bytes.chunks(2).map(|c| (c[0] as u32 | (c.get(1).copied().unwrap_or(b' ') as u32) << 8) as f32).collect()
}

/// The table [`pack`] made (`None` for no table). JSON ignores the trailing space an odd
/// length is padded with.
pub fn unpack(words: &[f32], origin: &str) -> Result<Option<GemmTuningTable>, TuningError> {
    if words.is_empty() {
        return Ok(None);
    }
    let bad = |problem: String| TuningError::Carried { origin: origin.to_string(), problem };
    let mut bytes = Vec::with_capacity(words.len() * 2);
    for &w in words {
        if !(0.0..65536.0).contains(&w) || w.fract() != 0.0 {
            return Err(bad(format!("word {w} is not two bytes")));
        }
        let v = w as u32;
        bytes.extend_from_slice(&[(v & 0xff) as u8, (v >> 8) as u8]);
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(device: &str, cc: [u32; 2], version: u64) -> GemmEnvironment {
        GemmEnvironment { device: device.into(), compute_capability: cc, cublaslt_version: version }
    }

    fn shape(m: usize) -> GemmShape {
        GemmShape {
            transa: true,
            transb: false,
            m,
            n: 16384,
            k: 768,
            lda: 768,
            ldb: 768,
            ldd: m,
            a_type: GemmType::Bf16,
            b_type: GemmType::Bf16,
            d_type: GemmType::Bf16,
            bias: true,
            epilogue: GemmEpilogue::Gelu,
            fast_accum: false,
            align: [256, 256, 256, 16, 256, 256],
        }
    }

    fn table() -> GemmTuningTable {
        let mut t = GemmTuningTable::new(env("NVIDIA H200", [9, 0], 130100));
        for (i, m) in [3072usize, 768].into_iter().enumerate() {
            t.gemms.push(StoredGemm {
                shape: shape(m),
                algo: [u64::MAX, 1, 2, 3, 4, 5, 6, i as u64],
                config: format!("id {i} tile 20"),
                candidate: i,
                candidates: 8,
                heuristic_ms: 0.25,
                // Dyadic: JSON parsing keeps timings to the last bit or so only (they are for people).
                chosen_ms: 0.1875 + i as f64 * 0.015625,
            });
        }
        t
    }

    #[test]
    fn a_table_round_trips_through_its_file_exactly() {
        let t = table();
        let back = GemmTuningTable::from_json(&t.to_json(), Path::new("x.json")).expect("parse");
        assert_eq!(back, t);
        // Every algorithm word survives, u64::MAX included (JSON numbers beyond 2^53).
        assert_eq!(back.gemms[0].algo[0], u64::MAX);
        assert_eq!(back.lookup(&shape(768)).map(|g| g.candidate), Some(1));
        assert_eq!(back.changed(), 1);
        // A shape that differs in anything (here one alignment) is another GEMM.
        let mut other = shape(768);
        other.align[3] = 2;
        assert!(back.lookup(&other).is_none());
        let mut other = shape(768);
        other.epilogue = GemmEpilogue::None;
        assert!(back.lookup(&other).is_none());
    }

    #[test]
    fn another_format_or_a_broken_file_is_refused_naming_the_file() {
        let mut v: serde_json::Value = serde_json::from_str(&table().to_json()).expect("json");
        v["format"] = 2.into();
        let e = GemmTuningTable::from_json(&v.to_string(), Path::new("runs/a/gemm_tuning.json")).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("runs/a/gemm_tuning.json") && s.contains("format 2") && s.contains("anew"), "{s}");
        let e = GemmTuningTable::from_json("{\"format\": 1}", Path::new("t.json")).unwrap_err().to_string();
        assert!(e.contains("t.json") && e.contains("missing field"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(&table().to_json()).expect("json");
        v["gemms"][0]["shape"]["a_type"] = "fp4".into();
        assert!(GemmTuningTable::from_json(&v.to_string(), Path::new("t.json")).is_err(), "an unknown type");
    }

    #[test]
    fn a_table_fits_only_the_gpu_and_library_it_was_timed_with() {
        let t = table();
        let here = t.environment.clone();
        for on in [OnMismatch::Refuse, OnMismatch::SetAside] {
            assert_eq!(t.fits(&here, "o", on), Ok(true));
        }
        for other in [
            env("NVIDIA H100 80GB HBM3", [9, 0], 130100),
            env("NVIDIA H200", [10, 0], 130100),
            env("NVIDIA H200", [9, 0], 130000),
        ] {
            assert_eq!(t.fits(&other, "o", OnMismatch::SetAside), Ok(false), "{other}");
            let e = t.fits(&other, "train.gemm_tuning_from = runs/a", OnMismatch::Refuse).unwrap_err().to_string();
            for needle in [
                "train.gemm_tuning_from = runs/a",
                "NVIDIA H200 (compute capability 9.0) with cuBLASLt 130100",
                &other.to_string(),
                "remove train.gemm_tuning_from",
            ] {
                assert!(e.contains(needle), "`{needle}` missing: {e}");
            }
        }
    }

    #[test]
    fn an_algorithm_no_longer_offered_is_refused_or_left_to_the_heuristic() {
        let t = table();
        let g = &t.gemms[1];
        assert_eq!(GemmTuningTable::unavailable(g, &t.environment, "o", OnMismatch::SetAside), Ok(()));
        let e = GemmTuningTable::unavailable(g, &t.environment, "run x", OnMismatch::Refuse).unwrap_err().to_string();
        assert!(e.contains("run x") && e.contains("m=768 n=16384 k=768 TN") && e.contains("id 1 tile 20"), "{e}");
    }

    #[test]
    fn a_table_is_carried_exactly_in_f32_words() {
        let t = table();
        let words = pack(Some(&t));
        assert!(words.iter().all(|w| w.fract() == 0.0 && (0.0..65536.0).contains(w)));
        assert_eq!(unpack(&words, "rank 0").expect("unpack"), Some(t.clone()));
        assert_eq!(unpack(&pack(None), "rank 0").expect("none"), None);
        // Odd and even JSON lengths both come back.
        let mut t2 = t.clone();
        t2.environment.device.push('x');
        assert_eq!(unpack(&pack(Some(&t2)), "r").expect("unpack"), Some(t2));
        let mut broken = words.clone();
        broken[3] = 1.5;
        assert!(matches!(unpack(&broken, "r"), Err(TuningError::Carried { .. })));
    }

    #[test]
    fn load_finds_the_table_in_a_file_a_run_directory_or_a_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = table();
        let run = dir.path().join("run");
        std::fs::create_dir(&run).expect("dir");
        t.write(&run.join(TABLE_FILE)).expect("write");
        assert_eq!(GemmTuningTable::load(&run.join(TABLE_FILE)).expect("file"), t);
        assert_eq!(GemmTuningTable::load(&run).expect("run dir"), t);
        let ck = dir.path().join("step_00000004");
        std::fs::create_dir(&ck).expect("dir");
        let manifest = serde_json::json!({ "step": 4, "gemm_tuning": serde_json::to_value(&t).expect("v") });
        std::fs::write(ck.join("manifest.json"), manifest.to_string()).expect("write");
        assert_eq!(GemmTuningTable::load(&ck).expect("checkpoint"), t);
        std::fs::write(ck.join("manifest.json"), "{\"step\": 4}").expect("write");
        let e = GemmTuningTable::load(&ck).unwrap_err().to_string();
        assert!(e.contains("holds no GEMM tuning") && e.contains("heuristic"), "{e}");
        let e = GemmTuningTable::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("a directory without gemm_tuning.json"), "{e}");
        let e = GemmTuningTable::load(&dir.path().join("nope.json")).unwrap_err().to_string();
        assert!(e.contains("nope.json"), "{e}");
    }
}
