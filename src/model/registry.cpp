#include <utility>

#include "common/log.h"
#include "model/deepseek_v32.h"
#include "model/family.h"
#include "runtime/device.h"

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

std::unique_ptr<Family> make_on_device(const char* family, FamilyFactory cuda, FamilyFactory cpu, const Config& config,
                                       const WeightStore& weights, const dz_model_params& params) {
  if (params.device == DZ_DEVICE_CUDA) {
    require_cuda_device(family);  // before the family parses the checkpoint
    return cuda(config, weights, params);
  }
  if (params.device == DZ_DEVICE_AUTO && cuda_compiled() && cuda_device_count() > 0) {
    try {
      return cuda(config, weights, params);
    } catch (const Error& e) {
      if (e.status() == DZ_ERR_FORMAT) throw;
      log_warn(family, ": CUDA backend unavailable (", e.what(), "); using the CPU");
    }
  }
  return cpu(config, weights, params);
}

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
