// KV arenas, sessions, sampling and the batched decode step.
//
// A session is one kv::Sequence plus its sampler and last logits. Every
// mutating call is all or nothing: the forward pass writes KV into reserved
// room and the sequence commits only when the whole call succeeded; on any
// error the room is dropped and the session keeps its previous state.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <unordered_set>

#include "api/api_util.h"
#include "api/handles.h"
#include "common/log.h"
#include "cpu/sampling.h"

namespace {

constexpr uint32_t kDefaultPageTokens = 64;
constexpr uint64_t kDefaultArenaBytes = uint64_t(256) << 20;

dz::cpu::SamplerConfig sampler_config(const dz_sampler_params& p) { return {p.temperature, p.top_k, p.top_p}; }

void validate_sampler(const dz_sampler_params& p, const char* what) {
  dz::check(std::isfinite(p.temperature), DZ_ERR_INVALID_ARGUMENT, what, ".temperature is not a finite number");
  dz::check(p.top_k >= 0, DZ_ERR_INVALID_ARGUMENT, what, ".top_k is ", p.top_k, " (0 = off, else positive)");
  dz::check(p.top_p > 0 && p.top_p <= 1, DZ_ERR_INVALID_ARGUMENT, what, ".top_p is ", p.top_p,
            " (must be in (0, 1]; 1 = off)");
}

int32_t n_vocab(const dz_session* s) { return s->arena->model->family->n_vocab(); }

void check_tokens(const dz_session* s, const int32_t* tokens, size_t n) {
  const int32_t v = n_vocab(s);
  for (size_t i = 0; i < n; ++i)
    dz::check(tokens[i] >= 0 && tokens[i] < v, DZ_ERR_INVALID_ARGUMENT, "tokens[", i, "] = ", tokens[i],
              " is outside the vocabulary [0, ", v, ")");
}

// Put a sequence back to length n after a failed call, keeping the original
// error. saved_state: the recurrent state as of n (empty without one), which
// a rewind needs once later chunks have been committed.
void restore(dz::kv::Sequence& seq, size_t n, const std::vector<uint8_t>& saved_state = {}) noexcept {
  try {
    seq.rollback();
    if (seq.length() != n && !saved_state.empty())
      seq.rewind(n, saved_state.data());
    else if (seq.length() != n)
      seq.truncate(n);
  } catch (const std::exception& e) {
    dz::log_warn("could not restore a session after a failed call: ", e.what());
  }
}

// Record tokens the model has computed; where they end a page of a model with
// recurrent state, keep the state as of that boundary for prefix reuse (a no-op
// without state or with the prefix cache off).
void commit_tokens(dz::kv::Sequence& seq, std::span<const int32_t> ids) {
  seq.commit(ids);
  if (seq.arena().layout().state_slot_bytes && seq.length() % seq.arena().page_tokens() == 0)
    seq.snapshot_state(seq.length());
}

// The sessions of one batched step: non-null, distinct, one arena.
void check_batch(dz_session* const* sessions, size_t n) {
  dz::need(sessions, "sessions");
  dz::check(n > 0, DZ_ERR_INVALID_ARGUMENT, "n is 0");
  std::unordered_set<const dz_session*> seen;
  for (size_t i = 0; i < n; ++i) {
    dz::check(sessions[i] != nullptr, DZ_ERR_INVALID_ARGUMENT, "sessions[", i, "] is NULL");
    dz::check(seen.insert(sessions[i]).second, DZ_ERR_INVALID_ARGUMENT, "sessions[", i,
              "] appears more than once in the batch");
    dz::check(sessions[i]->arena == sessions[0]->arena, DZ_ERR_INVALID_ARGUMENT, "sessions[", i,
              "] uses a different KV arena than sessions[0]");
  }
}

// Abort polling for a batch: stop when any session's callback says so.
struct BatchAbort {
  dz_session* const* sessions;
  size_t n;
  static int poll(void* user) {
    const auto* b = static_cast<const BatchAbort*>(user);
    for (size_t i = 0; i < b->n; ++i) {
      const dz_session_params& p = b->sessions[i]->params;
      if (p.abort && p.abort(p.abort_user)) return 1;
    }
    return 0;
  }
};

// The session's two device logits rows, made on first use where the family
// keeps logits on the device; null where it does not or had no room (not
// asked again: the session keeps its logits on the host).
dz::DeviceLogits* device_rows(dz_session* s, dz::Family& family) {
  if (!s->dlog && !s->host_rows_only) {
    s->dlog = family.make_device_logits();
    s->host_rows_only = !s->dlog;
  }
  return s->dlog.get();
}

// After a successful forward into the spare device row: it is the session's
// logits now (one row, argmax known, not yet on the host).
void take_device_row(dz_session* s, int32_t argmax) {
  s->dlog_cur = 1 - s->dlog_cur;
  s->on_device = true;
  s->fetched = nullptr;
  s->device_argmax = argmax;
  s->rows = 1;
}

// Append tokens[i] to sessions[i], one batched forward; all or nothing.
void decode_batch(dz_session* const* sessions, const int32_t* tokens, size_t n) {
  dz::Family& family = *sessions[0]->arena->model->family;
  const size_t v = size_t(family.n_vocab());
  // The new row goes to the session's spare device row where the family keeps
  // logits on the device (read back only if asked for), else to its spare host
  // buffer (allocated and touched once, not per step: a zero-filled fresh row
  // per session per step costs milliseconds at large batches); either becomes
  // the logits only on success.
  for (size_t i = 0; i < n; ++i) {
    dz_session* s = sessions[i];
    if (!device_rows(s, family) && s->spare.size() != v) s->spare.assign(v, 0.f);
  }
  std::vector<int32_t> argmax(n, -1);
  std::vector<uint64_t> read(n, 0);
  std::vector<dz::ForwardItem> items(n);
  size_t reserved = 0;
  try {
    for (; reserved < n; ++reserved) sessions[reserved]->seq->reserve(1);
    for (size_t i = 0; i < n; ++i) {
      items[i].seq = sessions[i]->seq.get();
      items[i].tokens = std::span<const int32_t>(tokens + i, 1);
      if (dz_session* s = sessions[i]; s->dlog) {
        items[i].device_logits = s->dlog->row(1 - s->dlog_cur);
        items[i].argmax = &argmax[i];
      } else {
        items[i].logits = s->spare.data();
      }
      items[i].attention_tokens_read = &read[i];
    }
    BatchAbort abort{sessions, n};
    dz::ForwardOptions opt;
    opt.abort = &BatchAbort::poll;
    opt.abort_user = &abort;
    family.forward(items, opt);
    for (size_t i = 0; i < n; ++i) commit_tokens(*sessions[i]->seq, std::span<const int32_t>(tokens + i, 1));
  } catch (...) {
    for (size_t i = 0; i < reserved; ++i) restore(*sessions[i]->seq, sessions[i]->seq->length());
    throw;
  }
  for (size_t i = 0; i < n; ++i) {
    dz_session* s = sessions[i];
    if (s->dlog) {
      take_device_row(s, argmax[i]);
    } else {
      s->logits.swap(s->spare);
      s->on_device = false;
      s->rows = 1;
    }
    s->tokens_computed += 1;
    s->attention_tokens_read += read[i];
  }
}

void check_has_logits(const dz_session* s, const char* what) {
  dz::check(s->rows > 0, DZ_ERR_INVALID_ARGUMENT, what,
            " has no logits: append tokens first (truncate and reset discard them)");
}

// The last logits (rows x n_vocab) on the host: `logits`, or the device row
// copied on first read.
const float* last_logits(const dz_session* s) {
  if (!s->on_device) return s->logits.data();
  if (!s->fetched) s->fetched = s->dlog->fetch(s->dlog_cur);
  return s->fetched;
}

// Greedy sampling from a row still on the device: its argmax, no copy.
bool greedy_on_device(const dz_session* s) { return s->on_device && s->params.sampler.temperature <= 0; }

// Any other sampler on a row still on the device: the family samples it there.
bool samples_on_device(const dz_session* s) { return s->on_device && s->params.sampler.temperature > 0; }

// Samples sessions[which[j]] into tokens[which[j]] on the device, one launch
// for all, each drawing from its rng as the host sampler would; false (no rng
// touched) where the family cannot.
bool sample_on_device(dz_session* const* sessions, std::span<const size_t> which, int32_t* tokens) {
  std::vector<dz::DeviceSample> rows(which.size());
  for (size_t j = 0; j < which.size(); ++j) {
    const dz_session* s = sessions[which[j]];
    std::mt19937_64 r = s->rng;  // advanced below only once the token is known
    rows[j] = {s->dlog->row(s->dlog_cur), sampler_config(s->params.sampler), dz::cpu::uniform01(r), s->device_argmax};
  }
  std::vector<int32_t> out(which.size());
  if (!sessions[0]->arena->model->family->sample_on_device(rows, out.data())) return false;
  for (size_t j = 0; j < which.size(); ++j) {
    dz::check(out[j] >= 0, DZ_ERR_INTERNAL, "the logits row holds no number (NaN everywhere)");
    sessions[which[j]]->rng.discard(1);
    tokens[which[j]] = out[j];
  }
  return true;
}

int32_t sample_last(dz_session* s) {
  const size_t v = size_t(n_vocab(s));
  int32_t t = -1;
  if (greedy_on_device(s)) {
    t = s->device_argmax;  // as cpu::argmax of the row
  } else if (const size_t zero = 0; !samples_on_device(s) || !sample_on_device(&s, std::span(&zero, 1), &t)) {
    t = dz::cpu::sample_token(last_logits(s) + (s->rows - 1) * v, int64_t(v), sampler_config(s->params.sampler),
                              s->rng);
  }
  dz::check(t >= 0, DZ_ERR_INTERNAL, "the logits row holds no number (NaN everywhere)");
  return t;
}

}  // namespace

extern "C" {

DZ_API void dz_kv_arena_params_init_sized(dz_kv_arena_params* p, size_t struct_size) {
  dz::init_sized(p, struct_size, [](dz_kv_arena_params& d) { d.prefix_cache = 1; });
}

// The header makes dz_*_init a macro: the parentheses keep it from expanding here.
DZ_API void(dz_kv_arena_params_init)(dz_kv_arena_params* p) {
  dz_kv_arena_params_init_sized(p, sizeof(dz_kv_arena_params));
}

DZ_API dz_status dz_kv_arena_create(dz_model* model, const dz_kv_arena_params* params, dz_kv_arena** out) {
  return DZ_GUARD({
    dz::need(out, "out");
    *out = nullptr;
    dz::need(model, "model");
    const dz_kv_arena_params p = dz::read_params(params, dz_kv_arena_params_init,
                                                 offsetof(dz_kv_arena_params, prefix_cache) + sizeof(int), "params");
    const uint32_t page_tokens = p.page_tokens ? p.page_tokens : kDefaultPageTokens;
    dz::check(page_tokens <= (1u << 16), DZ_ERR_INVALID_ARGUMENT, "params->page_tokens ", page_tokens,
              " is too large (at most 65536)");
    dz::kv::Layout layout = model->family->kv_layout(page_tokens);
    dz::kv::ArenaConfig cfg;
    cfg.max_state_slots = p.max_sessions ? p.max_sessions : 64;
    cfg.prefix_cache = p.prefix_cache != 0;
    // Recurrent-state slots and their snapshots (hybrid models) come on top of the default page budget.
    const uint64_t state_bytes = layout.state_slot_bytes ? dz::kv::Arena::storage_bytes(layout, cfg) : 0;
    const uint64_t bytes = p.capacity_bytes ? p.capacity_bytes : kDefaultArenaBytes + state_bytes;
    cfg.capacity_pages = p.capacity_pages ? p.capacity_pages : dz::kv::Arena::pages_for_bytes(layout, cfg, bytes);
    dz::check(cfg.capacity_pages > 0, DZ_ERR_INVALID_ARGUMENT, "params->capacity_bytes ", bytes,
              " holds no KV page of ", dz::kv::Arena::page_bytes_for(layout), " bytes (", page_tokens, " tokens)",
              state_bytes ? dz::cat(" beside the ", state_bytes, " bytes of recurrent state for ", cfg.max_state_slots,
                                    " sessions (params->max_sessions) and as many prefix snapshots")
                          : std::string());
    auto a = std::make_unique<dz_kv_arena>();
    a->model = model;
    a->arena = std::make_unique<dz::kv::Arena>(std::move(layout), cfg, model->family->kv_storage());
    *out = a.release();
  });
}

DZ_API void dz_kv_arena_free(dz_kv_arena* arena) {
  if (!arena) return;
  if (arena->sessions.load() != 0) {
    // Freeing the pages under live sessions would corrupt them: keep the arena.
    dz::log(DZ_LOG_ERROR, dz::cat("dz_kv_arena_free: ", arena->sessions.load(),
                                  " session(s) still use this arena; free them first (the arena is leaked)"));
    return;
  }
  delete arena;
}

DZ_API void dz_kv_stats_init_sized(dz_kv_stats* s, size_t struct_size) {
  dz::init_sized(s, struct_size, [](dz_kv_stats&) {});
}

DZ_API void(dz_kv_stats_init)(dz_kv_stats* s) { dz_kv_stats_init_sized(s, sizeof(dz_kv_stats)); }

DZ_API dz_status dz_kv_arena_get_stats(const dz_kv_arena* arena, dz_kv_stats* stats) {
  return DZ_GUARD({
    dz::need(arena, "arena");
    dz::write_out(stats, arena->arena->stats(), "stats");
  });
}

DZ_API void dz_sampler_params_init_sized(dz_sampler_params* p, size_t struct_size) {
  dz::init_sized(p, struct_size, [](dz_sampler_params& d) { d.top_p = 1.0f; });
}

DZ_API void(dz_sampler_params_init)(dz_sampler_params* p) {
  dz_sampler_params_init_sized(p, sizeof(dz_sampler_params));
}

DZ_API void dz_session_params_init_sized(dz_session_params* p, size_t struct_size) {
  dz::init_sized(p, struct_size, [struct_size](dz_session_params& d) {
    dz_sampler_params_init_sized(&d.sampler, sizeof d.sampler);
    // A caller's struct that ends inside the sampler holds only that part of it.
    constexpr size_t at = offsetof(dz_session_params, sampler);
    if (struct_size > at && struct_size - at < sizeof d.sampler) d.sampler.struct_size = struct_size - at;
  });
}

DZ_API void(dz_session_params_init)(dz_session_params* p) {
  dz_session_params_init_sized(p, sizeof(dz_session_params));
}

DZ_API dz_status dz_session_create(dz_kv_arena* arena, const dz_session_params* params, dz_session** out) {
  return DZ_GUARD({
    dz::need(out, "out");
    *out = nullptr;
    dz::need(arena, "arena");
    dz_session_params p = dz::read_params(params, dz_session_params_init,
                                          offsetof(dz_session_params, abort_user) + sizeof(void*), "params");
    dz::check(p.sampler.struct_size >= sizeof(dz_sampler_params), DZ_ERR_INVALID_ARGUMENT,
              "params->sampler.struct_size is ", p.sampler.struct_size, "; fill params with dz_session_params_init");
    validate_sampler(p.sampler, "params->sampler");
    auto s = std::make_unique<dz_session>();
    s->arena = arena;
    s->params = p;
    s->rng.seed(p.sampler.seed);
    s->seq = std::make_unique<dz::kv::Sequence>(*arena->arena);
    ++arena->sessions;
    *out = s.release();
  });
}

DZ_API void dz_session_free(dz_session* session) {
  if (!session) return;
  --session->arena->sessions;
  delete session;
}

DZ_API dz_status dz_session_fork(const dz_session* src, dz_session** out) {
  return DZ_GUARD({
    dz::need(out, "out");
    *out = nullptr;
    dz::need(src, "src");
    auto s = std::make_unique<dz_session>();
    s->arena = src->arena;
    s->params = src->params;
    s->rng = src->rng;  // the fork samples exactly as the original would
    const float* lg = last_logits(src);
    s->logits.assign(lg, lg + src->rows * size_t(n_vocab(src)));
    s->rows = src->rows;
    s->seq = src->seq->fork();
    ++s->arena->sessions;
    *out = s.release();
  });
}

DZ_API dz_status dz_session_append(dz_session* session, const int32_t* tokens, size_t n, dz_logits_mode mode) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz::need(tokens, "tokens");
    dz::check(n > 0, DZ_ERR_INVALID_ARGUMENT, "n is 0");
    // Read as an int: a C caller may pass any value, which C++ must not load as the enum.
    int mode_value;
    static_assert(sizeof(mode_value) == sizeof(mode));
    std::memcpy(&mode_value, &mode, sizeof(mode_value));
    dz::check(mode_value == DZ_LOGITS_LAST || mode_value == DZ_LOGITS_ALL, DZ_ERR_INVALID_ARGUMENT, "mode ", mode_value,
              " is not a dz_logits_mode");
    check_tokens(session, tokens, n);
    dz::kv::Sequence& seq = *session->seq;
    dz::Family& family = *session->arena->model->family;
    const size_t v = size_t(family.n_vocab());
    const bool all = mode_value == DZ_LOGITS_ALL;
    dz::check(!all || n <= SIZE_MAX / sizeof(float) / v, DZ_ERR_OUT_OF_MEMORY, "logits of ", n, " rows overflow");
    // The last row stays on the device where the family can keep it there
    // (sampled there, copied to the host only if read), as after a decode step.
    dz::DeviceLogits* dev = all ? nullptr : device_rows(session, family);
    std::vector<float> logits(dev ? 0 : all ? n * v : v);
    int32_t argmax = -1;
    const size_t start = seq.length();
    // A recurrent state cannot be rewound by dropping pages: keep a copy to
    // put back if a chunk fails after others were committed or a prefix was
    // adopted (one token is one chunk and adopts nothing; a failed chunk
    // leaves the state as it was).
    const size_t state_bytes = seq.arena().layout().state_slot_bytes;
    std::vector<uint8_t> saved_state;
    if (state_bytes && n > 1) {
      dz::kv::Storage& st = seq.arena().storage();
      saved_state.resize(state_bytes);
      st.read(size_t(seq.state_ptr() - st.data()), saved_state.data(), state_bytes);
    }
    const size_t page = seq.arena().page_tokens();
    size_t done = 0;
    size_t reused = 0;
    uint64_t read = 0;
    try {
      // Reused pages have no logits, so DZ_LOGITS_ALL always computes every token.
      if (!all && seq.arena().config().prefix_cache) {
        reused = seq.adopt_prefix(std::span<const int32_t>(tokens, n));
        done = reused;
      }
      dz::ForwardOptions opt;
      opt.abort = session->params.abort;
      opt.abort_user = session->params.abort_user;
      opt.attention_tokens_read = &read;
      const size_t chunk = session->params.prefill_chunk ? session->params.prefill_chunk : family.prefill_chunk();
      while (done < n) {
        size_t c = std::min<size_t>(chunk, n - done);
        // With recurrent state, a chunk that crosses a page boundary ends on the
        // last one it reaches, where the state is kept for prefix reuse.
        if (state_bytes && (seq.length() + c) % page < c) c -= (seq.length() + c) % page;
        seq.reserve(c);
        dz::ForwardItem it;
        it.seq = &seq;
        it.tokens = std::span<const int32_t>(tokens + done, c);
        it.all_logits = all;
        if (dev) {
          it.device_logits = dev->row(1 - session->dlog_cur);
          it.argmax = &argmax;
        } else {
          it.logits = all ? logits.data() + done * v : logits.data();
        }
        family.forward(std::span<dz::ForwardItem>(&it, 1), opt);
        commit_tokens(seq, it.tokens);
        done += c;
      }
    } catch (...) {
      restore(seq, start, saved_state);
      throw;
    }
    if (dev) {
      take_device_row(session, argmax);
    } else {
      session->logits.swap(logits);
      session->on_device = false;
      session->rows = all ? n : 1;
    }
    session->tokens_computed += n - reused;
    session->tokens_reused += reused;
    session->attention_tokens_read += read;
  });
}

DZ_API dz_status dz_session_logits(const dz_session* session, const float** logits, size_t* rows, size_t* n_vocab) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz::need(logits, "logits");
    dz::need(rows, "rows");
    dz::need(n_vocab, "n_vocab");
    check_has_logits(session, "the session");
    *logits = last_logits(session);
    *rows = session->rows;
    *n_vocab = size_t(::n_vocab(session));
  });
}

DZ_API dz_status dz_session_sample(dz_session* session, int32_t* token) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz::need(token, "token");
    check_has_logits(session, "the session");
    *token = sample_last(session);
  });
}

DZ_API dz_status dz_session_set_sampler(dz_session* session, const dz_sampler_params* params) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz::need(params, "params");
    const dz_sampler_params p =
        dz::read_params(params, dz_sampler_params_init, offsetof(dz_sampler_params, seed) + sizeof(uint64_t), "params");
    validate_sampler(p, "params");
    session->params.sampler = p;
    session->rng.seed(p.seed);
  });
}

DZ_API dz_status dz_session_length(const dz_session* session, size_t* n) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz::need(n, "n");
    *n = session->seq->length();
  });
}

DZ_API dz_status dz_session_truncate(dz_session* session, size_t n) {
  return DZ_GUARD({
    dz::need(session, "session");
    const size_t len = session->seq->length();
    dz::check(n <= len, DZ_ERR_INVALID_ARGUMENT, "n = ", n, " exceeds the session length ", len);
    if (n == len) return;
    session->seq->truncate(n);
    // The last logits belonged to a token that is gone.
    session->logits.clear();
    session->on_device = false;
    session->rows = 0;
  });
}

DZ_API dz_status dz_session_reset(dz_session* session) {
  return DZ_GUARD({
    dz::need(session, "session");
    session->seq->truncate(0);
    session->logits.clear();
    session->on_device = false;
    session->rows = 0;
  });
}

DZ_API void dz_session_stats_init_sized(dz_session_stats* s, size_t struct_size) {
  dz::init_sized(s, struct_size, [](dz_session_stats&) {});
}

DZ_API void(dz_session_stats_init)(dz_session_stats* s) { dz_session_stats_init_sized(s, sizeof(dz_session_stats)); }

DZ_API dz_status dz_session_get_stats(const dz_session* session, dz_session_stats* stats) {
  return DZ_GUARD({
    dz::need(session, "session");
    dz_session_stats r;
    dz_session_stats_init(&r);
    r.n_tokens = session->seq->length();
    r.tokens_computed = session->tokens_computed;
    r.tokens_reused = session->tokens_reused;
    r.pages = session->seq->pages().size();
    r.attention_tokens_read = session->attention_tokens_read;
    dz::write_out(stats, r, "stats");
  });
}

DZ_API dz_status dz_generate_step(dz_session* const* sessions, size_t n, int32_t* out_tokens) {
  return DZ_GUARD({
    check_batch(sessions, n);
    dz::need(out_tokens, "out_tokens");
    for (size_t i = 0; i < n; ++i) check_has_logits(sessions[i], dz::cat("sessions[", i, "]").c_str());
    // Sampling advances each session's RNG: keep copies so a failed step
    // leaves every session exactly as it was.
    std::vector<std::mt19937_64> rngs;
    rngs.reserve(n);
    std::vector<int32_t> tokens(n);
    for (size_t i = 0; i < n; ++i) rngs.push_back(sessions[i]->rng);
    try {
      // Rows on a device are sampled there: greedy ones by their argmax, the
      // others in one launch for the batch. Sampling on the host (a row to
      // read, a softmax over the vocabulary) runs in parallel over the sessions.
      std::vector<size_t> dev;
      for (size_t i = 0; i < n; ++i)
        if (samples_on_device(sessions[i])) dev.push_back(i);
      std::vector<char> done(n, 0);
      if (!dev.empty() && sample_on_device(sessions, dev, tokens.data()))
        for (const size_t i : dev) done[i] = 1;
      size_t host = 0;
      for (size_t i = 0; i < n; ++i) host += !done[i] && !greedy_on_device(sessions[i]);
      dz::ThreadPool* pool = nullptr;
      if (host > 1) {
        dz_model* m = sessions[0]->arena->model;
        std::call_once(m->sample_pool_once,
                       [m] { m->sample_pool = std::make_unique<dz::ThreadPool>(dz::helper_threads()); });
        pool = m->sample_pool.get();
      }
      dz::parallel_for(pool, n, 1, [&](size_t i0, size_t i1) {
        for (size_t i = i0; i < i1; ++i)
          if (!done[i]) tokens[i] = sample_last(sessions[i]);
      });
      decode_batch(sessions, tokens.data(), n);
    } catch (...) {
      for (size_t i = 0; i < n; ++i) sessions[i]->rng = rngs[i];
      throw;
    }
    std::copy(tokens.begin(), tokens.end(), out_tokens);
  });
}

DZ_API dz_status dz_decode_batch(dz_session* const* sessions, const int32_t* tokens, size_t n) {
  return DZ_GUARD({
    check_batch(sessions, n);
    dz::need(tokens, "tokens");
    const int32_t v = n_vocab(sessions[0]);
    for (size_t i = 0; i < n; ++i)
      dz::check(tokens[i] >= 0 && tokens[i] < v, DZ_ERR_INVALID_ARGUMENT, "tokens[", i, "] = ", tokens[i],
                " is outside the vocabulary [0, ", v, ")");
    decode_batch(sessions, tokens, n);
  });
}

}  // extern "C"
