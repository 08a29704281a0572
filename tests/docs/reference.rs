//! The configuration reference, generated: walks the serde structs of `src/config/file.rs`
//! (parsed with `syn`) from `Config` down, one section per TOML table and a row per key with
//! its type, default and meaning, all taken from the field's doc comment: the meaning, then a
//! `Default:` line with the value as written in TOML, then the reason for that default.

use std::collections::HashMap;
use std::fmt::Write as _;

/// One key of the file format.
pub struct Key {
    /// Full path as the reference names it (`server.listen`, `pools.NAME.balance`).
    pub path: String,
    /// Its TOML type, in words.
    pub kind: String,
    /// The default as written in TOML, when it has one.
    pub default: Option<String>,
    /// What it means (the field's doc, less its `Default:` line).
    pub meaning: String,
    /// Why the default is what it is (the doc lines after the `Default:` line).
    pub why: Option<String>,
}

/// One TOML table of the format and its keys.
pub struct Section {
    /// Path of the table (`server`, `pools.NAME`, `routes`); its keys start with it.
    pub path: String,
    /// The table's header as written in a file (`[server]`, `[[routes]]`).
    pub header: String,
    /// What the table is for (the struct's doc, less its header).
    pub intro: String,
    /// Its keys, in the struct's order.
    pub keys: Vec<Key>,
}

/// How a field's type reads in TOML.
enum Shape {
    /// A value: `string`, `integer`, ...
    Value(String),
    /// A table of one struct.
    Table(String),
    /// An array of tables of one struct (`[[routes]]`).
    Tables(String),
    /// Tables of one struct under names the operator chooses (`[pools.NAME]`).
    Named(String),
}

/// Sections of the whole format, in the order of `File`'s fields.
pub fn sections(file_rs: &str, values_rs: &str) -> Vec<Section> {
    let file = syn::parse_file(file_rs).expect("src/config/file.rs parses");
    let values = syn::parse_file(values_rs).expect("src/config/values.rs parses");
    // Written as a string in TOML: the named choices (enums) and values parsed from a string.
    let strings: Vec<String> = values
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Enum(e) => Some(e.ident.to_string()),
            syn::Item::Struct(s) if s.attrs.iter().any(|a| quote_of(a).contains("try_from = \"String\"")) => {
                Some(s.ident.to_string())
            }
            _ => None,
        })
        .collect();
    let structs: HashMap<String, &syn::ItemStruct> = file
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Struct(s) => Some((s.ident.to_string(), s)),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    walk(&structs, &strings, ("Config", "", String::new(), String::new()), &mut out);
    out
}

/// Adds the section of struct `name` at `path` (unless it holds no key itself, like `File`),
/// introduced by the doc of the field holding it and its own, then the sections of its
/// sub-tables.
fn walk(
    structs: &HashMap<String, &syn::ItemStruct>,
    strings: &[String],
    (name, path, header, field_doc): (&str, &str, String, String),
    out: &mut Vec<Section>,
) {
    let item = structs.get(name).unwrap_or_else(|| panic!("struct {name} in file.rs"));
    let syn::Fields::Named(fields) = &item.fields else { panic!("{name} has named fields") };
    let mut keys = Vec::new();
    let mut tables = Vec::new();
    for field in &fields.named {
        let (rename, flatten, duration) = serde_attrs(&field.attrs);
        if flatten {
            continue;
        }
        let key = rename.unwrap_or_else(|| field.ident.as_ref().expect("named").to_string());
        let key_path = if path.is_empty() { key } else { format!("{path}.{key}") };
        let doc = doc_lines(&field.attrs);
        match shape(&field.ty, structs, strings) {
            Shape::Value(_) if duration => keys.push(entry(key_path, "duration".into(), &doc)),
            Shape::Value(kind) => keys.push(entry(key_path, kind, &doc)),
            Shape::Table(s) => tables.push((s, key_path.clone(), format!("[{key_path}]"), doc)),
            Shape::Tables(s) => tables.push((s, key_path.clone(), format!("[[{key_path}]]"), doc)),
            Shape::Named(s) => tables.push((s, format!("{key_path}.NAME"), format!("[{key_path}.NAME]"), doc)),
        }
    }
    if !keys.is_empty() {
        // The struct's doc opens with the table's header, which the section's title shows.
        let own = plain(&doc_lines(&item.attrs).join(" "));
        let own = match own.strip_prefix(&format!("`{header}`")) {
            Some(rest) => rest.trim_start_matches(':').trim(),
            // A struct another table reuses (a pool's `tls` under an allowlist entry): its doc
            // speaks of that table, the field's doc of this one.
            None if own.starts_with("`[") => "",
            None => own.trim(),
        };
        let intro: Vec<String> =
            [plain(&field_doc), own.to_owned()].into_iter().filter(|t| !t.is_empty()).map(capitalized).collect();
        out.push(Section { path: path.to_owned(), header, intro: intro.join(" "), keys });
    }
    for (s, p, h, doc) in tables {
        walk(structs, strings, (&s, &p, h, doc.join(" ")), out);
    }
}

/// The text with its first letter in upper case.
fn capitalized(text: String) -> String {
    let mut chars = text.chars();
    chars.next().map_or_else(String::new, |c| c.to_uppercase().chain(chars).collect())
}

/// A key's row from its doc lines: the `Default:` line gives the value, the lines after it
/// the reason.
fn entry(path: String, kind: String, doc: &[String]) -> Key {
    let at = doc.iter().position(|l| l.starts_with("Default: "));
    let (meaning, rest) = doc.split_at(at.unwrap_or(doc.len()));
    let mut default = None;
    let mut why = None;
    if let Some((line, reason)) = rest.split_first() {
        let value = line.split('`').nth(1).unwrap_or_else(|| panic!("{path}: `Default: `VALUE`.` ({line})"));
        assert!(line == &format!("Default: `{value}`."), "{path}: the Default line is only its value ({line})");
        assert!(!reason.is_empty(), "{path}: say why after the Default line");
        assert!(!reason.iter().any(|l| l.starts_with("Default: ")), "{path}: one `Default:` line at most");
        default = Some(value.to_owned());
        why = Some(reason.join(" "));
    }
    let meaning = plain(&meaning.join(" "));
    Key { path, kind, default, meaning, why }
}

/// The text of `///` lines, each without its first space.
fn doc_lines(attrs: &[syn::Attribute]) -> Vec<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            syn::Meta::NameValue(syn::MetaNameValue {
                value: syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }),
                ..
            }) => Some(s.value().strip_prefix(' ').map(str::to_owned).unwrap_or_else(|| s.value())),
            _ => None,
        })
        .collect()
}

/// `#[serde(rename = "..")]` and `#[serde(flatten)]` of a field, and whether it is read as a
/// duration (`deserialize_with = "duration::.."`).
fn serde_attrs(attrs: &[syn::Attribute]) -> (Option<String>, bool, bool) {
    let mut rename = None;
    let mut flatten = false;
    let mut duration = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename") {
                rename = Some(meta.value()?.parse::<syn::LitStr>()?.value());
            } else if meta.path.is_ident("flatten") {
                flatten = true;
            } else if meta.path.is_ident("deserialize_with") {
                duration = meta.value()?.parse::<syn::LitStr>()?.value().starts_with("duration::");
            } else if meta.input.peek(syn::Token![=]) {
                meta.value()?.parse::<syn::Expr>()?;
            }
            Ok(())
        })
        .expect("serde attribute parses");
    }
    (rename, flatten, duration)
}

/// What a field's Rust type is in TOML, through `Option`.
fn shape(ty: &syn::Type, structs: &HashMap<String, &syn::ItemStruct>, strings: &[String]) -> Shape {
    let syn::Type::Path(p) = ty else { panic!("unexpected type in file.rs") };
    let last = p.path.segments.last().expect("a type name");
    let args: Vec<&syn::Type> = match &last.arguments {
        syn::PathArguments::AngleBracketed(a) => a
            .args
            .iter()
            .filter_map(|g| match g {
                syn::GenericArgument::Type(t) => Some(t),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let name = last.ident.to_string();
    match (name.as_str(), args.as_slice()) {
        ("Option", [inner]) => shape(inner, structs, strings),
        ("Vec", [inner]) => match shape(inner, structs, strings) {
            Shape::Value(v) => Shape::Value(format!("array of {v}s")),
            Shape::Table(s) => Shape::Tables(s),
            _ => panic!("nested arrays in file.rs"),
        },
        ("BTreeMap", [_, inner]) => match shape(inner, structs, strings) {
            Shape::Value(v) => Shape::Value(format!("table of {v}s")),
            Shape::Table(s) => Shape::Named(s),
            _ => panic!("nested maps in file.rs"),
        },
        ("String", []) => Shape::Value("string".into()),
        ("u16" | "u32" | "u64" | "usize" | "BlockSize", []) => Shape::Value("integer".into()),
        ("Duration", []) => Shape::Value("duration".into()),
        ("f64", []) => Shape::Value("float".into()),
        ("bool", []) => Shape::Value("boolean".into()),
        ("ReuseShare", []) => Shape::Value("boolean or float".into()),
        // Named choices, and values parsed from a string (src/config/values.rs).
        (s, []) if strings.iter().any(|n| n == s) => Shape::Value("string".into()),
        (s, []) if structs.contains_key(s) => Shape::Table(s.to_owned()),
        (other, _) => panic!("file.rs type {other}: teach tests/docs/reference.rs how it reads in TOML"),
    }
}

/// An attribute's tokens as text.
fn quote_of(attr: &syn::Attribute) -> String {
    match &attr.meta {
        syn::Meta::List(list) => list.tokens.to_string(),
        _ => String::new(),
    }
}

/// Rustdoc links as plain code spans: ``[`X`](path)`` and ``[`X`]`` become `` `X` ``.
fn plain(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("[`") {
        let Some(close) = rest[at..].find("`]") else { break };
        out.push_str(&rest[..at]);
        out.push_str(&rest[at + 1..at + close + 1]);
        rest = &rest[at + close + 2..];
        if rest.starts_with('(') {
            rest = rest.find(')').map_or(rest, |end| &rest[end + 1..]);
        }
    }
    out.push_str(rest);
    out
}

/// A table cell: pipes escaped.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// The page: a header, a table per section, and the embedded default config.
pub fn render(sections: &[Section], default_toml: &str) -> String {
    let mut page = String::from(HEADER);
    page.push_str("\nTables: ");
    let links: Vec<String> = sections.iter().map(|s| format!("[`{}`](#{})", s.header, anchor(&s.header))).collect();
    page.push_str(&links.join(", "));
    page.push_str(".\n");
    for section in sections {
        let _ = write!(page, "\n## `{}`\n\n{}\n\n", section.header, section.intro);
        page.push_str("| key | type | default | meaning |\n|---|---|---|---|\n");
        for key in &section.keys {
            let default = key.default.as_ref().map_or_else(|| "—".to_owned(), |d| format!("`{d}`"));
            let mut meaning = cell(&key.meaning);
            if let Some(why) = &key.why {
                let _ = write!(meaning, " *Why this default:* {}", cell(&plain(why)));
            }
            let _ = writeln!(page, "| `{}` | {} | {} | {} |", key.path, key.kind, cell(&default), meaning);
        }
    }
    let _ = write!(
        page,
        "\n## The embedded default\n\nWhat `tokenonce` runs with no `--config` \
         ([`conf/default.toml`](../conf/default.toml); `tokenonce print-default` prints it):\n\n```toml\n{default_toml}```\n"
    );
    page
}

/// GitHub's heading anchor of `` `[pools.NAME]` ``: lower case, punctuation but `-` and `_` dropped.
fn anchor(header: &str) -> String {
    header.to_lowercase().chars().filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_').collect()
}

const HEADER: &str = "\
# Configuration reference

<!-- Generated by tests/docs.rs from the doc comments of src/config/file.rs: edit those,
then run `TOKENONCE_BLESS=1 cargo test --test docs`. -->

tokenonce reads one TOML file (`tokenonce --config FILE`), validated as a whole:
`tokenonce check FILE` prints every problem as `file:line:col: key: message` and exits non-zero
on any, and a reload of a file with problems (SIGHUP, `POST /admin/reload`, the file watch)
keeps the running config. Every key is
optional unless its meaning says *required*; an unknown key is a problem, not ignored (the
problem names the key of its table most like it: *did you mean `grace_period_seconds`?*). Keys
marked *Fixed at start* keep their start value across a reload, which names each one it could
not apply in a warn line ([operations](operations.md#reload)). Examples, each checked in CI:
[`conf/pd-pools.toml`](../conf/pd-pools.toml) (plain P/D pools, per-model and per-tenant
routes), [`conf/llmd-header.toml`](../conf/llmd-header.toml) (llm-d's endpoint picker names the
prefiller in `x-prefiller-host-port`), [`conf/relay.toml`](../conf/relay.toml) (behind an
orchestrator that sends both legs), [`conf/kv-aware.toml`](../conf/kv-aware.toml) (cache-aware
choice over the engines' KV events, the engine flags it needs), and the embedded default at
the end of this page.

A *duration* is a string with a unit, `\"500ms\"`, `\"30s\"`, `\"2m\"`, `\"1h\"`, with a fraction
(`\"1.5s\"`) or several in a row (`\"1m30s\"`), or an integer in the unit its key ends with:
milliseconds for `_ms`, seconds for `_seconds` (which take whole seconds only).
";
