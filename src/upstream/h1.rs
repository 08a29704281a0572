//! HTTP/1.1 on one engine connection: the request goes out in one vectored write (head and
//! body parts, never first copied into one buffer), the response head is parsed with
//! `httparse`, and the body is read by its framing (length, chunked, or until close),
//! handed out as slices of the read buffer.

use std::io::{self, IoSlice};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use nix::sys::socket::{recv, MsgFlags};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest response head accepted.
const HEAD_LIMIT: usize = 64 * 1024;
/// Most header lines in a response head.
const MAX_HEADERS: usize = 128;
/// Read size when nothing says how much is coming.
const READ_SIZE: usize = 16 * 1024;
/// Largest buffer reserved at once for a body of declared length.
const LENGTH_RESERVE_MAX: usize = 8 << 20;
/// Longest chunk-size or trailer line accepted.
const LINE_LIMIT: usize = 4096;

/// Why an exchange on the connection failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Writing the request failed.
    #[error("write failed: {0}")]
    Write(io::Error),
    /// Reading the response failed.
    #[error("read failed: {0}")]
    Read(io::Error),
    /// The engine closed the connection before the response was complete.
    #[error("connection closed before the response was complete")]
    Closed,
    /// The bytes are not a well-formed HTTP/1.1 response.
    #[error("not an HTTP/1.1 answer: {0}")]
    Malformed(&'static str),
}

impl WireError {
    /// The client-safe words for it (the vocabulary of `UpstreamError::cause`).
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Write(e) | Self::Read(e) if is_reset(e) => "connection closed",
            Self::Write(_) => "write failed",
            Self::Read(_) => "read failed",
            Self::Closed => "connection closed",
            Self::Malformed(_) => "not an HTTP/1.1 answer",
        }
    }
}

impl WireError {
    /// The I/O error under it, if any.
    pub fn io(&self) -> Option<&io::Error> {
        match self {
            Self::Write(e) | Self::Read(e) => Some(e),
            Self::Closed | Self::Malformed(_) => None,
        }
    }

    /// True for a write the engine had reset or closed the connection under.
    pub fn is_write_reset(&self) -> bool {
        matches!(self, Self::Write(e) if is_reset(e))
    }
}

fn is_reset(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    matches!(e.kind(), K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted | K::UnexpectedEof)
}

/// How the response body is framed, and how much of it is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// `Content-Length`: this many bytes left.
    Length(u64),
    /// `Transfer-Encoding: chunked`, at this point of the chunk grammar.
    Chunked(Chunk),
    /// Neither: the body runs until the engine closes (the connection is not reused).
    UntilClose,
    /// Read to its end.
    Done,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

/// One connection to an engine with its read buffer.
pub struct Conn {
    io: Stream,
    buf: BytesMut,
    /// When it was last returned to the pool.
    pub idle_since: Instant,
}

impl Conn {
    /// A connection over `io`, nothing read yet.
    pub fn new(io: Stream) -> Self {
        Self { io, buf: BytesMut::new(), idle_since: Instant::now() }
    }

    /// True when the engine has sent nothing since (no FIN, no reset, no stray bytes), so a
    /// request written now is read by a live engine: the check pingora's pool made.
    pub fn is_quiet(&self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(
                recv(self.io.id(), &mut probe, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
                Err(nix::errno::Errno::EAGAIN)
            )
    }

    /// Writes `head` and `body`'s parts with as few writes as the kernel takes.
    ///
    /// # Errors
    /// [`WireError::Write`].
    pub async fn write_request(&mut self, head: &[u8], body: &[Bytes]) -> Result<(), WireError> {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(body.len() + 1);
        slices.push(IoSlice::new(head));
        slices.extend(body.iter().filter(|b| !b.is_empty()).map(|b| IoSlice::new(b)));
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match self.io.write_vectored(rest).await {
                Ok(0) => return Err(WireError::Write(io::ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) => return Err(WireError::Write(e)),
            }
        }
        self.io.flush().await.map_err(WireError::Write)
    }

    /// Reads into the buffer (at least `want` bytes of room); 0 at end of stream.
    async fn fill(&mut self, want: usize) -> Result<usize, WireError> {
        self.buf.reserve(want.max(1));
        self.io.read_buf(&mut self.buf).await.map_err(WireError::Read)
    }

    /// Reads the response head (1xx informational heads skipped) and the body's framing.
    ///
    /// # Errors
    /// [`WireError`] on a read failure, an early close, or a malformed head.
    pub async fn read_head(&mut self) -> Result<Answer, WireError> {
        loop {
            if !self.buf.is_empty() {
                if let Some((answer, len)) = parse_head(&self.buf)? {
                    self.buf.advance(len);
                    if answer.informational {
                        continue;
                    }
                    return Ok(answer);
                }
                if self.buf.len() > HEAD_LIMIT {
                    return Err(WireError::Malformed("response head too large"));
                }
            }
            if self.fill(READ_SIZE).await? == 0 {
                return Err(WireError::Closed);
            }
        }
    }

    /// The next piece of the body (`None`: it ended), a slice of the read buffer.
    ///
    /// # Errors
    /// [`WireError`] on a read failure, an early close, or bad chunk framing.
    pub async fn read_body(&mut self, answer: &mut Answer) -> Result<Option<Bytes>, WireError> {
        loop {
            match answer.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => answer.framing = Framing::Done,
                Framing::Length(left) => {
                    let piece = self.take_data(left).await?;
                    answer.framing = Framing::Length(left - piece.len() as u64);
                    return Ok(Some(piece));
                }
                Framing::UntilClose => {
                    if self.buf.is_empty() && self.fill(READ_SIZE).await? == 0 {
                        answer.framing = Framing::Done;
                        return Ok(None);
                    }
                    return Ok(Some(self.buf.split().freeze()));
                }
                Framing::Chunked(Chunk::Data(left)) => {
                    let piece = self.take_data(left).await?;
                    let left = left - piece.len() as u64;
                    answer.framing = Framing::Chunked(if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) });
                    return Ok(Some(piece));
                }
                Framing::Chunked(at) => answer.framing = self.chunk_line(at).await?,
            }
        }
    }

    /// Up to `left` bytes of body data, reading when the buffer is empty.
    async fn take_data(&mut self, left: u64) -> Result<Bytes, WireError> {
        if self.buf.is_empty() {
            let want = usize::try_from(left).unwrap_or(usize::MAX).min(LENGTH_RESERVE_MAX);
            if self.fill(want.max(READ_SIZE)).await? == 0 {
                return Err(WireError::Closed);
            }
        }
        let take = usize::try_from(left).unwrap_or(usize::MAX).min(self.buf.len());
        Ok(self.buf.split_to(take).freeze())
    }

    /// Consumes one line of the chunk grammar at `at` and says where the body is then.
    async fn chunk_line(&mut self, at: Chunk) -> Result<Framing, WireError> {
        let line = loop {
            if let Some(end) = memchr::memmem::find(&self.buf, b"\r\n") {
                let line = self.buf.split_to(end);
                self.buf.advance(2);
                break line;
            }
            if self.buf.len() > LINE_LIMIT {
                return Err(WireError::Malformed("chunk line too long"));
            }
            if self.fill(READ_SIZE).await? == 0 {
                return Err(WireError::Closed);
            }
        };
        next_chunk_state(at, &line)
    }

    /// The whole body, at most `limit` bytes: a declared length is read straight into one
    /// buffer of that size. `Ok(None)`: it is over `limit`.
    ///
    /// # Errors
    /// As [`Self::read_body`].
    pub async fn read_to_end(&mut self, answer: &mut Answer, limit: usize) -> Result<Option<Bytes>, WireError> {
        if let Framing::Length(left) = answer.framing {
            let Some(left) = usize::try_from(left).ok().filter(|&n| n <= limit) else { return Ok(None) };
            self.buf.reserve(left.saturating_sub(self.buf.len()));
            while self.buf.len() < left {
                if self.io.read_buf(&mut self.buf).await.map_err(WireError::Read)? == 0 {
                    return Err(WireError::Closed);
                }
            }
            answer.framing = Framing::Done;
            return Ok(Some(self.buf.split_to(left).freeze()));
        }
        let mut whole = BytesMut::new();
        while let Some(piece) = self.read_body(answer).await? {
            if whole.len() + piece.len() > limit {
                return Ok(None);
            }
            if whole.is_empty() && answer.framing == Framing::Done {
                return Ok(Some(piece));
            }
            whole.extend_from_slice(&piece);
        }
        Ok(Some(whole.freeze()))
    }

    /// True when `answer` was read to its end and leaves the connection ready for another
    /// request (kept alive, nothing stray in the buffer).
    pub fn reusable_after(&self, answer: &Answer) -> bool {
        answer.keep_alive && answer.framing == Framing::Done && self.buf.is_empty()
    }
}

/// Where a chunked body goes after `line` (without its CRLF) at `at`.
fn next_chunk_state(at: Chunk, line: &[u8]) -> Result<Framing, WireError> {
    match at {
        Chunk::Size => {
            let digits = line.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
            let size = std::str::from_utf8(digits)
                .ok()
                .filter(|d| !d.is_empty() && d.len() <= 15)
                .and_then(|d| u64::from_str_radix(d, 16).ok())
                .ok_or(WireError::Malformed("bad chunk size"))?;
            Ok(Framing::Chunked(if size == 0 { Chunk::Trailers } else { Chunk::Data(size) }))
        }
        Chunk::DataEnd if line.is_empty() => Ok(Framing::Chunked(Chunk::Size)),
        Chunk::DataEnd => Err(WireError::Malformed("chunk data longer than its size")),
        Chunk::Trailers if line.is_empty() => Ok(Framing::Done),
        Chunk::Trailers => Ok(Framing::Chunked(Chunk::Trailers)),
        Chunk::Data(_) => unreachable!("data is read by take_data"),
    }
}

/// A response head and where its body stands.
pub struct Answer {
    /// The head as pingora's type (the rest of the proxy builds the client's head from it).
    pub head: ResponseHeader,
    framing: Framing,
    /// HTTP/1.1 without `Connection: close`.
    keep_alive: bool,
    /// A 1xx head other than 101 (skipped).
    informational: bool,
}

/// Parses a response head at the start of `buf`: the answer and the head's length, or
/// `None` while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(Answer, usize)>, WireError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(WireError::Malformed("too many headers")),
        Err(_) => return Err(WireError::Malformed("bad response head")),
    };
    let status = parsed.code.ok_or(WireError::Malformed("no status"))?;
    let mut head =
        ResponseHeader::build(status, Some(parsed.headers.len())).map_err(|_| WireError::Malformed("bad status"))?;
    let (mut length, mut chunked, mut close) = (None::<u64>, false, parsed.version != Some(1));
    for h in parsed.headers.iter() {
        let name = http::HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| WireError::Malformed("bad header"))?;
        if name == http::header::CONTENT_LENGTH {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or(WireError::Malformed("bad content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(WireError::Malformed("conflicting content-length"));
            }
            length = Some(n);
        } else if name == http::header::TRANSFER_ENCODING {
            chunked = last_token(h.value).eq_ignore_ascii_case(b"chunked");
        } else if name == http::header::CONNECTION {
            close |= h.value.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
        let value = http::HeaderValue::from_bytes(h.value).map_err(|_| WireError::Malformed("bad header value"))?;
        head.append_header(name, value).map_err(|_| WireError::Malformed("bad header"))?;
    }
    let informational = (100..200).contains(&status) && status != 101;
    let framing = match () {
        () if informational || status == 204 || status == 304 => Framing::Done,
        () if chunked => Framing::Chunked(Chunk::Size),
        () => match length {
            Some(n) => Framing::Length(n),
            None => Framing::UntilClose,
        },
    };
    // Both framings at once is how responses are smuggled: read as chunked, never reused.
    let keep_alive = !close && framing != Framing::UntilClose && !(chunked && length.is_some());
    Ok(Some((Answer { head, framing, keep_alive, informational }, len)))
}

/// The last comma-separated token of a header value.
fn last_token(value: &[u8]) -> &[u8] {
    value.rsplit(|&b| b == b',').next().unwrap_or_default().trim_ascii()
}

/// The request line and headers of `head` on the wire.
///
/// # Errors
/// A path with a space or line break (it would split the request line).
pub fn encode_head(head: &RequestHeader) -> Result<Vec<u8>, &'static str> {
    let path = head.raw_path();
    if path.iter().any(|&b| matches!(b, b' ' | b'\r' | b'\n')) {
        return Err("request path holds a space or line break");
    }
    let mut out = Vec::with_capacity(64 + path.len() + head.headers.len() * 48);
    out.extend_from_slice(head.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path);
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &head.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

#[cfg(test)]
mod tests;
