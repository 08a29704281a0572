//! The label values of every metric, as enums (bounded cardinality): each with its label
//! string and `ALL` in declaration order, which indexes the per-route handle tables.

label_enum! {
    /// Timed stages of an orchestrated request (`stage_duration_seconds{stage}`).
    Stage {
        /// The prefill leg, send to full response.
        Prefill => "prefill",
        /// Extracting and validating the handoff, building the decode body.
        Handoff => "handoff",
        /// Decode leg, send to response header.
        DecodeFirstByte => "decode_first_byte",
        /// Decode leg, send to end of stream.
        DecodeTotal => "decode_total",
    }
}

label_enum! {
    /// Which client listener a request came in on (`admission_rejected_total{listener}`).
    Listener {
        /// The plain HTTP listener (`server.listen`).
        Plain => "plain",
        /// The TLS listener (`server.tls.listen`).
        Tls => "tls",
    }
}

label_enum! {
    /// Which leg an upstream error or retry happened on (`upstream_errors_total{stage}`).
    Leg {
        /// The prefill leg.
        Prefill => "prefill",
        /// The decode leg (orchestrated, relayed, or decode-only).
        Decode => "decode",
        /// A passthrough route or an unmatched request.
        Passthrough => "passthrough",
    }
}

label_enum! {
    /// How an upstream exchange failed (`upstream_errors_total{kind}`).
    ErrorKind {
        /// Could not connect.
        Connect => "connect",
        /// The TLS handshake failed (certificate not trusted, or ours refused).
        Tls => "tls",
        /// The connection failed while sending or reading.
        Io => "io",
        /// No answer within the leg's deadline.
        Timeout => "timeout",
        /// The answer was over the size tokenonce buffers.
        TooLarge => "too_large",
        /// The engine answered 5xx.
        Status5xx => "status_5xx",
        /// A 2xx prefill answer that is not a completion response.
        BadResponse => "bad_response",
        /// A stream broke after the response began.
        StreamBroken => "stream_broken",
    }
}

label_enum! {
    /// Which bounded wait ran out (`timeouts_total{stage}`).
    TimeoutStage {
        /// TCP connect to an engine (`upstream.connect_timeout_ms`).
        Connect => "connect",
        /// The whole prefill leg (`prefill_timeout_ms`).
        Prefill => "prefill",
        /// An engine's response header (`decode_first_byte_timeout_ms`; a non-streamed answer:
        /// `decode_whole_answer_timeout_ms`).
        FirstByte => "first_byte",
        /// Silence between body chunks of an answer being relayed (`stream_idle_timeout_ms`).
        StreamIdle => "stream_idle",
        /// A write to a client that does not read (`client_write_timeout_ms`).
        ClientWrite => "client_write",
        /// The release leg sent for a client gone after its prefill (`release_timeout_ms`).
        Release => "release",
    }
}

label_enum! {
    /// What became of a prefill's KV blocks when the client left before the decode answered
    /// a body byte (`kv_releases_total{result}`).
    Release {
        /// The one-token decode was sent and answered 2xx: the decode pulled the blocks.
        Released => "released",
        /// It was sent and failed (no answer, or not 2xx).
        Failed => "failed",
        /// It was sent and did not finish within `release_timeout_ms`.
        Timeout => "timeout",
        /// The route has `on_client_gone = "abandon"`: nothing was sent.
        Abandoned => "abandoned",
        /// The decode had its request whole: it pulls the blocks, or frees them on the
        /// prefill when aborted first; nothing was sent.
        LeftToDecode => "left_to_decode",
    }
}

label_enum! {
    /// Whether an orchestrated request of a pool-prefill route got a prefill leg
    /// (`prefill_decisions_total{decision}`).
    PrefillDecision {
        /// Prefill leg, KV handoff, then the decode.
        Prefill => "prefill",
        /// The decode computed the prompt itself, token-in, no prefill leg.
        DecodeAlone => "decode_alone",
    }
}

label_enum! {
    /// Why (`prefill_decisions_total{reason}`).
    DecisionReason {
        /// The route's `prefill.skip_below_tokens` is 0.
        Off => "off",
        /// No trusted local ids for the prompt (untrusted shape, no tokenizer, an API without
        /// them, reuse gated off): the decode could not go token-in.
        NoLocalIds => "no_local_ids",
        /// The decode pool has no usable KV events (none configured, stale, or its hash check
        /// failed): what the decode holds is not known.
        NoDecodeEvents => "no_decode_events",
        /// The tokens the decode lacks are over the threshold.
        OverThreshold => "over_threshold",
        /// They are at or under it.
        UnderThreshold => "under_threshold",
        /// They are at or under it, but the decode has no room: with them, what it computes
        /// alone for this instance would pass the threshold, or its engine reports requests
        /// waiting. The prefill engine takes the work.
        DecodeBusy => "decode_busy",
        /// The decode alone failed before its answer began: retried with a prefill, on
        /// another decode (the request is counted `decode_alone` too).
        DecodeAloneFailed => "decode_alone_failed",
    }
}

label_enum! {
    /// How a request ended (`requests_total{outcome}`).
    Outcome {
        /// 2xx fully relayed.
        Success => "success",
        /// 4xx (ours or an engine's).
        ClientError => "client_error",
        /// 5xx, or a stream that broke.
        ServerError => "server_error",
        /// The client went away first.
        ClientClosed => "client_closed",
    }
}

impl Outcome {
    /// The outcome of a finished response with `status`.
    pub fn from_status(status: u16) -> Self {
        match status {
            200..=399 => Self::Success,
            400..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

label_enum! {
    /// Result of a parity check (`parity_checks_total{result}`).
    ParityResult {
        /// The ids decode to the request's contents, in order, and their count agrees.
        Match => "match",
        /// They do not.
        Mismatch => "mismatch",
        /// Nothing comparable (no text content, a token prompt, ids that do not decode).
        Skipped => "skipped",
        /// The watch's queue was full: not checked.
        Dropped => "dropped",
    }
}

label_enum! {
    /// What became of spans handed to the OTLP exporter (`trace_spans_total{result}`).
    SpanExport {
        /// The collector took the batch.
        Exported => "exported",
        /// The batch could not be sent (collector down, refused, timed out): the spans are lost.
        Failed => "failed",
    }
}

label_enum! {
    /// Result of a relay cache lookup (`cache_lookups_total{result}`).
    CacheLookup {
        /// Ids found and taken.
        Hit => "hit",
        /// No entry under any key.
        Miss => "miss",
        /// An entry was found but had expired.
        Expired => "expired",
        /// An entry was found under a key but for another prompt.
        Mismatch => "mismatch",
    }
}

label_enum! {
    /// Why relay cache entries were dropped (`cache_evictions_total{reason}`).
    Eviction {
        /// The TTL passed.
        Ttl => "ttl",
        /// Room was needed (or the entry was larger than the cache).
        Capacity => "capacity",
    }
}

label_enum! {
    /// A local-ids check's result (`local_ids_checks_total{result}`).
    LocalIdsResult {
        /// tokenonce's ids equal the prefill's echo.
        Match => "match",
        /// They differ.
        Mismatch => "mismatch",
        /// The request is not one tokenonce renders faithfully (`local_ids_unsupported_total{reason}`).
        Unsupported => "unsupported",
        /// The verifier's queue was full: not checked.
        Dropped => "dropped",
    }
}

label_enum! {
    /// What a follow-up turn's render did to the conversation before it
    /// (`prompt_history_turns_total{result}`).
    HistoryResult {
        /// It repeats the earlier conversation token for token.
        Same => "same",
        /// It renders part of it otherwise (a prefix-cache miss the template causes).
        Drift => "drift",
    }
}

label_enum! {
    /// Where a Responses follow-up naming a stored answer went (`response_followups_total{result}`).
    FollowUp {
        /// To the decode endpoint that stored it.
        Home => "home",
        /// Balanced: no endpoint of the route's decode pool is known to hold it.
        Unknown => "unknown",
    }
}

label_enum! {
    /// Result of one lookup of a discovered pool's DNS name (`discovery_lookups_total{result}`).
    DnsLookup {
        /// Addresses came back: they are the pool's members now.
        Ok => "ok",
        /// The lookup failed (no server answered, an error, no answer in time): the last set stays.
        Failed => "failed",
        /// The name has no address now: the last set stays (an empty pool serves nothing).
        Empty => "empty",
    }
}

label_enum! {
    /// How a read of an engine's `/metrics` went (`engine_metrics_reads_total{result}`).
    LoadRead {
        /// Read and believed: its gauges show it.
        Ok => "ok",
        /// No answer, or not 200, within the probe's deadline: the last read stays until stale.
        Failed => "failed",
        /// An answer that cannot be true (malformed, NaN, negative, absurd, too large): not kept.
        Rejected => "rejected",
        /// The last read believed grew too old and was forgotten (its gauges removed).
        Stale => "stale",
    }
}

label_enum! {
    /// Which source a cache-aware choice asked (`cache_aware_choices_total{source}`).
    ChoiceSource {
        /// The engines' KV events: what they hold.
        Events => "events",
        /// Where tokenonce itself sent each prefix.
        Sent => "sent",
        /// Where tokenonce sent each prompt known by its text only (no ids): chat messages,
        /// pieces of a completions prompt.
        Text => "text",
        /// None: the choice fell to least in flight.
        None => "none",
    }
}

label_enum! {
    /// Why a cache-aware choice went where it did (`cache_aware_choices_total{reason}`).
    ChoiceReason {
        /// A candidate holding the most of the prompt won: its held prefix decided.
        Prefix => "prefix",
        /// No candidate held any of it: the least work queued decided.
        NoPrefix => "no_prefix",
        /// Every candidate held as much of it (a shared system prompt): the queue decided.
        SharedPrefix => "shared_prefix",
        /// A holder of more of it was passed over for the work queued there.
        Load => "load",
        /// A holder of more of it was passed over for its KV cache's pressure.
        CachePressure => "cache_pressure",
        /// The prompt's ids were not known at the choice: least in flight.
        NoIds => "no_ids",
        /// The prompt is shorter than one block: least in flight.
        ShortPrompt => "short_prompt",
        /// No source may be believed now (events stale or off, no other): least in flight.
        Unusable => "unusable",
        /// Images, audio or video in the prompt: vLLM hashes their blocks with the media's
        /// own identifiers, which tokenonce does not compute, so least in flight.
        Multimodal => "multimodal",
        /// A completions prompt given as embeddings (`prompt_embeds`): hashed from the
        /// tensor's bytes, so least in flight.
        PromptEmbeds => "prompt_embeds",
    }
}

label_enum! {
    /// Result of a config reload (`config_reloads_total{result}`).
    Reload {
        /// The new config is in use.
        Success => "success",
        /// The file was rejected; the running config stays.
        Failure => "failure",
    }
}
