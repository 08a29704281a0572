//! HTTP/1.1 on one engine connection: the request out in one vectored write, the response
//! head parsed with `httparse`, the body read by its framing (length, chunked, or until close)
//! and handed out as slices of the read buffer.
//!
//! Head and body parts are never first copied into one buffer. Framing follows RFC 9112
//! §6.3; the framing decisions ([`parse_head`], [`body_step`]) are pure functions of the
//! bytes (the `h1` fuzz target drives them), the connection only reads.

use std::io::{self, IoSlice};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use nix::sys::socket::{recv, MsgFlags};
use pingora::http::ResponseHeader;
use pingora::protocols::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest response head accepted.
const HEAD_LIMIT: usize = 64 * 1024;
/// Most header lines in a response head.
const MAX_HEADERS: usize = 128;
/// Read size when nothing says how much is coming.
const READ_SIZE: usize = 16 * 1024;
/// Longest chunk-size or trailer line accepted (without its CRLF).
pub const LINE_LIMIT: usize = 4096;
/// Most trailer lines after a chunked body.
pub const MAX_TRAILERS: usize = 32;
/// Most bytes of trailer lines (CRLFs included) after a chunked body.
pub const TRAILER_BYTES_LIMIT: usize = 16 * 1024;

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
pub enum Framing {
    /// `Content-Length`: this many bytes left.
    Length(u64),
    /// `Transfer-Encoding` ending in `chunked`, at this point of the chunk grammar.
    Chunked(Chunk),
    /// No length, or a transfer coding other than `chunked` last: the body runs until the
    /// engine closes (the connection is not reused).
    UntilClose,
    /// Read to its end.
    Done,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one; so many lines and bytes so far.
    Trailers {
        /// Trailer lines read.
        lines: usize,
        /// Their bytes, CRLFs included.
        bytes: usize,
    },
}

/// What [`body_step`] made of the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// A piece of the body (split off the front of the buffer).
    Piece(Bytes),
    /// More bytes are needed (the buffer holds at most [`LINE_LIMIT`] + 1 bytes of a line).
    More,
    /// The body ended; what is left in the buffer is not part of it.
    End,
}

/// Consumes from the front of `buf` what `framing` says is body: the next piece, a need for
/// more bytes, or the end. Chunk lines and trailers are consumed without yielding anything.
///
/// # Errors
/// [`WireError::Malformed`] on bad chunk framing or a line or trailer section over its limit.
pub fn body_step(framing: &mut Framing, buf: &mut BytesMut) -> Result<Step, WireError> {
    loop {
        match *framing {
            Framing::Done => return Ok(Step::End),
            Framing::Length(0) => *framing = Framing::Done,
            Framing::UntilClose | Framing::Length(_) | Framing::Chunked(Chunk::Data(_)) if buf.is_empty() => {
                return Ok(Step::More)
            }
            Framing::UntilClose => return Ok(Step::Piece(buf.split().freeze())),
            Framing::Length(left) => {
                let piece = take(buf, left);
                *framing = Framing::Length(left - piece.len() as u64);
                return Ok(Step::Piece(piece));
            }
            Framing::Chunked(Chunk::Data(left)) => {
                let piece = take(buf, left);
                let left = left - piece.len() as u64;
                *framing = Framing::Chunked(if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) });
                return Ok(Step::Piece(piece));
            }
            Framing::Chunked(Chunk::DataEnd) => {
                // Exactly CRLF after the data: anything else is data past the chunk's size.
                let have = buf.len().min(2);
                if buf.get(..have) != b"\r\n".get(..have) {
                    return Err(WireError::Malformed("chunk data longer than its size"));
                }
                if have < 2 {
                    return Ok(Step::More);
                }
                buf.advance(2);
                *framing = Framing::Chunked(Chunk::Size);
            }
            Framing::Chunked(at) => {
                let Some(end) = memchr::memmem::find(buf, b"\r\n") else {
                    if buf.len() > LINE_LIMIT + 1 {
                        return Err(WireError::Malformed("chunk line too long"));
                    }
                    return Ok(Step::More);
                };
                if end > LINE_LIMIT {
                    return Err(WireError::Malformed("chunk line too long"));
                }
                let line = buf.split_to(end);
                buf.advance(2);
                *framing = next_chunk_state(at, &line)?;
            }
        }
    }
}

/// Up to `left` bytes off the front of `buf`.
fn take(buf: &mut BytesMut, left: u64) -> Bytes {
    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    buf.split_to(n).freeze()
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

    /// Reads the response head (1xx informational heads skipped) and the body's framing;
    /// `to_head` says the request was a `HEAD` (its answer has no body whatever it says).
    ///
    /// # Errors
    /// [`WireError`] on a read failure, an early close, or a malformed head.
    pub async fn read_head(&mut self, to_head: bool) -> Result<Answer, WireError> {
        loop {
            if !self.buf.is_empty() {
                if let Some((answer, len)) = parse_head(&self.buf, to_head)? {
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
            match body_step(&mut answer.framing, &mut self.buf)? {
                Step::Piece(piece) => return Ok(Some(piece)),
                Step::End => return Ok(None),
                Step::More if self.fill(READ_SIZE).await? > 0 => {}
                Step::More if answer.framing == Framing::UntilClose => {
                    answer.framing = Framing::Done;
                    return Ok(None);
                }
                Step::More => return Err(WireError::Closed),
            }
        }
    }

    /// The next piece of the body if it is already read (no wait, no read of the socket);
    /// `None` when the next one must be read, or the body ended ([`Self::read_body`] then
    /// says which, without a read at the end).
    ///
    /// # Errors
    /// [`WireError::Malformed`] on bad chunk framing.
    pub fn buffered_body(&mut self, answer: &mut Answer) -> Result<Option<Bytes>, WireError> {
        match body_step(&mut answer.framing, &mut self.buf)? {
            Step::Piece(piece) => Ok(Some(piece)),
            Step::More | Step::End => Ok(None),
        }
    }

    /// The whole body, at most `limit` bytes; `Ok(None)`: it is over `limit`. A declared
    /// length over `limit` is refused before reading; the buffer grows with the bytes that
    /// arrive, to at most 4x what came (an engine cannot make us reserve memory by announcing
    /// it).
    ///
    /// # Errors
    /// As [`Self::read_body`].
    pub async fn read_to_end(&mut self, answer: &mut Answer, limit: usize) -> Result<Option<Bytes>, WireError> {
        if let Framing::Length(left) = answer.framing {
            let Some(left) = usize::try_from(left).ok().filter(|&n| n <= limit) else { return Ok(None) };
            // One buffer for the whole body (it leaves as one slice), grown with the bytes that
            // arrive: room for the rest at once when it is within 4x what came (a 240 KB
            // prefill answer takes two growths, not four doublings from 16 KiB, each a copy).
            while self.buf.len() < left {
                let room = (left - self.buf.len()).min(self.buf.len().saturating_mul(3).max(READ_SIZE));
                if self.buf.capacity() - self.buf.len() < room {
                    // Exactly this much (a reserve would double past it).
                    let mut grown = BytesMut::with_capacity(self.buf.len() + room);
                    grown.extend_from_slice(&self.buf);
                    self.buf = grown;
                }
                if self.fill(room).await? == 0 {
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
    if line.iter().any(|&b| b == b'\r' || b == b'\n' || b == 0) {
        // A bare CR or LF inside a line is where parsers disagree on framing.
        return Err(WireError::Malformed("bare CR or LF in a chunk line"));
    }
    match at {
        Chunk::Size => {
            let size = chunk_size(line).ok_or(WireError::Malformed("bad chunk size"))?;
            Ok(Framing::Chunked(if size == 0 { Chunk::Trailers { lines: 0, bytes: 0 } } else { Chunk::Data(size) }))
        }
        Chunk::Trailers { .. } if line.is_empty() => Ok(Framing::Done),
        Chunk::Trailers { lines, bytes } => {
            let (lines, bytes) = (lines + 1, bytes + line.len() + 2);
            if lines > MAX_TRAILERS || bytes > TRAILER_BYTES_LIMIT {
                return Err(WireError::Malformed("too many trailers"));
            }
            Ok(Framing::Chunked(Chunk::Trailers { lines, bytes }))
        }
        Chunk::Data(_) | Chunk::DataEnd => Err(WireError::Malformed("chunk data read as a line")),
    }
}

/// The size of a chunk-size line: `1*HEXDIG [BWS ";" chunk-ext]` (RFC 9112 §7.1), at most
/// 15 digits; `None` for anything else (a sign, leading space, no digit).
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits_end = line.iter().position(|b| !b.is_ascii_hexdigit()).unwrap_or(line.len());
    let (digits, rest) = line.split_at(digits_end);
    // BWS is spaces and tabs only (`trim_ascii_start` would also take a form feed).
    let bws = rest.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    let rest = rest.get(bws..).unwrap_or_default();
    if digits.is_empty() || digits.len() > 15 || !(rest.is_empty() || rest.starts_with(b";")) {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

/// A response head and where its body stands.
pub struct Answer {
    /// The head as pingora's type (the rest of the proxy builds the client's head from it).
    pub head: ResponseHeader,
    framing: Framing,
    /// The connection may carry another request after this body: HTTP/1.1 without
    /// `Connection: close`, framed by its length or chunked, not both.
    keep_alive: bool,
    /// A 1xx head other than 101 (skipped).
    informational: bool,
}

impl Answer {
    /// How its body is framed (where it stands).
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// True when the connection may be reused once the body is read to its end.
    pub fn keep_alive(&self) -> bool {
        self.keep_alive
    }

    /// True for a 1xx head other than 101 (the real answer follows).
    pub fn informational(&self) -> bool {
        self.informational
    }
}

/// The framing headers of a head, as RFC 9112 §6 reads them.
#[derive(Default)]
struct FramingHeaders {
    /// The one `Content-Length` value (repeats and lists of one value agree).
    length: Option<u64>,
    /// Some `Transfer-Encoding` was present.
    encoded: bool,
    /// The last transfer coding of the last `Transfer-Encoding` line is `chunked`.
    chunked: bool,
    /// `Connection: close`.
    close: bool,
}

impl FramingHeaders {
    fn read(&mut self, name: &http::HeaderName, value: &[u8]) -> Result<(), WireError> {
        if name == http::header::CONTENT_LENGTH {
            for item in value.split(|&b| b == b',') {
                let n = content_length(item.trim_ascii()).ok_or(WireError::Malformed("bad content-length"))?;
                if self.length.is_some_and(|l| l != n) {
                    return Err(WireError::Malformed("conflicting content-length"));
                }
                self.length = Some(n);
            }
        } else if name == http::header::TRANSFER_ENCODING {
            self.encoded = true;
            self.chunked = last_token(value).eq_ignore_ascii_case(b"chunked");
        } else if name == http::header::CONNECTION {
            self.close |= value.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
        Ok(())
    }

    /// The body's framing and whether the connection may be reused (RFC 9112 §6.3).
    fn framing(&self, status: u16, to_head: bool, http11: bool) -> Result<(Framing, bool), WireError> {
        if self.encoded && !http11 {
            // §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
            return Err(WireError::Malformed("transfer-encoding in an HTTP/1.0 answer"));
        }
        let framing = match () {
            () if (100..200).contains(&status) || status == 204 || status == 304 || to_head => Framing::Done,
            () if self.chunked => Framing::Chunked(Chunk::Size),
            () if self.encoded => Framing::UntilClose,
            () => self.length.map_or(Framing::UntilClose, Framing::Length),
        };
        // Both framings at once is how responses are smuggled: TE wins, never reused.
        let keep_alive = http11
            && status != 101
            && !self.close
            && framing != Framing::UntilClose
            && !(self.encoded && self.length.is_some());
        Ok((framing, keep_alive))
    }
}

/// `Content-Length`'s `1*DIGIT` (no sign, no space), within `u64`.
fn content_length(text: &[u8]) -> Option<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// Parses a response head at the start of `buf`: the answer and the head's length, or
/// `None` while it is incomplete. `to_head`: the request was a `HEAD`.
///
/// # Errors
/// [`WireError::Malformed`] for a head that is not HTTP/1.x, too many headers, or framing
/// headers that disagree (several lengths, an invalid length, chunked in HTTP/1.0).
pub fn parse_head(buf: &[u8], to_head: bool) -> Result<Option<(Answer, usize)>, WireError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(WireError::Malformed("too many headers")),
        Err(_) => return Err(WireError::Malformed("bad response head")),
    };
    let status = parsed.code.ok_or(WireError::Malformed("no status"))?;
    // No case map: this head is only read (the client's head is built from its HeaderMap).
    let mut head = ResponseHeader::build_no_case(status, Some(parsed.headers.len()))
        .map_err(|_| WireError::Malformed("bad status"))?;
    let mut framing_headers = FramingHeaders::default();
    for h in parsed.headers.iter() {
        let name = http::HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| WireError::Malformed("bad header"))?;
        framing_headers.read(&name, h.value)?;
        let value = http::HeaderValue::from_bytes(h.value).map_err(|_| WireError::Malformed("bad header value"))?;
        head.append_header(name, value).map_err(|_| WireError::Malformed("bad header"))?;
    }
    let informational = (100..200).contains(&status) && status != 101;
    let (framing, keep_alive) = framing_headers.framing(status, to_head, parsed.version == Some(1))?;
    Ok(Some((Answer { head, framing, keep_alive, informational }, len)))
}

/// The last comma-separated token of a header value.
fn last_token(value: &[u8]) -> &[u8] {
    value.rsplit(|&b| b == b',').next().unwrap_or_default().trim_ascii()
}

#[cfg(test)]
mod tests;
