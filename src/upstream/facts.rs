//! What asking an engine taught tokenonce, one set per endpoint: its vLLM version (with when
//! it was learned and when an ask last failed) and the model it serves. The health round
//! (`health`) and the reuse gate fill it; any other fact a probe reads of an engine joins it.

use parking_lot::RwLock;
use std::time::{Duration, Instant};

use crate::config::Version;

/// The model an engine serves, from `GET /v1/models` (its first base model): engines whose
/// identities differ must not exchange prompt ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// The served model name (`id`).
    pub id: String,
    /// Where the weights came from (`root`).
    pub root: Option<String>,
    /// The context length (`max_model_len`).
    pub max_model_len: Option<u64>,
}

/// What `GET /version` and `GET /v1/models` said of one engine, held by its
/// [`Endpoint`](super::Endpoint); forgotten when the engine goes away, since it may come
/// back as another vLLM serving another model.
#[derive(Debug, Default)]
pub struct EngineFacts {
    version: RwLock<Option<Version>>,
    /// When the version was learned (it is asked again after a while).
    version_learned_at: RwLock<Option<Instant>>,
    /// When `/version` was last asked and gave nothing usable (retried after a pause).
    version_failed_at: RwLock<Option<Instant>>,
    /// Held while a request asks `/version`, so a burst of first requests asks once.
    pub version_ask: tokio::sync::Mutex<()>,
    /// What `GET /v1/models` said: `None` not asked yet, `Some(None)` asked without a usable
    /// answer.
    model: RwLock<Option<Option<ModelIdentity>>>,
}

impl EngineFacts {
    /// The vLLM version learned from `GET /version`.
    pub fn version(&self) -> Option<Version> {
        *self.version.read()
    }

    /// True when `/version` may be asked now: never failed, or failed over `pause` ago.
    pub fn may_ask_version(&self, pause: Duration) -> bool {
        (*self.version_failed_at.read()).is_none_or(|t| t.elapsed() >= pause)
    }

    /// Records that `/version` gave nothing usable.
    pub fn version_failed(&self) {
        *self.version_failed_at.write() = Some(Instant::now());
    }

    /// Records the version.
    pub fn set_version(&self, version: Version) {
        *self.version.write() = Some(version);
        *self.version_learned_at.write() = Some(Instant::now());
    }

    /// True when the version was learned over `age` ago (or never).
    pub fn version_older_than(&self, age: Duration) -> bool {
        (*self.version_learned_at.read()).is_none_or(|t| t.elapsed() >= age)
    }

    /// Forgets the version: the engine went away and may come back as another vLLM.
    pub fn forget_version(&self) {
        *self.version.write() = None;
        *self.version_learned_at.write() = None;
    }

    /// Ends the pause after a failed `/version` (the engine answers `/health` again).
    pub fn end_version_pause(&self) {
        *self.version_failed_at.write() = None;
    }

    /// The model `GET /v1/models` reported, if known.
    pub fn model(&self) -> Option<ModelIdentity> {
        self.model.read().clone().flatten()
    }

    /// True once `/v1/models` was asked (since the endpoint last turned healthy).
    pub fn model_asked(&self) -> bool {
        self.model.read().is_some()
    }

    /// Records what `/v1/models` said (`None`: nothing usable).
    pub fn set_model(&self, model: Option<ModelIdentity>) {
        *self.model.write() = Some(model);
    }

    /// Forgets the model: the engine went away and may come back serving another.
    pub fn forget_model(&self) {
        *self.model.write() = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_ages_and_is_forgotten() {
        let e = EngineFacts::default();
        assert!(e.version_older_than(Duration::from_secs(3600)), "never learned");
        e.set_version(Version::parse("0.32.0").unwrap());
        assert!(!e.version_older_than(Duration::from_secs(3600)));
        assert!(e.version_older_than(Duration::ZERO));
        e.version_failed();
        assert!(!e.may_ask_version(Duration::from_secs(3600)));
        e.end_version_pause();
        assert!(e.may_ask_version(Duration::from_secs(3600)));
        e.forget_version();
        assert_eq!(e.version(), None);
    }
}
