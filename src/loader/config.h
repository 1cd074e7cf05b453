// config.json of a Hugging Face model directory, with typed accessors whose
// errors name the file and field.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>

#include "common/error.h"

namespace dz {

class Config {
 public:
  static Config load(const std::string& dir);  // reads dir/config.json
  static Config from_json(nlohmann::json j, std::string source);

  const nlohmann::json& json() const { return j_; }
  const std::string& source() const { return source_; }
  std::string model_type() const { return get<std::string>("model_type"); }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }

  template <typename T>
  T get(const std::string& key) const {
    check(j_.contains(key) && !j_[key].is_null(), DZ_ERR_FORMAT, source_, ": missing field \"", key, "\"");
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // json would truncate 2.5 and convert 1e300 with undefined behaviour: integers only, in range.
      const nlohmann::json& v = j_[key];
      const bool fits =
          v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(std::numeric_limits<T>::max())
          : v.is_number_integer()
              ? v.get<int64_t>() >= int64_t(std::numeric_limits<T>::min()) &&
                    (v.get<int64_t>() < 0 || uint64_t(v.get<int64_t>()) <= uint64_t(std::numeric_limits<T>::max()))
              : false;
      check(fits, DZ_ERR_FORMAT, source_, ": field \"", key, "\" = ", v.dump(), " is not an integer",
            v.is_number_integer() ? " in range" : "");
    }
    try {
      return j_[key].get<T>();
    } catch (const std::exception&) {
      fail(DZ_ERR_FORMAT, source_, ": field \"", key, "\" has the wrong type (", j_[key].type_name(), ")");
    }
  }
  template <typename T>
  T get_or(const std::string& key, T fallback) const {
    return has(key) ? get<T>(key) : fallback;
  }
  // The first present field of several spellings of one setting (a checkpoint's own, transformers'), else fallback.
  template <typename T>
  T get_first_or(std::initializer_list<const char*> keys, T fallback) const {
    for (const char* k : keys)
      if (has(k)) return get<T>(k);
    return fallback;
  }
  // An integer field that must lie in 1 .. 2^31 - 1 (a size or count).
  int64_t get_positive_int(const std::string& key) const {
    const int64_t v = get<int64_t>(key);
    check(v > 0 && v <= (int64_t(1) << 31) - 1, DZ_ERR_FORMAT, source_, ": ", key, " = ", v, " must be positive");
    return v;
  }
  int64_t get_positive_int_or(const std::string& key, int64_t fallback) const {
    return has(key) ? get_positive_int(key) : fallback;
  }

 private:
  nlohmann::json j_;
  std::string source_;
};

}  // namespace dz
