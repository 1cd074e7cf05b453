// Tokenizers of Hugging Face checkpoints: byte-level BPE from tokenizer.json
// (pre-tokenizer Split/ByteLevel/Digits sequences, added and special tokens,
// merges in both file formats) and tiktoken.model rank files (Kimi), plus the
// chat template of tokenizer_config.json / chat_template.jinja.
#pragma once

#include <ctime>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/bpe.h"

namespace dz {

class Regex;
namespace jinja {
class Template;
}

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

class Tokenizer {
 public:
  // path: a tokenizer.json or tiktoken.model (tokenizer_config.json,
  // chat_template.jinja and generation_config.json beside it are read when
  // present). Throws dz::Error naming the file and field on bad input.
  static std::unique_ptr<Tokenizer> open(const std::string& path);
  // dir/tokenizer.json, else dir/tiktoken.model; nullptr when neither exists.
  static std::unique_ptr<Tokenizer> open_dir(const std::string& dir);
  ~Tokenizer();

  // Appends the ids of text (any bytes; invalid UTF-8 is encoded as bytes).
  // parse_special: special-token text becomes its id (else it is plain text).
  void encode(std::string_view text, bool parse_special, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const {
    std::vector<int32_t> v;
    encode(text, parse_special, v);
    return v;
  }
  // Bytes of the ids (DZ_ERR_INVALID_ARGUMENT for an id outside the vocabulary).
  std::string decode(const int32_t* ids, size_t n) const;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }
  // Bytes of one token ("" for ids without one).
  std::string_view token_bytes(int32_t id) const;
  int32_t vocab_size() const { return n_vocab_; }
  // Id of an added token's text or of a vocabulary entry's bytes; -1 if none.
  int32_t token_id(std::string_view text) const;
  bool is_special(int32_t id) const;
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  const std::string& source() const { return source_; }

  bool has_chat_template() const;
  // Render messages (a JSON array) through the chat template. options_json:
  // "" or a JSON object of extra template variables. now: the time
  // strftime_now() reports (default: the current local time).
  std::string apply_chat_template(std::string_view messages_json, std::string_view options_json,
                                  bool add_generation_prompt, const std::tm* now = nullptr) const;

  // Pipeline pieces, defined in tokenizer.cpp.
  struct Step;
  struct Matcher;

 private:
  Tokenizer();
  void load_tokenizer_json(const std::string& path);
  void load_tiktoken(const std::string& path);
  void load_config(const std::string& dir);
  void finish();
  void encode_segment(std::string_view seg, bool parse_special, std::vector<int32_t>& out) const;
  void pretokenize_and_bpe(std::string_view seg, std::vector<int32_t>& out) const;

  std::string source_;
  Bpe bpe_;
  bool byte_level_json_ = false;  // token strings of tokenizer.json are GPT-2 byte-mapped
  std::vector<AddedToken> added_;
  std::vector<std::string> added_decode_;  // bytes an added token decodes to, by index in added_
  std::vector<int32_t> added_index_;       // id -> index in added_ (or -1)
  std::unique_ptr<Matcher> raw_match_, norm_match_;
  std::vector<std::unique_ptr<Step>> normalizer_, pretok_;
  int32_t n_vocab_ = 0;
  std::vector<int32_t> stop_ids_;
  // chat template and the special-token strings it sees
  std::string chat_template_source_, template_error_;
  std::unique_ptr<jinja::Template> template_;
  std::vector<std::pair<std::string, std::string>> template_tokens_;  // bos_token, eos_token, ...
  std::string eos_token_;
  std::vector<int32_t> generation_eos_;
};

// Streaming detokenizer: returns only complete UTF-8; bytes that can never
// complete a character come out as U+FFFD.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  // Text completed by this id (valid until the next call).
  std::string_view push(int32_t id);
  // Whatever is held back, with incomplete sequences as U+FFFD.
  std::string_view flush();

 private:
  const Tokenizer& tok_;
  std::string pending_, out_;
  void drain(bool final);
};

}  // namespace dz
