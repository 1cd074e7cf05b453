// A model family (gpt_oss, deepseek_v32, ...) wires the shared operators into
// one architecture. One family per file in src/model/; registry.cpp maps
// config.json's model_type to its factory.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "cpu/sampling.h"
#include "dayzero.h"
#include "kv/arena.h"
#include "loader/config.h"
#include "loader/safetensors.h"

namespace dz {

// One sequence's share of a forward pass (batches are ragged: sequences of
// different lengths and different numbers of new tokens run together).
struct ForwardItem {
  kv::Sequence* seq = nullptr;      // room for tokens.size() more tokens already reserved
  std::span<const int32_t> tokens;  // new tokens, at positions seq->length() ...
  bool all_logits = false;          // logits for every new token, else the last only
  float* logits = nullptr;          // [rows x n_vocab], rows = all_logits ? tokens.size() : 1
  // Instead of `logits` (one row, !all_logits): a row of a DeviceLogits from
  // this family, which also writes the row's argmax (cpu::argmax) here.
  float* device_logits = nullptr;
  int32_t* argmax = nullptr;
  uint64_t* attention_tokens_read = nullptr;  // optional: this item's share of ForwardOptions' counter
};

// A batch flattened into one row per new token (items in order).
struct BatchRow {
  size_t item;
  int64_t pos;  // position in the item's sequence
};
struct BatchRows {
  std::vector<BatchRow> rows;
  std::vector<int64_t> first_row;  // per item: index of its first row
  // The rows whose logits item b wants: [first, first + count).
  std::pair<int64_t, int64_t> logit_rows(std::span<const ForwardItem> batch, size_t b) const {
    const int64_t n = int64_t(batch[b].tokens.size());
    return batch[b].all_logits ? std::pair{first_row[b], n} : std::pair{first_row[b] + n - 1, int64_t(1)};
  }
};
// Checks every item (sequence, tokens, logits) and token id (< n_vocab);
// `family` names the model in messages.
inline BatchRows flatten_batch(std::span<const ForwardItem> batch, int32_t n_vocab, const char* family) {
  BatchRows b;
  b.first_row.resize(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const ForwardItem& it = batch[i];
    const bool out_ok = it.logits || (it.device_logits && it.argmax && !it.all_logits);
    check(it.seq && !it.tokens.empty() && out_ok, DZ_ERR_INTERNAL, family, " forward: malformed batch item ", i);
    b.first_row[i] = int64_t(b.rows.size());
    const int64_t start = int64_t(it.seq->length());
    for (size_t t = 0; t < it.tokens.size(); ++t) {
      const int32_t tok = it.tokens[t];
      check(tok >= 0 && tok < n_vocab, DZ_ERR_INVALID_ARGUMENT, "token id ", tok, " is outside the vocabulary [0, ",
            n_vocab, ")");
      b.rows.push_back({i, start + int64_t(t)});
    }
  }
  return b;
}

struct ForwardOptions {
  dz_abort_fn abort = nullptr;  // polled between layers; throw DZ_ERR_CANCELLED when it says stop
  void* abort_user = nullptr;
  uint64_t* attention_tokens_read = nullptr;  // optional counter: KV tokens read by attention ops

  // Throws DZ_ERR_CANCELLED when the abort callback says stop.
  void poll_abort() const {
    poll_abort([] {});
  }
  // The same, calling drain() first (a GPU family: its queued work completes before the error).
  template <class Drain>
  void poll_abort(Drain drain) const {
    if (abort && abort(abort_user)) {
      drain();
      fail(DZ_ERR_CANCELLED, "cancelled by the abort callback");
    }
  }
};

// A session's logits rows in a family's device memory (two rows: the last
// step's and the next step's, swapped on success), read back only on demand.
class DeviceLogits {
 public:
  virtual ~DeviceLogits() = default;
  virtual float* row(int i) = 0;  // i = 0, 1: device pointer, n_vocab floats
  // Row i copied to host memory owned by this object, valid until the next fetch.
  virtual const float* fetch(int i) const = 0;
};

// One session's draw from its last logits row on the device (a DeviceLogits
// row of the family, written by a decode step or an append), with its sampler (temperature > 0) and the draw u in
// [0, 1) that cpu::sample_token would take from the session's rng.
struct DeviceSample {
  const float* logits = nullptr;
  cpu::SamplerConfig cfg;
  double u = 0;
  int32_t argmax = -2;  // the row's cpu::argmax where known (-1: no number), else below -1
};

class Family {
 public:
  virtual ~Family() = default;
  // Architecture facts for dz_model_get_info (struct_size already checked).
  virtual void fill_info(dz_model_info& info) const = 0;
  virtual int32_t n_vocab() const = 0;
  // What the family caches per token per layer, for pages of page_tokens.
  virtual kv::Layout kv_layout(uint32_t page_tokens) const = 0;
  // Backing memory for an arena of `bytes` (host for CPU, device for CUDA).
  virtual std::unique_ptr<kv::Storage> (*kv_storage() const)(size_t) { return kv::make_host_storage; }
  // Tokens a prefill pass takes where the session leaves prefill_chunk at 0.
  virtual uint32_t prefill_chunk() const { return 512; }
  // Run the model over the batch: write each item's KV into its reserved
  // page slots and its logits. The caller commits (or rolls back) the
  // sequences afterwards. Throws dz::Error.
  virtual void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) = 0;
  // Device rows for one session's decode-step logits (ForwardItem::device_logits);
  // null where the family keeps logits on the host or the device is full.
  virtual std::unique_ptr<DeviceLogits> make_device_logits() { return nullptr; }
  // tokens[i] = the token sampled from rows[i] on the device, as
  // cpu::sample_token picks it for that draw (-1 for a row of NaNs); false
  // where the family cannot (the caller samples a host copy). Throws dz::Error.
  virtual bool sample_on_device(std::span<const DeviceSample> rows, int32_t* tokens) {
    (void)rows, (void)tokens;
    return false;
  }
};

using FamilyFactory = std::unique_ptr<Family> (*)(const Config& config, const WeightStore& weights,
                                                  const dz_model_params& params);

// DZ_DEVICE_CUDA builds `cuda` (its errors reach the caller); DZ_DEVICE_AUTO
// builds it when this build and machine have a GPU and the CUDA family takes
// the model, else `cpu` (a malformed checkpoint fails either way). `family`
// names it in the warning.
std::unique_ptr<Family> make_on_device(const char* family, FamilyFactory cuda, FamilyFactory cpu, const Config& config,
                                       const WeightStore& weights, const dz_model_params& params);
// The same with CpuFamily's constructor as `cpu`.
template <class CpuFamily>
std::unique_ptr<Family> make_on_device(const char* family, FamilyFactory cuda, const Config& config,
                                       const WeightStore& weights, const dz_model_params& params) {
  return make_on_device(
      family, cuda,
      [](const Config& c, const WeightStore& w, const dz_model_params& p) -> std::unique_ptr<Family> {
        return std::make_unique<CpuFamily>(c, w, p);
      },
      config, weights, params);
}

// The parameters a CPU-only family accepts: the CPU device, fp32 activations
// and weights decoded in checkpoint precision. `family` names it in messages.
inline void check_cpu_family_params(const dz_model_params& p, const char* family) {
  check(p.device != DZ_DEVICE_CUDA, DZ_ERR_UNSUPPORTED, family,
        ": the CUDA backend is not available in this build yet; use DZ_DEVICE_CPU");
  check(p.activations != DZ_ACTIVATIONS_BF16, DZ_ERR_UNSUPPORTED, family,
        ": DZ_ACTIVATIONS_BF16 (CPU rounding as a GPU backend) is not implemented for this family");
  check(p.experts == DZ_EXPERTS_AUTO || p.experts == DZ_EXPERTS_NATIVE, DZ_ERR_UNSUPPORTED, family,
        ": the CPU backend decodes weights in checkpoint precision only (DZ_EXPERTS_AUTO or DZ_EXPERTS_NATIVE), "
        "not dz_expert_precision ",
        int(p.experts));
}

// FNV-1a, for the model keys (kv::Layout::model_key) that salt prefix-cache hashes.
inline uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// nullptr when the model_type is not served by this build.
FamilyFactory find_family(const std::string& model_type);
std::vector<std::string> family_names();

}  // namespace dz
