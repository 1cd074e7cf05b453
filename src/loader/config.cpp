#include "loader/config.h"

#include <filesystem>
#include <fstream>

namespace dz {

Config Config::load(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  check(bool(in), DZ_ERR_IO, path, ": cannot open");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  check(!j.is_discarded(), DZ_ERR_FORMAT, path, ": not well-formed JSON");
  return from_json(std::move(j), path);
}

Config Config::from_json(nlohmann::json j, std::string source) {
  check(j.is_object(), DZ_ERR_FORMAT, source, ": not a JSON object");
  Config c;
  c.j_ = std::move(j);
  c.source_ = std::move(source);
  return c;
}

}  // namespace dz
