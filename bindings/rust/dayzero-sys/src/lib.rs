//! Raw declarations of libdayzero's C API, written by hand from `include/dayzero.h`.
//!
//! `tests/header.rs` parses the header and checks every function, struct field,
//! enum value and version macro against this file, so the two cannot drift.
//! C enums are `c_int` type aliases with one constant per value, so a value
//! added by a newer library never makes a Rust enum invalid.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub const DZ_VERSION_MAJOR: c_int = 0;
pub const DZ_VERSION_MINOR: c_int = 1;
pub const DZ_VERSION_PATCH: c_int = 0;
pub const DZ_ABI_VERSION: c_int = 0;

pub type dz_status = c_int;
pub const DZ_OK: dz_status = 0;
pub const DZ_ERR_INVALID_ARGUMENT: dz_status = 1;
pub const DZ_ERR_IO: dz_status = 2;
pub const DZ_ERR_FORMAT: dz_status = 3;
pub const DZ_ERR_UNSUPPORTED: dz_status = 4;
pub const DZ_ERR_OUT_OF_MEMORY: dz_status = 5;
pub const DZ_ERR_KV_FULL: dz_status = 6;
pub const DZ_ERR_CANCELLED: dz_status = 7;
pub const DZ_ERR_DEVICE: dz_status = 8;
pub const DZ_ERR_NOT_FOUND: dz_status = 9;
pub const DZ_ERR_BUFFER_TOO_SMALL: dz_status = 10;
pub const DZ_ERR_INTERNAL: dz_status = 11;

pub type dz_log_level = c_int;
pub const DZ_LOG_DEBUG: dz_log_level = 0;
pub const DZ_LOG_INFO: dz_log_level = 1;
pub const DZ_LOG_WARN: dz_log_level = 2;
pub const DZ_LOG_ERROR: dz_log_level = 3;
pub const DZ_LOG_NONE: dz_log_level = 4;

pub type dz_log_fn =
    Option<unsafe extern "C" fn(level: dz_log_level, message: *const c_char, user: *mut c_void)>;
pub type dz_progress_fn = Option<
    unsafe extern "C" fn(stage: *const c_char, done: u64, total: u64, user: *mut c_void) -> c_int,
>;
pub type dz_abort_fn = Option<unsafe extern "C" fn(user: *mut c_void) -> c_int>;

#[repr(C)]
pub struct dz_model {
    _private: [u8; 0],
}

pub type dz_device = c_int;
pub const DZ_DEVICE_CPU: dz_device = 0;
pub const DZ_DEVICE_CUDA: dz_device = 1;
pub const DZ_DEVICE_AUTO: dz_device = 2;

pub type dz_expert_precision = c_int;
pub const DZ_EXPERTS_AUTO: dz_expert_precision = 0;
pub const DZ_EXPERTS_NATIVE: dz_expert_precision = 1;
pub const DZ_EXPERTS_FP8: dz_expert_precision = 2;
pub const DZ_EXPERTS_BF16: dz_expert_precision = 3;

pub type dz_indexer_mode = c_int;
pub const DZ_INDEXER_EXACT: dz_indexer_mode = 0;
pub const DZ_INDEXER_FP8: dz_indexer_mode = 1;
pub const DZ_INDEXER_AUTO: dz_indexer_mode = 2;

pub type dz_activation_precision = c_int;
pub const DZ_ACTIVATIONS_AUTO: dz_activation_precision = 0;
pub const DZ_ACTIVATIONS_F32: dz_activation_precision = 1;
pub const DZ_ACTIVATIONS_BF16: dz_activation_precision = 2;

pub type dz_attention_precision = c_int;
pub const DZ_ATTENTION_AUTO: dz_attention_precision = 0;
pub const DZ_ATTENTION_PRECISE: dz_attention_precision = 1;
pub const DZ_ATTENTION_BF16: dz_attention_precision = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_model_params {
    pub struct_size: usize,
    pub device: dz_device,
    pub device_index: c_int,
    pub n_threads: c_int,
    pub experts: dz_expert_precision,
    pub indexer: dz_indexer_mode,
    pub bf16_sensitive: c_int,
    pub progress: dz_progress_fn,
    pub progress_user: *mut c_void,
    pub activations: dz_activation_precision,
    pub exact_moe_layers: c_int,
    pub attention: dz_attention_precision,
    pub pass_tokens: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_model_info {
    pub struct_size: usize,
    pub architecture: *const c_char,
    pub device: dz_device,
    pub n_layers: i32,
    pub n_vocab: i32,
    pub hidden_size: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub n_experts: i32,
    pub n_experts_active: i32,
    pub max_context: i64,
    pub n_params: u64,
    pub weight_bytes: u64,
    pub device_bytes: u64,
    pub n_shards: i32,
}

#[repr(C)]
pub struct dz_tokenizer {
    _private: [u8; 0],
}

#[repr(C)]
pub struct dz_detokenizer {
    _private: [u8; 0],
}

#[repr(C)]
pub struct dz_kv_arena {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_kv_arena_params {
    pub struct_size: usize,
    pub page_tokens: u32,
    pub capacity_pages: u64,
    pub capacity_bytes: u64,
    pub max_sessions: u32,
    pub prefix_cache: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_kv_stats {
    pub struct_size: usize,
    pub page_tokens: u32,
    pub page_bytes: u64,
    pub pages_total: u64,
    pub pages_used: u64,
    pub pages_cached: u64,
    pub pages_free: u64,
    pub bytes_total: u64,
    pub bytes_metadata: u64,
    pub tokens_requested: u64,
    pub tokens_reused: u64,
    pub evictions: u64,
    pub state_slots_total: u32,
    pub state_slots_used: u32,
    pub state_bytes: u64,
    pub state_snapshots_total: u32,
    pub state_snapshots_used: u32,
}

#[repr(C)]
pub struct dz_session {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_sampler_params {
    pub struct_size: usize,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub seed: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_session_params {
    pub struct_size: usize,
    pub sampler: dz_sampler_params,
    pub prefill_chunk: u32,
    pub abort: dz_abort_fn,
    pub abort_user: *mut c_void,
}

pub type dz_logits_mode = c_int;
pub const DZ_LOGITS_LAST: dz_logits_mode = 0;
pub const DZ_LOGITS_ALL: dz_logits_mode = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dz_session_stats {
    pub struct_size: usize,
    pub n_tokens: u64,
    pub tokens_computed: u64,
    pub tokens_reused: u64,
    pub pages: u64,
    pub attention_tokens_read: u64,
}

// The params/info structs' *_init: the header's *_init(p) is a macro for
// *_init_sized(p, sizeof *(p)). Call the *_init_sized forms with
// `size_of::<T>()` of the struct declared here: they write at most that many
// bytes, so a newer library whose struct has grown never writes past ours. The
// unsized *_init functions write the library's own sizeof.
extern "C" {
    pub fn dz_version() -> *const c_char;
    pub fn dz_abi_version() -> c_int;
    pub fn dz_last_error() -> *const c_char;
    pub fn dz_status_name(status: dz_status) -> *const c_char;
    pub fn dz_log_set(fn_: dz_log_fn, user: *mut c_void, min_level: dz_log_level) -> dz_status;

    pub fn dz_model_params_init_sized(params: *mut dz_model_params, struct_size: usize);
    pub fn dz_model_params_init(params: *mut dz_model_params);
    pub fn dz_model_open(
        dir: *const c_char,
        params: *const dz_model_params,
        out: *mut *mut dz_model,
    ) -> dz_status;
    pub fn dz_model_free(model: *mut dz_model);
    pub fn dz_model_info_init_sized(info: *mut dz_model_info, struct_size: usize);
    pub fn dz_model_info_init(info: *mut dz_model_info);
    pub fn dz_model_get_info(model: *const dz_model, info: *mut dz_model_info) -> dz_status;

    pub fn dz_tokenizer_open(path: *const c_char, out: *mut *mut dz_tokenizer) -> dz_status;
    pub fn dz_tokenizer_free(tok: *mut dz_tokenizer);
    pub fn dz_model_tokenizer(model: *const dz_model, out: *mut *const dz_tokenizer) -> dz_status;
    pub fn dz_tokenize(
        tok: *const dz_tokenizer,
        text: *const c_char,
        len: usize,
        parse_special: c_int,
        out: *mut i32,
        cap: usize,
        n_out: *mut usize,
    ) -> dz_status;
    pub fn dz_detokenize(
        tok: *const dz_tokenizer,
        ids: *const i32,
        n: usize,
        out: *mut c_char,
        cap: usize,
        n_out: *mut usize,
    ) -> dz_status;
    pub fn dz_tokenizer_vocab_size(tok: *const dz_tokenizer, n_vocab: *mut i32) -> dz_status;
    pub fn dz_tokenizer_token_id(
        tok: *const dz_tokenizer,
        text: *const c_char,
        id: *mut i32,
    ) -> dz_status;
    pub fn dz_tokenizer_stop_ids(
        tok: *const dz_tokenizer,
        ids: *mut *const i32,
        n: *mut usize,
    ) -> dz_status;
    pub fn dz_detokenizer_create(
        tok: *const dz_tokenizer,
        out: *mut *mut dz_detokenizer,
    ) -> dz_status;
    pub fn dz_detokenizer_free(d: *mut dz_detokenizer);
    pub fn dz_detokenizer_push(
        d: *mut dz_detokenizer,
        id: i32,
        piece: *mut *const c_char,
        len: *mut usize,
    ) -> dz_status;
    pub fn dz_detokenizer_flush(
        d: *mut dz_detokenizer,
        piece: *mut *const c_char,
        len: *mut usize,
    ) -> dz_status;
    pub fn dz_chat_apply_template(
        tok: *const dz_tokenizer,
        messages_json: *const c_char,
        options_json: *const c_char,
        add_generation_prompt: c_int,
        out: *mut c_char,
        cap: usize,
        n_out: *mut usize,
    ) -> dz_status;

    pub fn dz_kv_arena_params_init_sized(params: *mut dz_kv_arena_params, struct_size: usize);
    pub fn dz_kv_arena_params_init(params: *mut dz_kv_arena_params);
    pub fn dz_kv_arena_create(
        model: *mut dz_model,
        params: *const dz_kv_arena_params,
        out: *mut *mut dz_kv_arena,
    ) -> dz_status;
    pub fn dz_kv_arena_free(arena: *mut dz_kv_arena);
    pub fn dz_kv_stats_init_sized(stats: *mut dz_kv_stats, struct_size: usize);
    pub fn dz_kv_stats_init(stats: *mut dz_kv_stats);
    pub fn dz_kv_arena_get_stats(arena: *const dz_kv_arena, stats: *mut dz_kv_stats) -> dz_status;

    pub fn dz_sampler_params_init_sized(params: *mut dz_sampler_params, struct_size: usize);
    pub fn dz_sampler_params_init(params: *mut dz_sampler_params);
    pub fn dz_session_params_init_sized(params: *mut dz_session_params, struct_size: usize);
    pub fn dz_session_params_init(params: *mut dz_session_params);
    pub fn dz_session_create(
        arena: *mut dz_kv_arena,
        params: *const dz_session_params,
        out: *mut *mut dz_session,
    ) -> dz_status;
    pub fn dz_session_free(session: *mut dz_session);
    pub fn dz_session_fork(src: *const dz_session, out: *mut *mut dz_session) -> dz_status;
    pub fn dz_session_append(
        session: *mut dz_session,
        tokens: *const i32,
        n: usize,
        mode: dz_logits_mode,
    ) -> dz_status;
    pub fn dz_session_logits(
        session: *const dz_session,
        logits: *mut *const f32,
        rows: *mut usize,
        n_vocab: *mut usize,
    ) -> dz_status;
    pub fn dz_session_sample(session: *mut dz_session, token: *mut i32) -> dz_status;
    pub fn dz_session_set_sampler(
        session: *mut dz_session,
        params: *const dz_sampler_params,
    ) -> dz_status;
    pub fn dz_session_length(session: *const dz_session, n: *mut usize) -> dz_status;
    pub fn dz_session_truncate(session: *mut dz_session, n: usize) -> dz_status;
    pub fn dz_session_reset(session: *mut dz_session) -> dz_status;
    pub fn dz_session_stats_init_sized(stats: *mut dz_session_stats, struct_size: usize);
    pub fn dz_session_stats_init(stats: *mut dz_session_stats);
    pub fn dz_session_get_stats(
        session: *const dz_session,
        stats: *mut dz_session_stats,
    ) -> dz_status;

    pub fn dz_generate_step(
        sessions: *const *mut dz_session,
        n: usize,
        out_tokens: *mut i32,
    ) -> dz_status;
    pub fn dz_decode_batch(
        sessions: *const *mut dz_session,
        tokens: *const i32,
        n: usize,
    ) -> dz_status;
}
