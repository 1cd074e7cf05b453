// Definitions of the opaque handles shared by the API files.
#pragma once

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dayzero.h"
#include "kv/arena.h"
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

struct dz_kv_arena {
  dz_model* model = nullptr;
  std::unique_ptr<dz::kv::Arena> arena;
  std::atomic<int64_t> sessions{0};  // live sessions drawing from it
};

struct dz_session {
  dz_kv_arena* arena = nullptr;
  std::unique_ptr<dz::kv::Sequence> seq;
  dz_session_params params{};
  std::mt19937_64 rng;
  std::vector<float> logits;  // rows x n_vocab of the last append / step
  std::vector<float> spare;   // a decode step's logits land here, then swap with `logits` (no allocation per step)
  size_t rows = 0;
  uint64_t tokens_computed = 0, tokens_reused = 0, attention_tokens_read = 0;
};
