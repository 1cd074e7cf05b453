// Tokenizer entry points. Placeholder until the tokenizer lands: every call
// reports DZ_ERR_UNSUPPORTED with a message.
#include "api/api_util.h"
#include "api/handles.h"

namespace dz {
dz_tokenizer* open_model_tokenizer(const std::string&) { return nullptr; }
}  // namespace dz

#define DZ_NO_TOKENIZER \
  DZ_GUARD({ dz::fail(DZ_ERR_UNSUPPORTED, "tokenizers are not implemented in this build yet"); })

extern "C" {
DZ_API dz_status dz_tokenizer_open(const char*, dz_tokenizer** out) {
  if (out) *out = nullptr;
  return DZ_NO_TOKENIZER;
}
DZ_API void dz_tokenizer_free(dz_tokenizer*) {}
DZ_API dz_status dz_model_tokenizer(const dz_model*, const dz_tokenizer** out) {
  if (out) *out = nullptr;
  return DZ_NO_TOKENIZER;
}
DZ_API dz_status dz_tokenize(const dz_tokenizer*, const char*, size_t, int, int32_t*, size_t, size_t*) {
  return DZ_NO_TOKENIZER;
}
DZ_API dz_status dz_detokenize(const dz_tokenizer*, const int32_t*, size_t, char*, size_t, size_t*) {
  return DZ_NO_TOKENIZER;
}
DZ_API dz_status dz_tokenizer_vocab_size(const dz_tokenizer*, int32_t*) { return DZ_NO_TOKENIZER; }
DZ_API dz_status dz_tokenizer_token_id(const dz_tokenizer*, const char*, int32_t*) { return DZ_NO_TOKENIZER; }
DZ_API dz_status dz_tokenizer_stop_ids(const dz_tokenizer*, const int32_t**, size_t*) { return DZ_NO_TOKENIZER; }
DZ_API dz_status dz_detokenizer_create(const dz_tokenizer*, dz_detokenizer** out) {
  if (out) *out = nullptr;
  return DZ_NO_TOKENIZER;
}
DZ_API void dz_detokenizer_free(dz_detokenizer*) {}
DZ_API dz_status dz_detokenizer_push(dz_detokenizer*, int32_t, const char**, size_t*) { return DZ_NO_TOKENIZER; }
DZ_API dz_status dz_chat_apply_template(const dz_tokenizer*, const char*, const char*, int, char*, size_t, size_t*) {
  return DZ_NO_TOKENIZER;
}
}
