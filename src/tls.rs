//! TLS on both sides, on pingora's OpenSSL back end: certificates and keys read from PEM
//! files (when the config is loaded, so `tokenonce check` reports bad ones), the client
//! listener's certificate handed out per handshake from the current config (a SIGHUP reload
//! swaps it for new connections), and a pool's upstream TLS applied to the peers of its legs.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use async_trait::async_trait;
use pingora::listeners::TlsAccept;
use pingora::protocols::tls::TlsRef;
use pingora::tls::ext;
use pingora::tls::pkey::{PKey, Private};
use pingora::tls::x509::X509;
use pingora::upstreams::peer::HttpPeer;
use pingora::utils::tls::CertKey;

/// A certificate chain (leaf first) and the leaf's private key, checked to belong together.
#[derive(Clone)]
pub struct Identity {
    chain: Vec<X509>,
    key: PKey<Private>,
    /// The files' bytes, to tell whether a reload changed them.
    source: Arc<[u8]>,
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let subject = self.chain.first().map(|c| format!("{:?}", c.subject_name())).unwrap_or_default();
        write!(f, "Identity({subject}, {} certificate(s), key ***)", self.chain.len())
    }
}

impl Identity {
    /// Reads `cert_path` (PEM, leaf first, then intermediates) and `key_path` (PEM).
    ///
    /// # Errors
    /// A sentence naming the file and what is wrong with it.
    pub fn load(cert_path: &str, key_path: &str) -> Result<Self, String> {
        let cert_pem = read(cert_path)?;
        let key_pem = read(key_path)?;
        let chain = X509::stack_from_pem(&cert_pem)
            .map_err(|e| format!("`{cert_path}` is not a PEM certificate chain: {e}"))?;
        let leaf = chain.first().ok_or_else(|| format!("`{cert_path}` holds no certificate"))?;
        let key =
            PKey::private_key_from_pem(&key_pem).map_err(|e| format!("`{key_path}` is not a PEM private key: {e}"))?;
        let matches = leaf.public_key().map(|public| public.public_eq(&key)).unwrap_or(false);
        if !matches {
            return Err(format!("the key in `{key_path}` does not belong to the first certificate of `{cert_path}`"));
        }
        let source: Vec<u8> = [cert_pem, key_pem].concat();
        Ok(Self { chain, key, source: source.into() })
    }

    /// Puts this identity on one handshake.
    fn apply(&self, ssl: &mut TlsRef) -> Result<(), String> {
        let (leaf, rest) = self.chain.split_first().ok_or("empty chain")?;
        ext::ssl_use_certificate(ssl, leaf).map_err(|e| e.to_string())?;
        ext::ssl_use_private_key(ssl, &self.key).map_err(|e| e.to_string())?;
        rest.iter().try_for_each(|c| ext::ssl_add_chain_cert(ssl, c).map_err(|e| e.to_string()))
    }

    /// As pingora's client-certificate type.
    fn cert_key(&self) -> CertKey {
        CertKey::new(self.chain.clone(), self.key.clone())
    }
}

/// Reads the CA certificates of `path` (PEM, one or more).
///
/// # Errors
/// A sentence naming the file and what is wrong with it.
pub fn load_ca(path: &str) -> Result<Vec<X509>, String> {
    let pem = read(path)?;
    let certs = X509::stack_from_pem(&pem).map_err(|e| format!("`{path}` is not a PEM certificate bundle: {e}"))?;
    if certs.is_empty() {
        return Err(format!("`{path}` holds no certificate"));
    }
    Ok(certs)
}

fn read(path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read `{path}`: {e}"))
}

/// A pool's TLS to its engines, ready to put on peers (shared by every endpoint of the pool).
#[derive(Clone)]
pub struct UpstreamTls {
    /// Trusted roots (`None`: the system's).
    ca: Option<Arc<Box<[X509]>>>,
    /// Name sent as SNI and checked against the engine's certificate (`None`: the endpoint's host).
    server_name: Option<String>,
    /// Client certificate for engines that require mTLS.
    client: Option<Arc<CertKey>>,
    /// Check the engine's certificate (chain and name).
    verify: bool,
    /// Every setting that decides whom a connection trusts and what it presents, to tell
    /// whether a reload changed anything and to keep idle connections apart.
    trust: TrustKey,
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        self.trust == other.trust
    }
}

impl Eq for UpstreamTls {}

/// The trust settings of a pool's TLS as one value (CA certificates, server name, client
/// certificate and key, verify), part of the key idle engine connections are kept under: a
/// connection made under some settings is handed out only under equal ones. Equal exactly
/// when the settings' bytes are; hashed by a digest of them.
#[derive(Clone)]
pub struct TrustKey {
    digest: u64,
    bytes: Arc<[u8]>,
}

impl TrustKey {
    /// The key of `parts`, each length-prefixed (so no two lists of parts give the same bytes).
    fn of(parts: &[&[u8]]) -> Self {
        let mut bytes = Vec::new();
        for part in parts {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part);
        }
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut hasher);
        Self { digest: hasher.finish(), bytes: bytes.into() }
    }
}

impl PartialEq for TrustKey {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest && (Arc::ptr_eq(&self.bytes, &other.bytes) || self.bytes == other.bytes)
    }
}

impl Eq for TrustKey {}

impl Hash for TrustKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.digest.hash(state);
    }
}

impl fmt::Debug for TrustKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TrustKey({:016x})", self.digest)
    }
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("server_name", &self.server_name)
            .field("client_cert", &self.client.is_some())
            .field("verify", &self.verify)
            .finish()
    }
}

impl UpstreamTls {
    /// Settings from their parts (the config checker has loaded the files).
    pub fn new(ca: Option<Vec<X509>>, server_name: Option<String>, client: Option<Identity>, verify: bool) -> Self {
        let ca_der: Vec<Vec<u8>> = ca.iter().flatten().map(|c| c.to_der().unwrap_or_default()).collect();
        let mut parts: Vec<&[u8]> = vec![
            if ca.is_some() { b"ca" } else { b"system roots" },
            server_name.as_deref().map_or(&b"\0endpoint host"[..], str::as_bytes),
            client.as_ref().map_or(&[][..], |c| &c.source[..]),
            if verify { b"verify" } else { b"no verify" },
        ];
        parts.extend(ca_der.iter().map(Vec::as_slice));
        let trust = TrustKey::of(&parts);
        Self {
            ca: ca.map(|c| Arc::new(c.into_boxed_slice())),
            server_name,
            client: client.map(|c| Arc::new(c.cert_key())),
            verify,
            trust,
        }
    }

    /// The key idle connections made with these settings are kept under (with the peer's).
    pub fn trust_key(&self) -> &TrustKey {
        &self.trust
    }

    /// The name checked against the engine's certificate when it is `host:port`.
    pub fn name_for<'a>(&'a self, host_port: &'a str) -> &'a str {
        self.server_name.as_deref().unwrap_or_else(|| crate::addr::host_of(host_port))
    }

    /// Makes `peer` (to the endpoint `host_port`) speak TLS with these settings.
    pub fn apply(&self, peer: &mut HttpPeer, host_port: &str) {
        peer.scheme = pingora::upstreams::peer::Scheme::HTTPS;
        peer.sni = self.name_for(host_port).to_owned();
        peer.options.verify_cert = self.verify;
        peer.options.verify_hostname = self.verify;
        peer.options.ca.clone_from(&self.ca);
        peer.client_cert_key.clone_from(&self.client);
        // pingora's connection pool (passthrough) keys by the peer's reuse hash, which leaves
        // the CA bundle out: the group key puts every trust setting in it.
        peer.group_key = self.trust.digest;
    }
}

/// The client TLS listener's certificate, taken from the current config at each handshake.
pub struct ListenerCert {
    /// The current config's listener identity (`None`: a reload removed `[server.tls]`).
    pub current: Box<dyn Fn() -> Option<Identity> + Send + Sync>,
}

#[async_trait]
impl TlsAccept for ListenerCert {
    async fn certificate_callback(&self, ssl: &mut TlsRef) {
        let Some(identity) = (self.current)() else {
            // The reloaded config has no `[server.tls]`: the handshake fails without a certificate.
            tracing::warn!("TLS handshake refused: the config has no [server.tls] any more");
            return;
        };
        if let Err(e) = identity.apply(ssl) {
            tracing::warn!(error = %e, "TLS handshake: the certificate could not be used");
        }
    }
}
