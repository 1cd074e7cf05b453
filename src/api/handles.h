// Definitions of the opaque handles shared by the API files.
#pragma once

#include <memory>
#include <string>

#include "dayzero.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "model/family.h"

struct dz_model {
  dz_model_params params{};
  dz::Config config;
  std::unique_ptr<dz::WeightStore> weights;
  std::unique_ptr<dz::Family> family;
  dz_tokenizer* tokenizer = nullptr;  // owned; null when the directory has none
  std::string architecture;
  ~dz_model() { dz_tokenizer_free(tokenizer); }
};
