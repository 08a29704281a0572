//! Incremental Server-Sent-Events framing: feed bytes as they arrive (cut anywhere), get back
//! complete events as their exact raw bytes; an unfinished event waits for more input.

/// One complete SSE event: its raw bytes, terminating blank line included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    raw: Vec<u8>,
}

impl Event {
    /// The event exactly as received.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// The `data` field: see [`data_of`].
    pub fn data(&self) -> Option<Vec<u8>> {
        data_of(&self.raw)
    }

    /// The lines other than `data`: see [`other_lines_of`].
    pub fn other_lines(&self) -> impl Iterator<Item = &[u8]> {
        other_lines_of(&self.raw)
    }
}

/// The `data` field of the event `raw`: its `data:` lines joined with `\n` (one leading
/// space after the colon removed, as the SSE spec says); `None` for events without data
/// (comments).
pub fn data_of(raw: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in lines(raw) {
        let Some(rest) = line.strip_prefix(b"data") else {
            continue;
        };
        let value = match rest.first() {
            None => &[][..],
            Some(b':') => {
                let v = rest.get(1..).unwrap_or_default();
                v.strip_prefix(b" ").unwrap_or(v)
            }
            Some(_) => continue, // a field named e.g. "database", not "data"
        };
        match data.as_mut() {
            Some(d) => {
                d.push(b'\n');
                d.extend_from_slice(value);
            }
            None => data = Some(value.to_vec()),
        }
    }
    data
}

/// The lines of the event `raw` other than `data` (`event:`, `id:`, `retry:`, comments), in
/// order, without their line ends: what a rewrite of the data must keep (Responses streams
/// name every event, `event: response.completed`).
pub fn other_lines_of(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    // A line of nothing but CRs carries no field, and written back with a LF it would
    // read as the blank line that ends the event.
    lines(raw).filter(|line| {
        line.iter().any(|&b| b != b'\r')
            && line.strip_prefix(b"data").is_none_or(|rest| rest.first().is_some_and(|&b| b != b':'))
    })
}

/// Finds the events in `data`, whose current line starts at `line_start`, looking for line
/// ends from `from` (before it, none); hands each event to `each`. Returns where the last
/// event ended (0: none did) and where the unfinished line starts. An event ends at a blank
/// line (CR before its LF allowed); blank lines before an event's first field belong to it.
fn scan_events(data: &[u8], mut line_start: usize, from: usize, each: &mut impl FnMut(&[u8])) -> (usize, usize) {
    let mut event_start = 0;
    for at in memchr::memchr_iter(b'\n', data.get(from..).unwrap_or_default()) {
        let end = from + at;
        let line = data.get(line_start..end).unwrap_or_default();
        let blank = line.is_empty() || line == b"\r";
        if blank && line_start > event_start {
            each(data.get(event_start..=end).unwrap_or_default());
            event_start = end + 1;
        }
        line_start = end + 1;
    }
    (event_start, line_start)
}

fn lines(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    raw.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l)).filter(|l| !l.is_empty())
}

/// Bytes left over when a stream ended in the middle of an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stream ended inside an event ({} bytes unterminated)", .0.len())]
pub struct Unterminated(pub Vec<u8>);

/// The incremental decoder.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    /// Where to resume looking for a line end in `buf`.
    scan: usize,
    /// Start of the current line in `buf`.
    line_start: usize,
}

impl SseDecoder {
    /// A decoder with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `chunk` and returns every event it completed, in order.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        self.feed_each(chunk, |raw| events.push(Event { raw: raw.to_vec() }));
        events
    }

    /// Adds `chunk` and hands every event it completed to `each`, in order, as its raw bytes.
    /// With nothing held back from earlier chunks the events are slices of `chunk` itself:
    /// only an unfinished tail is copied, to wait for the rest.
    pub fn feed_each(&mut self, chunk: &[u8], mut each: impl FnMut(&[u8])) {
        if self.buf.is_empty() {
            let (event_end, line_start) = scan_events(chunk, 0, 0, &mut each);
            let tail = chunk.get(event_end..).unwrap_or_default();
            self.buf.extend_from_slice(tail);
            self.line_start = line_start - event_end;
            self.scan = tail.len();
            return;
        }
        self.buf.extend_from_slice(chunk);
        let (event_end, line_start) = scan_events(&self.buf, self.line_start, self.scan, &mut each);
        self.buf.drain(..event_end);
        self.line_start = line_start - event_end;
        self.scan = self.buf.len();
    }

    /// Ends the stream: `Ok` when nothing (or only blank lines) is left over.
    ///
    /// # Errors
    /// [`Unterminated`] with the leftover bytes of an event that never ended.
    pub fn finish(self) -> Result<(), Unterminated> {
        if self.buf.iter().all(|b| matches!(b, b'\n' | b'\r')) {
            Ok(())
        } else {
            Err(Unterminated(self.buf))
        }
    }

    /// Bytes held back waiting for the end of an event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Ends the stream and hands back every byte held back, blank lines included, so a
    /// relay can forward the stream byte for byte.
    pub fn into_pending(self) -> Vec<u8> {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_lines_are_every_field_but_data() {
        let mut d = SseDecoder::new();
        let events = d.feed(b"event: response.completed\r\ndata: {}\nid: 7\n\r\r\n: note\ndatabase: x\n\n");
        let other: Vec<&[u8]> = events[0].other_lines().collect();
        assert_eq!(other, [&b"event: response.completed"[..], b"id: 7", b": note", b"database: x"]);
    }

    const STREAM: &[u8] = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":\n data: 2}\r\n\r\ndata: [DONE]\n\n";

    fn decode_in_pieces(cuts: &[usize]) -> Vec<Event> {
        let mut dec = SseDecoder::new();
        let mut events = Vec::new();
        let mut last = 0;
        for &cut in cuts.iter().chain(std::iter::once(&STREAM.len())) {
            events.extend(dec.feed(&STREAM[last..cut]));
            last = cut;
        }
        dec.finish().unwrap();
        events
    }

    #[test]
    fn whole_stream_gives_four_events() {
        let events = decode_in_pieces(&[]);
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].data().unwrap(), b"{\"a\":1}");
        assert_eq!(events[1].data(), None);
        assert_eq!(events[2].data().unwrap(), b"{\"b\":");
        assert_eq!(events[3].data().unwrap(), b"[DONE]");
        let joined: Vec<u8> = events.iter().flat_map(|e| e.raw().to_vec()).collect();
        assert_eq!(joined, STREAM);
    }

    #[test]
    fn every_cut_gives_the_same_events() {
        let whole = decode_in_pieces(&[]);
        for cut in 0..=STREAM.len() {
            assert_eq!(decode_in_pieces(&[cut]), whole, "cut at {cut}");
        }
        for a in 0..STREAM.len() {
            assert_eq!(decode_in_pieces(&[a, (a + 7).min(STREAM.len())]), whole, "cuts at {a}");
        }
    }

    #[test]
    fn multi_line_data_is_joined() {
        let mut dec = SseDecoder::new();
        let ev = dec.feed(b"event: x\ndata: a\ndata:b\n\n");
        assert_eq!(ev[0].data().unwrap(), b"a\nb");
    }

    #[test]
    fn unterminated_tail_is_reported() {
        let mut dec = SseDecoder::new();
        assert!(dec.feed(b"data: {\"a\"").is_empty());
        assert_eq!(dec.pending(), 10);
        assert_eq!(dec.finish(), Err(Unterminated(b"data: {\"a\"".to_vec())));
    }

    #[test]
    fn trailing_blank_lines_stay_pending_and_are_handed_back() {
        let mut dec = SseDecoder::new();
        assert_eq!(dec.feed(b"data: a\n\n\r\n").len(), 1);
        assert_eq!(dec.pending(), 2);
        assert_eq!(dec.into_pending(), b"\r\n");
    }
}
