// A model family (gpt_oss, deepseek_v32, ...) wires the shared operators into
// one architecture. One family per file in src/model/; registry.cpp maps
// config.json's model_type to its factory.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dayzero.h"
#include "loader/config.h"
#include "loader/safetensors.h"

namespace dz {

class Family {
 public:
  virtual ~Family() = default;
  // Architecture facts for dz_model_get_info (struct_size already checked).
  virtual void fill_info(dz_model_info& info) const = 0;
};

using FamilyFactory = std::unique_ptr<Family> (*)(const Config& config, const WeightStore& weights,
                                                   const dz_model_params& params);

// nullptr when the model_type is not served by this build.
FamilyFactory find_family(const std::string& model_type);
std::vector<std::string> family_names();

}  // namespace dz
