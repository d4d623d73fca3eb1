//! The built-in training corpus: deterministic, English-like synthetic text that needs
//! no download, and its one-call preparation into shards.
//!
//! [`generate_corpus`] combines a small hand-written set of templates — arithmetic word
//! problems whose numbers add up, counting and calendar sequences, fixed facts, question
//! and answer pairs, comparisons and short stories with consistent pronouns — using the
//! hand-written SplitMix64 stream of [`crate::rng`] (never the `rand` crate), so the text
//! is byte-identical on every machine and build. It is regular enough that a small GPT's
//! loss falls visibly within ~100 steps. [`ensure_builtin_dataset`] prepares it once per
//! directory, safely under concurrent callers.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use crate::dataset::Split;
use crate::documents::ENDOFTEXT;
use crate::error::{io_err, DataError, Result};
use crate::rng::SplitMix64;
use crate::shard::{unique_suffix, TokenShard};
use crate::text::{prepare_str, ValSplit};

/// Bump whenever the generator, the tokenisation, the split or the shard files change:
/// directories prepared by an older version are then regenerated (2: shards carry the
/// tokenizer record and a document index).
pub const BUILTIN_VERSION: u32 = 2;
/// The seed [`ensure_builtin_dataset`] generates with.
pub const BUILTIN_SEED: u64 = 20240520;
/// The dataset name: shards are `builtin_val_000000.bin` and `builtin_train_000000.bin`.
pub const BUILTIN_NAME: &str = "builtin";
/// Approximate corpus size in bytes.
const TARGET_BYTES: usize = 480_000;
/// Tokens of the corpus (from its start) used for validation.
const VAL_FRACTION: f64 = 0.15;
/// Large enough for the whole training split to be one shard.
const SHARD_TOKENS: usize = 1 << 24;
/// The manifest, written last inside the prepared directory.
const MANIFEST: &str = "builtin_manifest.txt";

const NAMES: &[(&str, bool)] = &[
    ("Alice", true),
    ("Bob", false),
    ("Carol", true),
    ("Dave", false),
    ("Emma", true),
    ("Frank", false),
    ("Grace", true),
    ("Henry", false),
    ("Ivy", true),
    ("Jack", false),
    ("Kate", true),
    ("Leo", false),
    ("Mia", true),
    ("Noah", false),
    ("Olivia", true),
    ("Peter", false),
    ("Rosa", true),
    ("Sam", false),
    ("Tina", true),
    ("Victor", false),
    ("Wendy", true),
    ("Oscar", false),
    ("Zoe", true),
    ("Hugo", false),
];
const THINGS: &[(&str, &str)] = &[
    ("apple", "apples"),
    ("pear", "pears"),
    ("book", "books"),
    ("coin", "coins"),
    ("marble", "marbles"),
    ("pencil", "pencils"),
    ("cookie", "cookies"),
    ("shell", "shells"),
    ("stamp", "stamps"),
    ("card", "cards"),
    ("egg", "eggs"),
    ("flower", "flowers"),
    ("orange", "oranges"),
    ("ribbon", "ribbons"),
];
const PLACES: &[&str] = &[
    "the market",
    "the park",
    "the library",
    "the river",
    "the school",
    "the garden",
    "the bakery",
    "the harbor",
    "the museum",
    "the farm",
    "the beach",
    "the station",
];
const ANIMALS: &[(&str, &str, &str)] = &[
    ("cat", "cats", "meow"),
    ("dog", "dogs", "woof"),
    ("cow", "cows", "moo"),
    ("duck", "ducks", "quack"),
    ("sheep", "sheep", "baa"),
    ("horse", "horses", "neigh"),
    ("owl", "owls", "hoot"),
    ("frog", "frogs", "croak"),
    ("lion", "lions", "roar"),
    ("bee", "bees", "buzz"),
];
const COLORS: &[(&str, &str)] = &[
    ("the sky", "blue"),
    ("grass", "green"),
    ("snow", "white"),
    ("a lemon", "yellow"),
    ("a tomato", "red"),
    ("coal", "black"),
    ("a carrot", "orange"),
    ("a plum", "purple"),
    ("the sea", "blue"),
    ("a banana", "yellow"),
    ("milk", "white"),
    ("a leaf", "green"),
];
const CAPITALS: &[(&str, &str)] = &[
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Germany", "Berlin"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
];
const FACTS: &[&str] = &[
    "The sun rises in the east and sets in the west.",
    "Water freezes at zero degrees and boils at one hundred degrees.",
    "A week has seven days.",
    "A year has twelve months.",
    "A day has twenty-four hours.",
    "An hour has sixty minutes.",
    "Fish live in water.",
    "Birds have wings and most of them can fly.",
    "Plants need light and water to grow.",
    "The moon goes around the earth.",
    "Ice is cold and fire is hot.",
    "A triangle has three sides and a square has four sides.",
];
const VERBS: &[(&str, &str)] = &[
    ("read", "read a book"),
    ("walk", "walked along the path"),
    ("sing", "sang a song"),
    ("paint", "painted a picture"),
    ("cook", "cooked some soup"),
    ("play", "played a game"),
    ("write", "wrote a letter"),
    ("swim", "swam in the lake"),
];
const WEATHER: &[&str] = &["sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy"];
const NUMBER_WORDS: &[&str] = &[
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
];
const DAYS: &[&str] = &["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: &[&str] = &[
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A character of a document, with consistent pronouns.
#[derive(Clone, Copy)]
struct Person {
    name: &'static str,
    she: bool,
}

impl Person {
    fn subj(self) -> &'static str {
        if self.she {
            "she"
        } else {
            "he"
        }
    }
    fn obj(self) -> &'static str {
        if self.she {
            "her"
        } else {
            "him"
        }
    }
    fn poss(self) -> &'static str {
        if self.she {
            "her"
        } else {
            "his"
        }
    }
}

fn person(r: &mut SplitMix64) -> Person {
    let &(name, she) = r.pick(NAMES);
    Person { name, she }
}

/// Someone other than `p`.
fn other_than(r: &mut SplitMix64, p: Person) -> Person {
    loop {
        let q = person(r);
        if q.name != p.name {
            return q;
        }
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
}

fn plural(n: usize, thing: (&str, &str)) -> String {
    format!("{n} {}", if n == 1 { thing.0 } else { thing.1 })
}

/// One paragraph from one of the templates, appended to `out`.
fn paragraph(r: &mut SplitMix64, hero: Person, out: &mut String) {
    let thing = *r.pick(THINGS);
    match r.below(12) {
        0 | 1 => {
            let (a, b) = (r.range(1, 9), r.range(1, 9));
            let other = other_than(r, hero);
            let _ = write!(
                out,
                "{} has {}. {} gives {} {} more, so {} has {}.",
                hero.name,
                plural(a, thing),
                other.name,
                hero.obj(),
                b,
                hero.subj(),
                plural(a + b, thing)
            );
        }
        2 => {
            let a = r.range(2, 12);
            let b = r.range(1, a);
            let _ = write!(
                out,
                "{} had {}. {} lost {}, so now {} has {}.",
                hero.name,
                plural(a, thing),
                capitalize(hero.subj()),
                b,
                hero.subj(),
                plural(a - b, thing)
            );
        }
        3 => {
            let (a, b) = (r.range(0, 12), r.range(0, 12));
            let _ = match r.below(3) {
                0 => write!(out, "What is {a} plus {b}? {a} plus {b} is {}.", a + b),
                1 => write!(out, "{a} times {b} is {}. {b} times {a} is also {}.", a * b, a * b),
                _ => write!(
                    out,
                    "{} plus {} is {}.",
                    NUMBER_WORDS[a % 11],
                    NUMBER_WORDS[b % 10],
                    NUMBER_WORDS[a % 11 + b % 10]
                ),
            };
        }
        4 => {
            let start = r.range(1, 10);
            let len = r.range(4, 8);
            let words: Vec<&str> = NUMBER_WORDS[start..(start + len).min(NUMBER_WORDS.len())].to_vec();
            let _ = write!(out, "{} counted: {}.", hero.name, words.join(", "));
        }
        5 => {
            let (list, label) = if r.below(2) == 0 { (DAYS, "day") } else { (MONTHS, "month") };
            let i = r.below(list.len());
            let next = list[(i + 1) % list.len()];
            let _ = write!(
                out,
                "After {} comes {}. The {label} after {next} is {}.",
                list[i],
                next,
                list[(i + 2) % list.len()]
            );
        }
        6 => {
            let &(one, many, sound) = r.pick(ANIMALS);
            let n = r.range(2, 9);
            let place = r.pick(PLACES);
            let _ = write!(
                out,
                "At {place}, {} saw {n} {many}. A {one} says {sound}, so the {many} said {sound} {sound}.",
                hero.name
            );
        }
        7 => {
            let &(thing, color) = r.pick(COLORS);
            let _ = write!(out, "Q: What color is {thing}? A: {} is {color}.", capitalize(thing));
        }
        8 => {
            let &(country, city) = r.pick(CAPITALS);
            let _ = write!(out, "The capital of {country} is {city}. {} wants to visit {city} one day.", hero.name);
        }
        9 => {
            let b = other_than(r, hero);
            let c = loop {
                let c = other_than(r, hero);
                if c.name != b.name {
                    break c;
                }
            };
            let _ = write!(
                out,
                "{} is taller than {}. {} is taller than {}. So {} is taller than {}.",
                hero.name, b.name, b.name, c.name, hero.name, c.name
            );
        }
        10 => {
            let friend = other_than(r, hero);
            let place = r.pick(PLACES);
            let weather = r.pick(WEATHER);
            let &(_, did) = r.pick(VERBS);
            let day = r.pick(DAYS);
            let _ = write!(
                out,
                "On {day} it was {weather}. {} went to {place} with {}. There {} {did}, and {} friend {} \
                 smiled. Then they went home.",
                hero.name,
                friend.name,
                hero.subj(),
                hero.poss(),
                friend.name
            );
        }
        _ => {
            let _ = write!(out, "{}", r.pick(FACTS));
        }
    }
}

/// Generate the built-in corpus for `seed`: a few hundred KB of deterministic English-like
/// text, documents separated by `<|endoftext|>`. The same seed always gives the same text.
pub fn generate_corpus(seed: u64) -> String {
    let mut r = SplitMix64::new(seed ^ 0xB017_7D47_A5E7_C0DE);
    let mut out = String::with_capacity(TARGET_BYTES + 4096);
    let mut first = true;
    while out.len() < TARGET_BYTES {
        if !first {
            out.push_str(ENDOFTEXT);
        }
        first = false;
        let hero = person(&mut r);
        let _ = write!(out, "A story about {}.\n\n", hero.name);
        let paragraphs = r.range(3, 8);
        for p in 0..paragraphs {
            if p > 0 {
                out.push_str(if r.below(3) == 0 { "\n\n" } else { " " });
            }
            paragraph(&mut r, hero, &mut out);
        }
        out.push('\n');
    }
    out
}

fn manifest_header() -> String {
    format!("shardtrain built-in dataset\nversion = {BUILTIN_VERSION}\nseed = {BUILTIN_SEED}\n")
}

/// Whether `dir` holds a complete, current built-in dataset: its manifest has this
/// version and every shard it lists opens with the listed token count.
fn is_current(dir: &Path) -> bool {
    let Ok(manifest) = fs::read_to_string(dir.join(MANIFEST)) else { return false };
    let Some(files) = manifest.strip_prefix(&manifest_header()) else { return false };
    let mut splits = [false, false];
    for line in files.lines() {
        let Some((file, tokens)) = line.split_once(' ') else { return false };
        let Ok(tokens) = tokens.parse::<usize>() else { return false };
        if file.contains(['/', '\\']) || !TokenShard::open(dir.join(file)).is_ok_and(|s| s.len() == tokens) {
            return false;
        }
        splits[0] |= Split::Train.matches(file);
        splits[1] |= Split::Val.matches(file);
    }
    splits == [true, true]
}

/// Files a built-in dataset directory may hold (so it may be replaced when stale).
fn is_builtin_file(name: &str) -> bool {
    name == MANIFEST
        || (name.starts_with(&format!("{BUILTIN_NAME}_")) && (name.ends_with(".bin") || name.ends_with(".idx")))
        || name.starts_with('.')
}

/// Error unless `dir` is absent, empty, or holds only built-in dataset files.
fn check_replaceable(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    if !dir.is_dir() {
        return Err(DataError::NotBuiltinDir { dir: dir.to_owned(), found: "a file, not a directory".into() });
    }
    for entry in fs::read_dir(dir).map_err(io_err("list the directory", dir))? {
        let entry = entry.map_err(io_err("list the directory", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_builtin_file(&name) || entry.path().is_dir() {
            return Err(DataError::NotBuiltinDir { dir: dir.to_owned(), found: format!("{name:?}") });
        }
    }
    Ok(())
}

/// Make sure `dir` holds the prepared built-in dataset and return `dir`.
///
/// If `dir` already holds a current one (checked through a versioned manifest) this only
/// validates it. Otherwise the corpus is generated and prepared into a temporary sibling
/// directory that is renamed onto `dir` atomically; a stale built-in dataset is replaced,
/// but a directory holding anything else is an error, never overwritten. Safe when
/// several processes call it at once: a loser of the rename race uses the winner's copy.
pub fn ensure_builtin_dataset(dir: &Path) -> Result<PathBuf> {
    if is_current(dir) {
        return Ok(dir.to_owned());
    }
    check_replaceable(dir)?;
    let dir_name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| {
        DataError::InvalidArgument(format!("the built-in dataset directory {} has no final component", dir.display()))
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(io_err("create the directory", &parent))?;

    let tmp = parent.join(format!(".{dir_name}.tmp-{}", unique_suffix()));
    let built = build_into(&tmp);
    if let Err(e) = built {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let installed = install(&tmp, dir, &parent, &dir_name);
    if tmp.exists() {
        let _ = fs::remove_dir_all(&tmp);
    }
    installed.map(|()| dir.to_owned())
}

/// Generate, tokenise and write the corpus and its manifest into the new directory `tmp`.
fn build_into(tmp: &Path) -> Result<()> {
    fs::create_dir(tmp).map_err(io_err("create the temporary directory", tmp))?;
    let text = generate_corpus(BUILTIN_SEED);
    let source = Path::new("<built-in corpus>");
    let summary = prepare_str(&text, source, tmp, BUILTIN_NAME, SHARD_TOKENS, ValSplit::Fraction(VAL_FRACTION))?;
    let mut manifest = manifest_header();
    for f in &summary.files {
        let shard = TokenShard::open(f)?;
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let _ = writeln!(manifest, "{name} {}", shard.len());
    }
    let path = tmp.join(MANIFEST);
    fs::write(&path, manifest).map_err(io_err("write", &path))?;
    Ok(())
}

/// Rename `tmp` onto `dir`, moving a stale `dir` aside first; if another process installs
/// a current copy meanwhile, keep theirs.
fn install(tmp: &Path, dir: &Path, parent: &Path, dir_name: &str) -> Result<()> {
    let mut last_err = None;
    for _ in 0..5 {
        match fs::rename(tmp, dir) {
            Ok(()) => return Ok(()),
            Err(e) => {
                if is_current(dir) {
                    return Ok(()); // Lost the race to an equally good copy.
                }
                if !dir.exists() {
                    last_err = Some(e);
                    continue; // Moved away between our rename and the check: retry.
                }
                // A stale built-in dataset (or an empty directory): move it aside and retry.
                check_replaceable(dir)?;
                let aside = parent.join(format!(".{dir_name}.stale-{}", unique_suffix()));
                match fs::rename(dir, &aside) {
                    Ok(()) => {
                        let _ = fs::remove_dir_all(&aside);
                    }
                    Err(e2) if e2.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e2) => {
                        return Err(DataError::Io { action: "move aside the stale", path: dir.to_owned(), source: e2 })
                    }
                }
                last_err = Some(e);
            }
        }
    }
    if is_current(dir) {
        return Ok(());
    }
    Err(DataError::Io {
        action: "install the built-in dataset into",
        path: dir.to_owned(),
        source: last_err.unwrap_or_else(|| std::io::Error::other("rename kept failing")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Dataset;
    use crate::sampler::BatchSampler;
    use crate::{EOT_TOKEN, GPT2_VOCAB};

    #[test]
    fn corpus_is_deterministic_and_sized() {
        let a = generate_corpus(1);
        assert_eq!(a, generate_corpus(1));
        assert_ne!(a, generate_corpus(2));
        assert!((TARGET_BYTES..TARGET_BYTES + 4096).contains(&a.len()), "{}", a.len());
        assert!(a.contains(ENDOFTEXT) && a.is_ascii());
        // Pinned: a change to the generator must bump BUILTIN_VERSION (and this value).
        let b = generate_corpus(BUILTIN_SEED);
        let h = b.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        assert_eq!(h, 10942800032794935122, "corpus hash changed: bump BUILTIN_VERSION, then update this value");
    }

    #[test]
    fn builtin_dataset_is_prepared_once_and_loads() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("builtin");
        let t0 = std::time::Instant::now();
        assert_eq!(ensure_builtin_dataset(&dir).unwrap(), dir);
        eprintln!("built-in dataset prepared in {:?}", t0.elapsed());
        let train = Dataset::open(&dir, Split::Train).unwrap();
        let val = Dataset::open(&dir, Split::Val).unwrap();
        eprintln!("built-in: {} train tokens, {} val tokens", train.total_tokens(), val.total_tokens());
        assert!(train.total_tokens() > 50_000 && val.total_tokens() > 16_384);
        assert!((train.max_token() as usize) < GPT2_VOCAB);
        assert!(train.shards()[0].ids().iter().any(|t| t == u32::from(EOT_TOKEN)));
        assert_eq!(train.shards()[0].info().map(|i| i.tokenizer.as_str()), Some("gpt2"));
        assert!(train.shards()[0].doc_starts().is_some_and(|d| d.len() > 100));
        assert_eq!(val.val_batches(4, 1024, 4).unwrap().len(), 4);
        BatchSampler::new(train, 1024, 0).unwrap();

        // A second call reuses it (no rewrite) ...
        let mtime = |p: &Path| fs::metadata(p).unwrap().modified().unwrap();
        let before = mtime(&dir.join(MANIFEST));
        ensure_builtin_dataset(&dir).unwrap();
        assert_eq!(mtime(&dir.join(MANIFEST)), before);
        // ... a stale version is regenerated ...
        fs::write(dir.join(MANIFEST), "shardtrain built-in dataset\nversion = 0\n").unwrap();
        ensure_builtin_dataset(&dir).unwrap();
        assert!(is_current(&dir));
        // ... and a corrupt shard too.
        fs::write(dir.join("builtin_train_000000.bin"), b"junk").unwrap();
        ensure_builtin_dataset(&dir).unwrap();
        assert!(is_current(&dir));
        // No temporary or stale directories are left behind.
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn concurrent_callers_agree() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("data").join("builtin");
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3).map(|_| s.spawn(|| ensure_builtin_dataset(&dir))).collect();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap(), dir);
            }
        });
        assert!(is_current(&dir));
        assert_eq!(fs::read_dir(root.path().join("data")).unwrap().count(), 1, "temporaries cleaned up");
    }

    #[test]
    fn refuses_to_replace_a_foreign_directory() {
        let root = tempfile::tempdir().unwrap();
        fs::write(root.path().join("precious.txt"), "keep me").unwrap();
        let e = ensure_builtin_dataset(root.path()).unwrap_err();
        assert!(matches!(e, DataError::NotBuiltinDir { .. }), "{e}");
        assert!(e.to_string().contains("precious.txt"), "{e}");
        assert!(root.path().join("precious.txt").exists());
    }
}
