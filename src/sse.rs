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

    /// The `data` field: the event's `data:` lines joined with `\n` (one leading space after
    /// the colon removed, as the SSE spec says); `None` for events without data (comments).
    pub fn data(&self) -> Option<Vec<u8>> {
        let mut data: Option<Vec<u8>> = None;
        for line in lines(&self.raw) {
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
}

impl Event {
    /// The event's lines other than `data` (`event:`, `id:`, `retry:`, comments), in order,
    /// without their line ends: what a rewrite of the data must keep (Responses streams name
    /// every event, `event: response.completed`).
    pub fn other_lines(&self) -> impl Iterator<Item = &[u8]> {
        // A line of nothing but CRs carries no field, and written back with a LF it would
        // read as the blank line that ends the event.
        lines(&self.raw).filter(|line| {
            line.iter().any(|&b| b != b'\r')
                && line.strip_prefix(b"data").is_none_or(|rest| rest.first().is_some_and(|&b| b != b':'))
        })
    }
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
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut event_start = 0;
        let mut i = self.scan;
        while let Some(&b) = self.buf.get(i) {
            match b {
                b'\n' => {
                    let line = self.buf.get(self.line_start..i).unwrap_or_default();
                    let line = line.strip_suffix(b"\r").unwrap_or(line);
                    if line.is_empty() && self.line_start > event_start {
                        events.push(Event { raw: self.buf.get(event_start..=i).unwrap_or_default().to_vec() });
                        event_start = i + 1;
                    } else if line.is_empty() {
                        // Blank line with no event before it: keep it as part of the next event.
                    }
                    self.line_start = i + 1;
                }
                b'\r' if self.buf.get(i + 1).is_none() => break, // maybe CRLF: wait for more
                _ => {}
            }
            i += 1;
        }
        if event_start > 0 {
            self.buf.drain(..event_start);
            i -= event_start;
            self.line_start -= event_start;
        }
        self.scan = i;
        events
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
