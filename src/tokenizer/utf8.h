// UTF-8 helpers shared by the tokenizer and the chat-template engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dz::utf8 {

// Length of the well-formed UTF-8 sequence starting at s[i] (1..4), or 0 when
// the bytes there are not a complete, valid sequence (overlong forms,
// surrogates and values above U+10FFFF are invalid).
inline size_t seq_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return 1;
  const size_t n = s.size() - i;
  if (c >= 0xC2 && c <= 0xDF) return n >= 2 && (b(i + 1) & 0xC0) == 0x80 ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (n < 3 || (b(i + 1) & 0xC0) != 0x80 || (b(i + 2) & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && b(i + 1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(i + 1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (n < 4 || (b(i + 1) & 0xC0) != 0x80 || (b(i + 2) & 0xC0) != 0x80 || (b(i + 3) & 0xC0) != 0x80) return 0;
    if (c == 0xF0 && b(i + 1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(i + 1) >= 0x90) return 0;  // > U+10FFFF
    return 4;
  }
  return 0;
}

// Whether s[i..] could still become a valid sequence with more bytes (a valid
// but truncated prefix). Used by the streaming decoder to hold bytes back.
inline bool is_incomplete_prefix(std::string_view s, size_t i) {
  const size_t n = s.size() - i;
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  size_t need;
  const uint8_t c = b(0);
  if (c >= 0xC2 && c <= 0xDF)
    need = 2;
  else if (c >= 0xE0 && c <= 0xEF)
    need = 3;
  else if (c >= 0xF0 && c <= 0xF4)
    need = 4;
  else
    return false;
  if (n >= need) return false;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return false;
    if (k == 1) {
      if (c == 0xE0 && b(1) < 0xA0) return false;
      if (c == 0xED && b(1) >= 0xA0) return false;
      if (c == 0xF0 && b(1) < 0x90) return false;
      if (c == 0xF4 && b(1) >= 0x90) return false;
    }
  }
  return true;
}

// Code point of the valid sequence of length len at s[i].
inline uint32_t decode(std::string_view s, size_t i, size_t len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
  switch (len) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

inline void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

inline bool valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = seq_len(s, i);
    if (!n) return false;
    i += n;
  }
  return true;
}

// Unicode White_Space (what Rust's char::is_whitespace and Python's str.strip use).
inline bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace dz::utf8
