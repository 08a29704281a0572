//! Why a request's decode takes the text path instead of the prefill's ids: one
//! [`FallbackReason`] per cause, decided where the cause is seen (the request view, the plan,
//! relay's cache lookup) and counted as `token_reuse_total{result="fallback",reason}`.

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
        /// vLLM refuses the request for a field the prefill leg rewrites (`stream_options`
        /// without `stream`, `prompt_logprobs` with `stream`): sent to the decode alone, as
        /// sent, for vLLM to refuse in its own words (no prefill spent on it).
        VllmRefuses => "vllm_refuses",
    }
}
