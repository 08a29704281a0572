//! TLS for the tests: a certificate authority made in the test (rcgen) that issues server and
//! client certificates into a temporary directory, and a TLS front for a fake engine (OpenSSL,
//! optionally requiring a client certificate) that relays each connection to the plain fake.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pingora::tls::ssl::{SslAcceptor, SslFiletype, SslMethod, SslVerifyMode, SslVersion};
use pingora::tls::tokio_ssl::SslStream;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
use tokio::net::{TcpListener, TcpStream};

/// A CA of the test and the files it wrote.
pub struct Pki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
    name: String,
}

/// A certificate and key on disk.
#[derive(Clone, Debug)]
pub struct Issued {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

impl Pki {
    /// A new CA called `name`; its certificate is written to `<name>-ca.pem`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(format!("{name}-ca.pem")), ca.pem()).unwrap();
        Self { dir, ca, name: name.to_owned() }
    }

    /// The CA certificate's file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca.pem", self.name))
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Issues a certificate for the DNS names `names` (server and client use), written as
    /// `<file>.pem` and `<file>.key`.
    pub fn issue(&self, file: &str, names: &[&str]) -> Issued {
        let mut params = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let issued = Issued {
            cert: self.dir.path().join(format!("{file}.pem")),
            key: self.dir.path().join(format!("{file}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }
}

/// A TLS listener on 127.0.0.1 that relays every connection, decrypted, to a plain backend
/// (a fake engine), like an engine served over HTTPS. Handshakes are counted.
pub struct TlsFront {
    /// Where it accepts.
    pub addr: SocketAddr,
    /// Handshakes that completed.
    pub accepted: Arc<AtomicUsize>,
    /// Handshakes that failed (e.g. a client without a certificate when one is required).
    pub refused: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Serves `identity` in front of `backend`; with `client_ca`, a client certificate signed
    /// by that CA is required.
    pub async fn start(backend: SocketAddr, identity: &Issued, client_ca: Option<&Path>) -> Self {
        Self::start_on(backend, identity, client_ca, None).await
    }

    /// [`Self::start`] speaking only TLS `version` (e.g. 1.2, where a missing client
    /// certificate is refused inside the handshake, or 1.3, where the client learns it from an
    /// alert after its side of the handshake is done).
    pub async fn start_on(
        backend: SocketAddr,
        identity: &Issued,
        client_ca: Option<&Path>,
        version: Option<SslVersion>,
    ) -> Self {
        let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        if let Some(version) = version {
            builder.set_min_proto_version(Some(version)).unwrap();
            builder.set_max_proto_version(Some(version)).unwrap();
        }
        builder.set_certificate_chain_file(&identity.cert).unwrap();
        builder.set_private_key_file(&identity.key, SslFiletype::PEM).unwrap();
        if let Some(ca) = client_ca {
            builder.set_ca_file(ca).unwrap();
            builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        }
        let acceptor = Arc::new(builder.build());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (ok, bad) = (Arc::clone(&accepted), Arc::clone(&refused));
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, ok, bad) = (Arc::clone(&acceptor), Arc::clone(&ok), Arc::clone(&bad));
                tokio::spawn(async move {
                    let Ok(ssl) = pingora::tls::ssl::Ssl::new(acceptor.context()) else { return };
                    let Ok(mut tls) = SslStream::new(ssl, tcp) else { return };
                    if Pin::new(&mut tls).accept().await.is_err() {
                        bad.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    ok.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut plain) = TcpStream::connect(backend).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Self { addr, accepted, refused, task }
    }

    /// Completed handshakes so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Failed handshakes so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
