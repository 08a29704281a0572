//! What asking an engine taught tokenonce, one set per endpoint: its vLLM version (with when
//! it was learned and when an ask last failed), the model it serves and its own pressure
//! (from `/metrics`, with when it was read). The health round (`health`) and the reuse gate
//! fill it; any other fact a probe reads of an engine joins it.

use parking_lot::RwLock;
use std::time::{Duration, Instant};

use super::engine_load::{EngineLoad, Pressure};
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
    /// What `GET /metrics` last said of the engine's pressure, and when it was read.
    load: RwLock<Option<(EngineLoad, Instant)>>,
    /// When `/metrics` was last asked (whatever it answered).
    load_asked_at: RwLock<Option<Instant>>,
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

    /// The engine's pressure as last read, when read under `max_age` ago.
    pub fn load(&self, max_age: Duration) -> Option<EngineLoad> {
        self.load.read().as_ref().filter(|(_, at)| at.elapsed() < max_age).map(|(load, _)| load.clone())
    }

    /// The numbers of the engine's pressure as last read, when read under `max_age` ago
    /// (what a pick reads: nothing is cloned).
    pub fn pressure(&self, max_age: Duration) -> Option<Pressure> {
        self.load.read().as_ref().filter(|(_, at)| at.elapsed() < max_age).map(|(load, _)| load.pressure())
    }

    /// Whether the engine runs or queues requests of LoRA adapter `name`, as last read under
    /// `max_age` ago (`None`: no such read, or the engine serves no LoRA).
    pub fn runs_adapter(&self, name: &str, max_age: Duration) -> Option<bool> {
        let load = self.load.read();
        let (load, _) = load.as_ref().filter(|(_, at)| at.elapsed() < max_age)?;
        load.max_loras?;
        Some(load.loras_running.iter().chain(&load.loras_waiting).any(|n| n == name))
    }

    /// True when `/metrics` is due: never asked, or asked about `every` ago (a quarter of it
    /// early, so a round that comes a little early does not skip a read).
    pub fn load_due(&self, every: Duration) -> bool {
        (*self.load_asked_at.read()).is_none_or(|t| t.elapsed() >= every.saturating_sub(every / 4))
    }

    /// Records that `/metrics` is asked now.
    pub fn load_asked(&self) {
        *self.load_asked_at.write() = Some(Instant::now());
    }

    /// Records the engine's pressure, read now.
    pub fn set_load(&self, load: EngineLoad) {
        *self.load.write() = Some((load, Instant::now()));
    }

    /// Forgets a read older than `max_age`; true when one was forgotten (it went stale).
    pub fn expire_load(&self, max_age: Duration) -> bool {
        let mut load = self.load.write();
        let stale = load.as_ref().is_some_and(|(_, at)| at.elapsed() >= max_age);
        if stale {
            *load = None;
        }
        stale
    }

    /// Forgets the pressure read: the engine went away (or reads stopped).
    pub fn forget_load(&self) {
        *self.load.write() = None;
        *self.load_asked_at.write() = None;
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

    #[test]
    fn a_load_is_believed_until_it_ages_and_then_expires_once() {
        let e = EngineFacts::default();
        assert!(e.load_due(Duration::from_secs(2)), "never asked");
        e.load_asked();
        assert!(!e.load_due(Duration::from_secs(2)));
        assert!(e.load_due(Duration::ZERO));
        let load = EngineLoad { waiting: 3, ..EngineLoad::default() };
        e.set_load(load.clone());
        assert_eq!(e.load(Duration::from_secs(3600)), Some(load));
        assert_eq!(e.load(Duration::ZERO), None, "too old to believe");
        assert_eq!(e.pressure(Duration::from_secs(3600)).map(|p| p.waiting), Some(3));
        assert_eq!(e.pressure(Duration::ZERO), None);
        assert!(!e.expire_load(Duration::from_secs(3600)));
        assert!(e.expire_load(Duration::ZERO));
        assert!(!e.expire_load(Duration::ZERO), "counted once");
        assert_eq!(e.load(Duration::from_secs(3600)), None);
    }
}
