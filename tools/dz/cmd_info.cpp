// dz info: what a model directory holds and whether it is valid. Works for
// any architecture (it does not need the family to be served).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>

#include "commands.h"
#include "common/error.h"
#include "cpu/mxfp4_fold.h"
#include "kv/arena.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "model/family.h"
#include "runtime/device.h"

namespace dz::cli {

namespace {
std::string human_bytes(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (b >= 1024 && i < 4) b /= 1024, ++i;
  char s[32];
  std::snprintf(s, sizeof s, i ? "%.2f %s" : "%.0f %s", b, u[i]);
  return s;
}
std::string human_count(double n) {
  char s[32];
  if (n >= 1e9)
    std::snprintf(s, sizeof s, "%.2fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(s, sizeof s, "%.2fM", n / 1e6);
  else if (n >= 1e3)
    std::snprintf(s, sizeof s, "%.1fK", n / 1e3);
  else
    std::snprintf(s, sizeof s, "%.0f", n);
  return s;
}
// MXFP4 blocks pack two elements per byte.
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool is_fp4_blocks(const std::string& name) { return ends_with(name, "_blocks"); }
// MXFP4 scales and FP8 block scales are metadata of other tensors, not parameters.
bool is_scale(const std::string& name) { return ends_with(name, "_scales") || ends_with(name, "weight_scale_inv"); }
}  // namespace

int cmd_info(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz info --model DIR [--tensors] [--fold-check]\n\n"
        "Validates every shard of a Hugging Face model directory (header, dtypes,\n"
        "shapes, offsets, index) and prints its architecture, layer types,\n"
        "parameter count, bytes by dtype and shard count.\n\n"
        "  --model DIR   model directory (config.json + *.safetensors)\n"
        "  --tensors     also list every tensor\n"
        "  --fold-check  check every MXFP4 tensor for the lossless FP4 -> FP8 1x128 fold\n"
        "                (the CUDA expert pipeline's rule): counts lossy groups, refuses NaN scales\n");
    return 0;
  }
  reject_unknown(a, {"--model", "--tensors", "--fold-check", "--help"}, "info");
  const std::string dir = flag_value(a, "--model");
  if (dir.empty()) {
    std::fprintf(stderr, "dz info: --model DIR is required (see dz info --help)\n");
    return 2;
  }
  try {
    const auto t0 = std::chrono::steady_clock::now();
    Config cfg = Config::load(dir);
    const bool tty = isatty(fileno(stderr));
    WeightStore ws(dir, [tty](size_t done, size_t total) {
      if (tty) std::fprintf(stderr, "\rvalidating shards %zu/%zu%s", done, total, done == total ? "\n" : "");
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string arch = cfg.get_or<std::string>("model_type", "?");
    std::printf("model:        %s\n", dir.c_str());
    std::printf("architecture: %s (%s by this build)\n", arch.c_str(), find_family(arch) ? "served" : "not served");
    const auto& j = cfg.json();
    auto show = [&](const char* label, const char* key) {
      if (j.contains(key) && !j[key].is_null()) std::printf("%-14s%s\n", label, j[key].dump().c_str());
    };
    show("layers:", "num_hidden_layers");
    show("hidden:", "hidden_size");
    show("heads:", "num_attention_heads");
    show("kv heads:", "num_key_value_heads");
    show("vocab:", "vocab_size");
    show("experts:", j.contains("num_local_experts") ? "num_local_experts" : "n_routed_experts");
    show("active:", j.contains("num_experts_per_tok") ? "num_experts_per_tok" : "experts_per_token");
    show("context:", "max_position_embeddings");
    if (j.contains("layer_types") && j["layer_types"].is_array()) {
      std::map<std::string, int> counts;
      for (const auto& t : j["layer_types"]) counts[t.is_string() ? t.get<std::string>() : t.dump()]++;
      std::printf("layer types: ");
      for (const auto& [t, n] : counts) std::printf(" %s x%d", t.c_str(), n);
      std::printf("\n");
    }
    if (j.contains("quantization_config") && j["quantization_config"].is_object())
      std::printf("quantization: %s\n", j["quantization_config"].value("quant_method", std::string("?")).c_str());
    std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // bytes, params
    uint64_t params = 0;
    for (const auto& [name, t] : ws.all()) {
      const uint64_t n = is_scale(name) ? 0 : uint64_t(t->numel()) * (is_fp4_blocks(name) ? 2 : 1);
      params += n;
      const std::string key = is_fp4_blocks(name) ? "MXFP4 (U8 blocks)"
                              : is_scale(name)    ? std::string("scales (") + dtype_name(t->dtype) + ")"
                                                  : std::string(dtype_name(t->dtype));
      by_dtype[key].first += t->nbytes;
      by_dtype[key].second += n;
    }
    std::printf("parameters:   %s (%llu)\n", human_count(double(params)).c_str(), (unsigned long long)params);
    std::printf("tensors:      %zu in %zu shard%s, %s\n", ws.all().size(), ws.n_shards(), ws.n_shards() == 1 ? "" : "s",
                human_bytes(double(ws.total_bytes())).c_str());
    for (const auto& [dt, v] : by_dtype)
      std::printf("  %-20s %12s  %s params\n", dt.c_str(), human_bytes(double(v.first)).c_str(),
                  human_count(double(v.second)).c_str());
    if (has_flag(a, "--tensors"))
      for (const auto& [name, t] : ws.all()) std::printf("  %s\n", t->describe().c_str());
    if (has_flag(a, "--fold-check")) {
      // Each *_blocks [..., rows, K/32, 16] with its *_scales [..., rows, K/32].
      cpu::FoldStats all, by64;
      int n = 0, exact64 = 0;
      for (const auto& [name, t] : ws.all()) {
        if (!is_fp4_blocks(name)) continue;
        const std::string sname = name.substr(0, name.size() - 7) + "_scales";
        const TensorView* sc = ws.find(sname);
        check(sc != nullptr, DZ_ERR_FORMAT, "MXFP4 tensor ", name, " has no ", sname);
        check(t->shape.size() >= 3 && t->dim(-1) == 16 && t->dtype == DType::U8 && sc->dtype == DType::U8 &&
                  sc->numel() * 16 == t->numel(),
              DZ_ERR_FORMAT, "MXFP4 tensor ", name,
              ": expected U8 [..., rows, K/32, 16] with scales [..., rows, K/32]");
        const int64_t k = t->dim(-2) * 32;
        const cpu::Mxfp4View view{t->data, sc->data, t->numel() / (k / 2), k, name};
        // The 1x128 check, and (one read for both) the 64-row groups the GPU's
        // FP8 path folds a projection by where all of them are exact.
        cpu::FoldStats st;
        if (t->dim(-3) % 64 == 0) {
          const cpu::FoldStats g = cpu::mxfp4_fold_check(view, 64, &st);
          by64.merge(g);
          exact64 += g.lossy_groups == 0;
        } else {
          st = cpu::mxfp4_fold_check(view);
        }
        all.merge(st);
        ++n;
        if (st.lossy_groups)
          std::printf("  fold lossy:  %s: %llu of %llu groups (max spread %d)\n", name.c_str(),
                      (unsigned long long)st.lossy_groups, (unsigned long long)st.groups, st.max_spread);
      }
      std::printf("fold check:   %d MXFP4 tensors, %llu groups of 1x128, %llu lossy, %llu all-zero, max spread %d%s\n",
                  n, (unsigned long long)all.groups, (unsigned long long)all.lossy_groups,
                  (unsigned long long)all.zero_groups, all.max_spread,
                  all.lossy_groups ? " (FP8 folding is not exact for these)" : " (FP8 folding exact)");
      std::printf(
          "              %llu groups of 64x128, %llu lossy, max spread %d: %d of %d tensors fold by 64-row "
          "groups on the GPU\n",
          (unsigned long long)by64.groups, (unsigned long long)by64.lossy_groups, by64.max_spread, exact64, n);
    }
    if (FamilyFactory make = find_family(arch)) {
      // What a session costs in the KV arena (the CPU layout, fp32; pages of 64 tokens). Describing the files
      // does not need the model to open, so a failure here is reported, not fatal.
      try {
        dz_model_params mp;
        dz_model_params_init(&mp);
        mp.device = DZ_DEVICE_CPU;
        mp.n_threads = 1;
        const kv::Layout layout = make(cfg, ws, mp)->kv_layout(64);
        const double per_token = double(kv::Arena::page_bytes_for(layout)) / layout.page_tokens;
        std::printf("kv cache:     %s a token (CPU layout, pages of 64), %s a million tokens",
                    human_bytes(per_token).c_str(), human_bytes(per_token * 1048576.0).c_str());
        if (layout.state_slot_bytes)
          std::printf(", + %s state a session", human_bytes(double(layout.state_slot_bytes)).c_str());
        std::printf("\n");
      } catch (const Error& e) {
        std::printf("kv cache:     unknown (the model does not open: %s)\n", e.what());
      }
    }
    std::printf("devices:      %s\n", runtime_devices_summary().c_str());
    std::printf("validation:   OK (%.3f s)\n", secs);
    return 0;
  } catch (const Error& e) {
    std::printf("validation:   FAILED\n");
    std::fprintf(stderr, "dz info: %s: %s\n", dz_status_name(e.status()), e.what());
    return 1;
  }
}

}  // namespace dz::cli
