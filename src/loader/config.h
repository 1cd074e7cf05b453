// config.json of a Hugging Face model directory, with typed accessors whose
// errors name the file and field.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

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

 private:
  nlohmann::json j_;
  std::string source_;
};

}  // namespace dz
