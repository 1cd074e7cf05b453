// Tokenizer entry points: encode/decode, streaming decode, chat templates.
#include <cstring>

#include "api/api_util.h"
#include "api/handles.h"
#include "tokenizer/tokenizer.h"

struct dz_tokenizer {
  std::unique_ptr<dz::Tokenizer> impl;
};

struct dz_detokenizer {
  explicit dz_detokenizer(const dz::Tokenizer& t) : dec(t) {}
  dz::StreamDecoder dec;
};

namespace dz {

dz_tokenizer* open_model_tokenizer(const std::string& dir) {
  auto t = Tokenizer::open_dir(dir);
  if (!t) return nullptr;
  return new dz_tokenizer{std::move(t)};
}

namespace {
const Tokenizer& tok_of(const dz_tokenizer* t) {
  need(t, "tok");
  return *t->impl;
}
// Copy bytes to a caller buffer: NUL-terminated when room remains.
void emit_bytes(const std::string& s, char* out, size_t cap, size_t* n_out) {
  need(n_out, "n_out");
  *n_out = s.size();
  if (cap > 0) need(out, "out");
  if (cap < s.size()) fail(DZ_ERR_BUFFER_TOO_SMALL, "output needs ", s.size(), " bytes; cap is ", cap);
  if (!s.empty()) std::memcpy(out, s.data(), s.size());
  if (cap > s.size()) out[s.size()] = '\0';
}
}  // namespace

}  // namespace dz

extern "C" {

DZ_API dz_status dz_tokenizer_open(const char* path, dz_tokenizer** out) {
  if (out) *out = nullptr;
  return DZ_GUARD({
    dz::need(path, "path");
    dz::need(out, "out");
    *out = new dz_tokenizer{dz::Tokenizer::open(path)};
  });
}

DZ_API void dz_tokenizer_free(dz_tokenizer* tok) { delete tok; }

DZ_API dz_status dz_model_tokenizer(const dz_model* model, const dz_tokenizer** out) {
  if (out) *out = nullptr;
  return DZ_GUARD({
    dz::need(model, "model");
    dz::need(out, "out");
    if (!model->tokenizer) dz::fail(DZ_ERR_NOT_FOUND, "the model directory has no tokenizer.json or tiktoken.model");
    *out = model->tokenizer;
  });
}

DZ_API dz_status dz_tokenize(const dz_tokenizer* tok, const char* text, size_t len, int parse_special, int32_t* out,
                             size_t cap, size_t* n_out) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(n_out, "n_out");
    if (len) dz::need(text, "text");
    if (cap) dz::need(out, "out");
    std::vector<int32_t> ids;
    t.encode(std::string_view(text ? text : "", len), parse_special != 0, ids);
    *n_out = ids.size();
    if (cap < ids.size()) dz::fail(DZ_ERR_BUFFER_TOO_SMALL, "text encodes to ", ids.size(), " ids; cap is ", cap);
    if (!ids.empty()) std::memcpy(out, ids.data(), ids.size() * sizeof(int32_t));
  });
}

DZ_API dz_status dz_detokenize(const dz_tokenizer* tok, const int32_t* ids, size_t n, char* out, size_t cap,
                               size_t* n_out) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    if (n) dz::need(ids, "ids");
    dz::emit_bytes(t.decode(ids, n), out, cap, n_out);
  });
}

DZ_API dz_status dz_tokenizer_vocab_size(const dz_tokenizer* tok, int32_t* n_vocab) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(n_vocab, "n_vocab");
    *n_vocab = t.vocab_size();
  });
}

DZ_API dz_status dz_tokenizer_token_id(const dz_tokenizer* tok, const char* text, int32_t* id) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(text, "text");
    dz::need(id, "id");
    *id = t.token_id(text);
    if (*id < 0) dz::fail(DZ_ERR_NOT_FOUND, "no token is exactly '", text, "'");
  });
}

DZ_API dz_status dz_tokenizer_stop_ids(const dz_tokenizer* tok, const int32_t** ids, size_t* n) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(ids, "ids");
    dz::need(n, "n");
    *ids = t.stop_ids().data();
    *n = t.stop_ids().size();
  });
}

DZ_API dz_status dz_detokenizer_create(const dz_tokenizer* tok, dz_detokenizer** out) {
  if (out) *out = nullptr;
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(out, "out");
    *out = new dz_detokenizer(t);
  });
}

DZ_API void dz_detokenizer_free(dz_detokenizer* d) { delete d; }

DZ_API dz_status dz_detokenizer_push(dz_detokenizer* d, int32_t id, const char** piece, size_t* len) {
  return DZ_GUARD({
    dz::need(d, "d");
    dz::need(piece, "piece");
    dz::need(len, "len");
    const std::string_view s = d->dec.push(id);
    *piece = s.data();
    *len = s.size();
  });
}

DZ_API dz_status dz_detokenizer_flush(dz_detokenizer* d, const char** piece, size_t* len) {
  return DZ_GUARD({
    dz::need(d, "d");
    dz::need(piece, "piece");
    dz::need(len, "len");
    const std::string_view s = d->dec.flush();
    *piece = s.data();
    *len = s.size();
  });
}

DZ_API dz_status dz_chat_apply_template(const dz_tokenizer* tok, const char* messages_json, const char* options_json,
                                        int add_generation_prompt, char* out, size_t cap, size_t* n_out) {
  return DZ_GUARD({
    const dz::Tokenizer& t = dz::tok_of(tok);
    dz::need(messages_json, "messages_json");
    dz::emit_bytes(t.apply_chat_template(messages_json, options_json ? options_json : "", add_generation_prompt != 0),
                   out, cap, n_out);
  });
}

}  // extern "C"
