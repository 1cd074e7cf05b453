// Definitions of the opaque handles shared by the API files.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "dayzero.h"
#include "kv/arena.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "model/family.h"
#include "runtime/parallel.h"

struct dz_model {
  dz_model_params params{};
  dz::Config config;
  std::unique_ptr<dz::WeightStore> weights;
  std::unique_ptr<dz::Family> family;
  dz_tokenizer* tokenizer = nullptr;  // owned; null when the directory has none
  std::string architecture;
  // Threads sampling a batch's sessions on the host (created on first use).
  std::once_flag sample_pool_once;
  std::unique_ptr<dz::ThreadPool> sample_pool;
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
  // rows x n_vocab of the last append / host decode step. After a decode step
  // or a DZ_LOGITS_LAST append on a family with device logits the row stays in
  // dlog (row dlog_cur) until first read (into dlog's host row: `fetched`);
  // sessions are used by one thread at a time.
  std::vector<float> logits;
  std::vector<float> spare;  // a host decode step's logits land here, then swap with `logits` (no allocation per step)
  size_t rows = 0;
  std::unique_ptr<dz::DeviceLogits> dlog;  // this session's device rows (created on first use)
  bool host_rows_only = false;             // the family has none, or had no room for them
  int dlog_cur = 0;
  bool on_device = false;                  // the last logits are dlog's row dlog_cur, not `logits`
  mutable const float* fetched = nullptr;  // with on_device: that row on the host once read
  int32_t device_argmax = -1;              // with on_device: that row's argmax (greedy sampling without a copy)
  uint64_t tokens_computed = 0, tokens_reused = 0, attention_tokens_read = 0;
};
