// KV arena and session entry points. Placeholder until a model family can
// run: every call reports DZ_ERR_UNSUPPORTED with a message.
#include "api/api_util.h"
#include "api/handles.h"

#define DZ_NO_RUNTIME \
  DZ_GUARD({ dz::fail(DZ_ERR_UNSUPPORTED, "sessions and KV arenas are not implemented in this build yet"); })

extern "C" {
DZ_API void dz_kv_arena_params_init(dz_kv_arena_params* p) {
  if (!p) return;
  *p = dz_kv_arena_params{};
  p->struct_size = sizeof(*p);
  p->prefix_cache = 1;
}
DZ_API dz_status dz_kv_arena_create(dz_model*, const dz_kv_arena_params*, dz_kv_arena** out) {
  if (out) *out = nullptr;
  return DZ_NO_RUNTIME;
}
DZ_API void dz_kv_arena_free(dz_kv_arena*) {}
DZ_API void dz_kv_stats_init(dz_kv_stats* s) {
  if (!s) return;
  *s = dz_kv_stats{};
  s->struct_size = sizeof(*s);
}
DZ_API dz_status dz_kv_arena_get_stats(const dz_kv_arena*, dz_kv_stats*) { return DZ_NO_RUNTIME; }
DZ_API void dz_sampler_params_init(dz_sampler_params* p) {
  if (!p) return;
  *p = dz_sampler_params{};
  p->struct_size = sizeof(*p);
  p->top_p = 1.0f;
}
DZ_API void dz_session_params_init(dz_session_params* p) {
  if (!p) return;
  *p = dz_session_params{};
  p->struct_size = sizeof(*p);
  dz_sampler_params_init(&p->sampler);
}
DZ_API dz_status dz_session_create(dz_kv_arena*, const dz_session_params*, dz_session** out) {
  if (out) *out = nullptr;
  return DZ_NO_RUNTIME;
}
DZ_API void dz_session_free(dz_session*) {}
DZ_API dz_status dz_session_fork(const dz_session*, dz_session** out) {
  if (out) *out = nullptr;
  return DZ_NO_RUNTIME;
}
DZ_API dz_status dz_session_append(dz_session*, const int32_t*, size_t, dz_logits_mode) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_logits(const dz_session*, const float**, size_t*, size_t*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_sample(dz_session*, int32_t*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_set_sampler(dz_session*, const dz_sampler_params*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_length(const dz_session*, size_t*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_truncate(dz_session*, size_t) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_session_reset(dz_session*) { return DZ_NO_RUNTIME; }
DZ_API void dz_session_stats_init(dz_session_stats* s) {
  if (!s) return;
  *s = dz_session_stats{};
  s->struct_size = sizeof(*s);
}
DZ_API dz_status dz_session_get_stats(const dz_session*, dz_session_stats*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_generate_step(dz_session* const*, size_t, int32_t*) { return DZ_NO_RUNTIME; }
DZ_API dz_status dz_decode_batch(dz_session* const*, const int32_t*, size_t) { return DZ_NO_RUNTIME; }
}
