//! Configuration: the file as typed data (`file`, its value types in `values`, durations and
//! their ranges in `duration`), read from TOML with every problem reported at once
//! ([`crate::toml_read`]), checked across keys (`check`), then what its paths name loaded
//! (`resources`). The embedded default (`conf/default.toml`) runs when no file is given.

mod check;
mod duration;
pub mod file;
mod resources;
pub mod values;

pub use crate::toml_read::Problem;
pub use duration::{MAX_ANSWER_MS, MAX_LEG_MS};
pub use file::{
    AllowRule, Cache, CacheAware, Config, Defaults, Match, Pool, PoolKvEvents, PoolTls, Prefill, Route, Server,
    ServerTls, Tracing, Upstream,
};
pub use resources::{AdminToken, MissingFiles, PoolResources, Resources, SkippedFile};
pub use values::{
    parse_allow, AllowEntry, AllowTarget, Balance, BlockSize, ClientHandoff, LocalIdsMode, LogFormat, Mode, ModelGlob,
    Net, OnClientGone, OnPrefillFailure, OtlpProtocol, ParityPolicy, RelayHandoff, ReuseShare, Version,
};

/// The embedded default configuration text.
pub const DEFAULT_TOML: &str = include_str!("../../conf/default.toml");

/// Every problem found in one file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} problem(s) in {source_name}", problems.len())]
pub struct ConfigError {
    /// The file name (or `<embedded default>`).
    pub source_name: String,
    /// The problems, in file order (those with no place last).
    pub problems: Vec<Problem>,
}

/// A config and what its paths name: what tokenonce runs on.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The settings.
    pub config: Config,
    /// The certificates, tokens and tokenizers they name.
    pub resources: Resources,
}

impl Config {
    /// Parses and checks TOML text, reading no file; `source_name` labels the problems.
    ///
    /// # Errors
    /// [`ConfigError`] listing every problem found, in file order.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        read(text, source_name, None).map(|loaded| loaded.config)
    }
}

/// Parses and checks TOML text and loads what it names (`tokenonce check` and every load).
///
/// # Errors
/// [`ConfigError`] listing every problem found, in file order.
pub fn from_toml(text: &str, source_name: &str) -> Result<Loaded, ConfigError> {
    read(text, source_name, Some(MissingFiles::Problem))
}

/// Reads, checks and loads a file.
///
/// # Errors
/// [`ConfigError`] with one problem when the file cannot be read, else every problem found.
pub fn load(path: &std::path::Path) -> Result<Loaded, ConfigError> {
    load_with(path, MissingFiles::Problem)
}

/// [`load`], with files the config names that do not exist treated as `missing` says
/// (`tokenonce check --skip-missing-files`); skipped ones are in [`Resources::skipped`].
///
/// # Errors
/// As [`load`].
pub fn load_with(path: &std::path::Path, missing: MissingFiles) -> Result<Loaded, ConfigError> {
    let name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => read(&text, &name, Some(missing)),
        Err(e) => Err(ConfigError {
            source_name: name,
            problems: vec![Problem { line: 0, column: 0, key: String::from("(file)"), message: e.to_string() }],
        }),
    }
}

/// The embedded default, loaded.
///
/// # Errors
/// Only if the shipped default is broken (a test keeps it valid).
pub fn embedded_default() -> Result<Loaded, ConfigError> {
    from_toml(DEFAULT_TOML, "<embedded default>")
}

/// Parse, check and (with `resources`, treating missing files so) load: every problem of the
/// three in one list.
fn read(text: &str, source_name: &str, resources: Option<MissingFiles>) -> Result<Loaded, ConfigError> {
    let (config, mut problems, doc) = crate::toml_read::read::<Config>(text);
    let loaded = config.map(|config| {
        check::check(&config, &doc, &mut problems);
        let resources = match resources {
            Some(missing) => resources::load(&config, &doc, &mut problems, missing),
            None => Resources::default(),
        };
        Loaded { config, resources }
    });
    match loaded {
        Some(loaded) if problems.is_empty() => Ok(loaded),
        _ => {
            // File order; problems of the file as a whole (no place) last.
            problems.sort_by_key(|p| (p.line == 0, p.line, p.column));
            Err(ConfigError { source_name: source_name.to_owned(), problems })
        }
    }
}
