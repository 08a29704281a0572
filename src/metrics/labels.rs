//! The label values of every metric, as enums (bounded cardinality): each with its label
//! string and `ALL` in declaration order, which indexes the per-route handle tables.

use crate::config::Mode;
use crate::openai::Api;

/// Declares a label enum: variants, their label strings, and `ALL` in declaration order
/// (so `variant as usize` indexes `ALL` and the per-route handle tables).
macro_rules! label_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $label,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

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
    /// Why a request took the text decode instead of reusing the prefill's ids
    /// (`token_reuse_total{result="fallback",reason}`).
    FallbackReason {
        /// The route turns token reuse off.
        Disabled => "disabled",
        /// The decode vLLM is older than 0.27 (no `kv_transfer_params.prompt_token_ids`).
        DecodeVersionOld => "decode_version_old",
        /// The decode vLLM's version could not be learned.
        DecodeVersionUnknown => "decode_version_unknown",
        /// Messages carry media: ids alone would drop it.
        Media => "media",
        /// `echo` is set.
        Echo => "echo",
        /// `n > 1`.
        NGreaterThanOne => "n_gt_1",
        /// A completions batch (several prompts).
        BatchPrompt => "batch_prompt",
        /// The client already sent token ids: nothing to save.
        PromptIsTokens => "prompt_is_tokens",
        /// The prefill echoed no ids.
        IdsMissing => "ids_missing",
        /// The prefill's ids failed validation.
        IdsMalformed => "ids_malformed",
        /// Relay mode: no cached ids for this decode.
        CacheMiss => "cache_miss",
        /// The prefill leg failed and the route sends the decode alone.
        PrefillFailed => "prefill_failed",
        /// The API has no way to echo prompt ids on vLLM (`/v1/messages`).
        IdsNotEchoed => "ids_not_echoed",
        /// A Responses request that needs the decode's response store
        /// (`previous_response_id`, `conversation`, `background`): sent to the decode alone.
        Stateful => "stateful",
        /// A fractional `token_reuse` left this request out of the canary share.
        Canary => "canary",
        /// An id is at or above the vocabulary size of the route's tokenizer.
        IdsOutOfVocab => "ids_out_of_vocab",
        /// The parity watch found ids that do not carry their request (`disable_reuse`).
        ParityReuseOff => "parity_reuse_off",
        /// The prefill and decode pools serve different models (`GET /v1/models`).
        ModelMismatch => "model_mismatch",
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
    /// Where a Responses follow-up naming a stored answer went (`response_followups_total{result}`).
    FollowUp {
        /// To the decode endpoint that stored it.
        Home => "home",
        /// Balanced: no endpoint of the route's decode pool is known to hold it.
        Unknown => "unknown",
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

/// The `api` label: an orchestrated API, or `other`.
pub(super) fn api_label(api: Option<Api>) -> &'static str {
    api.map_or("other", Api::as_str)
}

/// The `api` label values, in the order [`RouteMetrics`] tables them.
pub(super) const API_LABELS: [Option<Api>; 6] =
    [Some(Api::Chat), Some(Api::Completions), Some(Api::Responses), Some(Api::Messages), Some(Api::Generate), None];

/// The `mode` label of a request: its route's mode for the OpenAI APIs; every other
/// request is passed through whatever its route.
pub fn served_as(api: Option<Api>, route_mode: Mode) -> Mode {
    if api.is_some() {
        route_mode
    } else {
        Mode::Passthrough
    }
}

pub(super) fn api_index(api: Option<Api>) -> usize {
    match api {
        Some(Api::Chat) => 0,
        Some(Api::Completions) => 1,
        Some(Api::Responses) => 2,
        Some(Api::Messages) => 3,
        Some(Api::Generate) => 4,
        None => 5,
    }
}
