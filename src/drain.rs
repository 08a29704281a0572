//! `tokenonce drain`: the client side of the admin listener's `/drain`, for a preStop hook in
//! an image without a shell or curl; the admin token comes from its file, never a command line.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::config::{AdminToken, Config};

/// Longest a `/drain` holds (the admin listener caps `wait_seconds` at this).
pub const MAX_WAIT_SECONDS: u64 = 300;
/// Time to connect, and beyond `wait_seconds` to get the answer.
const MARGIN: Duration = Duration::from_secs(5);
/// Most of an answer read (the admin listener's are a line).
const MAX_ANSWER_BYTES: u64 = 64 * 1024;

/// Where the admin listener is and what proves the caller may drain it.
#[derive(Debug)]
pub struct Target {
    /// The admin listener to call.
    pub addr: SocketAddr,
    token: AdminToken,
}

/// Why a drain did not happen.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// No admin token file named, by flag or by `server.admin_token_file`.
    #[error("no admin token: pass --admin-token-file or set server.admin_token_file in --config")]
    NoTokenFile,
    /// The token file cannot be read or holds no valid token.
    #[error("admin token: {0}")]
    Token(String),
    /// The admin address is not `host:port`, or resolves to nothing.
    #[error("admin address `{0}`: {1}")]
    Address(String, String),
    /// The admin listener could not be reached or stopped answering.
    #[error("admin listener {addr}: {source}")]
    Io {
        /// The address called.
        addr: SocketAddr,
        /// What failed.
        source: std::io::Error,
    },
    /// The admin listener answered, but not 200 (e.g. 403: a token other than the server's).
    #[error("admin listener {addr} answered {status}: {body}")]
    Refused {
        /// The address called.
        addr: SocketAddr,
        /// The HTTP status (0: not an HTTP answer).
        status: u16,
        /// The answer's body, trimmed.
        body: String,
    },
}

impl Target {
    /// The admin listener and token: the flags where given, else `config`'s
    /// `server.admin_listen` (an unspecified address, `0.0.0.0` or `[::]`, called on loopback)
    /// and `server.admin_token_file`.
    ///
    /// # Errors
    /// [`DrainError`] when no token file is named, it does not hold a token, or the address
    /// does not resolve.
    pub fn new(config: &Config, admin: Option<&str>, token_file: Option<&str>) -> Result<Self, DrainError> {
        let token_file = token_file.or(config.server.admin_token_file.as_deref()).ok_or(DrainError::NoTokenFile)?;
        let token = AdminToken::read(token_file).map_err(DrainError::Token)?;
        let admin = admin.unwrap_or(&config.server.admin_listen);
        let bad = |why: String| DrainError::Address(admin.to_owned(), why);
        let mut addr =
            admin.to_socket_addrs().map_err(|e| bad(e.to_string()))?.next().ok_or_else(|| bad("no address".into()))?;
        if addr.ip().is_unspecified() {
            let loopback = if addr.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            };
            addr.set_ip(loopback);
        }
        Ok(Self { addr, token })
    }

    /// `GET /drain?wait_seconds=N` with the token; returns the answer's body once the admin
    /// listener answers 200 (after holding `wait_seconds`, at most [`MAX_WAIT_SECONDS`]).
    ///
    /// # Errors
    /// [`DrainError::Io`] when the listener cannot be reached or does not answer in time,
    /// [`DrainError::Refused`] for any answer but 200.
    pub fn drain(&self, wait_seconds: u64) -> Result<String, DrainError> {
        let wait_seconds = wait_seconds.min(MAX_WAIT_SECONDS);
        let io = |source| DrainError::Io { addr: self.addr, source };
        let mut stream = TcpStream::connect_timeout(&self.addr, MARGIN).map_err(io)?;
        stream.set_read_timeout(Some(Duration::from_secs(wait_seconds) + MARGIN)).map_err(io)?;
        stream.set_write_timeout(Some(MARGIN)).map_err(io)?;
        let request = format!(
            "GET /drain?wait_seconds={wait_seconds} HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            self.token.bearer()
        );
        stream.write_all(request.as_bytes()).map_err(io)?;
        let (status, body) = read_answer(stream).map_err(io)?;
        if status == 200 {
            Ok(body)
        } else {
            Err(DrainError::Refused { addr: self.addr, status, body })
        }
    }
}

/// Status and body of one HTTP/1.1 answer with a `Content-Length` (or ended by the close).
fn read_answer(stream: TcpStream) -> std::io::Result<(u16, String)> {
    let mut stream = stream.take(MAX_ANSWER_BYTES);
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk)?;
        answer.extend_from_slice(chunk.get(..n).unwrap_or_default());
        let text = String::from_utf8_lossy(&answer);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse::<usize>().ok()).flatten()
            });
            if n == 0 || length.is_some_and(|len| body.len() >= len) {
                let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
                return Ok((status, body.trim().to_owned()));
            }
        } else if n == 0 {
            return Ok((0, text.trim().to_owned()));
        }
    }
}
