#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include "common/error.h"

namespace dz {

namespace {

// Unicode White_Space, as a class body.
constexpr const char* kWhiteSpace =
    "\\t-\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread scratch shared by every pattern: match data (one pair is all we
// read) and a JIT stack large enough for long whitespace runs.
struct Scratch {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* mctx = pcre2_match_context_create(nullptr);
  Scratch() {
    if (!md || !stack || !mctx) throw std::bad_alloc();
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~Scratch() {
    pcre2_match_data_free(md);
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
  }
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Whether a \\p{name} names a script (not a general category or binary property).
bool is_script(std::string_view name) {
  if (name.empty() || name.find_first_of(":=^ ") != std::string_view::npos) return false;
  const std::string pat = "\\p{sc:" + std::string(name) + "}";
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* c =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  pcre2_code_free(c);
  return c != nullptr;
}

// Copy one escape sequence starting at p[i] ('\\') into out; returns the index
// after it. \p{..}, \P{..}, \x{..} are copied whole.
size_t copy_escape(std::string_view p, size_t i, std::string& out) {
  if (i + 1 >= p.size()) {
    out += p.substr(i);
    return p.size();
  }
  const char c = p[i + 1];
  if ((c == 'p' || c == 'P' || c == 'x') && i + 2 < p.size() && p[i + 2] == '{') {
    const size_t close = p.find('}', i + 2);
    const size_t end = close == std::string_view::npos ? p.size() : close + 1;
    if (c != 'x' && close != std::string_view::npos && is_script(p.substr(i + 3, close - i - 3))) {
      // \p{Han}: PCRE2 matches a script by Script_Extensions (U+3002 "。" is
      // then Han); Oniguruma and Rust regex use the Script property.
      out += cat("\\", c, "{sc:", std::string(p.substr(i + 3, close - i - 3)), "}");
      return end;
    }
    out += p.substr(i, end - i);
    return end;
  }
  out += p.substr(i, 2);
  return i + 2;
}

// Translate the body of one bracket class starting at p[i] == '['; returns the
// index after its closing ']'.
size_t translate_class(std::string_view p, size_t i, std::string& out) {
  size_t j = i + 1;
  std::string head = "[";
  if (j < p.size() && p[j] == '^') head += p[j++];
  std::string body;
  std::vector<std::string> intersect;  // nested classes after &&
  bool first = true;
  while (j < p.size()) {
    const char c = p[j];
    if (c == ']' && !first) break;
    first = false;
    if (c == '\\') {
      if (j + 1 < p.size() && p[j + 1] == 's') {
        body += kWhiteSpace;
        j += 2;
      } else {
        j = copy_escape(p, j, body);
      }
    } else if (c == '&' && j + 1 < p.size() && p[j + 1] == '&') {
      j += 2;
      std::string other;
      if (j < p.size() && p[j] == '[') {
        j = translate_class(p, j, other);
      } else {  // [A&&B...] with a bare set: read up to the closing ']'
        std::string rest = "[";
        while (j < p.size() && p[j] != ']') {
          if (p[j] == '\\')
            j = copy_escape(p, j, rest);
          else
            rest += p[j++];
        }
        other = rest + "]";
      }
      intersect.push_back(other);
    } else if (c == '[' && j + 1 < p.size() && p[j + 1] == ':') {  // POSIX [:alpha:]
      const size_t close = p.find(":]", j + 2);
      const size_t end = close == std::string_view::npos ? p.size() : close + 2;
      body += p.substr(j, end - j);
      j = end;
    } else {
      body += c;
      ++j;
    }
  }
  const std::string cls = head + body + "]";
  if (intersect.empty()) {
    out += cls;
  } else {
    out += "(?:";
    for (const auto& o : intersect) out += "(?=" + o + ")";
    out += cls + ")";
  }
  return j < p.size() ? j + 1 : j;
}

}  // namespace

std::string Regex::translate(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size() && (p[i + 1] == 's' || p[i + 1] == 'S')) {
      out += p[i + 1] == 's' ? "[" : "[^";
      out += kWhiteSpace;
      out += "]";
      i += 2;
    } else if (c == '\\') {
      i = copy_escape(p, i, out);
    } else if (c == '[') {
      i = translate_class(p, i, out);
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Impl() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern, const std::string& where, bool literal) : impl_(std::make_unique<Impl>()) {
  const std::string pat = literal ? std::string(pattern) : translate(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  if (literal) opts |= PCRE2_LITERAL;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &off, nullptr);
  if (!impl_->code)
    fail(DZ_ERR_FORMAT, where, ": regex does not compile at offset ", off, ": ", pcre2_message(err), " (pattern ",
         std::string(pattern), ")");
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view s, std::vector<Match>& out) const {
  Scratch& sc = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0;
  while (pos <= s.size()) {
    const int rc = pcre2_match(impl_->code, subject, s.size(), pos, 0, sc.md, sc.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail(DZ_ERR_INTERNAL, "regex match failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(sc.md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.push_back({b, e});
      pos = e;
    } else {  // empty match: step over one character (or one byte)
      if (b >= s.size()) break;
      const auto c = static_cast<unsigned char>(s[b]);
      size_t step = 1;
      if (c >= 0xC0) {
        while (b + step < s.size() && (static_cast<unsigned char>(s[b + step]) & 0xC0) == 0x80 && step < 4) ++step;
      }
      pos = b + step;
    }
  }
}

bool Regex::search(std::string_view s) const {
  Scratch& sc = scratch();
  const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, sc.md, sc.mctx);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) fail(DZ_ERR_INTERNAL, "regex match failed: ", pcre2_message(rc));
  return true;
}

}  // namespace dz
