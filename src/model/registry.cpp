#include <utility>

#include "model/family.h"

namespace dz {

namespace {
// One line per family; keep sorted.
const std::pair<const char*, FamilyFactory> kFamilies[] = {
    {"", nullptr},
};
}  // namespace

FamilyFactory find_family(const std::string& model_type) {
  for (const auto& [name, f] : kFamilies)
    if (f && model_type == name) return f;
  return nullptr;
}

std::vector<std::string> family_names() {
  std::vector<std::string> r;
  for (const auto& [name, f] : kFamilies)
    if (f) r.push_back(name);
  return r;
}

}  // namespace dz
