#include "tokenizer/jinja.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>

#include "common/error.h"
#include "tokenizer/utf8.h"

namespace dz::jinja {

namespace {

// ================================================================ values

struct Value;
struct Interp;
using List = std::vector<Value>;
struct Dict;
struct Args;
using Fn = std::function<Value(Interp&, Args&)>;

// Lists and dicts nest at most this deep, and never contain themselves: the
// functions that walk values (printing, comparison, tojson, destruction)
// recurse, and a hostile template or messages array must not overflow the stack.
constexpr uint32_t kMaxNesting = 256;
[[noreturn]] void error(const std::string& msg);
// Strings, lists and the output stay below this many bytes or elements: a
// template that doubles a string in a loop gets an error, not the host's memory.
constexpr size_t kMaxSize = size_t(1) << 28;
void check_size(size_t n) {
  if (n > kMaxSize)
    error("a string, list or output beyond " + std::to_string(kMaxSize >> 20) + " Mi characters or items");
}

struct Value {
  enum Kind : uint8_t { kUndef, kNone, kBool, kInt, kFloat, kStr, kList, kDict, kFunc, kNs } k = kUndef;
  uint32_t depth = 0;  // kList: 1 + its deepest element (lists do not change once made)
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;  // kStr; kUndef: the missing name
  std::shared_ptr<List> l;
  std::shared_ptr<Dict> d;  // kDict, kNs
  std::shared_ptr<Fn> fn;

  static Value undef(std::string name) {
    Value v;
    v.s = std::make_shared<const std::string>(std::move(name));
    return v;
  }
  static Value none() {
    Value v;
    v.k = kNone;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.k = kBool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.k = kInt;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.k = kFloat;
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    Value v;
    v.k = kStr;
    v.s = std::make_shared<const std::string>(std::move(x));
    return v;
  }
  static Value list(List x = {});
  static Value dict();
  static Value func(Fn f) {
    Value v;
    v.k = kFunc;
    v.fn = std::make_shared<Fn>(std::move(f));
    return v;
  }
  uint32_t nesting() const;  // 0 for scalars
  bool undefined() const { return k == kUndef; }
  bool is_num() const { return k == kInt || k == kFloat || k == kBool; }
  const std::string& sv() const { return *s; }
  double num() const { return k == kFloat ? f : k == kBool ? double(b) : double(i); }
};

// True when v is d or holds it at any depth.
bool reaches(const Value& v, const Dict* d);

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  uint32_t depth = 1;  // 1 + the deepest value ever set (never lowered)
  Value* find(std::string_view key) {
    for (auto& kv : items)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
  void set(const std::string& key, Value v) {
    if (v.nesting() && reaches(v, this)) error("a dict cannot contain itself ('" + key + "')");
    deepen(v);
    if (Value* p = find(key))
      *p = std::move(v);
    else
      items.emplace_back(key, std::move(v));
  }
  // A key known to be new (a JSON object's).
  void add(std::string key, Value v) {
    deepen(v);
    items.emplace_back(std::move(key), std::move(v));
  }

 private:
  void deepen(const Value& v) {
    depth = std::max(depth, 1 + v.nesting());
    if (depth > kMaxNesting) error("values nested more than " + std::to_string(kMaxNesting) + " levels");
  }
};

Value Value::dict() {
  Value v;
  v.k = kDict;
  v.d = std::make_shared<Dict>();
  return v;
}

Value Value::list(List x) {
  Value v;
  v.k = kList;
  for (const Value& e : x) v.depth = std::max(v.depth, e.nesting());
  if (++v.depth > kMaxNesting) error("values nested more than " + std::to_string(kMaxNesting) + " levels");
  v.l = std::make_shared<List>(std::move(x));
  return v;
}

uint32_t Value::nesting() const { return k == kList ? depth : (k == kDict || k == kNs) ? d->depth : 0; }

bool reaches(const Value& v, const Dict* d) {
  if (v.k == Value::kDict || v.k == Value::kNs) {
    if (v.d.get() == d) return true;
    for (const auto& kv : v.d->items)
      if (kv.second.nesting() && reaches(kv.second, d)) return true;
  } else if (v.k == Value::kList) {
    for (const Value& e : *v.l)
      if (e.nesting() && reaches(e, d)) return true;
  }
  return false;
}

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Positional i or keyword name, else dflt.
  Value get(size_t i, const char* name, Value dflt = Value()) const {
    for (const auto& [k, v] : kw)
      if (k == name) return v;
    return i < pos.size() ? pos[i] : dflt;
  }
};

[[noreturn]] void error(const std::string& msg) { fail(DZ_ERR_INVALID_ARGUMENT, "chat template: ", msg); }

Value from_json(const nlohmann::ordered_json& j, uint32_t depth = 0) {
  if (depth >= kMaxNesting) error("input nested more than " + std::to_string(kMaxNesting) + " levels");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u <= uint64_t(INT64_MAX) ? Value::integer(int64_t(u)) : Value::real(double(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x, depth + 1));
      return Value::list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v = Value::dict();
      for (auto it = j.begin(); it != j.end(); ++it) v.d->add(it.key(), from_json(it.value(), depth + 1));
      return v;
    }
    default:
      return Value::none();
  }
}

// ---------------------------------------------------------------- Python text forms

std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]XX, shortest round-trip digits
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t e = sci.find('e');
  const int exp = std::atoi(sci.c_str() + e + 1);
  std::string digits;
  for (size_t k = 0; k < e; ++k)
    if (sci[k] != '.') digits += sci[k];
  std::string out;
  if (exp >= -5 + 1 && exp < 16) {  // Python repr: fixed for 1e-4 <= |x| < 1e16
    if (exp >= 0) {
      if (digits.size() <= size_t(exp) + 1) {
        out = digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
      }
    } else {
      out = "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string py_repr_str(const std::string& s) {
  const bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  const char q = has_sq && !has_dq ? '"' : '\'';
  std::string o(1, q);
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = uint8_t(s[i]);
    if (c == '\\')
      o += "\\\\";
    else if (c == uint8_t(q))
      o += std::string("\\") + char(q);
    else if (c == '\n')
      o += "\\n";
    else if (c == '\r')
      o += "\\r";
    else if (c == '\t')
      o += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      o += b;
    } else {
      o += char(c);
    }
    ++i;
  }
  return o + q;
}

std::string to_str(const Value& v);

std::string repr(const Value& v) {
  if (v.k == Value::kStr) return py_repr_str(v.sv());
  if (v.k == Value::kUndef) return "";
  return to_str(v);
}

std::string to_str(const Value& v) {
  switch (v.k) {
    case Value::kUndef:
      return "";
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return py_float(v.f);
    case Value::kStr:
      return v.sv();
    case Value::kList: {
      std::string o = "[";
      for (size_t i = 0; i < v.l->size(); ++i) o += (i ? ", " : "") + repr((*v.l)[i]);
      return o + "]";
    }
    case Value::kDict: {
      std::string o = "{";
      for (size_t i = 0; i < v.d->items.size(); ++i)
        o += (i ? ", " : "") + py_repr_str(v.d->items[i].first) + ": " + repr(v.d->items[i].second);
      return o + "}";
    }
    case Value::kNs:
      return "<Namespace>";
    case Value::kFunc:
      return "<function>";
  }
  return "";
}

// json.dumps(x, ensure_ascii=False, indent=indent, separators=..., sort_keys=...)
void to_json(const Value& v, std::string& o, int indent, int depth, const std::string& item_sep,
             const std::string& key_sep, bool sort_keys) {
  auto nl = [&](int d) {
    if (indent < 0) return;
    o += '\n';
    o.append(size_t(indent * d), ' ');
  };
  switch (v.k) {
    case Value::kNone:
      o += "null";
      return;
    case Value::kBool:
      o += v.b ? "true" : "false";
      return;
    case Value::kInt:
      o += std::to_string(v.i);
      return;
    case Value::kFloat:
      if (std::isnan(v.f))
        o += "NaN";
      else if (std::isinf(v.f))
        o += v.f > 0 ? "Infinity" : "-Infinity";
      else
        o += py_float(v.f);
      return;
    case Value::kStr: {
      o += '"';
      for (char ch : v.sv()) {
        const unsigned char c = uint8_t(ch);
        switch (c) {
          case '"':
            o += "\\\"";
            break;
          case '\\':
            o += "\\\\";
            break;
          case '\n':
            o += "\\n";
            break;
          case '\r':
            o += "\\r";
            break;
          case '\t':
            o += "\\t";
            break;
          case '\b':
            o += "\\b";
            break;
          case '\f':
            o += "\\f";
            break;
          default:
            if (c < 0x20) {
              char b[8];
              std::snprintf(b, sizeof b, "\\u%04x", c);
              o += b;
            } else {
              o += char(c);
            }
        }
      }
      o += '"';
      return;
    }
    case Value::kList:
      if (v.l->empty()) {
        o += "[]";
        return;
      }
      o += '[';
      for (size_t i = 0; i < v.l->size(); ++i) {
        if (i) o += item_sep;
        nl(depth + 1);
        to_json((*v.l)[i], o, indent, depth + 1, item_sep, key_sep, sort_keys);
      }
      nl(depth);
      o += ']';
      return;
    case Value::kDict:
    case Value::kNs: {
      if (v.d->items.empty()) {
        o += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.d->items) items.push_back(&kv);
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto a, auto b) { return a->first < b->first; });
      o += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) o += item_sep;
        nl(depth + 1);
        to_json(Value::str(items[i]->first), o, indent, depth + 1, item_sep, key_sep, sort_keys);
        o += key_sep;
        to_json(items[i]->second, o, indent, depth + 1, item_sep, key_sep, sort_keys);
      }
      nl(depth);
      o += '}';
      return;
    }
    case Value::kUndef:
      error("tojson: value is undefined" + (v.s && !v.s->empty() ? " ('" + *v.s + "')" : std::string()));
    case Value::kFunc:
      error("tojson: a function is not JSON serializable");
  }
}

bool truthy(const Value& v) {
  switch (v.k) {
    case Value::kUndef:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kStr:
      return !v.sv().empty();
    case Value::kList:
      return !v.l->empty();
    case Value::kDict:
      return !v.d->items.empty();
    default:
      return true;
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_num() && b.is_num()) {
    if (a.k == Value::kFloat || b.k == Value::kFloat) return a.num() == b.num();
    return (a.k == Value::kBool ? int64_t(a.b) : a.i) == (b.k == Value::kBool ? int64_t(b.b) : b.i);
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case Value::kUndef:
    case Value::kNone:
      return true;
    case Value::kStr:
      return a.sv() == b.sv();
    case Value::kList:
      if (a.l->size() != b.l->size()) return false;
      for (size_t i = 0; i < a.l->size(); ++i)
        if (!equal((*a.l)[i], (*b.l)[i])) return false;
      return true;
    case Value::kDict:
      if (a.d->items.size() != b.d->items.size()) return false;
      for (auto& [k, v] : a.d->items) {
        Value* o = b.d->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default:
      return a.d == b.d && a.fn == b.fn;
  }
}

const char* type_name(const Value& v) {
  switch (v.k) {
    case Value::kUndef:
      return "undefined";
    case Value::kNone:
      return "NoneType";
    case Value::kBool:
      return "bool";
    case Value::kInt:
      return "int";
    case Value::kFloat:
      return "float";
    case Value::kStr:
      return "str";
    case Value::kList:
      return "list";
    case Value::kDict:
      return "dict";
    case Value::kFunc:
      return "function";
    case Value::kNs:
      return "Namespace";
  }
  return "?";
}

[[noreturn]] void undefined_error(const Value& v) {
  error("'" + (v.s && !v.s->empty() ? *v.s : std::string("value")) + "' is undefined");
}

// Code-point boundaries of a string (Python indexes str by code point).
std::vector<size_t> cp_bounds(const std::string& s) {
  std::vector<size_t> b;
  for (size_t i = 0; i < s.size();) {
    b.push_back(i);
    const size_t n = utf8::seq_len(s, i);
    i += n ? n : 1;
  }
  b.push_back(s.size());
  return b;
}

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_num() && b.is_num()) return a.num() < b.num() ? -1 : a.num() > b.num() ? 1 : 0;
  if (a.k == Value::kStr && b.k == Value::kStr) return a.sv() < b.sv() ? -1 : a.sv() > b.sv() ? 1 : 0;
  if (a.k == Value::kList && b.k == Value::kList) {
    for (size_t i = 0; i < std::min(a.l->size(), b.l->size()); ++i) {
      if (equal((*a.l)[i], (*b.l)[i])) continue;
      return compare((*a.l)[i], (*b.l)[i], op);
    }
    return a.l->size() < b.l->size() ? -1 : a.l->size() > b.l->size() ? 1 : 0;
  }
  if (a.undefined()) undefined_error(a);
  if (b.undefined()) undefined_error(b);
  error(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) +
        "'");
}

// Iterate like Python: lists, dict keys, string characters; undefined is empty.
List iterate(const Value& v) {
  switch (v.k) {
    case Value::kList:
      return *v.l;
    case Value::kDict: {
      List l;
      for (auto& kv : v.d->items) l.push_back(Value::str(kv.first));
      return l;
    }
    case Value::kStr: {
      List l;
      const auto b = cp_bounds(v.sv());
      for (size_t i = 0; i + 1 < b.size(); ++i) l.push_back(Value::str(v.sv().substr(b[i], b[i + 1] - b[i])));
      return l;
    }
    case Value::kUndef:
      return {};
    default:
      error(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.k) {
    case Value::kStr:
      if (item.k != Value::kStr) error("'in <string>' requires string as left operand");
      return container.sv().find(item.sv()) != std::string::npos;
    case Value::kList:
      for (const auto& x : *container.l)
        if (equal(x, item)) return true;
      return false;
    case Value::kDict:
    case Value::kNs:
      return item.k == Value::kStr && container.d->find(item.sv()) != nullptr;
    case Value::kUndef:
      return false;
    default:
      error(std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.k) {
    case Value::kStr:
      return int64_t(cp_bounds(v.sv()).size() - 1);
    case Value::kList:
      return int64_t(v.l->size());
    case Value::kDict:
    case Value::kNs:
      return int64_t(v.d->items.size());
    case Value::kUndef:
      return 0;
    default:
      error(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

bool py_space(uint32_t c) { return utf8::is_white_space(c) || (c >= 0x1C && c <= 0x1F); }

// str.strip/lstrip/rstrip with chars (None: whitespace)
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const auto b = cp_bounds(s);
  size_t lo = 0, hi = b.size() - 1;
  auto strip_cp = [&](size_t k) {
    const std::string_view c(s.data() + b[k], b[k + 1] - b[k]);
    if (chars.k == Value::kStr) return chars.sv().find(c) != std::string::npos;
    const size_t n = utf8::seq_len(c, 0);
    return n && py_space(utf8::decode(c, 0, n));
  };
  if (left)
    while (lo < hi && strip_cp(lo)) ++lo;
  if (right)
    while (hi > lo && strip_cp(hi - 1)) --hi;
  return s.substr(b[lo], b[hi] - b[lo]);
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) {  // Python inserts `to` between characters
    std::string o;
    const auto b = cp_bounds(s);
    int64_t n = 0;
    for (size_t i = 0; i + 1 < b.size(); ++i) {
      if (count < 0 || n < count) {
        o += to;
        ++n;
      }
      o.append(s, b[i], b[i + 1] - b[i]);
    }
    if (count < 0 || n < count) o += to;
    return o;
  }
  std::string o;
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    o.append(s, pos, f - pos);
    o += to;
    pos = f + from.size();
    ++n;
  }
  o.append(s, pos, std::string::npos);
  return o;
}

// ================================================================ lexer

struct Tok {
  enum Kind { kName, kStr, kInt, kFloat, kOp, kEnd } k = kEnd;
  std::string text;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct Item {  // template text or a tag's tokens
  enum Kind { kText, kVar, kBlock } k;
  std::string text;
  std::vector<Tok> toks;
  int line;
};

[[noreturn]] void syntax(int line, const std::string& msg) {
  fail(DZ_ERR_FORMAT, "chat template line ", line, ": ", msg);
}

bool ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  explicit Lexer(std::string_view src) {
    // Jinja normalises newlines and drops one trailing newline.
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        s_ += '\n';
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        s_ += src[i];
      }
    }
    if (!s_.empty() && s_.back() == '\n') s_.pop_back();
  }

  std::vector<Item> run() {
    std::vector<Item> items;
    size_t pos = 0;
    bool line_starting = true;
    while (pos <= s_.size()) {
      size_t start = std::string::npos;
      for (const char* o : {"{{", "{%", "{#"}) start = std::min(start, s_.find(o, pos));
      if (start == std::string::npos) {
        add_text(items, s_.substr(pos), line_of(pos));
        break;
      }
      std::string text = s_.substr(pos, start - pos);
      const char kind = s_[start + 1];
      size_t p = start + 2;
      const char sign = p < s_.size() && (s_[p] == '-' || s_[p] == '+') ? s_[p] : 0;
      if (sign == '-') {
        while (!text.empty() && ws(text.back())) text.pop_back();
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
            std::all_of(text.begin() + long(l_pos), text.end(), ws))
          text.resize(l_pos);
      }
      add_text(items, text, line_of(pos));
      if (sign) ++p;
      const int line = line_of(start);
      if (kind == '#') {
        const size_t e = s_.find("#}", p);
        if (e == std::string::npos) syntax(line, "unterminated comment");
        pos = e + 2;
        pos = after_tag(pos, e > p ? s_[e - 1] : 0, true);
      } else {
        Item it{kind == '{' ? Item::kVar : Item::kBlock, "", {}, line};
        char end_sign = 0;
        p = lex_tag(p, kind == '{' ? '}' : '%', it.toks, end_sign, line);
        pos = after_tag(p, end_sign, kind == '%');
        if (it.k == Item::kBlock && it.toks.size() == 1 && it.toks[0].k == Tok::kName && it.toks[0].text == "raw") {
          pos = raw_block(pos, items, line);
        } else {
          items.push_back(std::move(it));
        }
      }
      line_starting = pos > 0 && s_[pos - 1] == '\n';
    }
    return items;
  }

 private:
  std::string s_;

  int line_of(size_t pos) const {
    return 1 + int(std::count(s_.begin(), s_.begin() + long(std::min(pos, s_.size())), '\n'));
  }

  static void add_text(std::vector<Item>& items, const std::string& t, int line) {
    if (!t.empty()) items.push_back({Item::kText, t, {}, line});
  }

  // After a tag's closer: '-' strips following whitespace; block and comment
  // ends eat one newline (trim_blocks) unless marked '+'.
  size_t after_tag(size_t pos, char end_sign, bool block) {
    if (end_sign == '-') {
      while (pos < s_.size() && ws(s_[pos])) ++pos;
    } else if (end_sign != '+' && block && pos < s_.size() && s_[pos] == '\n') {
      ++pos;
    }
    return pos;
  }

  size_t raw_block(size_t pos, std::vector<Item>& items, int line) {
    size_t q = pos;
    while (true) {
      const size_t t = s_.find("{%", q);
      if (t == std::string::npos) syntax(line, "missing endraw");
      size_t p = t + 2;
      const char sign = p < s_.size() && (s_[p] == '-' || s_[p] == '+') ? s_[p] : 0;
      if (sign) ++p;
      while (p < s_.size() && ws(s_[p])) ++p;
      if (s_.compare(p, 6, "endraw") == 0) {
        std::string text = s_.substr(pos, t - pos);
        if (sign == '-')
          while (!text.empty() && ws(text.back())) text.pop_back();
        add_text(items, text, line);
        p += 6;
        while (p < s_.size() && ws(s_[p])) ++p;
        char es = 0;
        if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) es = s_[p++];
        if (s_.compare(p, 2, "%}") != 0) syntax(line, "malformed endraw");
        return after_tag(p + 2, es, true);
      }
      q = t + 2;
    }
  }

  size_t lex_tag(size_t p, char closer, std::vector<Tok>& out, char& end_sign, int line) {
    int depth = 0;
    while (true) {
      while (p < s_.size() && ws(s_[p])) {
        if (s_[p] == '\n') ++line;
        ++p;
      }
      if (p >= s_.size()) syntax(line, "unterminated tag");
      const char c = s_[p];
      if (depth == 0) {
        if ((c == '-' || c == '+') && p + 2 < s_.size() + 0 && s_[p + 1] == closer && s_[p + 2] == '}') {
          end_sign = c;
          return p + 3;
        }
        if (c == closer && p + 1 < s_.size() && s_[p + 1] == '}') return p + 2;
      }
      Tok t;
      t.line = line;
      if (std::isalpha(uint8_t(c)) || c == '_') {
        size_t e = p;
        while (e < s_.size() && (std::isalnum(uint8_t(s_[e])) || s_[e] == '_')) ++e;
        t.k = Tok::kName;
        t.text = s_.substr(p, e - p);
        p = e;
      } else if (std::isdigit(uint8_t(c))) {
        size_t e = p;
        bool is_float = false;
        while (e < s_.size() && (std::isdigit(uint8_t(s_[e])) || s_[e] == '_')) ++e;
        if (e + 1 < s_.size() && s_[e] == '.' && std::isdigit(uint8_t(s_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < s_.size() && (std::isdigit(uint8_t(s_[e])) || s_[e] == '_')) ++e;
        }
        if (e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
          size_t x = e + 1;
          if (x < s_.size() && (s_[x] == '+' || s_[x] == '-')) ++x;
          if (x < s_.size() && std::isdigit(uint8_t(s_[x]))) {
            is_float = true;
            e = x;
            while (e < s_.size() && std::isdigit(uint8_t(s_[e]))) ++e;
          }
        }
        std::string num;
        for (size_t k = p; k < e; ++k)
          if (s_[k] != '_') num += s_[k];
        if (is_float) {
          t.k = Tok::kFloat;
          t.f = std::strtod(num.c_str(), nullptr);
        } else {
          t.k = Tok::kInt;
          t.i = std::strtoll(num.c_str(), nullptr, 10);
        }
        p = e;
      } else if (c == '"' || c == '\'') {
        t.k = Tok::kStr;
        p = lex_string(p, t.text, line);
      } else {
        static const char* const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                          ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        bool found = false;
        for (const char* op : ops) {
          const size_t n = std::strlen(op);
          if (s_.compare(p, n, op) == 0) {
            t.k = Tok::kOp;
            t.text = op;
            p += n;
            found = true;
            break;
          }
        }
        if (!found) syntax(line, std::string("unexpected character '") + c + "'");
        if (t.text == "(" || t.text == "[" || t.text == "{") ++depth;
        if (t.text == ")" || t.text == "]" || t.text == "}") --depth;
      }
      out.push_back(std::move(t));
    }
  }

  size_t lex_string(size_t p, std::string& out, int line) {
    const char q = s_[p++];
    while (true) {
      if (p >= s_.size()) syntax(line, "unterminated string");
      const char c = s_[p];
      if (c == q) return p + 1;
      if (c == '\\' && p + 1 < s_.size()) {
        const char e = s_[p + 1];
        p += 2;
        switch (e) {
          case 'n':
            out += '\n';
            break;
          case 't':
            out += '\t';
            break;
          case 'r':
            out += '\r';
            break;
          case '\\':
            out += '\\';
            break;
          case '\'':
            out += '\'';
            break;
          case '"':
            out += '"';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'v':
            out += '\v';
            break;
          case 'a':
            out += '\a';
            break;
          case '0':
            out += '\0';
            break;
          case '\n':
            break;
          case 'x':
          case 'u':
          case 'U': {
            const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            if (p + n > s_.size()) syntax(line, "truncated escape");
            const uint32_t cp = uint32_t(std::strtoul(s_.substr(p, n).c_str(), nullptr, 16));
            utf8::append(out, cp);
            p += n;
            break;
          }
          default:
            out += '\\';
            out += e;
        }
        continue;
      }
      out += c;
      ++p;
    }
  }
};

}  // namespace

// ================================================================ AST

struct Expr {
  enum Kind {
    kLit,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kPos,
    kNot,
    kBin,
    kAnd,
    kOr,
    kCmp,
    kCond,
    kList,
    kDictLit
  } k;
  Value lit;
  std::string name;                                               // name, attribute, filter/test/op
  std::vector<std::unique_ptr<Expr>> a;                           // operands / args / list items / dict keys+values
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kw;  // keyword args
  std::vector<std::string> ops;                                   // comparison chain
  bool negate = false;                                            // is not
  int line = 0;
};
using ExprP = std::unique_ptr<Expr>;

struct Stmt {
  enum Kind { kText, kOut, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kFilterBlock, kBlock } k;
  std::string text;                  // kText; kSet/kSetBlock/kMacro name; kFilterBlock filter name
  ExprP e;                           // kOut; kFor iterable; kSet value; kFor filter in e2
  ExprP e2;                          // kFor "if" filter; kSet namespace target object
  std::vector<std::string> targets;  // kFor loop variables; kSet tuple targets
  std::vector<std::pair<ExprP, std::vector<std::unique_ptr<Stmt>>>> branches;  // kIf
  std::vector<std::unique_ptr<Stmt>> body, else_body;
  std::vector<std::pair<std::string, ExprP>> params;  // kMacro (defaults may be null)
  std::string attr;                                   // kSet ns.attr
  int line = 0;
};
using StmtP = std::unique_ptr<Stmt>;

namespace {

// ================================================================ parser

class Parser {
 public:
  explicit Parser(std::vector<Item> items) : items_(std::move(items)) {}

  std::vector<StmtP> parse_all() {
    std::string end;
    auto body = parse_body({}, end);
    return body;
  }

 private:
  std::vector<Item> items_;
  size_t ip_ = 0;
  // current tag's tokens
  const std::vector<Tok>* toks_ = nullptr;
  size_t tp_ = 0;
  int line_ = 0;
  int depth_ = 0, block_depth_ = 0;

  const Tok& peek(size_t ahead = 0) const {
    static const Tok end;
    return tp_ + ahead < toks_->size() ? (*toks_)[tp_ + ahead] : end;
  }
  const Tok& next() {
    const Tok& t = peek();
    if (tp_ < toks_->size()) ++tp_;
    return t;
  }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).k == Tok::kOp && peek(ahead).text == op; }
  bool is_name(const char* n, size_t ahead = 0) const { return peek(ahead).k == Tok::kName && peek(ahead).text == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) syntax(line_, std::string("expected '") + op + "', got '" + peek().text + "'");
    next();
  }
  std::string expect_name() {
    if (peek().k != Tok::kName) syntax(line_, "expected a name, got '" + peek().text + "'");
    return next().text;
  }
  void expect_end() {
    if (peek().k != Tok::kEnd) syntax(line_, "unexpected '" + peek().text + "' at the end of the tag");
  }

  // Statements until a block tag whose first name is in `ends`; its name in end.
  std::vector<StmtP> parse_body(const std::vector<std::string>& ends, std::string& end) {
    std::vector<StmtP> out;
    while (ip_ < items_.size()) {
      Item& it = items_[ip_++];
      line_ = it.line;
      if (it.k == Item::kText) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::kText;
        s->text = it.text;
        out.push_back(std::move(s));
        continue;
      }
      toks_ = &it.toks;
      tp_ = 0;
      if (it.k == Item::kVar) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::kOut;
        s->line = line_;
        s->e = parse_expr();
        expect_end();
        out.push_back(std::move(s));
        continue;
      }
      const std::string kw = expect_name();
      if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
        end = kw;
        return out;
      }
      out.push_back(parse_statement(kw));
    }
    if (!ends.empty()) syntax(line_, "missing '" + ends.back() + "'");
    end.clear();
    return out;
  }

  StmtP parse_statement(const std::string& kw) {
    if (++block_depth_ > 200) syntax(line_, "statements nested too deeply");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{block_depth_};
    auto s = std::make_unique<Stmt>();
    s->line = line_;
    const int start_line = line_;
    std::string end;
    if (kw == "if") {
      s->k = Stmt::kIf;
      ExprP cond = parse_expr();
      expect_end();
      while (true) {
        auto body = parse_body({"elif", "else", "endif"}, end);
        s->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "elif") {
          cond = parse_expr();
          expect_end();
          continue;
        }
        if (end == "else") {
          expect_end();
          s->else_body = parse_body({"endif"}, end);
        }
        break;
      }
      if (end != "endif") syntax(start_line, "'if' without 'endif'");
    } else if (kw == "for") {
      s->k = Stmt::kFor;
      s->targets.push_back(expect_name());
      while (is_op(",")) {
        next();
        s->targets.push_back(expect_name());
      }
      if (!is_name("in")) syntax(line_, "expected 'in' in for loop");
      next();
      s->e = parse_ternary(false);
      if (is_name("if")) {
        next();
        s->e2 = parse_ternary(false);
      }
      if (is_name("recursive")) syntax(line_, "recursive loops are not supported");
      expect_end();
      s->body = parse_body({"else", "endfor"}, end);
      if (end == "else") {
        expect_end();
        s->else_body = parse_body({"endfor"}, end);
      }
      if (end != "endfor") syntax(start_line, "'for' without 'endfor'");
    } else if (kw == "set") {
      std::string first = expect_name();
      if (is_op(".")) {
        next();
        s->k = Stmt::kSet;
        s->text = first;
        s->attr = expect_name();
      } else {
        s->targets.push_back(first);
        while (is_op(",")) {
          next();
          s->targets.push_back(expect_name());
        }
        s->k = Stmt::kSet;
      }
      if (is_op("=")) {
        next();
        s->e = parse_tuple_or_expr();
        expect_end();
      } else {
        if (!s->attr.empty() || s->targets.size() != 1) syntax(line_, "block set takes one name");
        while (is_op("|")) {  // {% set x | filter %}
          next();
          s->params.emplace_back(expect_name(), nullptr);
        }
        expect_end();
        s->k = Stmt::kSetBlock;
        s->body = parse_body({"endset"}, end);
        if (end != "endset") syntax(start_line, "'set' without 'endset'");
      }
    } else if (kw == "macro") {
      s->k = Stmt::kMacro;
      s->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        std::string p = expect_name();
        ExprP dflt;
        if (is_op("=")) {
          next();
          dflt = parse_expr();
        }
        s->params.emplace_back(p, std::move(dflt));
        if (!is_op(")")) expect_op(",");
      }
      next();
      expect_end();
      s->body = parse_body({"endmacro"}, end);
      if (end != "endmacro") syntax(start_line, "'macro' without 'endmacro'");
    } else if (kw == "break" || kw == "continue") {
      s->k = kw == "break" ? Stmt::kBreak : Stmt::kContinue;
      expect_end();
    } else if (kw == "filter") {
      s->k = Stmt::kFilterBlock;
      s->text = expect_name();
      expect_end();
      s->body = parse_body({"endfilter"}, end);
      if (end != "endfilter") syntax(start_line, "'filter' without 'endfilter'");
    } else if (kw == "generation") {  // transformers' assistant-mask marker: renders its body
      s->k = Stmt::kBlock;
      expect_end();
      s->body = parse_body({"endgeneration"}, end);
      if (end != "endgeneration") syntax(start_line, "'generation' without 'endgeneration'");
    } else {
      fail(DZ_ERR_UNSUPPORTED, "chat template line ", line_, ": statement '", kw, "' is not supported");
    }
    return s;
  }

  ExprP make(Expr::Kind k) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line_;
    return e;
  }

  ExprP parse_tuple_or_expr() {
    ExprP first = parse_expr();
    if (!is_op(",")) return first;
    auto l = make(Expr::kList);
    l->a.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().k == Tok::kEnd) break;
      l->a.push_back(parse_expr());
    }
    return l;
  }

  ExprP parse_expr() { return parse_ternary(true); }

  ExprP parse_ternary(bool with_cond) {
    ExprP e = parse_or();
    while (with_cond && is_name("if")) {
      next();
      auto c = make(Expr::kCond);
      ExprP cond = parse_or();
      ExprP other;
      if (is_name("else")) {
        next();
        other = parse_ternary(true);
      }
      c->a.push_back(std::move(cond));
      c->a.push_back(std::move(e));
      c->a.push_back(std::move(other));  // may be null: undefined
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (is_name("or")) {
      next();
      auto o = make(Expr::kOr);
      o->a.push_back(std::move(l));
      o->a.push_back(parse_and());
      l = std::move(o);
    }
    return l;
  }

  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      next();
      auto o = make(Expr::kAnd);
      o->a.push_back(std::move(l));
      o->a.push_back(parse_not());
      l = std::move(o);
    }
    return l;
  }

  ExprP parse_not() {
    if (is_name("not")) {
      next();
      auto n = make(Expr::kNot);
      n->a.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprP parse_compare() {
    ExprP l = parse_math1();
    ExprP cmp;
    while (true) {
      std::string op;
      if (peek().k == Tok::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                   peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::kCmp);
        cmp->a.push_back(std::move(l));
      }
      cmp->ops.push_back(op);
      cmp->a.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(l);
  }

  ExprP bin(const std::string& op, ExprP l, ExprP r) {
    auto b = make(Expr::kBin);
    b->name = op;
    b->a.push_back(std::move(l));
    b->a.push_back(std::move(r));
    return b;
  }

  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().text;
      l = bin(op, std::move(l), parse_concat());
    }
    return l;
  }

  ExprP parse_concat() {
    ExprP l = parse_math2();
    while (is_op("~")) {
      next();
      l = bin("~", std::move(l), parse_math2());
    }
    return l;
  }

  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().text;
      l = bin(op, std::move(l), parse_pow());
    }
    return l;
  }

  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (is_op("**")) {
      next();
      l = bin("**", std::move(l), parse_unary(true));
    }
    return l;
  }

  ExprP parse_unary(bool with_filter) {
    // Bounded nesting: a hostile template cannot overflow the stack.
    struct Depth {
      int& d;
      Depth(int& x, int line) : d(x) {
        if (++d > 200) syntax(line, "expression nested too deeply");
      }
      ~Depth() { --d; }
    } guard(depth_, line_);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const bool neg = next().text == "-";
      e = make(neg ? Expr::kNeg : Expr::kPos);
      e->a.push_back(parse_unary(false));
    } else {
      e = parse_postfix(parse_primary());
    }
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprP parse_primary() {
    const Tok& t = peek();
    if (t.k == Tok::kName) {
      next();
      if (t.text == "true" || t.text == "True") return lit(Value::boolean(true));
      if (t.text == "false" || t.text == "False") return lit(Value::boolean(false));
      if (t.text == "none" || t.text == "None") return lit(Value::none());
      auto n = make(Expr::kName);
      n->name = t.text;
      return n;
    }
    if (t.k == Tok::kStr) {
      std::string s = next().text;
      while (peek().k == Tok::kStr) s += next().text;  // adjacent literals concatenate
      return lit(Value::str(s));
    }
    if (t.k == Tok::kInt) return lit(Value::integer(next().i));
    if (t.k == Tok::kFloat) return lit(Value::real(next().f));
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        return make(Expr::kList);
      }
      ExprP e = parse_expr();
      if (is_op(",")) {  // tuple
        auto l = make(Expr::kList);
        l->a.push_back(std::move(e));
        while (is_op(",")) {
          next();
          if (is_op(")")) break;
          l->a.push_back(parse_expr());
        }
        e = std::move(l);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto l = make(Expr::kList);
      while (!is_op("]")) {
        l->a.push_back(parse_expr());
        if (!is_op("]")) expect_op(",");
      }
      next();
      return l;
    }
    if (is_op("{")) {
      next();
      auto d = make(Expr::kDictLit);
      while (!is_op("}")) {
        d->a.push_back(parse_expr());
        expect_op(":");
        d->a.push_back(parse_expr());
        if (!is_op("}")) expect_op(",");
      }
      next();
      return d;
    }
    syntax(line_, "unexpected '" + (t.k == Tok::kEnd ? std::string("end of tag") : t.text) + "'");
  }

  ExprP lit(Value v) {
    auto e = make(Expr::kLit);
    e->lit = std::move(v);
    return e;
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().k == Tok::kName && is_op("=", 1)) {
        std::string k = next().text;
        next();
        call.kw.emplace_back(k, parse_expr());
      } else {
        call.a.push_back(parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    next();
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        next();
        auto a = make(Expr::kAttr);
        if (peek().k == Tok::kInt)
          a->name = std::to_string(next().i);
        else
          a->name = expect_name();
        a->a.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        next();
        ExprP idx[3];
        bool slice = false;
        for (int part = 0; part < 3; ++part) {
          if (!is_op(":") && !is_op("]")) idx[part] = parse_expr();
          if (is_op(":") && part < 2) {
            next();
            slice = true;
            continue;
          }
          break;
        }
        expect_op("]");
        if (!slice && !idx[0]) syntax(line_, "empty subscript '[]'");
        if (slice) {
          auto s = make(Expr::kSlice);
          s->a.push_back(std::move(e));
          for (auto& x : idx) s->a.push_back(std::move(x));
          e = std::move(s);
        } else {
          auto it = make(Expr::kItem);
          it->a.push_back(std::move(e));
          it->a.push_back(std::move(idx[0]));
          e = std::move(it);
        }
      } else if (is_op("(")) {
        auto c = make(Expr::kCall);
        c->a.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprP parse_filter_expr(ExprP e) {
    while (true) {
      if (is_op("|")) {
        next();
        auto f = make(Expr::kFilter);
        f->name = expect_name();
        f->a.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        next();
        auto t = make(Expr::kTest);
        if (is_name("not")) {
          next();
          t->negate = true;
        }
        t->name = expect_name();
        t->a.push_back(std::move(e));
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((peek().k == Tok::kName || peek().k == Tok::kStr || peek().k == Tok::kInt ||
                    peek().k == Tok::kFloat || is_op("[") || is_op("{") || is_op("(")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          t->a.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
};

// ================================================================ interpreter

struct Frame {
  std::vector<std::pair<std::string, Value>> vars;
  std::shared_ptr<Frame> parent;
  Value* find(const std::string& n) {
    for (Frame* f = this; f; f = f->parent.get())
      for (auto& kv : f->vars)
        if (kv.first == n) return &kv.second;
    return nullptr;
  }
  void set(const std::string& n, Value v) {
    for (auto& kv : vars)
      if (kv.first == n) {
        kv.second = std::move(v);
        return;
      }
    vars.emplace_back(n, std::move(v));
  }
};
using FrameP = std::shared_ptr<Frame>;

enum class Flow { kNormal, kBreak, kContinue };

struct Interp {
  std::tm now{};
  FrameP frame;
  int depth = 0;

  Value eval(const Expr& e);
  Flow exec(const std::vector<StmtP>& body, std::string& out);
  Flow exec1(const Stmt& s, std::string& out);
  Value call(const Value& f, Args& args, int line);
  Value filter(const std::string& name, Value v, Args& args, int line);
  bool test(const std::string& name, const Value& v, Args& args, int line);
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  Value method(const Value& obj, const std::string& name);
  Value binop(const std::string& op, const Value& a, const Value& b);
};

Value Interp::method(const Value& obj, const std::string& name) {
  auto bind = [&](auto body) {
    Value self = obj;
    return Value::func([self, body](Interp& in, Args& a) { return body(in, self, a); });
  };
  if (obj.k == Value::kStr) {
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return bind([name](Interp&, const Value& s, Args& a) {
        return Value::str(strip(s.sv(), a.get(0, "chars"), name != "rstrip", name != "lstrip"));
      });
    if (name == "upper" || name == "lower")
      return bind([name](Interp&, const Value& s, Args&) {
        std::string r = s.sv();
        for (auto& c : r) c = char(name == "upper" ? std::toupper(uint8_t(c)) : std::tolower(uint8_t(c)));
        return Value::str(r);
      });
    if (name == "startswith" || name == "endswith")
      return bind([name](Interp&, const Value& s, Args& a) {
        Value p = a.get(0, "prefix");
        List cands = p.k == Value::kList ? *p.l : List{p};
        for (const auto& c : cands) {
          if (c.k != Value::kStr) error(name + " arg must be str");
          const std::string& x = c.sv();
          const bool hit = name == "startswith" ? s.sv().rfind(x, 0) == 0
                                                : s.sv().size() >= x.size() &&
                                                      s.sv().compare(s.sv().size() - x.size(), x.size(), x) == 0;
          if (hit) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "replace")
      return bind([](Interp&, const Value& s, Args& a) {
        Value c = a.get(2, "count", Value::integer(-1));
        return Value::str(replace_all(s.sv(), to_str(a.get(0, "old")), to_str(a.get(1, "new")), c.i));
      });
    if (name == "split" || name == "rsplit")
      return bind([name](Interp&, const Value& s, Args& a) {
        Value sep = a.get(0, "sep", Value::none());
        int64_t maxsplit = a.get(1, "maxsplit", Value::integer(-1)).i;
        List out;
        const std::string& str = s.sv();
        if (sep.k != Value::kStr) {  // whitespace runs
          std::vector<std::string> parts;
          size_t i = 0;
          while (i < str.size()) {
            while (i < str.size() && ws(str[i])) ++i;
            if (i >= str.size()) break;
            size_t j = i;
            while (j < str.size() && !ws(str[j])) ++j;
            if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
              std::string rest = str.substr(i);
              while (!rest.empty() && ws(rest.back())) rest.pop_back();
              parts.push_back(rest);
              break;
            }
            parts.push_back(str.substr(i, j - i));
            i = j;
          }
          for (auto& p : parts) out.push_back(Value::str(p));
          return Value::list(out);
        }
        if (sep.sv().empty()) error("split: empty separator");
        size_t pos = 0;
        int64_t n = 0;
        while (maxsplit < 0 || n < maxsplit) {
          const size_t f = str.find(sep.sv(), pos);
          if (f == std::string::npos) break;
          out.push_back(Value::str(str.substr(pos, f - pos)));
          pos = f + sep.sv().size();
          ++n;
        }
        out.push_back(Value::str(str.substr(pos)));
        return Value::list(out);
      });
    if (name == "join")
      return bind([](Interp&, const Value& s, Args& a) {
        std::string r;
        List items = iterate(a.get(0, "iterable"));
        for (size_t i = 0; i < items.size(); ++i) r += (i ? s.sv() : "") + to_str(items[i]);
        return Value::str(r);
      });
    if (name == "find" || name == "count")
      return bind([name](Interp&, const Value& s, Args& a) {
        const std::string x = to_str(a.get(0, "sub"));
        if (name == "find") {
          const size_t f = s.sv().find(x);
          return Value::integer(f == std::string::npos ? -1 : int64_t(cp_bounds(s.sv().substr(0, f)).size() - 1));
        }
        int64_t n = 0;
        for (size_t p = s.sv().find(x); p != std::string::npos && !x.empty(); p = s.sv().find(x, p + x.size())) ++n;
        return Value::integer(n);
      });
    if (name == "title" || name == "capitalize")
      return bind([name](Interp&, const Value& s, Args&) {
        std::string r = s.sv();
        bool start = true;
        for (auto& c : r) {
          const bool alpha = std::isalpha(uint8_t(c));
          if (name == "capitalize")
            c = char(start ? std::toupper(uint8_t(c)) : std::tolower(uint8_t(c)));
          else
            c = char(start && alpha ? std::toupper(uint8_t(c)) : alpha ? std::tolower(uint8_t(c)) : c);
          start = name == "capitalize" ? false : !alpha;
        }
        return Value::str(r);
      });
    if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum")
      return bind([name](Interp&, const Value& s, Args&) {
        if (s.sv().empty()) return Value::boolean(false);
        for (char c : s.sv()) {
          const auto u = uint8_t(c);
          const bool ok = name == "isdigit"   ? std::isdigit(u)
                          : name == "isspace" ? ws(c)
                          : name == "isalpha" ? std::isalpha(u)
                                              : std::isalnum(u);
          if (!ok) return Value::boolean(false);
        }
        return Value::boolean(true);
      });
    return Value::undef(name);
  }
  if (obj.k == Value::kDict) {
    if (name == "items")
      return bind([](Interp&, const Value& d, Args&) {
        List l;
        for (auto& kv : d.d->items) l.push_back(Value::list({Value::str(kv.first), kv.second}));
        return Value::list(l);
      });
    if (name == "keys" || name == "values")
      return bind([name](Interp&, const Value& d, Args&) {
        List l;
        for (auto& kv : d.d->items) l.push_back(name == "keys" ? Value::str(kv.first) : kv.second);
        return Value::list(l);
      });
    if (name == "get")
      return bind([](Interp&, const Value& d, Args& a) {
        Value k = a.get(0, "key");
        Value* v = k.k == Value::kStr ? d.d->find(k.sv()) : nullptr;
        return v ? *v : a.get(1, "default", Value::none());
      });
    if (name == "copy")
      return bind([](Interp&, const Value& d, Args&) {
        Value c = Value::dict();
        *c.d = *d.d;
        return c;
      });
  }
  if (obj.k == Value::kList) {
    if (name == "index")
      return bind([](Interp&, const Value& l, Args& a) {
        Value x = a.get(0, "value");
        for (size_t i = 0; i < l.l->size(); ++i)
          if (equal((*l.l)[i], x)) return Value::integer(int64_t(i));
        error(repr(x) + " is not in list");
      });
    if (name == "count")
      return bind([](Interp&, const Value& l, Args& a) {
        int64_t n = 0;
        for (auto& x : *l.l) n += equal(x, a.get(0, "value"));
        return Value::integer(n);
      });
  }
  return Value::undef(name);
}

// Jinja's environment.getattr: Python attribute first, then item.
Value Interp::getattr(const Value& obj, const std::string& name) {
  if (obj.undefined()) undefined_error(obj);
  if (obj.k == Value::kNs) {
    Value* v = obj.d->find(name);
    return v ? *v : Value::undef(name);
  }
  Value m = method(obj, name);
  if (!m.undefined()) return m;
  if (obj.k == Value::kDict) {
    Value* v = obj.d->find(name);
    return v ? *v : Value::undef(name);
  }
  return Value::undef(name);
}

// Jinja's environment.getitem: item first, then (for a string key) attribute.
Value Interp::getitem(const Value& obj, const Value& key) {
  if (obj.undefined()) undefined_error(obj);
  if (obj.k == Value::kDict || obj.k == Value::kNs) {
    if (key.k == Value::kStr) {
      if (Value* v = obj.d->find(key.sv())) return *v;
      return obj.k == Value::kDict ? getattr(obj, key.sv()) : Value::undef(key.sv());
    }
    return Value::undef(to_str(key));
  }
  if ((obj.k == Value::kList || obj.k == Value::kStr) && (key.k == Value::kInt || key.k == Value::kBool)) {
    int64_t i = key.k == Value::kBool ? key.b : key.i;
    if (obj.k == Value::kList) {
      const int64_t n = int64_t(obj.l->size());
      if (i < 0) i += n;
      return i >= 0 && i < n ? (*obj.l)[size_t(i)] : Value::undef(to_str(key));
    }
    const auto b = cp_bounds(obj.sv());
    const int64_t n = int64_t(b.size()) - 1;
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undef(to_str(key));
    return Value::str(obj.sv().substr(b[size_t(i)], b[size_t(i) + 1] - b[size_t(i)]));
  }
  if (key.k == Value::kStr) return getattr(obj, key.sv());
  return Value::undef(to_str(key));
}

// 64-bit integer arithmetic that says so instead of overflowing (Python's
// ints would grow; no chat template needs that).
int64_t int_op(char op, int64_t a, int64_t b) {
  int64_t r = 0;
  const bool overflow = op == '+'   ? __builtin_add_overflow(a, b, &r)
                        : op == '-' ? __builtin_sub_overflow(a, b, &r)
                                    : __builtin_mul_overflow(a, b, &r);
  if (overflow) error("integer overflow");
  return r;
}

// int(x) of a float: truncation, an error where no int64 holds it (NaN, inf, beyond 2^63).
int64_t float_to_int(double x) {
  if (!(x >= -9223372036854775808.0 && x < 9223372036854775808.0)) error("cannot convert " + py_float(x) + " to int");
  return int64_t(x);
}

Value Interp::binop(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string l = to_str(a), r = to_str(b);
    check_size(l.size() + r.size());
    return Value::str(l + r);
  }
  if (a.undefined()) undefined_error(a);
  if (b.undefined()) undefined_error(b);
  const bool ints = (a.k == Value::kInt || a.k == Value::kBool) && (b.k == Value::kInt || b.k == Value::kBool);
  auto iv = [](const Value& v) { return v.k == Value::kBool ? int64_t(v.b) : v.i; };
  if (op == "+") {
    if (a.k == Value::kStr && b.k == Value::kStr) {
      check_size(a.sv().size() + b.sv().size());
      return Value::str(a.sv() + b.sv());
    }
    if (a.k == Value::kList && b.k == Value::kList) {
      check_size(a.l->size() + b.l->size());
      List l = *a.l;
      l.insert(l.end(), b.l->begin(), b.l->end());
      return Value::list(l);
    }
    if (ints) return Value::integer(int_op('+', iv(a), iv(b)));
    if (a.is_num() && b.is_num()) return Value::real(a.num() + b.num());
  } else if (op == "-") {
    if (ints) return Value::integer(int_op('-', iv(a), iv(b)));
    if (a.is_num() && b.is_num()) return Value::real(a.num() - b.num());
  } else if (op == "*") {
    if (ints) return Value::integer(int_op('*', iv(a), iv(b)));
    if (a.is_num() && b.is_num()) return Value::real(a.num() * b.num());
    const Value* s = a.k == Value::kStr || a.k == Value::kList   ? &a
                     : b.k == Value::kStr || b.k == Value::kList ? &b
                                                                 : nullptr;
    const Value* n = s == &a ? &b : &a;
    if (s && (n->k == Value::kInt || n->k == Value::kBool)) {
      const int64_t times = std::max<int64_t>(0, iv(*n));
      const size_t each = s->k == Value::kStr ? s->sv().size() : s->l->size();
      if (each && uint64_t(times) > kMaxSize / each) check_size(kMaxSize + 1);
      if (s->k == Value::kStr) {
        std::string r;
        for (int64_t i = 0; i < times; ++i) r += s->sv();
        return Value::str(r);
      }
      List l;
      for (int64_t i = 0; i < times; ++i) l.insert(l.end(), s->l->begin(), s->l->end());
      return Value::list(l);
    }
  } else if (op == "/") {
    if (a.is_num() && b.is_num()) {
      if (b.num() == 0) error("division by zero");
      return Value::real(a.num() / b.num());
    }
  } else if (op == "//" || op == "%") {
    if (ints) {
      if (iv(b) == 0) error("integer division or modulo by zero");
      if (iv(b) == -1 && iv(a) == INT64_MIN) error("integer overflow");
      int64_t q = iv(a) / iv(b), r = iv(a) % iv(b);
      if (r != 0 && ((r < 0) != (iv(b) < 0))) {
        --q;
        r += iv(b);
      }
      return Value::integer(op == "//" ? q : r);
    }
    if (a.is_num() && b.is_num()) {
      if (b.num() == 0) error("float division or modulo by zero");
      const double q = std::floor(a.num() / b.num());
      return Value::real(op == "//" ? q : a.num() - q * b.num());
    }
  } else if (op == "**") {
    if (ints && iv(b) >= 0) {
      // By squaring: 64 steps at most, and an overflow is an error.
      int64_t base = iv(a), e = iv(b), r = 1;
      while (e > 0) {
        if (e & 1) r = int_op('*', r, base);
        e >>= 1;
        if (e) base = int_op('*', base, base);
      }
      return Value::integer(r);
    }
    if (a.is_num() && b.is_num()) return Value::real(std::pow(a.num(), b.num()));
  }
  error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

Value slice(const Value& obj, const Value& lo, const Value& hi, const Value& st) {
  auto opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.k == Value::kNone || v.k == Value::kUndef) return std::nullopt;
    if (v.k != Value::kInt && v.k != Value::kBool) error(std::string("slice ") + what + " must be an integer");
    return v.k == Value::kBool ? v.b : v.i;
  };
  std::vector<size_t> bounds;
  int64_t n;
  if (obj.k == Value::kList)
    n = int64_t(obj.l->size());
  else if (obj.k == Value::kStr) {
    bounds = cp_bounds(obj.sv());
    n = int64_t(bounds.size()) - 1;
  } else if (obj.undefined())
    undefined_error(obj);
  else
    error(std::string("'") + type_name(obj) + "' object is not subscriptable");
  const int64_t step = opt(st, "step").value_or(1);
  if (step == 0) error("slice step cannot be zero");
  auto norm = [&](std::optional<int64_t> v, int64_t dflt, bool is_hi) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    (void)is_hi;
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t a = norm(opt(lo, "start"), step > 0 ? 0 : n - 1, false);
  const int64_t b = norm(opt(hi, "stop"), step > 0 ? n : -1, true);
  std::vector<int64_t> idx;
  if (step > 0)
    for (int64_t i = a; i < b; i += step) idx.push_back(i);
  else
    for (int64_t i = a; i > b; i += step) idx.push_back(i);
  if (obj.k == Value::kList) {
    List l;
    for (int64_t i : idx) l.push_back((*obj.l)[size_t(i)]);
    return Value::list(l);
  }
  std::string s;
  for (int64_t i : idx) s.append(obj.sv(), bounds[size_t(i)], bounds[size_t(i) + 1] - bounds[size_t(i)]);
  return Value::str(s);
}

Value Interp::eval(const Expr& e) {
  switch (e.k) {
    case Expr::kLit:
      return e.lit;
    case Expr::kName: {
      if (Value* v = frame->find(e.name)) return *v;
      return Value::undef(e.name);
    }
    case Expr::kAttr:
      return getattr(eval(*e.a[0]), e.name);
    case Expr::kItem:
      return getitem(eval(*e.a[0]), eval(*e.a[1]));
    case Expr::kSlice: {
      Value o = eval(*e.a[0]);
      Value parts[3];
      for (int i = 0; i < 3; ++i) parts[i] = e.a[size_t(i) + 1] ? eval(*e.a[size_t(i) + 1]) : Value::none();
      return slice(o, parts[0], parts[1], parts[2]);
    }
    case Expr::kCall: {
      Value f = eval(*e.a[0]);
      Args args;
      for (size_t i = 1; i < e.a.size(); ++i) args.pos.push_back(eval(*e.a[i]));
      for (const auto& [k, x] : e.kw) args.kw.emplace_back(k, eval(*x));
      return call(f, args, e.line);
    }
    case Expr::kFilter: {
      Value v = eval(*e.a[0]);
      Args args;
      for (size_t i = 1; i < e.a.size(); ++i) args.pos.push_back(eval(*e.a[i]));
      for (const auto& [k, x] : e.kw) args.kw.emplace_back(k, eval(*x));
      return filter(e.name, std::move(v), args, e.line);
    }
    case Expr::kTest: {
      Value v = eval(*e.a[0]);
      Args args;
      for (size_t i = 1; i < e.a.size(); ++i) args.pos.push_back(eval(*e.a[i]));
      for (const auto& [k, x] : e.kw) args.kw.emplace_back(k, eval(*x));
      return Value::boolean(test(e.name, v, args, e.line) != e.negate);
    }
    case Expr::kNeg:
    case Expr::kPos: {
      Value v = eval(*e.a[0]);
      if (!v.is_num()) {
        if (v.undefined()) undefined_error(v);
        error(std::string("bad operand type for unary ") + (e.k == Expr::kNeg ? "-" : "+") + ": '" + type_name(v) +
              "'");
      }
      if (e.k == Expr::kPos) return v;
      return v.k == Value::kFloat ? Value::real(-v.f) : Value::integer(int_op('-', 0, v.k == Value::kBool ? v.b : v.i));
    }
    case Expr::kNot:
      return Value::boolean(!truthy(eval(*e.a[0])));
    case Expr::kBin:
      return binop(e.name, eval(*e.a[0]), eval(*e.a[1]));
    case Expr::kAnd: {
      Value l = eval(*e.a[0]);
      return truthy(l) ? eval(*e.a[1]) : l;
    }
    case Expr::kOr: {
      Value l = eval(*e.a[0]);
      return truthy(l) ? l : eval(*e.a[1]);
    }
    case Expr::kCmp: {
      Value l = eval(*e.a[0]);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value r = eval(*e.a[i + 1]);
        const std::string& op = e.ops[i];
        bool ok;
        if (op == "==")
          ok = equal(l, r);
        else if (op == "!=")
          ok = !equal(l, r);
        else if (op == "in")
          ok = contains(r, l);
        else if (op == "notin")
          ok = !contains(r, l);
        else {
          const int c = compare(l, r, op.c_str());
          ok = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
        }
        if (!ok) return Value::boolean(false);
        l = std::move(r);
      }
      return Value::boolean(true);
    }
    case Expr::kCond: {
      if (truthy(eval(*e.a[0]))) return eval(*e.a[1]);
      return e.a[2] ? eval(*e.a[2]) : Value::undef("");
    }
    case Expr::kList: {
      List l;
      for (const auto& x : e.a) l.push_back(eval(*x));
      return Value::list(l);
    }
    case Expr::kDictLit: {
      Value d = Value::dict();
      for (size_t i = 0; i + 1 < e.a.size(); i += 2) {
        Value k = eval(*e.a[i]);
        if (k.k != Value::kStr) error("dict keys must be strings in this implementation");
        d.d->set(k.sv(), eval(*e.a[i + 1]));
      }
      return d;
    }
  }
  return Value();
}

Value Interp::call(const Value& f, Args& args, int line) {
  if (f.k != Value::kFunc) {
    if (f.undefined()) undefined_error(f);
    error(std::string("'") + type_name(f) + "' object is not callable (line " + std::to_string(line) + ")");
  }
  return (*f.fn)(*this, args);
}

Value do_map_attr(Interp& in, const Value& item, const std::string& attr) {
  Value cur = item;
  size_t p = 0;
  while (true) {  // dotted attribute paths
    const size_t dot = attr.find('.', p);
    const std::string part = attr.substr(p, dot == std::string::npos ? std::string::npos : dot - p);
    const bool digits =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(uint8_t(c)); });
    cur = digits ? in.getitem(cur, Value::integer(std::stoll(part))) : in.getitem(cur, Value::str(part));
    if (dot == std::string::npos) return cur;
    p = dot + 1;
  }
}

Value Interp::filter(const std::string& name, Value v, Args& a, int line) {
  if (name == "length" || name == "count") return Value::integer(length(v));
  if (name == "tojson") {
    Value ind = a.get(0, "indent", Value::none());
    const int indent = ind.k == Value::kInt ? int(ind.i) : -1;
    std::string item_sep = indent >= 0 ? "," : ", ", key_sep = ": ";
    Value seps = a.get(99, "separators", Value::none());
    if (seps.k == Value::kList && seps.l->size() == 2) {
      item_sep = to_str((*seps.l)[0]);
      key_sep = to_str((*seps.l)[1]);
    }
    std::string o;
    to_json(v, o, indent, 0, item_sep, key_sep, truthy(a.get(99, "sort_keys", Value::boolean(false))));
    return Value::str(o);
  }
  if (name == "trim") return Value::str(strip(to_str(v), a.get(0, "chars", Value::none()), true, true));
  if (name == "string") return Value::str(to_str(v));
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    Value s = Value::str(to_str(v));
    Args none;
    return call(method(s, name), none, line);
  }
  if (name == "replace") {
    Value c = a.get(2, "count", Value::none());
    return Value::str(
        replace_all(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")), c.k == Value::kInt ? c.i : -1));
  }
  if (name == "join") {
    Value attr = a.get(1, "attribute", Value::none());
    std::string sep = to_str(a.get(0, "d", Value::str("")));
    std::string r;
    List items = iterate(v);
    for (size_t i = 0; i < items.size(); ++i)
      r += (i ? sep : "") + to_str(attr.k == Value::kStr ? do_map_attr(*this, items[i], attr.sv()) : items[i]);
    return Value::str(r);
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
    if (v.undefined() || (boolean && !truthy(v))) return a.get(0, "default_value", Value::str(""));
    return v;
  }
  if (name == "first" || name == "last") {
    List l = iterate(v);
    if (l.empty()) return Value::undef(name);
    return name == "first" ? l.front() : l.back();
  }
  if (name == "list") return Value::list(iterate(v));
  if (name == "reverse") {
    if (v.k == Value::kStr) return slice(v, Value::none(), Value::none(), Value::integer(-1));
    List l = iterate(v);
    std::reverse(l.begin(), l.end());
    return Value::list(l);
  }
  if (name == "int") {
    if (v.k == Value::kInt) return v;
    if (v.k == Value::kBool) return Value::integer(v.b);
    if (v.k == Value::kFloat) return Value::integer(float_to_int(v.f));
    if (v.k == Value::kStr) {
      char* end = nullptr;
      const std::string t = strip(v.sv(), Value::none(), true, true);
      const long long x = std::strtoll(t.c_str(), &end, 10);
      if (end && *end == '\0' && !t.empty()) return Value::integer(x);
      const double d = std::strtod(t.c_str(), &end);
      if (end && *end == '\0' && !t.empty()) return Value::integer(float_to_int(d));
    }
    return a.get(0, "default", Value::integer(0));
  }
  if (name == "float") {
    if (v.is_num()) return Value::real(v.num());
    if (v.k == Value::kStr) {
      char* end = nullptr;
      const std::string t = strip(v.sv(), Value::none(), true, true);
      const double d = std::strtod(t.c_str(), &end);
      if (end && *end == '\0' && !t.empty()) return Value::real(d);
    }
    return a.get(0, "default", Value::real(0));
  }
  if (name == "abs") {
    if (v.k == Value::kFloat) return Value::real(std::fabs(v.f));
    if (v.is_num()) {
      const int64_t x = v.k == Value::kBool ? v.b : v.i;
      return Value::integer(x < 0 ? int_op('-', 0, x) : x);
    }
    error("abs of a non-number");
  }
  if (name == "round") {
    const int64_t prec = a.get(0, "precision", Value::integer(0)).i;
    const std::string m = to_str(a.get(1, "method", Value::str("common")));
    const double p = std::pow(10.0, double(prec));
    double x = v.num() * p;
    x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::round(x);
    return Value::real(x / p);
  }
  if (name == "items") {
    if (v.undefined()) return Value::list();
    Args none;
    return call(method(v, "items"), none, line);
  }
  if (name == "unique") {
    List out;
    for (auto& x : iterate(v))
      if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equal(x, y); })) out.push_back(x);
    return Value::list(out);
  }
  if (name == "sort" || name == "dictsort") {
    List l = iterate(name == "dictsort" ? call(method(v, "items"), a, line) : v);
    const bool rev = truthy(a.get(0, "reverse", Value::boolean(false)));
    Value attr = a.get(2, "attribute", Value::none());
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      const Value kx = attr.k == Value::kStr ? do_map_attr(*this, x, attr.sv()) : x;
      const Value ky = attr.k == Value::kStr ? do_map_attr(*this, y, attr.sv()) : y;
      return rev ? compare(ky, kx, "<") < 0 : compare(kx, ky, "<") < 0;
    });
    return Value::list(l);
  }
  if (name == "map") {
    List out;
    Value attr = a.get(99, "attribute", Value::none());
    for (auto& x : iterate(v)) {
      if (attr.k == Value::kStr) {
        Value r = do_map_attr(*this, x, attr.sv());
        if (r.undefined()) r = a.get(99, "default", r);
        out.push_back(r);
      } else {
        Args fa;
        fa.pos.assign(a.pos.begin() + (a.pos.empty() ? 0 : 1), a.pos.end());
        out.push_back(filter(to_str(a.get(0, "filter")), x, fa, line));
      }
    }
    return Value::list(out);
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    const bool by_attr = name.ends_with("attr");
    const bool want = name.starts_with("select");
    List out;
    for (auto& x : iterate(v)) {
      Value subject = by_attr ? do_map_attr(*this, x, to_str(a.pos.at(0))) : x;
      const size_t tpos = by_attr ? 1 : 0;
      bool ok;
      if (a.pos.size() > tpos) {
        Args ta;
        ta.pos.assign(a.pos.begin() + long(tpos) + 1, a.pos.end());
        ok = test(to_str(a.pos[tpos]), subject, ta, line);
      } else {
        ok = truthy(subject);
      }
      if (ok == want) out.push_back(x);
    }
    return Value::list(out);
  }
  if (name == "indent") {
    const Value w = a.get(0, "width", Value::integer(4));
    const std::string pad = w.k == Value::kStr ? w.sv() : std::string(size_t(std::max<int64_t>(0, w.i)), ' ');
    const bool first = truthy(a.get(1, "first", Value::boolean(false)));
    const bool blank = truthy(a.get(2, "blank", Value::boolean(false)));
    const std::string s = to_str(v);
    std::string o;
    size_t p = 0;
    bool is_first = true;
    while (true) {
      const size_t nl = s.find('\n', p);
      const std::string ln = s.substr(p, nl == std::string::npos ? std::string::npos : nl - p);
      if ((is_first ? first : true) && (blank || !ln.empty()) && !(is_first && !first)) o += pad;
      o += ln;
      if (nl == std::string::npos) break;
      o += '\n';
      p = nl + 1;
      is_first = false;
    }
    return Value::str(o);
  }
  if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") {
    if (name == "safe") return v;
    const std::string s = to_str(v);
    std::string o;
    for (char c : s) {
      switch (c) {
        case '&':
          o += "&amp;";
          break;
        case '<':
          o += "&lt;";
          break;
        case '>':
          o += "&gt;";
          break;
        case '"':
          o += "&#34;";
          break;
        case '\'':
          o += "&#39;";
          break;
        default:
          o += c;
      }
    }
    return Value::str(o);
  }
  if (name == "sum") {
    Value acc = a.get(1, "start", Value::integer(0));
    Value attr = a.get(0, "attribute", Value::none());
    for (auto& x : iterate(v)) acc = binop("+", acc, attr.k == Value::kStr ? do_map_attr(*this, x, attr.sv()) : x);
    return acc;
  }
  if (name == "min" || name == "max") {
    List l = iterate(v);
    if (l.empty()) return Value::undef(name);
    Value best = l[0];
    for (auto& x : l)
      if (name == "min" ? compare(x, best, "<") < 0 : compare(x, best, ">") > 0) best = x;
    return best;
  }
  if (name == "wordcount") {
    Args none;
    return Value::integer(length(call(method(Value::str(to_str(v)), "split"), none, line)));
  }
  error("unknown filter '" + name + "' (line " + std::to_string(line) + ")");
}

bool Interp::test(const std::string& name, const Value& v, Args& a, int line) {
  if (name == "defined") return !v.undefined();
  if (name == "undefined") return v.undefined();
  if (name == "none") return v.k == Value::kNone;
  if (name == "boolean") return v.k == Value::kBool;
  if (name == "true") return v.k == Value::kBool && v.b;
  if (name == "false") return v.k == Value::kBool && !v.b;
  if (name == "integer") return v.k == Value::kInt;
  if (name == "float") return v.k == Value::kFloat;
  if (name == "number") return v.is_num();
  if (name == "string") return v.k == Value::kStr;
  if (name == "mapping") return v.k == Value::kDict;
  if (name == "iterable") return v.k == Value::kList || v.k == Value::kDict || v.k == Value::kStr || v.undefined();
  if (name == "sequence") return v.k == Value::kList || v.k == Value::kDict || v.k == Value::kStr;
  if (name == "callable") return v.k == Value::kFunc;
  if (name == "odd" || name == "even") {
    if (v.k != Value::kInt) error("odd/even test of a non-integer");
    return (v.i % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const Value d = a.get(0, "num");
    if (v.k != Value::kInt || d.k != Value::kInt || d.i == 0) error("divisibleby needs integers");
    return v.i % d.i == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, a.get(0, "other"));
  if (name == "ne" || name == "!=") return !equal(v, a.get(0, "other"));
  if (name == "lt" || name == "lessthan") return compare(v, a.get(0, "other"), "<") < 0;
  if (name == "le") return compare(v, a.get(0, "other"), "<=") <= 0;
  if (name == "gt" || name == "greaterthan") return compare(v, a.get(0, "other"), ">") > 0;
  if (name == "ge") return compare(v, a.get(0, "other"), ">=") >= 0;
  if (name == "in") return contains(a.get(0, "seq"), v);
  if (name == "sameas") {
    const Value o = a.get(0, "other");
    if (v.k != o.k) return false;
    if (v.k == Value::kNone || v.k == Value::kUndef) return true;
    if (v.k == Value::kBool) return v.b == o.b;
    return v.l == o.l && v.d == o.d && v.s == o.s && v.fn == o.fn && v.i == o.i;
  }
  if (name == "lower" || name == "upper") {
    if (v.k != Value::kStr) return false;
    const std::string& s = v.sv();
    return std::none_of(s.begin(), s.end(),
                        [&](char c) { return name == "lower" ? std::isupper(uint8_t(c)) : std::islower(uint8_t(c)); });
  }
  error("unknown test '" + name + "' (line " + std::to_string(line) + ")");
}

Flow Interp::exec(const std::vector<StmtP>& body, std::string& out) {
  for (const auto& s : body) {
    const Flow f = exec1(*s, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

void assign(Frame& f, const std::vector<std::string>& targets, const Value& v) {
  if (targets.size() == 1) {
    f.set(targets[0], v);
    return;
  }
  List items = iterate(v);
  if (items.size() != targets.size())
    error("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()) +
          " names");
  for (size_t i = 0; i < targets.size(); ++i) f.set(targets[i], items[i]);
}

Flow Interp::exec1(const Stmt& s, std::string& out) {
  switch (s.k) {
    case Stmt::kText:
      out += s.text;
      check_size(out.size());
      return Flow::kNormal;
    case Stmt::kOut:
      out += to_str(eval(*s.e));
      check_size(out.size());
      return Flow::kNormal;
    case Stmt::kIf:
      for (const auto& [cond, body] : s.branches)
        if (truthy(eval(*cond))) return exec(body, out);
      return exec(s.else_body, out);
    case Stmt::kFor: {
      List all = iterate(eval(*s.e));
      List items;
      if (s.e2) {  // the "if" filter runs before the loop (loop.length counts filtered items)
        for (auto& x : all) {
          auto f = std::make_shared<Frame>();
          f->parent = frame;
          assign(*f, s.targets, x);
          FrameP saved = frame;
          frame = f;
          const bool keep = truthy(eval(*s.e2));
          frame = saved;
          if (keep) items.push_back(x);
        }
      } else {
        items = std::move(all);
      }
      if (items.empty()) return exec(s.else_body, out);
      FrameP saved = frame;
      const int64_t n = int64_t(items.size());
      for (int64_t i = 0; i < n; ++i) {
        auto f = std::make_shared<Frame>();
        f->parent = saved;
        Value loop = Value::dict();
        auto& d = *loop.d;
        d.set("index", Value::integer(i + 1));
        d.set("index0", Value::integer(i));
        d.set("revindex", Value::integer(n - i));
        d.set("revindex0", Value::integer(n - i - 1));
        d.set("first", Value::boolean(i == 0));
        d.set("last", Value::boolean(i == n - 1));
        d.set("length", Value::integer(n));
        d.set("depth", Value::integer(1));
        d.set("depth0", Value::integer(0));
        d.set("previtem", i > 0 ? items[size_t(i - 1)] : Value::undef("previtem"));
        d.set("nextitem", i + 1 < n ? items[size_t(i + 1)] : Value::undef("nextitem"));
        d.set("cycle", Value::func([i](Interp&, Args& a) {
                if (a.pos.empty()) error("loop.cycle needs arguments");
                return a.pos[size_t(i) % a.pos.size()];
              }));
        f->set("loop", loop);
        assign(*f, s.targets, items[size_t(i)]);
        frame = f;
        const Flow fl = exec(s.body, out);
        frame = saved;
        if (fl == Flow::kBreak) break;
      }
      return Flow::kNormal;
    }
    case Stmt::kSet: {
      Value v = eval(*s.e);
      if (!s.attr.empty()) {
        Value* ns = frame->find(s.text);
        if (!ns || ns->k != Value::kNs) error("cannot assign attribute on non-namespace object '" + s.text + "'");
        ns->d->set(s.attr, v);
      } else {
        assign(*frame, s.targets, v);
      }
      return Flow::kNormal;
    }
    case Stmt::kSetBlock: {
      std::string body;
      exec(s.body, body);
      Value v = Value::str(body);
      for (const auto& [f, _] : s.params) {
        Args none;
        v = filter(f, v, none, s.line);
      }
      frame->set(s.targets[0], v);
      return Flow::kNormal;
    }
    case Stmt::kMacro: {
      // Weak: the macro lives in the frame it closes over (a strong pointer
      // would be a cycle). Frames outlive their macros' calls during a render.
      std::weak_ptr<Frame> def = frame;
      const Stmt* m = &s;
      frame->set(s.text, Value::func([def, m](Interp& in, Args& a) {
                   if (++in.depth > 200) error("macro recursion too deep");
                   auto f = std::make_shared<Frame>();
                   f->parent = def.lock();
                   if (!f->parent) f->parent = in.frame;
                   if (a.pos.size() > m->params.size())
                     error("macro '" + m->text + "' takes " + std::to_string(m->params.size()) + " arguments");
                   for (size_t i = 0; i < m->params.size(); ++i) {
                     const auto& [pname, dflt] = m->params[i];
                     Value v = i < a.pos.size() ? a.pos[i] : Value::undef(pname);
                     for (const auto& [k, kv] : a.kw)
                       if (k == pname) v = kv;
                     if (v.undefined() && dflt) {
                       FrameP saved = in.frame;
                       in.frame = f;
                       v = in.eval(*dflt);
                       in.frame = saved;
                     }
                     f->set(pname, v);
                   }
                   FrameP saved = in.frame;
                   in.frame = f;
                   std::string body;
                   in.exec(m->body, body);
                   in.frame = saved;
                   --in.depth;
                   return Value::str(body);
                 }));
      return Flow::kNormal;
    }
    case Stmt::kBreak:
      return Flow::kBreak;
    case Stmt::kContinue:
      return Flow::kContinue;
    case Stmt::kFilterBlock: {
      std::string body;
      exec(s.body, body);
      Args none;
      out += to_str(filter(s.text, Value::str(body), none, s.line));
      return Flow::kNormal;
    }
    case Stmt::kBlock:
      return exec(s.body, out);
  }
  return Flow::kNormal;
}

}  // namespace

Template::Template(std::string_view source) {
  Lexer lx(source);
  Parser p(lx.run());
  body_ = p.parse_all();
}

Template::~Template() = default;

std::string Template::render(const nlohmann::ordered_json& vars, const std::tm* now) const {
  Interp in;
  if (now) {
    in.now = *now;
  } else {
    const std::time_t t = std::time(nullptr);
    localtime_r(&t, &in.now);
  }
  auto globals = std::make_shared<Frame>();
  globals->set("raise_exception", Value::func([](Interp&, Args& a) -> Value {
                 fail(DZ_ERR_INVALID_ARGUMENT, "chat template raised: ", to_str(a.get(0, "message")));
               }));
  globals->set("strftime_now", Value::func([](Interp& in, Args& a) {
                 const std::string fmt = to_str(a.get(0, "format"));
                 char buf[256];
                 const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &in.now);
                 return Value::str(std::string(buf, n));
               }));
  globals->set("namespace", Value::func([](Interp&, Args& a) {
                 Value ns = Value::dict();
                 ns.k = Value::kNs;
                 for (const auto& p : a.pos)
                   if (p.k == Value::kDict)
                     for (auto& kv : p.d->items) ns.d->set(kv.first, kv.second);
                 for (auto& [k, v] : a.kw) ns.d->set(k, v);
                 return ns;
               }));
  globals->set("range", Value::func([](Interp&, Args& a) {
                 int64_t lo = 0, hi, st = 1;
                 if (a.pos.size() == 1)
                   hi = a.pos[0].i;
                 else if (a.pos.size() >= 2) {
                   lo = a.pos[0].i;
                   hi = a.pos[1].i;
                   if (a.pos.size() > 2) st = a.pos[2].i;
                 } else
                   error("range expects arguments");
                 if (st == 0) error("range step must not be zero");
                 List l;
                 for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
                   l.push_back(Value::integer(i));
                   if (l.size() > 1000000) error("range too large");
                 }
                 return Value::list(l);
               }));
  globals->set("dict", Value::func([](Interp&, Args& a) {
                 Value d = Value::dict();
                 for (const auto& p : a.pos)
                   if (p.k == Value::kDict) *d.d = *p.d;
                 for (auto& [k, v] : a.kw) d.d->set(k, v);
                 return d;
               }));
  auto top = std::make_shared<Frame>();
  top->parent = globals;
  for (auto it = vars.begin(); it != vars.end(); ++it) top->set(it.key(), from_json(it.value()));
  in.frame = top;
  std::string out;
  in.exec(body_, out);
  return out;
}

}  // namespace dz::jinja
