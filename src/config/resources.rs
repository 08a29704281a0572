//! What a config's paths name, loaded: the admin token, the TLS listener's certificate, each
//! pool's TLS material and tokenizer, the TLS of header-named prefillers. The one place config
//! loading reads files; `tokenonce check` runs it too, and a file that does not load is a
//! problem at its key.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::file::{Config, PoolTls};
use super::values::{Balance, LocalIdsMode};
use crate::parity::Tokenizer;
use crate::render::{ChatTemplate, LoadOptions, Mistral};
use crate::tls::{self, Identity, UpstreamTls};
use crate::toml_read::{Doc, Problem};

/// Everything the config's paths name, as loaded.
#[derive(Debug, Clone, Default)]
pub struct Resources {
    /// The token `/drain` requires (`None`: state-changing admin endpoints are off).
    pub admin_token: Option<AdminToken>,
    /// The TLS client listener's certificate chain and key.
    pub server_identity: Option<Identity>,
    /// Per pool name.
    pub pools: BTreeMap<String, PoolResources>,
    /// Per route name: the TLS of each entry of its header prefill's allowlist, in order
    /// (`None`: plain HTTP).
    pub allow_tls: BTreeMap<String, Vec<Option<UpstreamTls>>>,
    /// Files not loaded because they do not exist ([`MissingFiles::Skip`] only), in config order.
    pub skipped: Vec<SkippedFile>,
}

/// What loading does with a file the config names that does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingFiles {
    /// A problem at its key (a start, a reload, plain `tokenonce check`).
    #[default]
    Problem,
    /// Skipped and listed in [`Resources::skipped`]: `tokenonce check --skip-missing-files`,
    /// a pod's config (Secret and model volume paths) checked outside the pod. A file that
    /// exists is loaded and checked as always.
    Skip,
}

/// A file the config names, skipped because it does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedFile {
    /// The key naming it (`server.admin_token_file`, `pools.NAME.tokenizer`, ...).
    pub key: String,
    /// The path, as written.
    pub path: String,
}

/// What one pool's paths name.
#[derive(Debug, Clone, Default)]
pub struct PoolResources {
    /// TLS to its engines (`None`: plain HTTP).
    pub tls: Option<UpstreamTls>,
    /// The engines' tokenizer.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The model's chat template, with `local_ids` on.
    pub template: Option<Arc<ChatTemplate>>,
    /// With `local_ids` on, a Mistral model's renderer (vLLM's Mistral tokenizer mode, no
    /// chat template), in place of `template`.
    pub mistral: Option<Arc<Mistral>>,
}

/// The secret state-changing admin requests must carry; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl AdminToken {
    /// The token in `path`: the file's text without surrounding white space, at least 16
    /// printable characters (a guessable token protects nothing).
    ///
    /// # Errors
    /// Why the file holds no token, naming the path.
    pub fn read(path: &str) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
        let token = text.trim();
        if token.len() < 16 || token.chars().any(|c| !c.is_ascii_graphic()) {
            return Err(format!("`{path}` must hold one token of at least 16 printable characters"));
        }
        Ok(Self(token.to_owned()))
    }

    /// The `Authorization` header value that carries it (what `tokenonce drain` sends).
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// True when `presented` is the token (compared in time independent of where they differ).
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

/// Loads what `config` names; what does not load is a problem at its key (with
/// [`MissingFiles::Skip`], a file that does not exist is skipped instead, and listed).
pub(super) fn load(config: &Config, doc: &Doc<'_>, problems: &mut Vec<Problem>, missing: MissingFiles) -> Resources {
    let mut fail = |path: &str, why: String| problems.push(doc.at_value(path, why));
    let mut skipped = Vec::new();
    // True when every named file is there to load (or missing ones are problems); else
    // records each missing one and the caller skips what they make up.
    let mut present = |files: &[(&str, Option<&str>)]| {
        let gone = files
            .iter()
            .filter_map(|(key, path)| path.map(|p| (key, p)))
            .filter(|(_, path)| missing == MissingFiles::Skip && !Path::new(path).exists());
        let gone: Vec<SkippedFile> =
            gone.map(|(key, path)| SkippedFile { key: (*key).to_owned(), path: path.to_owned() }).collect();
        let all_there = gone.is_empty();
        skipped.extend(gone);
        all_there
    };
    let server = &config.server;
    let admin_token = server
        .admin_token_file
        .as_deref()
        .filter(|path| present(&[("server.admin_token_file", Some(path))]))
        .and_then(|path| AdminToken::read(path).map_err(|why| fail("server.admin_token_file", why)).ok());
    let server_identity = server.tls.as_ref().and_then(|t| {
        let keys = ["server.tls.cert_file", "server.tls.key_file"];
        let files = [(keys[0], Some(t.cert_file.as_str())), (keys[1], Some(t.key_file.as_str()))];
        present(&files).then(|| identity(&t.cert_file, &t.key_file, keys, &mut fail)).flatten()
    });
    let mut pools = BTreeMap::new();
    for (name, pool) in &config.pools {
        let tokenizer_key = format!("pools.{name}.tokenizer");
        let tokenizer_path = pool.tokenizer.as_deref().filter(|path| present(&[(&tokenizer_key, Some(path))]));
        let tokenizer = tokenizer_path.and_then(|path| {
            let loaded = Tokenizer::load(Path::new(path)).map(Arc::new);
            loaded.map_err(|why| fail(&tokenizer_key, why)).ok()
        });
        let tls = pool.tls.as_ref().and_then(|t| {
            let at = format!("pools.{name}.tls");
            present(&tls_files(&at, t).each()).then(|| pool_tls(&at, t, &mut fail)).flatten()
        });
        let loaded = tokenizer.as_ref().and_then(|t| t.tekken());
        let renderer = match (tokenizer_path, pool.local_ids) {
            (Some(path), LocalIdsMode::Shadow | LocalIdsMode::On) => {
                renderer(Path::new(path), loaded).map_err(|why| fail(&format!("pools.{name}.local_ids"), why)).ok()
            }
            // A cache-aware pool with a tokenizer steers by its prompts' ids, local ids off or
            // not; a model folder that cannot render leaves it its text keys.
            (Some(path), LocalIdsMode::Off) if pool.balance == Balance::CacheAware => renderer(Path::new(path), loaded)
                .map_err(
                    |why| tracing::warn!(pool = %name, %why, "cache-aware picks go by text keys: no chat template"),
                )
                .ok(),
            _ => None,
        };
        let (template, mistral) = match renderer {
            Some(Renderer::Template(template)) => (Some(template), None),
            Some(Renderer::Mistral(mistral)) => (None, Some(mistral)),
            None => (None, None),
        };
        pools.insert(name.clone(), PoolResources { tls, tokenizer, template, mistral });
    }
    let mut allow_tls = BTreeMap::new();
    for (i, route) in config.routes.iter().enumerate() {
        let Some(prefill) = route.prefill.as_ref().filter(|p| p.header.is_some()) else { continue };
        let entries = prefill.allow.iter().enumerate().map(|(j, rule)| {
            let path = format!("routes[{i}].prefill.allow[{j}].tls");
            rule.tls
                .as_ref()
                .and_then(|t| present(&tls_files(&path, t).each()).then(|| pool_tls(&path, t, &mut fail)).flatten())
        });
        allow_tls.insert(route.name.clone(), entries.collect());
    }
    Resources { admin_token, server_identity, pools, allow_tls, skipped }
}

/// The files of a `tls` table with their keys.
struct TlsFiles<'a> {
    keys: [String; 3],
    paths: [Option<&'a str>; 3],
}

impl TlsFiles<'_> {
    fn each(&self) -> Vec<(&str, Option<&str>)> {
        self.keys.iter().map(String::as_str).zip(self.paths).collect()
    }
}

fn tls_files<'a>(at: &str, t: &'a PoolTls) -> TlsFiles<'a> {
    TlsFiles {
        keys: [format!("{at}.ca_file"), format!("{at}.cert_file"), format!("{at}.key_file")],
        paths: [t.ca_file.as_deref(), t.cert_file.as_deref(), t.key_file.as_deref()],
    }
}

/// A certificate and key loaded from their files: a file that cannot be read is a problem at
/// its own key (both are reported), one that does not parse or a pair that does not belong
/// together a problem at the certificate.
fn identity(
    cert: &str,
    key: &str,
    [cert_key, key_key]: [&str; 2],
    fail: &mut impl FnMut(&str, String),
) -> Option<Identity> {
    if cert.is_empty() || key.is_empty() {
        return None; // a required key is missing: the checks said so
    }
    let mut readable = |path: &str, at: &str| {
        std::fs::File::open(path).map_err(|e| fail(at, format!("cannot read `{path}`: {e}"))).is_ok()
    };
    let cert_readable = readable(cert, cert_key);
    if !(readable(key, key_key) && cert_readable) {
        return None;
    }
    Identity::load(cert, key).map_err(|why| fail(cert_key, why)).ok()
}

/// How a pool's requests are rendered locally.
enum Renderer {
    Template(Arc<ChatTemplate>),
    Mistral(Arc<Mistral>),
}

/// The renderer of the model folder `tokenizer` names (the folder, or the file's folder):
/// Mistral's when vLLM would serve it in its Mistral mode (over `loaded`, the pool's tekken
/// tokenizer, when it is one), else its chat template.
fn renderer(tokenizer: &Path, loaded: Option<&Arc<crate::render::Tekken>>) -> Result<Renderer, String> {
    let folder = if tokenizer.is_dir() { tokenizer } else { tokenizer.parent().unwrap_or(Path::new(".")) };
    let options = LoadOptions::default();
    let loaded = match Mistral::for_folder(folder, &options, loaded) {
        Some(mistral) => mistral.map(|m| Renderer::Mistral(Arc::new(m))),
        None => ChatTemplate::load(folder, options).map(|t| Renderer::Template(Arc::new(t))),
    };
    loaded.map_err(|e| format!("cannot render locally with `{}`: {e}", folder.display()))
}

/// `[pools.NAME.tls]`'s (or an allowlist entry's `tls`) CA bundle and client certificate.
fn pool_tls(path: &str, t: &PoolTls, fail: &mut impl FnMut(&str, String)) -> Option<UpstreamTls> {
    let ca_key = format!("{path}.ca_file");
    let ca = match &t.ca_file {
        None => Ok(None),
        Some(file) => tls::load_ca(file).map(Some).map_err(|why| fail(&ca_key, why)),
    };
    let client = match (&t.cert_file, &t.key_file) {
        (Some(cert), Some(key)) => {
            let (cert_key, key_key) = (format!("{path}.cert_file"), format!("{path}.key_file"));
            identity(cert, key, [&cert_key, &key_key], fail).map(Some).ok_or(())
        }
        (None, None) => Ok(None),
        _ => Err(()), // the checks said they go together
    };
    Some(UpstreamTls::new(ca.ok()?, t.server_name.clone(), client.ok()?, t.verify))
}
