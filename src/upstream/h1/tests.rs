//! Tests of the HTTP/1.1 wire: response heads and their framing, bodies (chunked ones split
//! at every kind of boundary), early closes, and the idle check, over real loopback sockets.

use std::time::Duration;

use proptest::prelude::*;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// A connection whose engine side is a raw socket the test writes to.
async fn pair() -> (Conn, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
    let (engine, _) = listener.accept().await.unwrap();
    let io: Stream = Box::new(pingora::protocols::l4::stream::Stream::from(client));
    (Conn::new(io), engine)
}

/// Writes `pieces` with a flush and a short pause between, so the reader meets each boundary.
async fn send_in_pieces(engine: &mut TcpStream, pieces: &[&[u8]]) {
    for piece in pieces {
        engine.write_all(piece).await.unwrap();
        engine.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Reads the head and the body piece by piece; returns the body and whether it is reusable.
async fn read_all(conn: &mut Conn) -> Result<(u16, Vec<u8>, bool), WireError> {
    let mut answer = conn.read_head(false).await?;
    let mut body = Vec::new();
    while let Some(piece) = conn.read_body(&mut answer).await? {
        body.extend_from_slice(&piece);
    }
    Ok((answer.head.status.as_u16(), body, conn.reusable_after(&answer)))
}

fn head_of(raw: &[u8]) -> Answer {
    parse_head(raw, false).unwrap().expect("complete").0
}

#[test]
fn framing_follows_the_head() {
    let length = head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n");
    assert_eq!((length.framing, length.keep_alive), (Framing::Length(12), true));
    let chunked = head_of(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
    assert_eq!(chunked.framing, Framing::Chunked(Chunk::Size));
    let close = head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nConnection: keep-alive, Close\r\n\r\n");
    assert!(!close.keep_alive);
    let old = head_of(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n");
    assert!(!old.keep_alive, "HTTP/1.0 is not reused");
    let until_close = head_of(b"HTTP/1.1 200 OK\r\n\r\n");
    assert_eq!((until_close.framing, until_close.keep_alive), (Framing::UntilClose, false));
    let both = head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n");
    assert_eq!((both.framing, both.keep_alive), (Framing::Chunked(Chunk::Size), false), "chunked wins, not reused");
    let empty = head_of(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n");
    assert_eq!(empty.framing, Framing::Done);
    assert!(head_of(b"HTTP/1.1 100 Continue\r\n\r\n").informational);
}

/// The framing and reuse of `raw`'s head (`to_head`: answering a HEAD), or its error.
fn framing_of(raw: &str, to_head: bool) -> Result<(Framing, bool), &'static str> {
    match parse_head(raw.as_bytes(), to_head) {
        Ok(Some((answer, _))) => Ok((answer.framing, answer.keep_alive)),
        Ok(None) => Err("incomplete"),
        Err(WireError::Malformed(why)) => Err(why),
        Err(_) => Err("other"),
    }
}

/// One framing case: the raw head, whether it answers a HEAD, and what it must give.
type FramingCase = (String, bool, Result<(Framing, bool), &'static str>);

/// RFC 9112 §6.3, one row per framing combination.
#[test]
fn framing_follows_rfc_9112_section_6_3() {
    let ok = "HTTP/1.1 200 OK\r\n";
    let cases: [FramingCase; 16] = [
        (format!("{ok}content-length: 5\r\n\r\n"), true, Ok((Framing::Done, true))),
        ("HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n".into(), false, Ok((Framing::Done, true))),
        ("HTTP/1.1 101 Switching Protocols\r\n\r\n".into(), false, Ok((Framing::Done, false))),
        (format!("{ok}transfer-encoding: gzip, chunked\r\n\r\n"), false, Ok((Framing::Chunked(Chunk::Size), true))),
        (
            format!("{ok}transfer-encoding: gzip\r\ntransfer-encoding: Chunked\r\n\r\n"),
            false,
            Ok((Framing::Chunked(Chunk::Size), true)),
        ),
        (format!("{ok}transfer-encoding: chunked, gzip\r\n\r\n"), false, Ok((Framing::UntilClose, false))),
        (format!("{ok}transfer-encoding: gzip\r\ncontent-length: 3\r\n\r\n"), false, Ok((Framing::UntilClose, false))),
        (
            format!("{ok}content-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"),
            false,
            Ok((Framing::Chunked(Chunk::Size), false)),
        ),
        (format!("{ok}content-length: 3, 3\r\n\r\n"), false, Ok((Framing::Length(3), true))),
        (format!("{ok}content-length: 3, 4\r\n\r\n"), false, Err("conflicting content-length")),
        (format!("{ok}content-length: 3\r\ncontent-length: 4\r\n\r\n"), false, Err("conflicting content-length")),
        (format!("{ok}content-length: +3\r\n\r\n"), false, Err("bad content-length")),
        (format!("{ok}content-length: 3 3\r\n\r\n"), false, Err("bad content-length")),
        (format!("{ok}content-length: 99999999999999999999\r\n\r\n"), false, Err("bad content-length")),
        (
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".into(),
            false,
            Err("transfer-encoding in an HTTP/1.0 answer"),
        ),
        (format!("{ok}\r\n"), false, Ok((Framing::UntilClose, false))),
    ];
    for (raw, to_head, want) in cases {
        assert_eq!(framing_of(&raw, to_head), want, "{raw:?} (HEAD: {to_head})");
    }
}

#[tokio::test]
async fn a_coding_other_than_chunked_last_is_read_until_close_whatever_the_length() {
    let (mut conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 3\r\n\r\nabcdef").await.unwrap();
    drop(engine);
    let (_, body, reusable) = read_all(&mut conn).await.unwrap();
    assert_eq!((body.as_slice(), reusable), (&b"abcdef"[..], false), "read to the close, never reused");
}

#[tokio::test]
async fn trailers_are_capped_in_count_and_bytes() {
    let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n0\r\n";
    let many = format!("{head}{}\r\n", "x-t: 1\r\n".repeat(MAX_TRAILERS + 1));
    let big = format!("{head}{}\r\n", format!("x-t: {}\r\n", "v".repeat(4000)).repeat(5));
    let fine = format!("{head}{}\r\n", "x-t: 1\r\n".repeat(MAX_TRAILERS));
    for (raw, ok) in [(many, false), (big, false), (fine, true)] {
        let (mut conn, mut engine) = pair().await;
        engine.write_all(raw.as_bytes()).await.unwrap();
        let result = read_all(&mut conn).await;
        assert_eq!(result.is_ok(), ok, "{} bytes: {:?}", raw.len(), result.err());
    }
}

#[tokio::test]
async fn a_declared_length_reserves_nothing_before_the_bytes_arrive() {
    // 60 MiB announced (under the 64 MiB limit), 100 bytes sent.
    let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 62914560\r\n\r\n";
    for whole in [true, false] {
        let (mut conn, mut engine) = pair().await;
        engine.write_all(raw).await.unwrap();
        engine.write_all(&[b'x'; 100]).await.unwrap();
        drop(engine);
        let mut answer = conn.read_head(false).await.unwrap();
        let read = if whole {
            conn.read_to_end(&mut answer, 64 << 20).await.map(|_| ())
        } else {
            while conn.read_body(&mut answer).await.is_ok_and(|p| p.is_some()) {}
            Ok(())
        };
        assert!(!whole || matches!(read, Err(WireError::Closed)));
        assert!(conn.buf.capacity() <= 4 * READ_SIZE, "whole: {whole}: {} bytes reserved", conn.buf.capacity());
    }
}

#[tokio::test]
async fn a_long_body_is_read_whole_and_a_false_length_reserves_at_most_4x_what_came() {
    // 240 KB declared and sent (a 37k prefill answer): read whole, in one buffer.
    let body: Vec<u8> = (0..240_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let (mut conn, mut engine) = pair().await;
    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
    let sent = body.clone();
    let writer = tokio::spawn(async move {
        engine.write_all(head.as_bytes()).await.unwrap();
        engine.write_all(&sent).await.unwrap();
        engine
    });
    let mut answer = conn.read_head(false).await.unwrap();
    let read = conn.read_to_end(&mut answer, 64 << 20).await.unwrap().unwrap();
    assert_eq!(read, body);
    drop(writer.await.unwrap());
    // 60 MiB announced, 100 KB sent, then the engine closes: at most 4x what came reserved.
    let (mut conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 62914560\r\n\r\n").await.unwrap();
    engine.write_all(&[b'x'; 100_000]).await.unwrap();
    drop(engine);
    let mut answer = conn.read_head(false).await.unwrap();
    assert!(matches!(conn.read_to_end(&mut answer, 64 << 20).await, Err(WireError::Closed)));
    assert!(conn.buf.capacity() <= 4 * 100_000 + READ_SIZE, "{} bytes reserved", conn.buf.capacity());
}

#[test]
fn the_head_keeps_status_and_headers() {
    let answer =
        head_of(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nX-A: 1\r\nX-A: 2\r\n\r\n");
    assert_eq!(answer.head.status.as_u16(), 503);
    assert_eq!(answer.head.headers.get("content-type").unwrap(), "application/json");
    assert_eq!(answer.head.headers.get_all("x-a").iter().count(), 2);
}

#[test]
fn bad_heads_are_malformed_and_partial_ones_wait() {
    assert!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-le", false).unwrap().is_none());
    for bad in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"SMTP ready\r\n\r\n",
    ] {
        assert!(matches!(parse_head(bad, false), Err(WireError::Malformed(_))), "{}", String::from_utf8_lossy(bad));
    }
    let repeated = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n";
    assert_eq!(head_of(repeated.as_bytes()).framing, Framing::Length(2), "equal repeats agree");
}

#[test]
fn chunk_lines_are_parsed_strictly() {
    let size = |line: &[u8]| next_chunk_state(Chunk::Size, line);
    assert_eq!(size(b"1a").unwrap(), Framing::Chunked(Chunk::Data(26)));
    assert_eq!(size(b"A;name=value").unwrap(), Framing::Chunked(Chunk::Data(10)));
    assert_eq!(size(b"0").unwrap(), Framing::Chunked(Chunk::Trailers { lines: 0, bytes: 0 }));
    assert_eq!(size(b"a \t;x").unwrap(), Framing::Chunked(Chunk::Data(10)), "BWS before an extension");
    for bad in [
        &b""[..],
        b"zz",
        b"-1",
        b"+a",
        b" a",
        b"a b",
        b"1234567890abcdef0",
        b"5\nx",
        b"5;a\rb",
        b"0\x0c;ext=1",
        b"0\x0b",
    ] {
        assert!(size(bad).is_err(), "{}", String::from_utf8_lossy(bad));
    }
    let trailers = Chunk::Trailers { lines: 0, bytes: 0 };
    assert_eq!(
        next_chunk_state(trailers, b"x-t: 1").unwrap(),
        Framing::Chunked(Chunk::Trailers { lines: 1, bytes: 8 })
    );
    assert_eq!(next_chunk_state(trailers, b"").unwrap(), Framing::Done);
    let mut data_end = Framing::Chunked(Chunk::DataEnd);
    assert!(body_step(&mut data_end, &mut BytesMut::from(&b"x\r\n"[..])).is_err(), "data past its declared size");
}

#[tokio::test]
async fn a_request_goes_out_whole_in_order() {
    let (mut conn, mut engine) = pair().await;
    let body =
        [Bytes::from_static(b"{\"a\":"), Bytes::new(), Bytes::from(vec![b'7'; 300_000]), Bytes::from_static(b"}")];
    let mut want = b"POST / HTTP/1.1\r\n\r\n{\"a\":".to_vec();
    want.extend(std::iter::repeat_n(b'7', 300_000));
    want.push(b'}');
    let writer = async { conn.write_request(b"POST / HTTP/1.1\r\n\r\n", &body).await.unwrap() };
    let reader = async {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 65536];
        while got.len() < want.len() {
            let n = tokio::io::AsyncReadExt::read(&mut engine, &mut buf).await.unwrap();
            assert!(n > 0, "closed early");
            got.extend_from_slice(&buf[..n]);
        }
        got
    };
    let ((), got) = tokio::join!(writer, reader);
    assert_eq!(got, want);
}

#[tokio::test]
async fn a_length_body_split_across_reads_is_whole_and_reusable() {
    let (mut conn, mut engine) = pair().await;
    send_in_pieces(&mut engine, &[b"HTTP/1.1 200 OK\r\ncontent-le", b"ngth: 11\r\n\r\nhello", b" world"]).await;
    let (status, body, reusable) = read_all(&mut conn).await.unwrap();
    assert_eq!((status, body.as_slice(), reusable), (200, &b"hello world"[..], true));
    assert!(conn.is_quiet(), "nothing stray after the body");
}

#[tokio::test]
async fn read_to_end_refuses_a_declared_length_over_the_limit() {
    let (mut conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n").await.unwrap();
    let mut answer = conn.read_head(false).await.unwrap();
    assert!(conn.read_to_end(&mut answer, 99).await.unwrap().is_none());
    assert!(!conn.reusable_after(&answer), "an unread body leaves the connection unusable");
}

/// `raw` answered on a fresh connection, read whole within `limit`; and whether reusable.
async fn whole_within(raw: &[u8], limit: usize) -> (Option<Bytes>, bool) {
    let (mut conn, mut engine) = pair().await;
    engine.write_all(raw).await.unwrap();
    let mut answer = conn.read_head(false).await.unwrap();
    let body = conn.read_to_end(&mut answer, limit).await.unwrap();
    (body, conn.reusable_after(&answer))
}

#[tokio::test]
async fn read_to_end_reads_a_chunked_body_whole() {
    let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    let fits = format!("{head}3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
    let (body, reusable) = whole_within(fits.as_bytes(), 5).await;
    assert_eq!((body.as_deref(), reusable), (Some(&b"abcde"[..]), true));
    let over = format!("{head}3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n");
    assert!(whole_within(over.as_bytes(), 5).await.0.is_none(), "6 bytes over a limit of 5");
}

#[tokio::test]
async fn an_early_close_is_an_error_not_a_short_body() {
    for raw in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
        b"HTTP/1.1 200 O",
    ] {
        let (mut conn, mut engine) = pair().await;
        engine.write_all(raw).await.unwrap();
        drop(engine);
        let result = read_all(&mut conn).await;
        assert!(matches!(result, Err(WireError::Closed)), "{}: {:?}", String::from_utf8_lossy(raw), result.err());
    }
}

#[tokio::test]
async fn a_body_until_close_ends_at_the_close_and_is_not_reused() {
    let (mut conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 200 OK\r\n\r\neverything").await.unwrap();
    drop(engine);
    let (_, body, reusable) = read_all(&mut conn).await.unwrap();
    assert_eq!((body.as_slice(), reusable), (&b"everything"[..], false));
}

#[tokio::test]
async fn informational_heads_are_skipped() {
    let (mut conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n").await.unwrap();
    let (status, body, reusable) = read_all(&mut conn).await.unwrap();
    assert_eq!((status, body.len(), reusable), (201, 0, true));
}

#[tokio::test]
async fn the_idle_check_sees_a_close_and_stray_bytes() {
    let (conn, engine) = pair().await;
    assert!(conn.is_quiet());
    drop(engine);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!conn.is_quiet(), "the engine's FIN");
    let (conn, mut engine) = pair().await;
    engine.write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!conn.is_quiet(), "an unasked answer");
}

/// A chunked body of `pieces` (their sizes are the chunk sizes), with an extension and a
/// trailer, as raw bytes.
fn chunked(pieces: &[Vec<u8>]) -> Vec<u8> {
    let mut raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for p in pieces {
        raw.extend_from_slice(format!("{:x};ext=1\r\n", p.len()).as_bytes());
        raw.extend_from_slice(p);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
    raw
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// However the bytes of a chunked answer are split across reads, the body read is the
    /// chunks' data in order, and the connection is reusable after it.
    #[test]
    fn chunked_bodies_survive_any_split(
        pieces in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..8),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let raw = chunked(&pieces);
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(raw.len())).collect();
        at.extend([0, raw.len()]);
        at.sort_unstable();
        at.dedup();
        let parts: Vec<&[u8]> = at.windows(2).map(|w| &raw[w[0]..w[1]]).collect();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (_, body, reusable) = runtime.block_on(async {
            let (mut conn, mut engine) = pair().await;
            let (read, ()) = tokio::join!(read_all(&mut conn), send_in_pieces(&mut engine, &parts));
            read.unwrap()
        });
        prop_assert_eq!(body, pieces.concat());
        prop_assert!(reusable);
    }
}
