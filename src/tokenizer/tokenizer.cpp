#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "common/error.h"
#include "tokenizer/jinja.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace dz {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// GPT-2's split pattern (ByteLevel pre-tokenizer with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Kimi's tiktoken split pattern (tokenization_kimi.py).
constexpr const char* kKimiPattern =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Tokens that end a turn in common chat formats; those present are stop ids.
const char* const kStopTokens[] = {"<|return|>", "<|call|>",        "<|endoftext|>",         "<|im_end|>", "<|eot_id|>",
                                   "<|eom_id|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "[EOS]"};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) fail(DZ_ERR_IO, path, ": cannot open");
  const std::streamoff size = f.tellg();
  if (size < 0) fail(DZ_ERR_IO, path, ": cannot read its size");
  std::string s(size_t(size), '\0');
  f.seekg(0);
  if (!f.read(s.data(), size)) fail(DZ_ERR_IO, path, ": read error");
  return s;
}

json parse_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(DZ_ERR_FORMAT, path, ": invalid JSON: ", e.what());
  }
}

// GPT-2 byte <-> unicode mapping: printable bytes map to themselves, the
// others to U+0100.. in byte order.
struct ByteMap {
  uint32_t to_char[256];
  int16_t to_byte[324];
  ByteMap() {
    std::fill(std::begin(to_byte), std::end(to_byte), int16_t(-1));
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? uint32_t(b) : uint32_t(256 + n++);
      to_byte[to_char[b]] = int16_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Byte-mapped token string -> bytes; false when a character is outside the map.
bool unmap_bytes(std::string_view s, std::string& out) {
  out.clear();
  const ByteMap& m = byte_map();
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8::seq_len(s, i);
    if (!n) return false;
    const uint32_t cp = utf8::decode(s, i, n);
    if (cp >= 324 || m.to_byte[cp] < 0) return false;
    out += char(m.to_byte[cp]);
    i += n;
  }
  return true;
}

std::string show(std::string_view s) {  // for messages: printable, bounded
  std::string r;
  for (char c : s.substr(0, 60)) {
    if (uint8_t(c) < 0x20)
      r += cat("\\x", std::hex, int(uint8_t(c)));
    else
      r += c;
  }
  return s.size() > 60 ? r + "..." : r;
}

const json* member(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const json& j, const char* key, bool dflt, const std::string& where) {
  const json* v = member(j, key);
  if (!v) return dflt;
  if (!v->is_boolean()) fail(DZ_ERR_FORMAT, where, ".", key, " must be a boolean");
  return v->get<bool>();
}

std::string get_string(const json& j, const char* key, const std::string& where) {
  const json* v = member(j, key);
  if (!v || !v->is_string()) fail(DZ_ERR_FORMAT, where, ".", key, " must be a string");
  return v->get<std::string>();
}

// A special-token entry of tokenizer_config.json: "text" or {"content": "text"}.
std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

bool rust_alnum(std::string_view s, bool last) {  // approximates char::is_alphanumeric
  static const Regex re(R"([\p{L}\p{N}])", "alphanumeric test");
  if (s.empty()) return false;
  size_t i = 0;
  if (last) {
    i = s.size() - 1;
    while (i > 0 && (uint8_t(s[i]) & 0xC0) == 0x80) --i;
  }
  const size_t n = utf8::seq_len(s, i);
  return n && re.search(s.substr(i, n));
}

}  // namespace

// ------------------------------------------------------------ pipeline steps

struct Tokenizer::Step {
  enum Kind { kSplit, kPrefixSpace, kReplace, kPrepend } kind = kSplit;
  enum Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous } behavior = kIsolated;
  std::unique_ptr<Regex> re;
  bool invert = false;
  std::string content;
};

namespace {

std::unique_ptr<Regex> pattern_regex(const json& p, const std::string& where) {
  if (const json* r = member(p, "Regex"); r && r->is_string())
    return std::make_unique<Regex>(r->get<std::string>(), where);
  if (const json* s = member(p, "String"); s && s->is_string())
    return std::make_unique<Regex>(s->get<std::string>(), where, true);
  fail(DZ_ERR_FORMAT, where, ".pattern must be {\"Regex\": ...} or {\"String\": ...}");
}

using StepPtr = std::unique_ptr<Tokenizer::Step>;

}  // namespace

// ------------------------------------------------------------ added tokens

// Leftmost-longest matcher over the added tokens' texts (a byte trie), the
// semantics of the Aho-Corasick automaton tokenizers uses.
struct Tokenizer::Matcher {
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    int32_t token = -1;                             // index into added_
  };
  std::vector<Node> nodes{1};
  bool first[256] = {};
  void add(std::string_view s, int32_t token) {
    if (s.empty()) return;
    int32_t n = 0;
    for (char ch : s) {
      const uint8_t c = uint8_t(ch);
      auto& nx = nodes[n].next;
      auto it = std::lower_bound(nx.begin(), nx.end(), std::make_pair(c, INT32_MIN));
      if (it != nx.end() && it->first == c) {
        n = it->second;
      } else {
        const int32_t id = int32_t(nodes.size());
        nx.insert(it, {c, id});
        nodes.emplace_back();
        n = id;
      }
    }
    if (nodes[n].token < 0) nodes[n].token = token;
    first[uint8_t(s[0])] = true;
  }
  bool empty() const { return nodes[0].next.empty(); }
  // Longest token starting at s[i]: its index and length, or -1.
  int32_t longest(std::string_view s, size_t i, size_t& len) const {
    int32_t n = 0, best = -1;
    for (size_t k = i; k < s.size(); ++k) {
      const auto& nx = nodes[n].next;
      const uint8_t c = uint8_t(s[k]);
      auto it = std::lower_bound(nx.begin(), nx.end(), std::make_pair(c, INT32_MIN));
      if (it == nx.end() || it->first != c) break;
      n = it->second;
      if (nodes[n].token >= 0) {
        best = nodes[n].token;
        len = k + 1 - i;
      }
    }
    return best;
  }
};

namespace {

struct Split {
  size_t begin, end;
  int32_t token;  // index into added_, or -1 for text
};

// tokenizers' AddedVocabulary::find_matches.
void find_added(const Tokenizer::Matcher& m, const std::vector<AddedToken>& added, std::string_view s,
                bool skip_special, std::vector<Split>& out) {
  size_t start_offset = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (!m.first[uint8_t(s[i])]) {
      ++i;
      continue;
    }
    size_t len = 0;
    const int32_t t = m.longest(s, i, len);
    if (t < 0) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + len;
    i = stop;  // non-overlapping, like the automaton's iterator
    const AddedToken& tok = added[size_t(t)];
    if (skip_special && tok.special) continue;
    if (tok.single_word) {
      const bool start_space = start == 0 || !rust_alnum(s.substr(0, start), true);
      const bool stop_space = stop == s.size() || !rust_alnum(s.substr(stop), false);
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t ns = start;
      while (ns > 0) {  // back over whitespace characters
        size_t b = ns - 1;
        while (b > 0 && (uint8_t(s[b]) & 0xC0) == 0x80) --b;
        const size_t n = utf8::seq_len(s, b);
        if (!n || b + n != ns || !utf8::is_white_space(utf8::decode(s, b, n))) break;
        ns = b;
      }
      start = std::max(ns, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size()) {
        const size_t n = utf8::seq_len(s, stop);
        if (!n || !utf8::is_white_space(utf8::decode(s, stop, n))) break;
        stop += n;
      }
      i = stop;
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, t});
    start_offset = stop;
  }
  if (start_offset < s.size() || s.empty()) out.push_back({start_offset, s.size(), -1});
}

// Scratch of one encode call: pieces and a cache of the ids of pieces seen.
struct EncodeCtx {
  std::deque<std::string> owned;
  std::vector<std::string_view> pieces, next;
  std::vector<Regex::Match> matches;
  std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;
  std::vector<int32_t> cache_ids;
};
thread_local EncodeCtx* t_ctx = nullptr;

void apply_split(const Tokenizer::Step& st, std::string_view p, EncodeCtx& c) {
  c.matches.clear();
  st.re->find_all(p, c.matches);
  struct Span {
    size_t b, e;
    bool m;
  };
  thread_local std::vector<Span> spans, acc;
  spans.clear();
  acc.clear();
  size_t prev = 0;
  for (const auto& m : c.matches) {
    if (prev != m.begin) spans.push_back({prev, m.begin, st.invert});
    spans.push_back({m.begin, m.end, !st.invert});
    prev = m.end;
  }
  if (prev != p.size()) spans.push_back({prev, p.size(), st.invert});
  using S = Tokenizer::Step;
  switch (st.behavior) {
    case S::kIsolated:
      acc = spans;
      break;
    case S::kRemoved:
      for (const auto& s : spans)
        if (!s.m) acc.push_back(s);
      break;
    case S::kMergedWithPrevious: {
      bool pm = false;
      for (const auto& s : spans) {
        if (s.m && !pm && !acc.empty())
          acc.back().e = s.e;
        else
          acc.push_back(s);
        pm = s.m;
      }
      break;
    }
    case S::kMergedWithNext: {
      bool pm = false;
      for (size_t k = spans.size(); k-- > 0;) {
        const auto& s = spans[k];
        if (s.m && !pm && !acc.empty())
          acc.back().b = s.b;
        else
          acc.push_back(s);
        pm = s.m;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    }
    case S::kContiguous: {
      bool pm = false;
      for (const auto& s : spans) {
        if (s.m == pm && !acc.empty())
          acc.back().e = s.e;
        else
          acc.push_back(s);
        pm = s.m;
      }
      break;
    }
  }
  for (const auto& s : acc)
    if (s.e > s.b) c.next.push_back(p.substr(s.b, s.e - s.b));
}

}  // namespace

// ------------------------------------------------------------ loading

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::open(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail(DZ_ERR_IO, path, ": no such tokenizer file");
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->source_ = path;
  const std::string name = fs::path(path).filename().string();
  const bool tiktoken = name.size() >= 6 && (name.ends_with(".model") || name.ends_with(".tiktoken"));
  const std::string dir = fs::path(path).parent_path().string();
  if (tiktoken) {
    t->load_config(dir.empty() ? "." : dir);  // tiktoken takes its special tokens from the config
    t->load_tiktoken(path);
  } else {
    t->load_tokenizer_json(path);
    t->load_config(dir.empty() ? "." : dir);
  }
  t->finish();
  return t;
}

std::unique_ptr<Tokenizer> Tokenizer::open_dir(const std::string& dir) {
  std::error_code ec;
  for (const char* f : {"tokenizer.json", "tiktoken.model"}) {
    const std::string p = (fs::path(dir) / f).string();
    if (fs::exists(p, ec)) return open(p);
  }
  return nullptr;
}

namespace {

// Sequences inside sequences: a few levels in practice, bounded so a hostile file cannot exhaust the stack.
constexpr int kMaxSequenceDepth = 16;

void add_pretok(const json& j, const std::string& where, std::vector<StepPtr>& steps, bool& byte_level, int depth = 0) {
  const std::string type = get_string(j, "type", where);
  if (type == "Sequence") {
    if (depth >= kMaxSequenceDepth)
      fail(DZ_ERR_FORMAT, where, ": Sequences nested more than ", kMaxSequenceDepth, " deep");
    const json* list = member(j, "pretokenizers");
    if (!list || !list->is_array()) fail(DZ_ERR_FORMAT, where, ".pretokenizers must be an array");
    for (size_t i = 0; i < list->size(); ++i)
      add_pretok((*list)[i], cat(where, ".pretokenizers[", i, "]"), steps, byte_level, depth + 1);
  } else if (type == "Split") {
    auto s = std::make_unique<Tokenizer::Step>();
    const json* p = member(j, "pattern");
    if (!p) fail(DZ_ERR_FORMAT, where, ".pattern is missing");
    s->re = pattern_regex(*p, where + ".pattern");
    s->invert = get_bool(j, "invert", false, where);
    const std::string b = get_string(j, "behavior", where);
    using S = Tokenizer::Step;
    if (b == "Isolated")
      s->behavior = S::kIsolated;
    else if (b == "Removed")
      s->behavior = S::kRemoved;
    else if (b == "MergedWithPrevious")
      s->behavior = S::kMergedWithPrevious;
    else if (b == "MergedWithNext")
      s->behavior = S::kMergedWithNext;
    else if (b == "Contiguous")
      s->behavior = S::kContiguous;
    else
      fail(DZ_ERR_FORMAT, where, ".behavior '", b, "' is not a split behavior");
    steps.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (get_bool(j, "add_prefix_space", false, where)) {
      auto s = std::make_unique<Tokenizer::Step>();
      s->kind = Tokenizer::Step::kPrefixSpace;
      steps.push_back(std::move(s));
    }
    if (get_bool(j, "use_regex", true, where)) {
      auto s = std::make_unique<Tokenizer::Step>();
      s->re = std::make_unique<Regex>(kGpt2Pattern, where + " (GPT-2 pattern)");
      steps.push_back(std::move(s));
    }
  } else if (type == "Digits") {
    auto s = std::make_unique<Tokenizer::Step>();
    s->re = std::make_unique<Regex>("[0-9]", where);
    s->behavior =
        get_bool(j, "individual_digits", false, where) ? Tokenizer::Step::kIsolated : Tokenizer::Step::kContiguous;
    steps.push_back(std::move(s));
  } else {
    fail(DZ_ERR_UNSUPPORTED, where, ": pre-tokenizer type '", type,
         "' is not supported (supported: Sequence, Split, ByteLevel, Digits)");
  }
}

void add_normalizer(const json& j, const std::string& where, std::vector<StepPtr>& steps, int depth = 0) {
  const std::string type = get_string(j, "type", where);
  if (type == "Sequence") {
    if (depth >= kMaxSequenceDepth)
      fail(DZ_ERR_FORMAT, where, ": Sequences nested more than ", kMaxSequenceDepth, " deep");
    const json* list = member(j, "normalizers");
    if (!list || !list->is_array()) fail(DZ_ERR_FORMAT, where, ".normalizers must be an array");
    for (size_t i = 0; i < list->size(); ++i)
      add_normalizer((*list)[i], cat(where, ".normalizers[", i, "]"), steps, depth + 1);
  } else if (type == "Replace") {
    auto s = std::make_unique<Tokenizer::Step>();
    s->kind = Tokenizer::Step::kReplace;
    const json* p = member(j, "pattern");
    if (!p) fail(DZ_ERR_FORMAT, where, ".pattern is missing");
    s->re = pattern_regex(*p, where + ".pattern");
    s->content = get_string(j, "content", where);
    steps.push_back(std::move(s));
  } else if (type == "Prepend") {
    auto s = std::make_unique<Tokenizer::Step>();
    s->kind = Tokenizer::Step::kPrepend;
    s->content = get_string(j, "prepend", where);
    steps.push_back(std::move(s));
  } else {
    fail(DZ_ERR_UNSUPPORTED, where, ": normalizer type '", type,
         "' is not supported (supported: Sequence, Replace, Prepend)");
  }
}

}  // namespace

void Tokenizer::load_tokenizer_json(const std::string& path) {
  const json j = parse_json(path);
  if (!j.is_object()) fail(DZ_ERR_FORMAT, path, ": top level must be an object");
  const json* model = member(j, "model");
  if (!model || !model->is_object()) fail(DZ_ERR_FORMAT, path, ": 'model' is missing");
  const std::string mw = path + ": model";
  if (const json* t = member(*model, "type"); t && (!t->is_string() || t->get<std::string>() != "BPE"))
    fail(DZ_ERR_UNSUPPORTED, mw, ".type '", t->dump(), "' is not supported (only byte-level BPE)");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = member(*model, k); v && !(v->is_string() && v->get<std::string>().empty()))
      fail(DZ_ERR_UNSUPPORTED, mw, ".", k, " is not supported");

  bool byte_level = false;
  if (const json* n = member(j, "normalizer")) add_normalizer(*n, path + ": normalizer", normalizer_);
  if (const json* p = member(j, "pre_tokenizer")) add_pretok(*p, path + ": pre_tokenizer", pretok_, byte_level);
  if (const json* d = member(j, "decoder")) {
    const std::string type = get_string(*d, "type", path + ": decoder");
    bool ok = type == "ByteLevel";
    if (type == "Sequence")
      if (const json* l = member(*d, "decoders"); l && l->is_array())
        ok = std::all_of(l->begin(), l->end(), [](const json& x) { return x.value("type", "") == "ByteLevel"; });
    if (!ok) fail(DZ_ERR_UNSUPPORTED, path, ": decoder type '", type, "' is not supported (only ByteLevel)");
    byte_level = true;
  }
  if (!byte_level)
    fail(DZ_ERR_UNSUPPORTED, path, ": not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer or decoder)");
  byte_level_json_ = true;

  const json* vocab = member(*model, "vocab");
  if (!vocab || !vocab->is_object()) fail(DZ_ERR_FORMAT, mw, ".vocab must be an object");
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() >= (int64_t(1) << 30))
      fail(DZ_ERR_FORMAT, mw, ".vocab['", show(it.key()), "'] must be a non-negative integer id");
    max_id = std::max(max_id, it->get<int64_t>());
  }
  bpe_.tokens.assign(size_t(max_id + 1), std::string());
  bpe_.ids.reserve(vocab->size());
  std::string bytes;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const int32_t id = it->get<int32_t>();
    if (unmap_bytes(it.key(), bytes)) {
      bpe_.tokens[size_t(id)] = bytes;
      bpe_.ids.emplace(bytes, id);
    } else {
      bpe_.tokens[size_t(id)] = it.key();  // not producible by byte-level BPE; decodes as its text
    }
  }
  bpe_.ignore_merges = get_bool(*model, "ignore_merges", false, mw);
  if (const json* unk = member(*model, "unk_token")) {
    if (!unk->is_string()) fail(DZ_ERR_FORMAT, mw, ".unk_token must be a string");
    auto it = vocab->find(unk->get<std::string>());
    if (it == vocab->end())
      fail(DZ_ERR_FORMAT, mw, ".unk_token '", show(unk->get<std::string>()), "' is not in the vocabulary");
    bpe_.unk = it->get<int32_t>();
  }
  const json* merges = member(*model, "merges");
  if (!merges || !merges->is_array()) fail(DZ_ERR_FORMAT, mw, ".merges must be an array");
  std::string a, b, ab;
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    std::string_view sa, sb;
    std::string line;
    if (m.is_string()) {
      line = m.get<std::string>();
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        fail(DZ_ERR_FORMAT, mw, ".merges[", i, "] '", show(line), "' must be two tokens separated by one space");
      sa = std::string_view(line).substr(0, sp);
      sb = std::string_view(line).substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      sa = m[0].get_ref<const std::string&>();
      sb = m[1].get_ref<const std::string&>();
    } else {
      fail(DZ_ERR_FORMAT, mw, ".merges[", i, "] must be \"a b\" or [\"a\", \"b\"]");
    }
    if (!unmap_bytes(sa, a) || !unmap_bytes(sb, b))
      fail(DZ_ERR_FORMAT, mw, ".merges[", i, "] has a character outside the byte-level alphabet");
    ab = a + b;
    const int32_t ia = bpe_.find(a), ib = bpe_.find(b), iab = bpe_.find(ab);
    if (ia < 0 || ib < 0 || iab < 0)
      fail(DZ_ERR_FORMAT, mw, ".merges[", i, "]: token '",
           show(ia < 0   ? sa
                : ib < 0 ? sb
                         : std::string_view(ab)),
           "' is not in the vocabulary");
    bpe_.add_merge(ia, ib, uint32_t(i), iab);
  }

  if (const json* at = member(j, "added_tokens")) {
    if (!at->is_array()) fail(DZ_ERR_FORMAT, path, ": added_tokens must be an array");
    for (size_t i = 0; i < at->size(); ++i) {
      const json& t = (*at)[i];
      const std::string w = cat(path, ": added_tokens[", i, "]");
      AddedToken a2;
      const json* id = member(t, "id");
      if (!id || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= (int64_t(1) << 30))
        fail(DZ_ERR_FORMAT, w, ".id must be a non-negative integer");
      a2.id = id->get<int32_t>();
      a2.content = get_string(t, "content", w);
      if (a2.content.empty()) fail(DZ_ERR_FORMAT, w, ".content is empty");
      a2.special = get_bool(t, "special", false, w);
      a2.lstrip = get_bool(t, "lstrip", false, w);
      a2.rstrip = get_bool(t, "rstrip", false, w);
      a2.single_word = get_bool(t, "single_word", false, w);
      a2.normalized = get_bool(t, "normalized", !a2.special, w);
      added_.push_back(std::move(a2));
    }
  }
}

void Tokenizer::load_tiktoken(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(DZ_ERR_IO, path, ": cannot open");
  static const auto b64 = [] {
    std::array<int8_t, 256> t;
    t.fill(-1);
    const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[uint8_t(a[i])] = int8_t(i);
    return t;
  }();
  std::string line, bytes;
  size_t lineno = 0;
  std::vector<std::pair<std::string, int32_t>> entries;
  int64_t max_rank = -1;
  while (std::getline(f, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos) fail(DZ_ERR_FORMAT, path, ":", lineno, ": expected '<base64> <rank>'");
    bytes.clear();
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < sp; ++i) {
      const char c = line[i];
      if (c == '=') break;
      const int v = b64[uint8_t(c)];
      if (v < 0) fail(DZ_ERR_FORMAT, path, ":", lineno, ": invalid base64 character");
      acc = (acc << 6) | uint32_t(v);
      bits += 6;
      if (bits >= 8) {
        bits -= 8;
        bytes += char((acc >> bits) & 0xFF);
      }
    }
    char* end = nullptr;
    const long long rank = std::strtoll(line.c_str() + sp + 1, &end, 10);
    if (end == line.c_str() + sp + 1 || *end != '\0' || rank < 0 || rank >= (1LL << 30))
      fail(DZ_ERR_FORMAT, path, ":", lineno, ": rank must be a non-negative integer");
    if (bytes.empty()) fail(DZ_ERR_FORMAT, path, ":", lineno, ": empty token");
    entries.emplace_back(bytes, int32_t(rank));
    max_rank = std::max<int64_t>(max_rank, rank);
  }
  if (f.bad()) fail(DZ_ERR_IO, path, ": read error");
  if (entries.empty()) fail(DZ_ERR_FORMAT, path, ": no tokens");
  bpe_.tokens.assign(size_t(max_rank + 1), std::string());
  bpe_.ids.reserve(entries.size());
  for (auto& [b, r] : entries) {
    if (!bpe_.tokens[size_t(r)].empty()) fail(DZ_ERR_FORMAT, path, ": rank ", r, " appears twice");
    if (!bpe_.ids.emplace(b, r).second) fail(DZ_ERR_FORMAT, path, ": token of rank ", r, " appears twice");
    bpe_.tokens[size_t(r)] = b;
  }
  // tiktoken merges the adjacent pair whose concatenation has the lowest rank:
  // enumerate every split of every token into two tokens.
  for (size_t id = 0; id < bpe_.tokens.size(); ++id) {
    const std::string& t = bpe_.tokens[id];
    for (size_t k = 1; k < t.size(); ++k) {
      const int32_t a = bpe_.find(std::string_view(t).substr(0, k));
      if (a < 0) continue;
      const int32_t b = bpe_.find(std::string_view(t).substr(k));
      if (b >= 0) bpe_.add_merge(a, b, uint32_t(id), int32_t(id));
    }
  }
  bpe_.ignore_merges = true;
  auto s = std::make_unique<Step>();
  s->re = std::make_unique<Regex>(kKimiPattern, path + " (Kimi split pattern)");
  pretok_.push_back(std::move(s));
}

void Tokenizer::load_config(const std::string& dir) {
  std::error_code ec;
  const std::string cfg_path = (fs::path(dir) / "tokenizer_config.json").string();
  const bool tiktoken = !byte_level_json_;
  if (fs::exists(cfg_path, ec)) {
    const json cfg = parse_json(cfg_path);
    if (!cfg.is_object()) fail(DZ_ERR_FORMAT, cfg_path, ": top level must be an object");
    if (const json* ct = member(cfg, "chat_template")) {
      if (ct->is_string()) {
        chat_template_source_ = ct->get<std::string>();
      } else if (ct->is_array()) {  // [{"name": ..., "template": ...}]: the default one
        for (const auto& e : *ct)
          if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
            chat_template_source_ = e["template"].get<std::string>();
      } else {
        fail(DZ_ERR_FORMAT, cfg_path, ": chat_template must be a string or a list of named templates");
      }
    }
    for (const char* k : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
      const json* v = member(cfg, k);
      if (!v) continue;
      const std::string t = token_text(*v);
      if (t.empty() && !v->is_string())
        fail(DZ_ERR_FORMAT, cfg_path, ".", k, " must be a string or {\"content\": ...}");
      template_tokens_.emplace_back(k, t);
      if (std::string_view(k) == "eos_token") eos_token_ = t;
    }
    if (tiktoken) {  // the rank file has no special tokens: they are in the config
      if (const json* d = member(cfg, "added_tokens_decoder")) {
        if (!d->is_object()) fail(DZ_ERR_FORMAT, cfg_path, ": added_tokens_decoder must be an object");
        for (auto it = d->begin(); it != d->end(); ++it) {
          const std::string w = cat(cfg_path, ": added_tokens_decoder['", it.key(), "']");
          AddedToken a;
          char* end = nullptr;
          const long long id = std::strtoll(it.key().c_str(), &end, 10);
          if (end == it.key().c_str() || *end || id < 0 || id >= (1LL << 30))
            fail(DZ_ERR_FORMAT, w, ": key must be a token id");
          a.id = int32_t(id);
          a.content = get_string(*it, "content", w);
          if (a.content.empty()) fail(DZ_ERR_FORMAT, w, ".content is empty");
          a.special = get_bool(*it, "special", true, w);
          a.lstrip = get_bool(*it, "lstrip", false, w);
          a.rstrip = get_bool(*it, "rstrip", false, w);
          a.single_word = get_bool(*it, "single_word", false, w);
          added_.push_back(std::move(a));
        }
      }
    }
  }
  const std::string jinja_path = (fs::path(dir) / "chat_template.jinja").string();
  if (fs::exists(jinja_path, ec)) chat_template_source_ = read_file(jinja_path);
  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gen_path, ec)) {
    const json g = parse_json(gen_path);
    if (const json* e = member(g, "eos_token_id")) {
      if (e->is_number_integer())
        generation_eos_.push_back(e->get<int32_t>());
      else if (e->is_array())
        for (const auto& x : *e)
          if (x.is_number_integer()) generation_eos_.push_back(x.get<int32_t>());
    }
  }
}

void Tokenizer::finish() {
  bpe_.finalize();
  int64_t max_id = int64_t(bpe_.tokens.size()) - 1;
  for (const auto& a : added_) max_id = std::max<int64_t>(max_id, a.id);
  n_vocab_ = int32_t(max_id + 1);
  added_index_.assign(size_t(n_vocab_), -1);
  raw_match_ = std::make_unique<Matcher>();
  norm_match_ = std::make_unique<Matcher>();
  std::string bytes;
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& a = added_[i];
    added_index_[size_t(a.id)] = int32_t(i);
    // tokenizers decodes an added token through the ByteLevel decoder: byte
    // mapped when every character is in the map, else its UTF-8 text.
    added_decode_.push_back(byte_level_json_ && unmap_bytes(a.content, bytes) ? bytes : a.content);
    // Two passes as in tokenizers: tokens with normalized=false on the raw
    // text first, then normalized=true ones on the normalized rest.
    (a.normalized ? *norm_match_ : *raw_match_).add(a.content, int32_t(i));
  }
  for (int32_t id : generation_eos_)
    if (id >= 0 && id < n_vocab_) stop_ids_.push_back(id);
  auto add_stop = [&](std::string_view text) {
    const int32_t id = token_id(text);
    if (id >= 0 && std::find(stop_ids_.begin(), stop_ids_.end(), id) == stop_ids_.end()) stop_ids_.push_back(id);
  };
  if (!eos_token_.empty()) add_stop(eos_token_);
  for (const char* t : kStopTokens)
    if (token_id(t) >= 0 && is_special(token_id(t))) add_stop(t);
  if (!chat_template_source_.empty()) {
    try {
      template_ = std::make_unique<jinja::Template>(chat_template_source_);
    } catch (const Error& e) {
      template_error_ = e.what();
    }
  }
}

// ------------------------------------------------------------ encoding

void Tokenizer::pretokenize_and_bpe(std::string_view seg, std::vector<int32_t>& out) const {
  EncodeCtx& c = *t_ctx;
  c.pieces.clear();
  c.pieces.push_back(seg);
  for (const auto& st : pretok_) {
    c.next.clear();
    if (st->kind == Step::kPrefixSpace) {
      for (auto p : c.pieces) {
        if (!p.empty() && p[0] != ' ') {
          c.owned.push_back(" " + std::string(p));
          c.next.push_back(c.owned.back());
        } else {
          c.next.push_back(p);
        }
      }
    } else {
      for (auto p : c.pieces) apply_split(*st, p, c);
    }
    std::swap(c.pieces, c.next);
  }
  for (auto p : c.pieces) {
    auto it = c.cache.find(p);
    if (it != c.cache.end()) {
      out.insert(out.end(), c.cache_ids.begin() + it->second.first,
                 c.cache_ids.begin() + it->second.first + it->second.second);
      continue;
    }
    const size_t before = out.size();
    bpe_.encode(p, out);
    const uint32_t at = uint32_t(c.cache_ids.size());
    c.cache_ids.insert(c.cache_ids.end(), out.begin() + before, out.end());
    c.cache.emplace(p, std::make_pair(at, uint32_t(out.size() - before)));
  }
}

void Tokenizer::encode_segment(std::string_view seg, bool parse_special, std::vector<int32_t>& out) const {
  std::string_view text = seg;
  if (!normalizer_.empty()) {
    std::string s(seg);
    for (const auto& st : normalizer_) {
      if (st->kind == Step::kPrepend) {
        if (!s.empty()) s = st->content + s;
      } else {  // Replace
        std::vector<Regex::Match> m;
        st->re->find_all(s, m);
        if (m.empty()) continue;
        std::string r;
        size_t prev = 0;
        for (const auto& x : m) {
          r.append(s, prev, x.begin - prev);
          r += st->content;
          prev = x.end;
        }
        r.append(s, prev, std::string::npos);
        s = std::move(r);
      }
    }
    t_ctx->owned.push_back(std::move(s));
    text = t_ctx->owned.back();
  }
  if (norm_match_->empty()) {
    pretokenize_and_bpe(text, out);
    return;
  }
  std::vector<Split> splits;
  find_added(*norm_match_, added_, text, !parse_special, splits);
  for (const auto& s : splits) {
    if (s.token >= 0)
      out.push_back(added_[size_t(s.token)].id);
    else if (s.end > s.begin)
      pretokenize_and_bpe(text.substr(s.begin, s.end - s.begin), out);
  }
}

void Tokenizer::encode(std::string_view text, bool parse_special, std::vector<int32_t>& out) const {
  EncodeCtx ctx;
  EncodeCtx* saved = t_ctx;
  t_ctx = &ctx;
  struct Restore {
    EncodeCtx* s;
    ~Restore() { t_ctx = s; }
  } restore{saved};
  if (raw_match_->empty()) {
    if (!text.empty()) encode_segment(text, parse_special, out);
    return;
  }
  std::vector<Split> splits;
  find_added(*raw_match_, added_, text, !parse_special, splits);
  for (const auto& s : splits) {
    if (s.token >= 0)
      out.push_back(added_[size_t(s.token)].id);
    else if (s.end > s.begin)
      encode_segment(text.substr(s.begin, s.end - s.begin), parse_special, out);
  }
}

// ------------------------------------------------------------ decoding

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= n_vocab_) return {};
  const int32_t a = added_index_[size_t(id)];
  if (a >= 0) return added_decode_[size_t(a)];
  return size_t(id) < bpe_.tokens.size() ? std::string_view(bpe_.tokens[size_t(id)]) : std::string_view();
}

std::string Tokenizer::decode(const int32_t* ids, size_t n) const {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab_)
      fail(DZ_ERR_INVALID_ARGUMENT, "token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ", n_vocab_,
           ")");
    out += token_bytes(ids[i]);
  }
  return out;
}

int32_t Tokenizer::token_id(std::string_view text) const {
  for (const auto& a : added_)
    if (a.content == text) return a.id;
  return bpe_.find(text);
}

bool Tokenizer::is_special(int32_t id) const {
  if (id < 0 || id >= n_vocab_) return false;
  const int32_t a = added_index_[size_t(id)];
  return a >= 0 && added_[size_t(a)].special;
}

// ------------------------------------------------------------ chat template

bool Tokenizer::has_chat_template() const { return template_ != nullptr; }

std::string Tokenizer::apply_chat_template(std::string_view messages_json, std::string_view options_json,
                                           bool add_generation_prompt, const std::tm* now) const {
  if (!template_) {
    if (!template_error_.empty()) fail(DZ_ERR_UNSUPPORTED, source_, ": chat template: ", template_error_);
    fail(DZ_ERR_NOT_FOUND, source_, ": no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
  }
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  for (const auto& [k, v] : template_tokens_) vars[k] = v;
  vars["tools"] = nullptr;
  vars["documents"] = nullptr;
  try {
    vars["messages"] = nlohmann::ordered_json::parse(messages_json);
  } catch (const nlohmann::json::exception& e) {
    fail(DZ_ERR_INVALID_ARGUMENT, "messages: invalid JSON: ", e.what());
  }
  if (!vars["messages"].is_array()) fail(DZ_ERR_INVALID_ARGUMENT, "messages must be a JSON array");
  if (!options_json.empty()) {
    nlohmann::ordered_json o;
    try {
      o = nlohmann::ordered_json::parse(options_json);
    } catch (const nlohmann::json::exception& e) {
      fail(DZ_ERR_INVALID_ARGUMENT, "options: invalid JSON: ", e.what());
    }
    if (!o.is_object() && !o.is_null()) fail(DZ_ERR_INVALID_ARGUMENT, "options must be a JSON object");
    if (o.is_object())
      for (auto it = o.begin(); it != o.end(); ++it) vars[it.key()] = it.value();
  }
  vars["add_generation_prompt"] = add_generation_prompt;
  return template_->render(vars, now);
}

// ------------------------------------------------------------ streaming

void StreamDecoder::drain(bool final) {
  size_t i = 0;
  while (i < pending_.size()) {
    const size_t n = utf8::seq_len(pending_, i);
    if (n) {
      out_.append(pending_, i, n);
      i += n;
      continue;
    }
    // The longest prefix of a character here (1..3 bytes): wait for the rest,
    // or, when it cannot complete, replace it with one U+FFFD (the "maximal
    // subpart" rule decoders such as from_utf8_lossy follow).
    size_t k = std::min<size_t>(3, pending_.size() - i);
    while (k > 0 && !utf8::is_incomplete_prefix(std::string_view(pending_).substr(i, k), 0)) --k;
    if (k > 0 && i + k == pending_.size() && !final) break;
    out_ += "\xEF\xBF\xBD";
    i += k ? k : 1;
  }
  pending_.erase(0, i);
}

std::string_view StreamDecoder::push(int32_t id) {
  if (id < 0 || id >= tok_.vocab_size())
    fail(DZ_ERR_INVALID_ARGUMENT, "token id ", id, " is outside the vocabulary [0, ", tok_.vocab_size(), ")");
  out_.clear();
  pending_ += tok_.token_bytes(id);
  drain(false);
  return out_;
}

std::string_view StreamDecoder::flush() {
  out_.clear();
  drain(true);
  return out_;
}

}  // namespace dz
