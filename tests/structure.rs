//! The house rules that a reviewer would otherwise have to keep in their head, checked
//! on the source tree itself: no source file over 900 lines, `too_many_arguments`
//! allowed in at most 4 places, no import circle of more than two files inside a crate,
//! a short README and BENCHMARKS, and the environment table in docs in step with the
//! `SHARDTRAIN_*` names the code reads. (Functions over 150 lines are clippy's
//! `too_many_lines`, set in clippy.toml and turned on in .ci/run.)
//!
//! Each check prints every offender with what to do about it. The source is read as
//! text through a small lexer (comments and string literals apart from code), so the
//! checks need no dependency and no build of the code they look at.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

/// Longest non-test source file (`*.rs`, `*.cu`, `*.cuh`), in lines.
const MAX_FILE_LINES: usize = 900;
/// Most `#[allow(clippy::too_many_arguments)]` in the whole workspace.
const MAX_TOO_MANY_ARGUMENTS: usize = 4;
/// Largest import circle (strongly connected files) allowed inside one crate.
const MAX_CIRCLE_FILES: usize = 2;
const MAX_README_LINES: usize = 150;
const MAX_BENCHMARKS_LINES: usize = 200;
/// The crates whose non-test sources may read `SHARDTRAIN_*` variables.
const ENV_CRATES: &[&str] = &["launcher", "trainer", "collectives", "data"];
const ENV_TABLE: &str = "docs/reference/environment.md";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the crate sits in the workspace root").to_path_buf()
}

/// Every file under `dir` (recursively), skipping build output and VCS folders.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if !matches!(name, "target" | ".git") && !name.starts_with('.') {
                walk(&p, out);
            }
        } else {
            out.push(p);
        }
    }
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).to_string_lossy().replace('\\', "/")
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn has_ext(p: &Path, exts: &[&str]) -> bool {
    p.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.contains(&e))
}

/// Under a `tests` folder (the root's integration tests, their common helpers).
fn is_test_path(p: &str) -> bool {
    p.split('/').any(|c| c == "tests")
}

/// Fails with every finding, each on its own line, under one heading.
fn report(what: &str, fix: &str, findings: &[String]) {
    if !findings.is_empty() {
        panic!("\n{what}:\n  {}\n\nfix: {fix}\n", findings.join("\n  "));
    }
}

// ---------------------------------------------------------------- the lexer

/// One Rust source apart: `code` is the text with comments and literals blanked (spaces,
/// newlines kept, so byte offsets and line numbers still hold), `strings` every string
/// literal's contents with its byte offset.
struct Lexed {
    code: String,
    strings: Vec<(usize, String)>,
}

fn lex(src: &str) -> Lexed {
    let b = src.as_bytes();
    let mut code = b.to_vec();
    let mut strings = Vec::new();
    let blank = |code: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut code[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            let end = src[i..].find('\n').map_or(b.len(), |n| i + n);
            blank(&mut code, i, end);
            i = end;
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                    depth += 1;
                    j += 2;
                } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut code, i, j);
            i = j;
        } else if !ident_before && (c == b'r' || (c == b'b' && b.get(i + 1) == Some(&b'r'))) && {
            let s = i + if c == b'b' { 2 } else { 1 };
            let hashes = b[s..].iter().take_while(|&&h| h == b'#').count();
            b.get(s + hashes) == Some(&b'"')
        } {
            // Raw string: r"..", r#".."#, br"..".
            let s = i + if c == b'b' { 2 } else { 1 };
            let hashes = b[s..].iter().take_while(|&&h| h == b'#').count();
            let open = s + hashes + 1;
            let close: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let end = src[open..].find(&close).map_or(b.len(), |n| open + n);
            strings.push((i, src[open..end].to_string()));
            let after = (end + close.len()).min(b.len());
            blank(&mut code, i, after);
            i = after;
        } else if c == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = j.min(b.len());
            strings.push((i, src[i + 1..end].to_string()));
            blank(&mut code, i, (end + 1).min(b.len()));
            i = end + 1;
        } else if c == b'\'' && !ident_before {
            // A char literal ('x', '\n', '\u{..}'), or else a lifetime (left alone).
            let rest = &b[i + 1..];
            let len = if rest.first() == Some(&b'\\') {
                rest.iter().skip(1).position(|&x| x == b'\'').map(|n| n + 2)
            } else {
                let ch = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                (rest.get(ch) == Some(&b'\'')).then_some(ch)
            };
            match len {
                Some(n) => {
                    blank(&mut code, i, i + n + 2);
                    i += n + 2;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    Lexed { code: String::from_utf8(code).expect("blanking keeps UTF-8 boundaries"), strings }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path, // `::`
    Punct(char),
}

fn tokens(code: &str) -> Vec<(usize, Tok)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((s, Tok::Ident(code[s..i].to_string())));
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.') {
                i += 1;
            }
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            out.push((i, Tok::Path));
            i += 2;
        } else if c.is_ascii_whitespace() || !c.is_ascii() {
            i += 1;
        } else {
            out.push((i, Tok::Punct(c as char)));
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------- a. file length

#[test]
fn no_source_file_over_900_lines() {
    let mut files = Vec::new();
    walk(&root(), &mut files);
    let mut long: Vec<(usize, String)> = files
        .iter()
        .filter(|p| has_ext(p, &["rs", "cu", "cuh"]) && !is_test_path(&rel(p)))
        .map(|p| (read(p).lines().count(), rel(p)))
        .filter(|(n, _)| *n > MAX_FILE_LINES)
        .collect();
    long.sort_by(|a, b| b.cmp(a));
    let findings: Vec<String> = long.iter().map(|(n, p)| format!("{p}: {n} lines")).collect();
    report(
        &format!("source files over {MAX_FILE_LINES} lines"),
        "split each by idea (a folder per idea, one file per part, the parent's `//!` header saying how \
         they fit); files under tests/ are exempt",
        &findings,
    );
}

// ---------------------------------------------------------------- b. too_many_arguments

#[test]
fn too_many_arguments_allowed_in_at_most_4_places() {
    let mut files = Vec::new();
    walk(&root(), &mut files);
    let mut sites = Vec::new();
    let mut raised = Vec::new();
    for p in &files {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if has_ext(p, &["rs"]) {
            let src = read(p);
            let lexed = lex(&src);
            for (n, line) in lexed.code.lines().enumerate() {
                if line.contains("clippy::too_many_arguments") {
                    sites.push(format!("{}:{}: {}", rel(p), n + 1, line.trim()));
                }
            }
        } else if matches!(name, "clippy.toml" | ".clippy.toml" | "Cargo.toml") {
            for (n, line) in read(p).lines().enumerate() {
                let line = line.split('#').next().unwrap_or("");
                if line.contains("too-many-arguments") || line.contains("too_many_arguments") {
                    raised.push(format!("{}:{}: {}", rel(p), n + 1, line.trim()));
                }
            }
        }
    }
    report(
        "clippy's too_many_arguments raised or turned off for the workspace",
        "keep clippy's default threshold (7); allow it at a site, within the limit of 4",
        &raised,
    );
    let findings = if sites.len() > MAX_TOO_MANY_ARGUMENTS { sites.clone() } else { Vec::new() };
    report(
        &format!("`allow(clippy::too_many_arguments)` in {} places (at most {MAX_TOO_MANY_ARGUMENTS})", sites.len()),
        "pass the arguments that travel together as one struct (as the backend's op groups do: a shape \
         struct and the tensors), then drop the allow",
        &findings,
    );
}

// ---------------------------------------------------------------- c. import circles
//
// Edges are file to file inside one crate (its lib, its main, each bin): every path that
// starts with `crate::`, `super::`, `self::` or a child module's name, in `use` lines and
// in code, goes to the file that defines what it names; a `pub use` is followed to the
// file it re-exports from (a facade is not an edge of its own). `mod` lines place the
// files; a module's use of its own ancestors (`super::` up to the crate root: they
// declared it) is not an edge.

/// One module of a crate: the file it lives in, and its own (inline) children.
#[derive(Default)]
struct Crate {
    /// Module path (`[]` is the crate root) -> the file holding it.
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// Per module: names it re-exports (`pub use a::b::Name`) -> the path written.
    reexports: HashMap<Vec<String>, Vec<(String, Vec<String>)>>,
    /// Per module: what it glob re-exports (`pub use a::b::*`).
    globs: HashMap<Vec<String>, Vec<Vec<String>>>,
    /// Per module: the items it defines (fn, struct, enum, trait, type, const, static).
    defines: HashMap<Vec<String>, BTreeSet<String>>,
    /// Per file: (module the path is written in, the path) for each path it uses.
    uses: Vec<(PathBuf, Vec<String>, Vec<String>)>,
}

/// A `use` tree written out as paths: `a::{b, c::d as e, f::*}` -> `a::b`, `a::c::d`
/// (alias `e`), `a::f::*`. Returns (path, the name it binds).
fn use_paths(toks: &[Tok]) -> Vec<(Vec<String>, String)> {
    fn tree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
        let mut path = prefix.to_vec();
        loop {
            match toks.get(*i) {
                Some(Tok::Ident(s)) => {
                    path.push(s.clone());
                    *i += 1;
                }
                Some(Tok::Path) => *i += 1,
                Some(Tok::Punct('*')) => {
                    *i += 1;
                    path.push("*".into());
                    out.push((path, "*".into()));
                    return;
                }
                Some(Tok::Punct('{')) => {
                    *i += 1;
                    while !matches!(toks.get(*i), Some(Tok::Punct('}')) | None) {
                        tree(toks, i, &path, out);
                        if matches!(toks.get(*i), Some(Tok::Punct(','))) {
                            *i += 1;
                        }
                    }
                    *i += 1;
                    return;
                }
                _ => break,
            }
        }
        // `x as y`: the ident pushed last was `as`'s target; take `as` apart.
        let mut bound = path.last().cloned().unwrap_or_default();
        if let Some(pos) = path.iter().rposition(|s| s == "as") {
            if pos > prefix.len() {
                bound = path[pos + 1..].first().cloned().unwrap_or_default();
                path.truncate(pos);
            }
        }
        if path.len() > prefix.len() {
            if path.last().is_some_and(|s| s == "self") {
                path.pop();
                bound = path.last().cloned().unwrap_or_default();
            }
            out.push((path, bound));
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    tree(toks, &mut i, &[], &mut out);
    out
}

const ITEM_KEYWORDS: &[&str] = &["fn", "struct", "enum", "trait", "type", "const", "static", "union"];

/// Reads one file of module `module` (and, through its `mod x;` lines, the files below).
fn read_module(c: &mut Crate, file: &Path, module: Vec<String>) {
    let src = read(file);
    let lexed = lex(&src);
    let toks: Vec<Tok> = tokens(&lexed.code).into_iter().map(|(_, t)| t).collect();
    let dir = file.parent().unwrap().to_path_buf();
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("").to_string();
    // Where `mod x;` of this file finds x: beside a mod.rs/lib.rs/main.rs, in a folder
    // named after any other file.
    let child_dir = if matches!(stem.as_str(), "mod" | "lib" | "main") || module.is_empty() {
        dir.clone()
    } else {
        dir.join(&stem)
    };
    c.modules.insert(module.clone(), file.to_path_buf());
    // The inline-module stack: (brace depth it opened at, its module path).
    let mut stack: Vec<(usize, Vec<String>)> = vec![(0, module.clone())];
    let mut depth = 0usize;
    let mut i = 0;
    let mut pending_mod: Option<String> = None;
    while i < toks.len() {
        let here = stack.last().unwrap().1.clone();
        match &toks[i] {
            Tok::Punct('{') => {
                depth += 1;
                if let Some(name) = pending_mod.take() {
                    let mut m = here.clone();
                    m.push(name);
                    c.modules.entry(m.clone()).or_insert_with(|| file.to_path_buf());
                    stack.push((depth, m));
                }
                i += 1;
            }
            Tok::Punct('}') => {
                if stack.len() > 1 && stack.last().unwrap().0 == depth {
                    stack.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(k) if k == "mod" => {
                if let Some(Tok::Ident(name)) = toks.get(i + 1) {
                    if matches!(toks.get(i + 2), Some(Tok::Punct(';'))) {
                        let mut m = here.clone();
                        m.push(name.clone());
                        let base =
                            if stack.len() == 1 { child_dir.clone() } else { dir.join(here[module.len()..].join("/")) };
                        let f = [base.join(format!("{name}.rs")), base.join(name).join("mod.rs")]
                            .into_iter()
                            .find(|p| p.exists());
                        if let Some(f) = f {
                            read_module(c, &f, m);
                        }
                        i += 3;
                        continue;
                    }
                    pending_mod = Some(name.clone());
                    c.defines.entry(here).or_default().insert(name.clone());
                }
                i += 2;
            }
            Tok::Ident(k) if k == "use" => {
                let public = i > 0 && {
                    // `pub use`, `pub(crate) use`, `pub(super) use`
                    let mut j = i - 1;
                    if matches!(toks[j], Tok::Punct(')')) {
                        while j > 0 && toks[j] != Tok::Punct('(') {
                            j -= 1;
                        }
                        j = j.saturating_sub(1);
                    }
                    matches!(&toks[j], Tok::Ident(p) if p == "pub")
                };
                let end = toks[i..].iter().position(|t| *t == Tok::Punct(';')).map_or(toks.len(), |n| i + n);
                for (path, bound) in use_paths(&toks[i + 1..end]) {
                    if public {
                        if bound == "*" {
                            c.globs.entry(here.clone()).or_default().push(path[..path.len() - 1].to_vec());
                        } else {
                            c.reexports.entry(here.clone()).or_default().push((bound, path));
                        }
                    } else {
                        let p = if bound == "*" { path[..path.len() - 1].to_vec() } else { path };
                        c.uses.push((file.to_path_buf(), here.clone(), p));
                    }
                }
                i = end + 1;
            }
            Tok::Ident(k) if ITEM_KEYWORDS.contains(&k.as_str()) => {
                if let Some(Tok::Ident(name)) = toks.get(i + 1) {
                    c.defines.entry(here).or_default().insert(name.clone());
                }
                i += 1;
            }
            Tok::Ident(first) if i == 0 || toks[i - 1] != Tok::Path => {
                // A path in code: `crate::a::b`, `super::x`, `self::y`, `child::z`.
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while let (Some(Tok::Path), Some(Tok::Ident(s))) = (toks.get(j), toks.get(j + 1)) {
                    path.push(s.clone());
                    j += 2;
                }
                if path.len() > 1 {
                    c.uses.push((file.to_path_buf(), here, path));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
}

impl Crate {
    /// Where a path written in module `from` starts: (module, the rest), or None for
    /// another crate's path or a local name.
    fn anchor(&self, from: &[String], path: &[String]) -> Option<(Vec<String>, Vec<String>)> {
        let mut base = from.to_vec();
        let mut k = 0;
        match path.first()?.as_str() {
            "crate" => {
                base.clear();
                k = 1;
            }
            "self" => k = 1,
            "super" => {
                while path.get(k).is_some_and(|s| s == "super") {
                    base.pop()?;
                    k += 1;
                }
            }
            name => {
                let mut child = from.to_vec();
                child.push(name.to_string());
                if !self.modules.contains_key(&child) {
                    return None;
                }
            }
        }
        Some((base, path[k..].to_vec()))
    }

    /// The file that defines what `path`, written in module `from`, names: through
    /// modules, then through re-exports to the item's own file.
    fn resolve(&self, from: &[String], path: &[String], hops: usize) -> Option<PathBuf> {
        let (mut m, rest) = self.anchor(from, path)?;
        for (n, seg) in rest.iter().enumerate() {
            let mut child = m.clone();
            child.push(seg.clone());
            if self.modules.contains_key(&child) {
                m = child;
                continue;
            }
            if hops < 8 && !self.defines.get(&m).is_some_and(|d| d.contains(seg)) {
                if let Some((_, target)) = self.reexports.get(&m).and_then(|r| r.iter().find(|(b, _)| b == seg)) {
                    let mut full = target.clone();
                    full.extend_from_slice(&rest[n + 1..]);
                    return self.resolve(&m, &full, hops + 1).or_else(|| self.modules.get(&m).cloned());
                }
                for g in self.globs.get(&m).into_iter().flatten() {
                    let mut full = g.clone();
                    full.extend_from_slice(&rest[n..]);
                    if let Some(f) = self.resolve(&m, &full, hops + 1) {
                        if self.modules.get(&m) != Some(&f) {
                            return Some(f);
                        }
                    }
                }
            }
            break;
        }
        self.modules.get(&m).cloned()
    }
}

/// The file-level import graph of each crate (a lib, a main, each bin), by file.
fn import_graphs() -> Vec<(String, BTreeMap<String, BTreeSet<String>>)> {
    let root = root();
    let mut graphs = Vec::new();
    let mut manifests: Vec<PathBuf> = Vec::new();
    walk(&root, &mut manifests);
    manifests.retain(|p| p.file_name().is_some_and(|n| n == "Cargo.toml") && p.parent() != Some(&root));
    for m in manifests {
        let src = m.parent().unwrap().join("src");
        let mut roots: Vec<PathBuf> =
            ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.exists()).collect();
        if let Ok(bins) = fs::read_dir(src.join("bin")) {
            roots.extend(bins.flatten().map(|e| e.path()).filter(|p| has_ext(p, &["rs"])));
        }
        for r in roots {
            let mut c = Crate::default();
            read_module(&mut c, &r, Vec::new());
            let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for f in c.modules.values() {
                edges.entry(rel(f)).or_default();
            }
            for (file, from, path) in &c.uses {
                // A module's own ancestors (`super::`, the crate root) declared it and
                // make one unit with it: using their names is not an edge.
                let ancestors: Vec<&PathBuf> = (0..from.len()).filter_map(|k| c.modules.get(&from[..k])).collect();
                if let Some(to) = c.resolve(from, path, 0) {
                    if &to != file && !ancestors.contains(&&to) {
                        edges.entry(rel(file)).or_default().insert(rel(&to));
                    }
                }
            }
            graphs.push((rel(&r), edges));
        }
    }
    graphs
}

/// Tarjan's strongly connected components.
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: HashMap<&'a str, usize>,
        low: HashMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let l = t.low[v].min(t.low[w]);
                t.low.insert(v, l);
            } else if t.on.contains(w) {
                let l = t.low[v].min(t.index[w]);
                t.low.insert(v, l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            comp.sort();
            t.out.push(comp);
        }
    }
    let mut t =
        T { g, index: HashMap::new(), low: HashMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_circle_of_more_than_two_files() {
    let mut findings = Vec::new();
    for (krate, g) in import_graphs() {
        for comp in circles(&g).into_iter().filter(|c| c.len() > MAX_CIRCLE_FILES) {
            let inside: BTreeSet<&String> = comp.iter().collect();
            findings.push(format!("{krate}: {} files import each other:", comp.len()));
            for f in &comp {
                let to: Vec<&str> = g[f].iter().filter(|t| inside.contains(t)).map(String::as_str).collect();
                findings.push(format!("    {f} -> {}", to.join(", ")));
            }
        }
    }
    report(
        &format!("import circles of more than {MAX_CIRCLE_FILES} files inside a crate"),
        "an import points down, never up: move the shared name (a type, an error, a helper) into a leaf \
         both sides import, or pass what the lower file needs in from the file above it",
        &findings,
    );
}

// ---------------------------------------------------------------- d. short front pages

#[test]
fn readme_and_benchmarks_are_short() {
    let mut findings = Vec::new();
    for (file, max, fix) in [
        ("README.md", MAX_README_LINES, "what it is, the two commands, today's results; the rest links into docs/"),
        (
            "BENCHMARKS.md",
            MAX_BENCHMARKS_LINES,
            "how we measure and current results; each run's log in docs/bench-log/",
        ),
    ] {
        let n = read(&root().join(file)).lines().count();
        if n > max {
            findings.push(format!("{file}: {n} lines (at most {max}): {fix}"));
        }
    }
    report("front pages over their length", "move the detail into docs/ and link to it", &findings);
}

// ---------------------------------------------------------------- e. environment table

/// Every `SHARDTRAIN_*` name in a string literal of a crate's non-test source (inline
/// `#[cfg(test)]` modules left out), with the first place it appears.
fn env_names_read() -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for krate in ENV_CRATES {
        let mut files = Vec::new();
        walk(&root().join(krate).join("src"), &mut files);
        for p in files.iter().filter(|p| has_ext(p, &["rs"])) {
            let src = read(p);
            let lexed = lex(&src);
            let tests = test_ranges(&lexed.code);
            for (at, s) in &lexed.strings {
                if tests.iter().any(|r| r.contains(at)) {
                    continue;
                }
                for name in shardtrain_names(s) {
                    let line = src[..*at].lines().count().max(1);
                    names.entry(name).or_insert_with(|| format!("{}:{line}", rel(p)));
                }
            }
        }
    }
    names
}

/// The byte ranges of `#[cfg(test)] mod x { .. }` blocks.
fn test_ranges(code: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(n) = code[from..].find("#[cfg(test)]") {
        let at = from + n;
        from = at + 1;
        let after = code[at + 12..].trim_start();
        if !after.starts_with("mod ") {
            continue;
        }
        let Some(open) = code[at..].find('{').map(|o| at + o) else { break };
        if code[at..open].contains(';') {
            continue;
        }
        let mut depth = 0;
        for (k, ch) in code[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(at..open + k + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

fn shardtrain_names(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(n) = s[from..].find("SHARDTRAIN_") {
        let at = from + n;
        let end = s[at..]
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .map_or(s.len(), |e| at + e);
        if end > at + "SHARDTRAIN_".len() {
            out.push(s[at..end].to_string());
        }
        from = end.max(at + 1);
    }
    out
}

#[test]
fn environment_table_lists_every_variable_read() {
    let read_names = env_names_read();
    let table = fs::read_to_string(root().join(ENV_TABLE)).unwrap_or_else(|_| {
        panic!(
            "\n{ENV_TABLE} is missing: it is the one table of the environment variables the code reads \
             ({} of them: {}), a row each with the name in backticks in the first column\n",
            read_names.len(),
            read_names.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    });
    // A row whose first cell is `SHARDTRAIN_...`.
    let rows: BTreeSet<String> = table
        .lines()
        .filter_map(|l| l.trim().strip_prefix('|')?.split('|').next())
        .filter_map(|cell| cell.trim().strip_prefix('`')?.strip_suffix('`').map(str::to_string))
        .filter(|n| n.starts_with("SHARDTRAIN_"))
        .collect();
    let mut findings: Vec<String> = read_names
        .iter()
        .filter(|(n, _)| !rows.contains(*n))
        .map(|(n, at)| format!("{n}: read at {at}, not in the table: add its row (what it does, its default)"))
        .collect();
    findings.extend(rows.iter().filter(|n| !read_names.contains_key(*n)).map(|n| {
        format!(
            "{n}: a row of the table that no source of {} reads: delete it (or fix its spelling)",
            ENV_CRATES.join(", ")
        )
    }));
    report(
        &format!("{ENV_TABLE} out of step with the SHARDTRAIN_* names the code reads"),
        &format!("one row per variable, the name in backticks in the first column of {ENV_TABLE}"),
        &findings,
    );
}
