// PCRE2 (UTF, Unicode properties, JIT) behind a small interface for the
// pre-tokenizers. Patterns written for Oniguruma / Rust regex (what
// tokenizers and tiktoken use) are translated where PCRE2 differs.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dz {

class Regex {
 public:
  // Throws dz::Error (DZ_ERR_FORMAT, naming `where`) when the pattern does not
  // compile. literal: match the text exactly (tokenizers' {"String": ...}).
  Regex(std::string_view pattern, const std::string& where, bool literal = false);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  struct Match {
    size_t begin, end;
  };
  // Every non-overlapping match in s, left to right. Invalid UTF-8 never
  // matches (it ends up between matches). Thread-safe.
  void find_all(std::string_view s, std::vector<Match>& out) const;
  // Whether the pattern matches anywhere in s.
  bool search(std::string_view s) const;

  // Oniguruma/Rust-regex pattern -> PCRE2 pattern: \s and \S mean Unicode
  // White_Space (PCRE2's also match U+180E), and class intersection
  // [A&&[^B]] becomes a lookahead. Exposed for tests.
  static std::string translate(std::string_view pattern);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dz
