//! `docs/reference/config.md`, made from this folder's structs: every key with its type, its
//! default (as serde fills it in) and its `///` doc comment. The test fails when the page is
//! not what the structs make (a key added, removed or re-documented without it; run
//! `UPDATE_DOCS=1 cargo test --release -p trainer --lib config::reference` to rewrite it),
//! when a key or section has no doc comment, and when the keys read from the sources are not
//! exactly the ones serde accepts (every struct denies unknown fields and lists the known ones).

use super::Config;
use std::path::{Path, PathBuf};

/// One `pub` field of a config struct, as its source says.
struct Field {
    /// The name in the file (a serde `rename`, or the field's own).
    key: String,
    ty: String,
    doc: String,
    /// No serde default: the file must give it.
    required: bool,
}

/// One config struct with serde derives, as its source says.
struct Struct {
    name: String,
    file: String,
    doc: String,
    fields: Vec<Field>,
}

/// A table of the file: `model`, `train`, ... or the array of tables `data.sources`.
struct Section<'a> {
    path: String,
    array: bool,
    st: &'a Struct,
}

const BASE: &str = "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nvocab_size = 11\nseq_len = 4\n";
const PAGE: &str = "../docs/reference/config.md";

fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/config")
}

/// The doc text of a `///` line.
fn doc_line(t: &str) -> Option<&str> {
    t.strip_prefix("///").map(|d| d.strip_prefix(' ').unwrap_or(d))
}

/// Every `pub struct` of `text` that derives serde's traits, with its `pub` fields.
fn parse_structs(file: &str, text: &str, out: &mut Vec<Struct>) {
    let (mut doc, mut attrs) = (Vec::<String>::new(), Vec::<String>::new());
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if let Some(d) = doc_line(line) {
            doc.push(d.to_string());
            continue;
        }
        if line.starts_with("#[") {
            attrs.push(line.to_string());
            continue;
        }
        let name = line.strip_prefix("pub struct ").and_then(|r| r.strip_suffix(" {"));
        let derives = attrs.iter().any(|a| a.contains("Deserialize"));
        if let (Some(name), true) = (name, derives) {
            let container_default = attrs.iter().any(|a| a.starts_with("#[serde(") && a.contains("default"));
            let fields = parse_fields(&mut lines, container_default);
            out.push(Struct { name: name.to_string(), file: file.to_string(), doc: doc.join(" "), fields });
        }
        doc.clear();
        attrs.clear();
    }
}

/// The `pub` fields up to the struct's closing brace.
fn parse_fields<'a>(lines: &mut impl Iterator<Item = &'a str>, container_default: bool) -> Vec<Field> {
    let (mut fields, mut doc, mut attrs) = (Vec::new(), Vec::<String>::new(), Vec::<String>::new());
    for line in lines.by_ref() {
        if line == "}" {
            break;
        }
        let t = line.trim();
        if let Some(d) = doc_line(t) {
            doc.push(d.to_string());
        } else if t.starts_with("#[") {
            attrs.push(t.to_string());
        } else if let Some((name, ty)) = t.strip_prefix("pub ").and_then(|r| r.split_once(": ")) {
            let rename = attrs.iter().find_map(|a| a.split_once("rename = \"").and_then(|(_, r)| r.split_once('"')));
            let field_default = attrs.iter().any(|a| a.starts_with("#[serde(") && a.contains("default"));
            fields.push(Field {
                key: rename.map_or(name, |r| r.0).to_string(),
                ty: ty.trim_end_matches(',').to_string(),
                doc: doc.join(" "),
                required: !(container_default || field_default),
            });
            doc.clear();
            attrs.clear();
        }
    }
    fields
}

/// `Option<T>` and `Vec<T>` to `T`.
fn inner(ty: &str) -> &str {
    for w in ["Option<", "Vec<"] {
        if let Some(t) = ty.strip_prefix(w).and_then(|t| t.strip_suffix('>')) {
            return t;
        }
    }
    ty
}

/// The sections in file order, from `Config`'s fields down (a field whose type is another
/// config struct is a table of its own).
fn sections(structs: &[Struct]) -> Vec<Section<'_>> {
    let by_name = |n: &str| structs.iter().find(|s| s.name == n);
    let root = by_name("Config").expect("config/mod.rs defines Config");
    let mut out = Vec::new();
    for f in &root.fields {
        let st = by_name(&f.ty).unwrap_or_else(|| panic!("section {} is a {}, not a config struct", f.key, f.ty));
        out.push(Section { path: f.key.clone(), array: false, st });
        for g in &st.fields {
            if let Some(sub) = by_name(inner(&g.ty)) {
                out.push(Section { path: format!("{}.{}", f.key, g.key), array: g.ty.starts_with("Vec<"), st: sub });
            }
        }
    }
    out
}

fn is_table(structs: &[Struct], f: &Field) -> bool {
    structs.iter().any(|s| s.name == inner(&f.ty))
}

fn read_structs() -> Vec<Struct> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(config_dir())
        .expect("src/config")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    let mut structs = Vec::new();
    for p in files {
        let name = p.file_name().expect("name").to_string_lossy().into_owned();
        parse_structs(&name, &std::fs::read_to_string(&p).expect("read"), &mut structs);
    }
    structs
}

/// A config with every section present: the shortest valid `[model]` and one data source,
/// as serde fills them in.
fn defaults() -> toml::Table {
    let text = format!("{BASE}[[data.sources]]\npath = \"p\"\n");
    let cfg = Config::from_toml_str(&text, "defaults").expect("parses");
    match toml::Value::try_from(&cfg).expect("serializes") {
        toml::Value::Table(t) => t,
        _ => unreachable!("a config is a table"),
    }
}

/// The default of `f` in section `path`, in TOML, as the page shows it.
fn default_of(defaults: &toml::Table, s: &Section<'_>, f: &Field) -> String {
    if f.required {
        return "required".into();
    }
    let mut v: Option<&toml::Value> = None;
    for (i, part) in s.path.split('.').enumerate() {
        let t = if i == 0 { defaults.get(part) } else { v.and_then(|v| v.get(part)) };
        v = t.map(|t| if let toml::Value::Array(a) = t { &a[0] } else { t });
    }
    match v.and_then(|t| t.get(&f.key)) {
        None => "unset".into(),
        Some(toml::Value::Float(x)) if f.ty == "f32" => format!("`{:?}`", *x as f32),
        Some(toml::Value::Float(x)) => format!("`{x:?}`"),
        Some(x) => format!("`{x}`"),
    }
}

/// One line of a table cell: intra-doc links as code, pipes escaped.
fn cell(doc: &str) -> String {
    doc.replace("[`", "`").replace("`]", "`").replace('|', "\\|")
}

fn render(structs: &[Struct]) -> String {
    let defaults = defaults();
    let mut md = String::from(
        "# Configuration reference\n\n\
         Every key of a shardtrain config file (TOML), section by section: its type, its default, and what it \
         does. A key can also be set on the command line as `--set section.key=value`. An unknown key or \
         section, or a value of the wrong type, is refused naming it; a value that cannot work is refused \
         naming the key and the fix.\n\n\
         <!-- Made from the doc comments of trainer/src/config/*.rs by the test config::reference: edit \
         those, then run `UPDATE_DOCS=1 cargo test --release -p trainer --lib config::reference`. -->\n",
    );
    for s in sections(structs) {
        let head = if s.array { format!("[[{}]]", s.path) } else { format!("[{}]", s.path) };
        md +=
            &format!("\n## `{head}`\n\n{} (`{}`, `trainer/src/config/{}`)\n\n", cell(&s.st.doc), s.st.name, s.st.file);
        md += "| key | type | default | what it does |\n|---|---|---|---|\n";
        for f in s.st.fields.iter().filter(|f| !is_table(structs, f)) {
            let key = if s.array { format!("{}[].{}", s.path, f.key) } else { format!("{}.{}", s.path, f.key) };
            let ty = inner(&f.ty).replace('<', "&lt;").replace('>', "&gt;");
            md += &format!("| `{key}` | `{ty}` | {} | {} |\n", default_of(&defaults, &s, f), cell(&f.doc));
        }
    }
    md
}

/// The names serde accepts at `table` (a dotted path; "" for the top level), from the error
/// an unknown key gets: "unknown field `__probe__`, expected one of `a`, `b`, ...".
fn accepted(table: &str, array: bool) -> Vec<String> {
    let text = match (table, array) {
        ("", _) => format!("__probe__ = 1\n{BASE}"),
        ("model", _) => format!("{BASE}__probe__ = 1\n"),
        (t, true) => format!("{BASE}[[{t}]]\npath = \"p\"\n__probe__ = 1\n"),
        (t, false) => format!("{BASE}[{t}]\n__probe__ = 1\n"),
    };
    let e = Config::from_toml_str(&text, "probe").expect_err("an unknown key is refused").to_string();
    let (_, list) = e.split_once("unknown field `__probe__`, expected").unwrap_or_else(|| panic!("{table}: {e}"));
    let list = list.lines().next().unwrap_or_default();
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

#[test]
fn every_key_has_a_doc_comment_and_serde_accepts_exactly_them() {
    let structs = read_structs();
    let root = structs.iter().find(|s| s.name == "Config").expect("Config");
    let mut sections_named: Vec<String> = root.fields.iter().map(|f| f.key.clone()).collect();
    let mut top = accepted("", false);
    sections_named.sort();
    top.sort();
    assert_eq!(sections_named, top, "Config's fields are not the sections serde accepts");
    for s in sections(&structs) {
        assert!(
            !s.st.doc.is_empty(),
            "{} ({}) has no /// doc comment: the page's [{}] needs one",
            s.st.name,
            s.st.file,
            s.path
        );
        let mut ours: Vec<String> = s.st.fields.iter().map(|f| f.key.clone()).collect();
        let mut serde = accepted(&s.path, s.array);
        ours.sort();
        serde.sort();
        assert_eq!(ours, serde, "[{}]: the keys in {} are not the ones serde accepts", s.path, s.st.file);
        for f in &s.st.fields {
            assert!(!f.doc.is_empty(), "{}.{} ({}) has no /// doc comment", s.path, f.key, s.st.file);
        }
    }
}

#[test]
fn the_reference_page_is_made_from_the_structs() {
    let want = render(&read_structs());
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join(PAGE);
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(&page, &want).expect("write docs/reference/config.md");
        return;
    }
    let have = std::fs::read_to_string(&page).unwrap_or_default();
    assert!(
        have == want,
        "docs/reference/config.md is not what trainer/src/config/*.rs's doc comments make: run \
         `UPDATE_DOCS=1 cargo test --release -p trainer --lib config::reference` and commit the page"
    );
}
