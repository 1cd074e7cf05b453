/*
 * dayzero.h - the dayzero C API (C89).
 *
 * dayzero serves new large-language-model architectures (sparse attention,
 * MXFP4 experts, million-token paged KV caches) from their Hugging Face
 * checkpoints, on the CPU (reference) or CUDA (sm_90a) backend.
 *
 * Conventions
 *  - Every fallible call returns dz_status. DZ_OK is 0. On failure
 *    dz_last_error() returns a message naming what was wrong (file, tensor,
 *    field). The message is thread-local and valid until the next failing call
 *    on the same thread.
 *  - Handles are opaque. *_free / *_close functions accept NULL and never fail.
 *  - Params and info structs begin with `size_t struct_size`; fill them with
 *    their *_init(p), then change fields. The library reads only the first
 *    struct_size bytes, so programs built against an older header keep working.
 *    *_init(p) is a macro for *_init_sized(p, sizeof *(p)): the library writes
 *    its defaults into at most that many bytes (a NULL p is ignored) and sets
 *    struct_size to the smaller of that size and its own sizeof, so a newer
 *    library never writes past an older program's struct. Bindings that
 *    declare the structs themselves must call *_init_sized with their own
 *    struct's size. The functions named like the macros remain, for programs
 *    built before the macros, and write the library's whole struct.
 *  - Pointers passed in are borrowed for the duration of the call unless a
 *    comment says otherwise. Pointers returned through `const T **` are owned
 *    by the library and valid for as long as the comment says.
 *  - Enum values are never renumbered; new values are only appended.
 *
 * Thread safety
 *  - dz_model, dz_tokenizer: immutable after open; every call taking a const
 *    pointer to them may be made from any thread concurrently.
 *  - dz_kv_arena: internally synchronised; sessions on different threads may
 *    allocate pages from one arena concurrently.
 *  - dz_session, dz_detokenizer: one thread at a time per handle. Different
 *    sessions may be used from different threads concurrently.
 *  - dz_log_set: call before other threads use the library.
 *  - dz_generate_step: the sessions passed must not be in use by other
 *    threads during the call.
 *  - Models on one GPU: each has its own CUDA streams and scratch and runs
 *    one forward pass at a time; different models may run concurrently from
 *    different threads.
 */
#ifndef DAYZERO_H
#define DAYZERO_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(DZ_BUILDING)
#define DZ_API __declspec(dllexport)
#else
#define DZ_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define DZ_API __attribute__((visibility("default")))
#else
#define DZ_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- version */

#define DZ_VERSION_MAJOR 0
#define DZ_VERSION_MINOR 1
#define DZ_VERSION_PATCH 0
/* ABI major version: the SONAME is libdayzero.so.<DZ_ABI_VERSION>. */
#define DZ_ABI_VERSION 0

/* "MAJOR.MINOR.PATCH" of the loaded library. Static storage. */
DZ_API const char *dz_version(void);
/* DZ_ABI_VERSION of the loaded library; compare with the header's. */
DZ_API int dz_abi_version(void);

/* ----------------------------------------------------------------- status */

typedef enum dz_status {
  DZ_OK = 0,
  DZ_ERR_INVALID_ARGUMENT = 1, /* NULL handle, bad value, struct_size too small */
  DZ_ERR_IO = 2,               /* file missing, unreadable, mmap failed */
  DZ_ERR_FORMAT = 3,           /* malformed checkpoint, JSON, tokenizer file */
  DZ_ERR_UNSUPPORTED = 4,      /* valid request this build cannot serve yet */
  DZ_ERR_OUT_OF_MEMORY = 5,    /* host or device allocation failed */
  DZ_ERR_KV_FULL = 6,          /* no KV page free; the session is unchanged */
  DZ_ERR_CANCELLED = 7,        /* the abort callback asked to stop */
  DZ_ERR_DEVICE = 8,           /* CUDA / cuBLAS / NCCL error (message has it) */
  DZ_ERR_NOT_FOUND = 9,        /* named tensor, token or file absent */
  DZ_ERR_BUFFER_TOO_SMALL = 10, /* output buffer too small; *n_out = needed */
  DZ_ERR_INTERNAL = 11         /* a bug in dayzero; please report */
} dz_status;

/* Message of the last failing call on this thread ("" if none). Thread-local
 * storage owned by the library. Thread-safe. */
DZ_API const char *dz_last_error(void);
/* Short name of a status ("DZ_ERR_FORMAT"). Static storage. Thread-safe. */
DZ_API const char *dz_status_name(dz_status status);

/* -------------------------------------------------------------------- log */

typedef enum dz_log_level {
  DZ_LOG_DEBUG = 0,
  DZ_LOG_INFO = 1,
  DZ_LOG_WARN = 2,
  DZ_LOG_ERROR = 3,
  DZ_LOG_NONE = 4
} dz_log_level;

typedef void (*dz_log_fn)(dz_log_level level, const char *message, void *user);

/* Route library log lines at or above min_level to fn (NULL: stderr, the
 * default, with min_level DZ_LOG_WARN). Not thread-safe: call at start-up. */
DZ_API dz_status dz_log_set(dz_log_fn fn, void *user, dz_log_level min_level);

/* Progress of long work (loading): done of total units; return nonzero to
 * cancel (the call then fails with DZ_ERR_CANCELLED). dz_model_open's
 * stages: "validate shards" (shards checked), then on CUDA "upload weights"
 * (bytes copied to the device; ends with done == total). */
typedef int (*dz_progress_fn)(const char *stage, uint64_t done, uint64_t total,
                              void *user);
/* Polled between layers and micro-batches on every backend; return nonzero to
 * stop the running call with DZ_ERR_CANCELLED (the session stays valid and
 * unchanged). */
typedef int (*dz_abort_fn)(void *user);

/* ------------------------------------------------------------------ model */

typedef struct dz_model dz_model;

typedef enum dz_device {
  DZ_DEVICE_CPU = 0,
  DZ_DEVICE_CUDA = 1,
  DZ_DEVICE_AUTO = 2 /* CUDA when a GPU is present, else CPU */
} dz_device;

typedef enum dz_expert_precision {
  DZ_EXPERTS_AUTO = 0,   /* checkpoint precision; CUDA: MXFP4 decoded in
                            registers for few tokens an expert (activations
                            FP16, or two E4M3 terms: ~8 significant bits),
                            FP4->FP8 pipeline for many */
  DZ_EXPERTS_NATIVE = 1, /* decode checkpoint precision exactly (reference) */
  DZ_EXPERTS_FP8 = 2,    /* E4M3 arithmetic at every batch size: weights
                            exact in E4M3, activations E4M3 with one scale
                            per 1x128 */
  DZ_EXPERTS_BF16 = 3    /* dequantised to BF16 (precision comparisons) */
} dz_expert_precision;

typedef enum dz_indexer_mode {
  DZ_INDEXER_EXACT = 0, /* fp32 scores, matches transformers (CPU only) */
  DZ_INDEXER_FP8 = 1,   /* Hadamard + E4M3 keys, one scale per 128 */
  DZ_INDEXER_AUTO = 2   /* the backend's own: CPU EXACT, CUDA FP8 */
} dz_indexer_mode;

/* Precision of the activations entering the matrix products. The CUDA
 * backend feeds BF16 (attention projections, router, lm_head) and FP16/FP8
 * (experts); the CPU backend computes in fp32 unless asked to round as the
 * CUDA backend does, which makes the two comparable position by position
 * (a tiny router margin can flip under either rounding). */
typedef enum dz_activation_precision {
  DZ_ACTIVATIONS_AUTO = 0, /* the backend's own (CPU fp32, CUDA BF16) */
  DZ_ACTIVATIONS_F32 = 1,  /* fp32 (CPU) */
  DZ_ACTIVATIONS_BF16 = 2  /* rounded to BF16 before each product, experts'
                              inputs to FP16, K and V cached in BF16 (CPU
                              gpt_oss; CUDA) */
} dz_activation_precision;

/* Precision of the attention's products in a CUDA prefill (queries times
 * keys, probabilities times values; K and V are BF16 in the cache either way).
 * Decode steps always take PRECISE: their reads of the cache bound them, not
 * the products. The CPU backend computes attention in fp32 either way. */
typedef enum dz_attention_precision {
  DZ_ATTENTION_AUTO = 0,    /* the backend's default: PRECISE */
  DZ_ATTENTION_PRECISE = 1, /* queries and probabilities as two BF16 terms
                               (~16 significant bits): fp32-like */
  DZ_ATTENTION_BF16 = 2     /* rounded to BF16 once, as FlashAttention does:
                               half the tensor-core work; outputs off by one
                               or two steps of their BF16 rounding */
} dz_attention_precision;

typedef struct dz_model_params {
  size_t struct_size;
  dz_device device;        /* default DZ_DEVICE_CPU */
  int device_index;        /* CUDA ordinal, default 0 */
  int n_threads;           /* CPU threads, 0 = all cores (default) */
  dz_expert_precision experts; /* default DZ_EXPERTS_AUTO */
  dz_indexer_mode indexer; /* default DZ_INDEXER_AUTO */
  int bf16_sensitive;      /* nonzero: router, lm_head, attention in BF16 on
                              CUDA (default 1) */
  dz_progress_fn progress; /* optional; called from the opening thread */
  void *progress_user;
  dz_activation_precision activations; /* default DZ_ACTIVATIONS_AUTO */
  int exact_moe_layers; /* DZ_EXPERTS_AUTO on CUDA: the first and last N MoE
                           layers keep the exact MXFP4 path (BF16/FP16
                           activations) at every batch size, the others
                           switch to FP8 for large batches (default 0) */
  dz_attention_precision attention; /* default DZ_ATTENTION_AUTO */
  uint32_t pass_tokens; /* CUDA backend: rows (tokens) one device pass holds,
                           256..65536, 0 = the default (16384). Device scratch
                           grows with it (about 250 KB a token for
                           gpt-oss-20b), longer batches run as several passes,
                           and it is the CUDA default of
                           dz_session_params.prefill_chunk. The CPU backend
                           ignores it. */
} dz_model_params;

/* Defaults. Each params/info struct has this trio: *_init_sized writes at
 * most struct_size bytes, *_init(p) is the macro to call (see Conventions). */
DZ_API void dz_model_params_init_sized(dz_model_params *params,
                                       size_t struct_size);
DZ_API void (dz_model_params_init)(dz_model_params *params);
#define dz_model_params_init(p) dz_model_params_init_sized((p), sizeof *(p))

/* Open a Hugging Face model directory (config.json, model.safetensors or
 * model.safetensors.index.json + shards, tokenizer.json). Every shard is
 * validated before use. params may be NULL (defaults). On success *out owns
 * the model; free it with dz_model_free after every session and arena made
 * from it is freed. */
DZ_API dz_status dz_model_open(const char *dir, const dz_model_params *params,
                               dz_model **out);
DZ_API void dz_model_free(dz_model *model);

typedef struct dz_model_info {
  size_t struct_size;
  const char *architecture; /* config.json model_type ("gpt_oss"); owned by
                               the model */
  dz_device device;
  int32_t n_layers;
  int32_t n_vocab;
  int32_t hidden_size;
  int32_t n_heads;
  int32_t n_kv_heads;
  int32_t n_experts;       /* 0 for dense models */
  int32_t n_experts_active;
  int64_t max_context;     /* tokens */
  uint64_t n_params;       /* elements as stored (MXFP4: 2 per byte) */
  uint64_t weight_bytes;   /* bytes of the checkpoint's tensors */
  uint64_t device_bytes;   /* bytes the backend holds for weights */
  int32_t n_shards;
} dz_model_info;

DZ_API void dz_model_info_init_sized(dz_model_info *info, size_t struct_size);
DZ_API void (dz_model_info_init)(dz_model_info *info);
#define dz_model_info_init(p) dz_model_info_init_sized((p), sizeof *(p))
DZ_API dz_status dz_model_get_info(const dz_model *model, dz_model_info *info);

/* -------------------------------------------------------------- tokenizer */

typedef struct dz_tokenizer dz_tokenizer;

/* Open a tokenizer.json (tokenizer_config.json beside it is read when
 * present, for the chat template and special tokens) or a tiktoken.model. */
DZ_API dz_status dz_tokenizer_open(const char *path, dz_tokenizer **out);
DZ_API void dz_tokenizer_free(dz_tokenizer *tok);
/* The model's tokenizer, owned by the model (do not free). */
DZ_API dz_status dz_model_tokenizer(const dz_model *model,
                                    const dz_tokenizer **out);

/* Encode UTF-8 text (len bytes; invalid UTF-8 is encoded as its bytes).
 * parse_special: nonzero to turn special-token text into its id. Writes up to
 * cap ids; *n_out is the count (or the needed count with
 * DZ_ERR_BUFFER_TOO_SMALL). */
DZ_API dz_status dz_tokenize(const dz_tokenizer *tok, const char *text,
                             size_t len, int parse_special, int32_t *out,
                             size_t cap, size_t *n_out);
/* Decode ids to UTF-8 bytes (not NUL-terminated unless room remains). */
DZ_API dz_status dz_detokenize(const dz_tokenizer *tok, const int32_t *ids,
                               size_t n, char *out, size_t cap, size_t *n_out);
DZ_API dz_status dz_tokenizer_vocab_size(const dz_tokenizer *tok,
                                         int32_t *n_vocab);
/* Id of a token's exact text ("<|end|>"), or DZ_ERR_NOT_FOUND. */
DZ_API dz_status dz_tokenizer_token_id(const dz_tokenizer *tok,
                                       const char *text, int32_t *id);
/* Ids that end generation (eos and the chat template's stop tokens); pointer
 * owned by the tokenizer. */
DZ_API dz_status dz_tokenizer_stop_ids(const dz_tokenizer *tok,
                                       const int32_t **ids, size_t *n);

/* Streaming detokenizer: holds back incomplete UTF-8 so every piece it
 * returns is valid UTF-8. */
typedef struct dz_detokenizer dz_detokenizer;
DZ_API dz_status dz_detokenizer_create(const dz_tokenizer *tok,
                                       dz_detokenizer **out);
DZ_API void dz_detokenizer_free(dz_detokenizer *d);
/* Feed one id; *piece (owned by d, valid until the next call on d) is the
 * text now complete, possibly "". */
DZ_API dz_status dz_detokenizer_push(dz_detokenizer *d, int32_t id,
                                     const char **piece, size_t *len);
/* End of stream: *piece is whatever push held back (an incomplete UTF-8
 * sequence comes out as U+FFFD); d starts afresh. Same ownership as push. */
DZ_API dz_status dz_detokenizer_flush(dz_detokenizer *d, const char **piece,
                                      size_t *len);

/* Render a conversation through the tokenizer's chat template (the Jinja
 * `chat_template` of tokenizer_config.json). messages_json is a JSON array of
 * {"role","content",...} objects as transformers takes them; options_json is
 * NULL or an object of extra template variables (e.g. {"tools": [...]}).
 * Output as for dz_detokenize. */
DZ_API dz_status dz_chat_apply_template(const dz_tokenizer *tok,
                                        const char *messages_json,
                                        const char *options_json,
                                        int add_generation_prompt, char *out,
                                        size_t cap, size_t *n_out);

/* --------------------------------------------------------------- KV arena */

typedef struct dz_kv_arena dz_kv_arena;

typedef struct dz_kv_arena_params {
  size_t struct_size;
  uint32_t page_tokens;    /* tokens per page, 0 = the model's choice (64) */
  uint64_t capacity_pages; /* if nonzero, the capacity */
  uint64_t capacity_bytes; /* else this many bytes, recurrent state included
                              (0 = 256 MiB of pages, plus the state slots) */
  uint32_t max_sessions;   /* models with recurrent state (hybrid linear
                              attention): sessions at once, each a state
                              slot, and as many state snapshots kept at page
                              boundaries for prefix reuse (0 = 64) */
  int prefix_cache;        /* nonzero (default): reuse full pages by hash */
} dz_kv_arena_params;

DZ_API void dz_kv_arena_params_init_sized(dz_kv_arena_params *params,
                                          size_t struct_size);
DZ_API void (dz_kv_arena_params_init)(dz_kv_arena_params *params);
#define dz_kv_arena_params_init(p) dz_kv_arena_params_init_sized((p), sizeof *(p))
/* The arena lives in the model's backend memory (host or device). It must be
 * freed before its model. */
DZ_API dz_status dz_kv_arena_create(dz_model *model,
                                    const dz_kv_arena_params *params,
                                    dz_kv_arena **out);
DZ_API void dz_kv_arena_free(dz_kv_arena *arena);

typedef struct dz_kv_stats {
  size_t struct_size;
  uint32_t page_tokens;
  uint64_t page_bytes;        /* bytes of one page, all layers */
  uint64_t pages_total;
  uint64_t pages_used;        /* referenced by at least one session */
  uint64_t pages_cached;      /* unreferenced, kept for prefix reuse (LRU) */
  uint64_t pages_free;
  uint64_t bytes_total;
  uint64_t bytes_metadata;    /* host bookkeeping (page tables, hashes) */
  uint64_t tokens_requested;  /* prefill tokens asked for */
  uint64_t tokens_reused;     /* of which served from the prefix cache */
  uint64_t evictions;
  uint32_t state_slots_total; /* recurrent-state slots */
  uint32_t state_slots_used;
  uint64_t state_bytes;       /* one session's recurrent state (0: none) */
  uint32_t state_snapshots_total; /* states kept at page boundaries */
  uint32_t state_snapshots_used;  /* for prefix reuse (LRU) */
} dz_kv_stats;

DZ_API void dz_kv_stats_init_sized(dz_kv_stats *stats, size_t struct_size);
DZ_API void (dz_kv_stats_init)(dz_kv_stats *stats);
#define dz_kv_stats_init(p) dz_kv_stats_init_sized((p), sizeof *(p))
DZ_API dz_status dz_kv_arena_get_stats(const dz_kv_arena *arena,
                                       dz_kv_stats *stats);

/* ---------------------------------------------------------------- session */

typedef struct dz_session dz_session;

typedef struct dz_sampler_params {
  size_t struct_size;
  float temperature; /* <= 0: greedy (default 0) */
  int32_t top_k;     /* 0 = off */
  float top_p;       /* 1 = off (default) */
  uint64_t seed;     /* default 0 */
} dz_sampler_params;

DZ_API void dz_sampler_params_init_sized(dz_sampler_params *params,
                                         size_t struct_size);
DZ_API void (dz_sampler_params_init)(dz_sampler_params *params);
#define dz_sampler_params_init(p) dz_sampler_params_init_sized((p), sizeof *(p))

typedef struct dz_session_params {
  size_t struct_size;
  dz_sampler_params sampler;
  uint32_t prefill_chunk; /* tokens per prefill micro-batch (0 = the
                             backend's: 512 on the CPU, the model's
                             pass_tokens on CUDA) */
  dz_abort_fn abort;      /* optional, polled between layers */
  void *abort_user;
} dz_session_params;

DZ_API void dz_session_params_init_sized(dz_session_params *params,
                                         size_t struct_size);
DZ_API void (dz_session_params_init)(dz_session_params *params);
#define dz_session_params_init(p) dz_session_params_init_sized((p), sizeof *(p))
/* A new empty sequence drawing pages from arena. params may be NULL. The
 * session must be freed before its arena. */
DZ_API dz_status dz_session_create(dz_kv_arena *arena,
                                   const dz_session_params *params,
                                   dz_session **out);
DZ_API void dz_session_free(dz_session *session);
/* A copy of src sharing its pages copy-on-write. */
DZ_API dz_status dz_session_fork(const dz_session *src, dz_session **out);

typedef enum dz_logits_mode {
  DZ_LOGITS_LAST = 0, /* logits of the last token only */
  DZ_LOGITS_ALL = 1   /* logits of every appended token */
} dz_logits_mode;

/* Append tokens and run the model over them (prefill, chunked; reuses cached
 * prefix pages where possible). On failure the session is unchanged. */
DZ_API dz_status dz_session_append(dz_session *session, const int32_t *tokens,
                                   size_t n, dz_logits_mode mode);
/* Logits of the last append or decode step: *rows x *n_vocab floats,
 * row-major; owned by the session, valid until the next call that changes it.
 * After a decode step or a DZ_LOGITS_LAST append on a GPU the row stays in
 * device memory until the first call here copies it (sampling needs no copy:
 * it runs on the device). */
DZ_API dz_status dz_session_logits(const dz_session *session,
                                   const float **logits, size_t *rows,
                                   size_t *n_vocab);
/* Sample from the last logits row with the session's sampler. A seed gives
 * the same tokens run after run. A row still on a GPU is sampled there, in
 * exact integer arithmetic: the token may differ from the host sampler's
 * (double) only where the draw falls within ~1e-6 of a boundary between two
 * tokens, and a token weighing below ~2^-39 of the likeliest is never drawn. */
DZ_API dz_status dz_session_sample(dz_session *session, int32_t *token);
DZ_API dz_status dz_session_set_sampler(dz_session *session,
                                        const dz_sampler_params *params);
/* Tokens in the sequence so far. */
DZ_API dz_status dz_session_length(const dz_session *session, size_t *n);
/* Keep the first n tokens (n <= length); pages beyond are released. */
DZ_API dz_status dz_session_truncate(dz_session *session, size_t n);
/* Truncate to 0. */
DZ_API dz_status dz_session_reset(dz_session *session);

typedef struct dz_session_stats {
  size_t struct_size;
  uint64_t n_tokens;          /* sequence length */
  uint64_t tokens_computed;   /* tokens run through the model, all appends */
  uint64_t tokens_reused;     /* served by the prefix cache */
  uint64_t pages;             /* pages in the page table */
  uint64_t attention_tokens_read; /* KV tokens read by attention (sparsity) */
} dz_session_stats;

DZ_API void dz_session_stats_init_sized(dz_session_stats *stats,
                                        size_t struct_size);
DZ_API void (dz_session_stats_init)(dz_session_stats *stats);
#define dz_session_stats_init(p) dz_session_stats_init_sized((p), sizeof *(p))
DZ_API dz_status dz_session_get_stats(const dz_session *session,
                                      dz_session_stats *stats);

/* One decode step for a batch of sessions of any lengths (continuous
 * batching): each session samples its next token from its last logits,
 * appends it and computes its new logits. out_tokens[i] receives session i's
 * token. All sessions must share one arena. On failure no session changes. */
DZ_API dz_status dz_generate_step(dz_session *const *sessions, size_t n,
                                  int32_t *out_tokens);

/* Append one given token to each session, batched (forced decoding). */
DZ_API dz_status dz_decode_batch(dz_session *const *sessions,
                                 const int32_t *tokens, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* DAYZERO_H */
