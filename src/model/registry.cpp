#include <utility>

#include "model/deepseek_v32.h"
#include "model/family.h"

namespace dz {

std::unique_ptr<Family> make_deepseek_v4(const Config&, const WeightStore&, const dz_model_params&);
std::unique_ptr<Family> make_gpt_oss(const Config&, const WeightStore&, const dz_model_params&);
std::unique_ptr<Family> make_kimi_linear(const Config&, const WeightStore&, const dz_model_params&);

namespace {
// One line per family; keep sorted.
const std::pair<const char*, FamilyFactory> kFamilies[] = {
    {"deepseek_v32", make_deepseek_v32},
    {"deepseek_v4", make_deepseek_v4},
    {"gpt_oss", make_gpt_oss},
    {"kimi_linear", make_kimi_linear},
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
