// dz bench model: a whole model through the normal loader and the session
// API. --make-random DIR writes a gpt-oss-20b- or 120b-shaped checkpoint in
// the published layout (sharded safetensors, MXFP4 experts with a realistic
// scale spread, BF16 elsewhere; multithreaded generation), a
// Kimi-Linear-48B-shaped one (all BF16), a DeepSeek-V4-Flash- or a
// DeepSeek-V3.2-shaped one, and benchmarks it; --model DIR
// benchmarks an existing one (any family, on either backend). Reports load
// time, device bytes, prefill tokens/s, decode ms/token at batch 1 and
// tokens/s at batch 64; gpt-oss and Kimi Linear on the GPU each next to the
// HBM floor (bytes the step must read / 4.27e12 B/s).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"
#include "dayzero.h"
#include "model_args.h"

namespace dz::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* kUsage =
    "usage: dz bench model (--make-random DIR [--shape 20b|120b|kimi-48b|v4-flash|v32] | --model DIR)\n"
    "                      [--device cuda|cpu|auto]\n"
    "                      [--prefill N]\n"
    "                      [--prefill-chunk N] [--ctx N] [--steps N] [--batch N] [--experts auto|native|fp8]\n"
    "                      [--attention precise|bf16|auto] [--pass-tokens N] [--threads N] [--activations A]\n"
    "                      [--out FILE.json]\n"
    "  --make-random DIR  write a random checkpoint of a published layout into DIR first\n"
    "  --shape S          its shape: gpt-oss 20b (32 experts, 24 layers, 13.8 GB; default) or 120b (128\n"
    "                     experts, 36 layers, 65.2 GB), or kimi-48b (Kimi-Linear-48B-A3B: 27 layers, 98 GB\n"
    "                     in BF16; 3.6 GB a layer, so --layers cuts it to what the disk and GPU hold), or\n"
    "                     v4-flash (DeepSeek-V4-Flash in DeepSeek's layout, FP4 experts: 43 layers of 3.7 GB),\n"
    "                     or v32 (DeepSeek-V3.2, MXFP4 experts: 61 layers of 6.5 GB; 3.7 GB of embeddings)\n"
    "  --layers N         layers of the random checkpoint (default: the shape's)\n"
    "  --write-only       write it and exit (no benchmark)\n"
    "  --prefill N        prefill tokens (default 4096)\n"
    "  --prefill-chunk N  tokens a prefill pass (dz_session_params.prefill_chunk; default 0: the library's)\n"
    "  --ctx N            short context before the decode steps (default 128)\n"
    "  --long-ctx N       long context before the decode steps (default 4096; 0: skip)\n"
    "  --steps N          decode steps timed (default 32)\n"
    "  --batch N          sessions of the batched decode (default 64)\n"
    "  --no-eager         skip the decode runs without CUDA graphs (DZ_CUDA_GRAPHS=0)\n"
    "  --experts MODE     expert precision (dz_expert_precision; default auto; fp8: E4M3 arithmetic)\n"
    "  --attention P      prefill attention products (dz_attention_precision; default precise)\n"
    "  --pass-tokens N    tokens one device pass holds (dz_model_params.pass_tokens; default 0: 16384)\n"
    "  --threads N, --activations A\n"
    "                     the CPU backend's threads and activation rounding (as for dz generate)\n";

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// How a tensor's bytes are generated (deterministic in its seed and byte index).
struct Gen {
  enum Kind { Normal, Const, Bytes, Scales } kind = Normal;
  float scale = 0.02f, mean = 0;
};

struct TensorSpec {
  std::string name, dtype;
  std::vector<int64_t> shape;
  Gen gen;
  uint64_t seed = 0;
  size_t bytes() const {
    size_t n = 1;
    for (auto d : shape) n *= size_t(d);
    return n * (dtype == "BF16" ? 2 : 1);
  }
};

void fill(const TensorSpec& t, size_t off, size_t n, uint8_t* out) {
  switch (t.gen.kind) {
    case Gen::Bytes:
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t(mix(t.seed ^ ((off + i) >> 3)) >> (8 * ((off + i) & 7)));
      return;
    case Gen::Scales:  // E8M0 118..122: weights up to 6 * 2^-5, spread 4 (folds losslessly)
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t(118 + mix(t.seed ^ (off + i)) % 5);
      return;
    case Gen::Const:
    case Gen::Normal:
      for (size_t i = 0; i < n; i += 2) {
        const size_t e = (off + i) / 2;
        float v = t.gen.mean;
        if (t.gen.kind == Gen::Normal) {  // sum of 4 uniforms: ~N(0, 1)
          const uint64_t h = mix(t.seed ^ e);
          float s = 0;
          for (int k = 0; k < 4; ++k) s += float((h >> (16 * k)) & 0xffff) / 65535.f;
          v += t.gen.scale * (s - 2.f) * 1.7320508f;
        }
        const uint16_t b = bf16(v);
        std::memcpy(out + i, &b, std::min<size_t>(2, n - i));
      }
      return;
  }
}

// A random checkpoint's tensors, shard by shard (list[0] first), each tensor with the next seed: the order of
// the add calls fixes every byte.
struct Shards {
  std::vector<std::vector<TensorSpec>> list{1};
  uint64_t seed = 1;
  void add(std::vector<TensorSpec>& s, std::string name, std::string dt, std::vector<int64_t> shape, Gen g) {
    s.push_back({std::move(name), std::move(dt), std::move(shape), g, mix(seed++)});
  }
  void add(std::vector<TensorSpec>& s, std::string name, std::vector<int64_t> shape, Gen g) {  // BF16
    add(s, std::move(name), "BF16", std::move(shape), g);
  }
};

double secs(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

void write_shards(const std::string& dir, const std::vector<std::vector<TensorSpec>>& shards);

// gpt-oss-20b and -120b differ only in experts (32 / 128) and layers (24 / 36).
void write_checkpoint(const std::string& dir, int64_t E, int layers) {
  const int64_t H = 2880, I = 2880, NH = 64, NKV = 8, D = 64, V = 201088, G = H / 32;
  fs::create_directories(dir);
  json cfg = {{"architectures", {"GptOssForCausalLM"}},
              {"model_type", "gpt_oss"},
              {"attention_bias", true},
              {"experts_per_token", 4},
              {"num_experts_per_tok", 4},
              {"head_dim", D},
              {"hidden_size", H},
              {"intermediate_size", I},
              {"max_position_embeddings", 131072},
              {"num_attention_heads", NH},
              {"num_key_value_heads", NKV},
              {"num_hidden_layers", layers},
              {"num_local_experts", E},
              {"rms_norm_eps", 1e-5},
              {"sliding_window", 128},
              {"swiglu_limit", 7.0},
              {"tie_word_embeddings", false},
              {"vocab_size", V},
              {"rope_parameters",
               {{"rope_type", "yarn"},
                {"factor", 32.0},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0},
                {"original_max_position_embeddings", 4096},
                {"rope_theta", 150000.0},
                {"truncate", false}}},
              {"quantization_config",
               {{"quant_method", "mxfp4"},
                {"modules_to_not_convert",
                 {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"}}}}};
  json types = json::array();
  for (int i = 0; i < layers; ++i) types.push_back(i % 2 ? "full_attention" : "sliding_attention");
  cfg["layer_types"] = types;
  std::ofstream(dir + "/config.json") << cfg.dump(2);

  // Shards: embeddings, then groups of layers, then norm + lm_head.
  Shards sh;
  const Gen w{Gen::Normal, 0.02f, 0}, bias{Gen::Normal, 0.01f, 0}, one{Gen::Const, 0, 1}, blocks{Gen::Bytes},
      scales{Gen::Scales}, sink{Gen::Normal, 1.0f, 0};
  sh.add(sh.list[0], "model.embed_tokens.weight", "BF16", {V, H}, Gen{Gen::Normal, 1.0f, 0});
  const int per_shard = 4;
  for (int i = 0; i < layers; ++i) {
    if (i % per_shard == 0) sh.list.emplace_back();
    auto& s = sh.list.back();
    const std::string p = "model.layers." + std::to_string(i) + ".";
    sh.add(s, p + "input_layernorm.weight", "BF16", {H}, one);
    sh.add(s, p + "post_attention_layernorm.weight", "BF16", {H}, one);
    sh.add(s, p + "self_attn.q_proj.weight", "BF16", {NH * D, H}, w);
    sh.add(s, p + "self_attn.q_proj.bias", "BF16", {NH * D}, bias);
    sh.add(s, p + "self_attn.k_proj.weight", "BF16", {NKV * D, H}, w);
    sh.add(s, p + "self_attn.k_proj.bias", "BF16", {NKV * D}, bias);
    sh.add(s, p + "self_attn.v_proj.weight", "BF16", {NKV * D, H}, w);
    sh.add(s, p + "self_attn.v_proj.bias", "BF16", {NKV * D}, bias);
    sh.add(s, p + "self_attn.o_proj.weight", "BF16", {H, NH * D}, w);
    sh.add(s, p + "self_attn.o_proj.bias", "BF16", {H}, bias);
    sh.add(s, p + "self_attn.sinks", "BF16", {NH}, sink);
    sh.add(s, p + "mlp.router.weight", "BF16", {E, H}, w);
    sh.add(s, p + "mlp.router.bias", "BF16", {E}, bias);
    sh.add(s, p + "mlp.experts.gate_up_proj_blocks", "U8", {E, 2 * I, G, 16}, blocks);
    sh.add(s, p + "mlp.experts.gate_up_proj_scales", "U8", {E, 2 * I, G}, scales);
    sh.add(s, p + "mlp.experts.gate_up_proj_bias", "BF16", {E, 2 * I}, bias);
    sh.add(s, p + "mlp.experts.down_proj_blocks", "U8", {E, H, I / 32, 16}, blocks);
    sh.add(s, p + "mlp.experts.down_proj_scales", "U8", {E, H, I / 32}, scales);
    sh.add(s, p + "mlp.experts.down_proj_bias", "BF16", {E, H}, bias);
  }
  sh.list.emplace_back();
  sh.add(sh.list.back(), "model.norm.weight", "BF16", {H}, one);
  sh.add(sh.list.back(), "lm_head.weight", "BF16", {V, H}, w);
  write_shards(dir, sh.list);
}

// Kimi-Linear-48B-A3B's published shape (hidden 2304, 256 experts of 1024
// top-8 plus one shared, KDA heads 32 x 128, MLA 32 heads over a 512 + 64
// latent without RoPE, every fourth layer and the last MLA; 27 layers, 98 GB
// in BF16); `layers` cuts it short.
void write_kimi_checkpoint(const std::string& dir, int layers) {
  const int64_t H = 2304, I = 9216, IM = 1024, E = 256, NH = 32, R = 512, RO = 64, NO = 128, VD = 128, V = 163840;
  const int64_t NHK = 32, D = 128, P = NHK * D, K = 4;
  fs::create_directories(dir);
  json kda = json::array(), full = json::array();
  for (int i = 1; i <= layers; ++i) (i % 4 == 0 || i == layers ? full : kda).push_back(i);
  json cfg = {{"architectures", {"KimiLinearForCausalLM"}},
              {"model_type", "kimi_linear"},
              {"vocab_size", V},
              {"hidden_size", H},
              {"intermediate_size", I},
              {"moe_intermediate_size", IM},
              {"num_hidden_layers", layers},
              {"num_attention_heads", NH},
              {"num_key_value_heads", NH},
              {"q_lora_rank", nullptr},
              {"kv_lora_rank", R},
              {"qk_nope_head_dim", NO},
              {"qk_rope_head_dim", RO},
              {"v_head_dim", VD},
              {"mla_use_nope", true},
              {"num_experts", E},
              {"num_experts_per_token", 8},
              {"num_shared_experts", 1},
              {"moe_renormalize", true},
              {"moe_router_activation_func", "sigmoid"},
              {"routed_scaling_factor", 2.446},
              {"num_expert_group", 1},
              {"topk_group", 1},
              {"use_grouped_topk", true},
              {"first_k_dense_replace", 1},
              {"moe_layer_freq", 1},
              {"linear_attn_config",
               {{"kda_layers", kda},
                {"full_attn_layers", full},
                {"num_heads", NHK},
                {"head_dim", D},
                {"short_conv_kernel_size", K}}},
              {"rms_norm_eps", 1e-5},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false},
              {"model_max_length", 1048576}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  Shards sh;
  const Gen w{Gen::Normal, 0.02f, 0}, one{Gen::Const, 0, 1}, zero{Gen::Const, 0, 0}, conv{Gen::Normal, 0.3f, 0};
  sh.add(sh.list[0], "model.embed_tokens.weight", {V, H}, Gen{Gen::Normal, 1.0f, 0});
  for (int i = 0; i < layers; ++i) {
    sh.list.emplace_back();
    auto& s = sh.list.back();
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    sh.add(s, p + "input_layernorm.weight", {H}, one);
    sh.add(s, p + "post_attention_layernorm.weight", {H}, one);
    if ((i + 1) % 4 != 0 && i + 1 != layers) {
      for (const char* x : {"q_proj", "k_proj", "v_proj"}) sh.add(s, a + x + ".weight", {P, H}, w);
      for (const char* x : {"q_conv1d", "k_conv1d", "v_conv1d"}) sh.add(s, a + x + ".weight", {P, 1, K}, conv);
      sh.add(s, a + "f_a_proj.weight", {D, H}, w);
      sh.add(s, a + "f_b_proj.weight", {P, D}, w);
      sh.add(s, a + "dt_bias", {P}, zero);
      sh.add(s, a + "A_log", {1, 1, NHK, 1}, zero);
      sh.add(s, a + "b_proj.weight", {NHK, H}, w);
      sh.add(s, a + "g_a_proj.weight", {D, H}, w);
      sh.add(s, a + "g_b_proj.weight", {P, D}, w);
      sh.add(s, a + "o_norm.weight", {D}, one);
      sh.add(s, a + "o_proj.weight", {H, P}, w);
    } else {
      sh.add(s, a + "q_proj.weight", {NH * (NO + RO), H}, w);
      sh.add(s, a + "kv_a_proj_with_mqa.weight", {R + RO, H}, w);
      sh.add(s, a + "kv_a_layernorm.weight", {R}, one);
      sh.add(s, a + "kv_b_proj.weight", {NH * (NO + VD), R}, w);
      sh.add(s, a + "o_proj.weight", {H, NH * VD}, w);
    }
    if (i == 0) {
      for (const char* x : {"gate_proj", "up_proj"}) sh.add(s, p + "mlp." + x + ".weight", {I, H}, w);
      sh.add(s, p + "mlp.down_proj.weight", {H, I}, w);
      continue;
    }
    const std::string m = p + "block_sparse_moe.";
    sh.add(s, m + "gate.weight", {E, H}, w);
    sh.add(s, m + "gate.e_score_correction_bias", {E}, zero);
    for (int e = 0; e < E; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      sh.add(s, x + "w1.weight", {IM, H}, w);
      sh.add(s, x + "w3.weight", {IM, H}, w);
      sh.add(s, x + "w2.weight", {H, IM}, w);
    }
    for (const char* x : {"gate_proj", "up_proj"}) sh.add(s, m + "shared_experts." + x + ".weight", {IM, H}, w);
    sh.add(s, m + "shared_experts.down_proj.weight", {H, IM}, w);
  }
  sh.list.emplace_back();
  sh.add(sh.list.back(), "model.norm.weight", {H}, one);
  sh.add(sh.list.back(), "lm_head.weight", {V, H}, w);
  write_shards(dir, sh.list);
}

// DeepSeek-V4-Flash's shape in DeepSeek's own layout (hidden 4096, 64 heads
// of 512 over one K=V head with 64 rotary channels, q and o ranks 1024 in 8
// output groups, window 128, CSA every 4 tokens with a 64 x 128 indexer
// keeping 512, HCA every 128, four mHC streams, 256 FP4 experts of 2048
// top-6 plus one shared; 43 layers, 2 HCA then CSA and HCA alternating), the
// projections in BF16 and every layer's experts scored (no hash layers: the
// token-id tables' random ids would not be experts); `layers` cuts it short.
void write_v4_checkpoint(const std::string& dir, int layers) {
  const int64_t H = 4096, NH = 64, D = 512, QL = 1024, OR = 1024, G = 8, E = 256, I = 2048, V = 129280;
  const int64_t IH = 64, ID = 128, NHC = 4, MIX = (2 + NHC) * NHC, RC = 4, RH = 128;
  fs::create_directories(dir);
  json ratios = json::array(), mlp = json::array();
  for (int i = 0; i < layers; ++i) ratios.push_back(i >= 2 && (i - 2) % 2 ? RC : RH), mlp.push_back("moe");
  json cfg = {{"architectures", {"DeepseekV4ForCausalLM"}},
              {"model_type", "deepseek_v4"},
              {"vocab_size", V},
              {"hidden_size", H},
              {"moe_intermediate_size", I},
              {"num_hidden_layers", layers},
              {"num_attention_heads", NH},
              {"num_key_value_heads", 1},
              {"head_dim", D},
              {"qk_rope_head_dim", 64},
              {"q_lora_rank", QL},
              {"o_lora_rank", OR},
              {"o_groups", G},
              {"sliding_window", 128},
              {"compress_ratios", ratios},
              {"mlp_layer_types", mlp},
              {"index_n_heads", IH},
              {"index_head_dim", ID},
              {"index_topk", 512},
              {"n_routed_experts", E},
              {"num_experts_per_tok", 6},
              {"n_shared_experts", 1},
              {"scoring_func", "sqrtsoftplus"},
              {"routed_scaling_factor", 1.5},
              {"swiglu_limit", 10.0},
              {"hc_mult", NHC},
              {"hc_sinkhorn_iters", 20},
              {"rope_theta", 10000.0},
              {"compress_rope_theta", 160000.0},
              {"rope_scaling",
               {{"type", "yarn"},
                {"factor", 16.0},
                {"original_max_position_embeddings", 65536},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0}}},
              {"max_position_embeddings", 1048576},
              {"rms_norm_eps", 1e-6},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  Shards sh;
  const Gen w{Gen::Normal, 0.02f, 0}, one{Gen::Const, 0, 1}, zero{Gen::Const, 0, 0}, mixw{Gen::Normal, 0.01f, 0},
      blocks{Gen::Bytes}, scales{Gen::Scales};
  sh.add(sh.list[0], "embed.weight", "BF16", {V, H}, Gen{Gen::Normal, 1.0f, 0});
  for (int i = 0; i < layers; ++i) {
    sh.list.emplace_back();
    auto& s = sh.list.back();
    const std::string p = "layers." + std::to_string(i) + ".", a = p + "attn.";
    sh.add(s, p + "attn_norm.weight", "BF16", {H}, one);
    sh.add(s, p + "ffn_norm.weight", "BF16", {H}, one);
    for (const char* hc : {"hc_attn_", "hc_ffn_"}) {
      sh.add(s, p + hc + "fn", "BF16", {MIX, NHC * H}, mixw);
      sh.add(s, p + hc + "base", "BF16", {MIX}, zero);
      sh.add(s, p + hc + "scale", "BF16", {3}, one);
    }
    sh.add(s, a + "wq_a.weight", "BF16", {QL, H}, w);
    sh.add(s, a + "q_norm.weight", "BF16", {QL}, one);
    sh.add(s, a + "wq_b.weight", "BF16", {NH * D, QL}, w);
    sh.add(s, a + "wkv.weight", "BF16", {D, H}, w);
    sh.add(s, a + "kv_norm.weight", "BF16", {D}, one);
    sh.add(s, a + "wo_a.weight", "BF16", {G * OR, NH * D / G}, w);
    sh.add(s, a + "wo_b.weight", "BF16", {H, G * OR}, w);
    sh.add(s, a + "attn_sink", "BF16", {NH}, zero);
    const int64_t rate = ratios[size_t(i)].get<int64_t>();
    auto comp = [&](const std::string& c, int64_t dim, int64_t series) {
      sh.add(s, c + "wkv.weight", "BF16", {series * dim, H}, w);
      sh.add(s, c + "wgate.weight", "BF16", {series * dim, H}, w);
      sh.add(s, c + "ape", "BF16", {rate, series * dim}, zero);
      sh.add(s, c + "norm.weight", "BF16", {dim}, one);
    };
    comp(a + "compressor.", D, rate == RC ? 2 : 1);
    if (rate == RC) {
      comp(a + "indexer.compressor.", ID, 2);
      sh.add(s, a + "indexer.wq_b.weight", "BF16", {IH * ID, QL}, w);
      sh.add(s, a + "indexer.weights_proj.weight", "BF16", {IH, H}, w);
    }
    sh.add(s, p + "ffn.gate.weight", "BF16", {E, H}, w);
    sh.add(s, p + "ffn.gate.bias", "BF16", {E}, zero);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = p + "ffn.experts." + std::to_string(e) + ".";
      for (const char* m : {"w1", "w3", "w2"}) {
        const bool down = m[1] == '2';
        const int64_t rows = down ? H : I, cols = down ? I : H;
        sh.add(s, x + m + ".weight", "I8", {rows, cols / 2}, blocks);
        sh.add(s, x + m + ".scale", "F8_E8M0", {rows, cols / 32}, scales);
      }
    }
    for (const char* m : {"w1", "w3"}) sh.add(s, p + "ffn.shared_experts." + m + ".weight", "BF16", {I, H}, w);
    sh.add(s, p + "ffn.shared_experts.w2.weight", "BF16", {H, I}, w);
  }
  sh.list.emplace_back();
  sh.add(sh.list.back(), "norm.weight", "BF16", {H}, one);
  sh.add(sh.list.back(), "head.weight", "BF16", {V, H}, w);
  sh.add(sh.list.back(), "hc_head_fn", "BF16", {NHC, NHC * H}, mixw);
  sh.add(sh.list.back(), "hc_head_base", "BF16", {NHC}, zero);
  sh.add(sh.list.back(), "hc_head_scale", "BF16", {1}, one);
  write_shards(dir, sh.list);
}

// DeepSeek-V3.2's shape in transformers' layout (hidden 7168, MLA with 128 heads over a 512 + 64 latent and
// q rank 1536, the lightning indexer 64 x 128 keeping 2048, 256 experts of 2048 top-8 in 8 groups (top 4) plus
// one shared; 61 layers, the first 3 dense), the experts MXFP4 as gpt-oss's (V3.2's own are FP8, which the GPU
// does not serve yet) and only layer 0 dense, so that a cut model is mostly MoE layers; `layers` cuts it short.
void write_v32_checkpoint(const std::string& dir, int layers) {
  const int64_t H = 7168, NH = 128, QL = 1536, R = 512, RO = 64, NO = 128, VD = 128, IH = 64, ID = 128;
  const int64_t E = 256, IM = 2048, I = 18432, V = 129280;
  fs::create_directories(dir);
  json attn = json::array(), mlp = json::array();
  for (int i = 0; i < layers; ++i) attn.push_back("deepseek_sparse_attention"), mlp.push_back(i ? "sparse" : "dense");
  json cfg = {{"architectures", {"DeepseekV32ForCausalLM"}},
              {"model_type", "deepseek_v32"},
              {"vocab_size", V},
              {"hidden_size", H},
              {"intermediate_size", I},
              {"moe_intermediate_size", IM},
              {"num_hidden_layers", layers},
              {"num_attention_heads", NH},
              {"num_key_value_heads", NH},
              {"q_lora_rank", QL},
              {"kv_lora_rank", R},
              {"qk_nope_head_dim", NO},
              {"qk_rope_head_dim", RO},
              {"qk_head_dim", NO + RO},
              {"head_dim", RO},
              {"v_head_dim", VD},
              {"index_n_heads", IH},
              {"index_head_dim", ID},
              {"index_topk", 2048},
              {"n_routed_experts", E},
              {"num_experts_per_tok", 8},
              {"n_shared_experts", 1},
              {"n_group", 8},
              {"topk_group", 4},
              {"norm_topk_prob", true},
              {"routed_scaling_factor", 2.5},
              {"first_k_dense_replace", 1},
              {"layer_types", attn},
              {"mlp_layer_types", mlp},
              {"rope_parameters",
               {{"rope_type", "yarn"},
                {"factor", 40.0},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0},
                {"mscale", 1.0},
                {"mscale_all_dim", 1.0},
                {"original_max_position_embeddings", 4096},
                {"rope_theta", 10000.0}}},
              {"max_position_embeddings", 163840},
              {"rms_norm_eps", 1e-6},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false},
              {"quantization_config",
               {{"quant_method", "mxfp4"},
                {"modules_to_not_convert",
                 {"model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts",
                  "model.layers.0.mlp", "model.embed_tokens", "lm_head"}}}}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  Shards sh;
  const Gen w{Gen::Normal, 0.02f, 0}, one{Gen::Const, 0, 1}, zero{Gen::Const, 0, 0}, blocks{Gen::Bytes},
      scales{Gen::Scales};
  sh.add(sh.list[0], "model.embed_tokens.weight", "BF16", {V, H}, Gen{Gen::Normal, 1.0f, 0});
  for (int i = 0; i < layers; ++i) {
    sh.list.emplace_back();
    auto& s = sh.list.back();
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    sh.add(s, p + "input_layernorm.weight", "BF16", {H}, one);
    sh.add(s, p + "post_attention_layernorm.weight", "BF16", {H}, one);
    sh.add(s, a + "q_a_proj.weight", "BF16", {QL, H}, w);
    sh.add(s, a + "q_a_layernorm.weight", "BF16", {QL}, one);
    sh.add(s, a + "q_b_proj.weight", "BF16", {NH * (NO + RO), QL}, w);
    sh.add(s, a + "kv_a_proj_with_mqa.weight", "BF16", {R + RO, H}, w);
    sh.add(s, a + "kv_a_layernorm.weight", "BF16", {R}, one);
    sh.add(s, a + "kv_b_proj.weight", "BF16", {NH * (NO + VD), R}, w);
    sh.add(s, a + "o_proj.weight", "BF16", {H, NH * VD}, w);
    sh.add(s, a + "indexer.wq_b.weight", "BF16", {IH * ID, QL}, w);
    sh.add(s, a + "indexer.wk.weight", "BF16", {ID, H}, w);
    sh.add(s, a + "indexer.weights_proj.weight", "BF16", {IH, H}, w);
    sh.add(s, a + "indexer.k_norm.weight", "BF16", {ID}, one);
    sh.add(s, a + "indexer.k_norm.bias", "BF16", {ID}, zero);
    if (i == 0) {
      for (const char* x : {"gate_proj", "up_proj"}) sh.add(s, p + "mlp." + x + ".weight", "BF16", {I, H}, w);
      sh.add(s, p + "mlp.down_proj.weight", "BF16", {H, I}, w);
      continue;
    }
    sh.add(s, p + "mlp.gate.weight", "BF16", {E, H}, w);
    sh.add(s, p + "mlp.gate.e_score_correction_bias", "BF16", {E}, zero);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      for (const char* m : {"gate_proj", "up_proj", "down_proj"}) {
        const bool down = m[0] == 'd';
        const int64_t rows = down ? H : IM, cols = down ? IM : H;
        sh.add(s, x + m + ".weight_blocks", "U8", {rows, cols / 32, 16}, blocks);
        sh.add(s, x + m + ".weight_scales", "U8", {rows, cols / 32}, scales);
      }
    }
    for (const char* x : {"gate_proj", "up_proj"})
      sh.add(s, p + "mlp.shared_experts." + x + ".weight", "BF16", {IM, H}, w);
    sh.add(s, p + "mlp.shared_experts.down_proj.weight", "BF16", {H, IM}, w);
  }
  sh.list.emplace_back();
  sh.add(sh.list.back(), "model.norm.weight", "BF16", {H}, one);
  sh.add(sh.list.back(), "lm_head.weight", "BF16", {V, H}, w);
  write_shards(dir, sh.list);
}

// The shards' files (model-0000i-of-0000n.safetensors) and the index, filled by every core.
void write_shards(const std::string& dir, const std::vector<std::vector<TensorSpec>>& shards) {
  const size_t n = shards.size();
  json weight_map = json::object();
  uint64_t total = 0;
  struct Piece {
    int fd;
    const TensorSpec* t;
    size_t file_off, off, len;
  };
  std::vector<Piece> pieces;
  std::vector<int> fds;
  for (size_t si = 0; si < n; ++si) {
    char fname[64];
    std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", si + 1, n);
    json hdr = json::object();
    size_t off = 0;
    for (const TensorSpec& t : shards[si]) {
      hdr[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes()}}};
      off += t.bytes();
      weight_map[t.name] = fname;
    }
    std::string h = hdr.dump();
    h.append((8 - h.size() % 8) % 8, ' ');
    const std::string path = dir + "/" + fname;
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    check(fd >= 0, DZ_ERR_IO, "cannot create ", path);
    fds.push_back(fd);
    const uint64_t hl = h.size();
    check(::pwrite(fd, &hl, 8, 0) == 8 && ::pwrite(fd, h.data(), h.size(), 8) == ssize_t(h.size()), DZ_ERR_IO, "write ",
          path);
    size_t base = 8 + h.size(), to = 0;
    for (const TensorSpec& t : shards[si]) {
      for (size_t o = 0; o < t.bytes(); o += size_t(32) << 20)
        pieces.push_back({fd, &t, base + to + o, o, std::min(size_t(32) << 20, t.bytes() - o)});
      to += t.bytes();
    }
    total += base + off;
  }
  std::atomic<size_t> next{0}, done_bytes{0};
  std::atomic<bool> bad{false};
  std::vector<std::thread> th;
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned k = 0; k < nt; ++k)
    th.emplace_back([&] {
      std::vector<uint8_t> buf(size_t(32) << 20);
      for (size_t i; (i = next++) < pieces.size();) {
        const Piece& p = pieces[i];
        fill(*p.t, p.off, p.len, buf.data());
        if (::pwrite(p.fd, buf.data(), p.len, off_t(p.file_off)) != ssize_t(p.len)) bad = true;
        done_bytes += p.len;
      }
    });
  // Progress every 5 s: a 120b-shaped checkpoint is 65 GB.
  const auto t0 = Clock::now();
  for (size_t shown = 0; next.load() < pieces.size() && !bad;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const size_t s = size_t(secs(t0) / 5);
    if (s > shown) {
      shown = s;
      std::fprintf(stderr, "writing %s: %.1f of %.1f GB\n", dir.c_str(), done_bytes.load() / 1e9, total / 1e9);
    }
  }
  for (auto& t : th) t.join();
  for (int fd : fds) ::close(fd);
  check(!bad, DZ_ERR_IO, "writing the random checkpoint into ", dir, " failed (disk full?)");
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(1);
}

// The library's message names the call already; what only when it has none.
void ok(dz_status s, const char* what) {
  if (s == DZ_OK) return;
  const char* m = dz_last_error();
  if (m && *m) fail(s, m);
  fail(s, what, " failed (status ", int(s), ")");
}

}  // namespace

int bench_model(const Args& a) {
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(
      a,
      with_model_options({"--make-random", "--model", "--prefill", "--prefill-chunk", "--ctx", "--long-ctx", "--steps",
                          "--batch", "--out", "--layers", "--no-eager", "--experts", "--shape", "--write-only"}),
      "bench model");
  try {
    const std::string mk = flag_value(a, "--make-random"), dir = mk.empty() ? flag_value(a, "--model") : mk;
    if (dir.empty()) {
      std::fprintf(stderr, "%s", kUsage);
      return 2;
    }
    const int prefill = std::stoi(flag_value(a, "--prefill", "4096")), ctx = std::stoi(flag_value(a, "--ctx", "128")),
              steps = std::stoi(flag_value(a, "--steps", "32")), batch = std::stoi(flag_value(a, "--batch", "64")),
              long_ctx = std::stoi(flag_value(a, "--long-ctx", "4096"));
    const bool eager = !has_flag(a, "--no-eager");
    json r = bench_meta();
    r["bench"] = "model";
    const std::string shape = flag_value(a, "--shape", "20b");
    if (shape != "20b" && shape != "120b" && shape != "kimi-48b" && shape != "v4-flash" && shape != "v32") {
      std::fprintf(stderr, "dz bench model: --shape takes 20b, 120b, kimi-48b, v4-flash or v32, not '%s'\n",
                   shape.c_str());
      return 2;
    }
    if (!mk.empty()) {
      const bool big = shape == "120b";
      const auto t0 = Clock::now();
      if (shape == "kimi-48b")
        write_kimi_checkpoint(mk, std::stoi(flag_value(a, "--layers", "27")));
      else if (shape == "v4-flash")
        write_v4_checkpoint(mk, std::stoi(flag_value(a, "--layers", "43")));
      else if (shape == "v32")
        write_v32_checkpoint(mk, std::stoi(flag_value(a, "--layers", "61")));
      else
        write_checkpoint(mk, big ? 128 : 32, std::stoi(flag_value(a, "--layers", big ? "36" : "24")));
      r["random_shape"] = shape;
      r["write_random_s"] = secs(t0);
      std::fprintf(stderr, "wrote %s in %.1f s\n", mk.c_str(), secs(t0));
      if (has_flag(a, "--write-only")) return 0;
    }
    dz_model_params mp;
    std::string err;
    const ModelOptionDefaults defaults{"cuda", "precise"};
    if (!parse_model_options(a, &mp, &err, defaults)) {
      std::fprintf(stderr, "dz bench model: %s\n", err.c_str());
      return 2;
    }
    const std::string ex = flag_value(a, "--experts", "auto");
    if (ex != "auto" && ex != "native" && ex != "fp8") {
      std::fprintf(stderr, "dz bench model: --experts takes auto, native or fp8, not '%s'\n", ex.c_str());
      return 2;
    }
    mp.experts = ex == "fp8" ? DZ_EXPERTS_FP8 : ex == "native" ? DZ_EXPERTS_NATIVE : DZ_EXPERTS_AUTO;
    r["experts"] = ex;
    r["attention"] = flag_value(a, "--attention", defaults.attention);
    r["pass_tokens"] = mp.pass_tokens;
    dz_model* m = nullptr;
    auto t0 = Clock::now();
    ok(dz_model_open(dir.c_str(), &mp, &m), "dz_model_open");
    r["load_s"] = secs(t0);
    dz_model_info info;
    dz_model_info_init(&info);
    ok(dz_model_get_info(m, &info), "dz_model_get_info");
    r["device"] = info.device == DZ_DEVICE_CUDA ? "cuda" : "cpu";
    r["checkpoint_bytes"] = info.weight_bytes;
    r["device_weight_bytes"] = info.device_bytes;
    r["shape"] = {{"layers", info.n_layers},     {"hidden", info.hidden_size}, {"heads", info.n_heads},
                  {"kv_heads", info.n_kv_heads}, {"experts", info.n_experts},  {"top_k", info.n_experts_active},
                  {"vocab", info.n_vocab}};
    std::fprintf(stderr, "loaded in %.2f s: %.2f GB on the device (checkpoint %.2f GB)\n", secs(t0),
                 info.device_bytes / 1e9, info.weight_bytes / 1e9);

    // Attention shape from config.json (not in dz_model_info): head_dim, and
    // which layers slide over how many keys (they read at most `window` keys).
    double head_dim = 64, window = 0, n_sliding = 0;
    // Kimi Linear: routed expert bytes (all layers), a sequence's KDA state bytes, MLA latent bytes a token (all
    // layers).
    double kimi_routed = 0, kimi_expert = 0, kimi_state = 0, kimi_latent = 0;
    std::string model_type;
    try {
      std::ifstream cf(dir + "/config.json");
      const json cj = json::parse(cf);
      model_type = cj.value("model_type", std::string());
      if (model_type == "kimi_linear") {
        const json& lc = cj.at("linear_attn_config");
        const double n_kda = double(lc.at("kda_layers").size()), n_mla = double(lc.at("full_attn_layers").size());
        const double n_moe = cj.at("num_hidden_layers").get<double>() - cj.value("first_k_dense_replace", 1.0);
        kimi_expert = 2.0 * 3 * cj.at("hidden_size").get<double>() * cj.at("moe_intermediate_size").get<double>();
        kimi_routed = n_moe * cj.at("num_experts").get<double>() * kimi_expert;
        const double D = lc.at("head_dim").get<double>();
        kimi_state = n_kda * lc.at("num_heads").get<double>() * D * D * 4;
        kimi_latent = n_mla * 2 * (cj.at("kv_lora_rank").get<double>() + cj.at("qk_rope_head_dim").get<double>());
      }
      head_dim = cj.value("head_dim", 64.0);
      window = cj.value("sliding_window", 0.0);
      if (cj.contains("layer_types"))
        for (const auto& t : cj["layer_types"]) n_sliding += t == "sliding_attention" ? 1 : 0;
    } catch (const std::exception&) {
      window = 0, n_sliding = 0;  // unknown: every layer counted at full context
    }

    // Bytes one decode step must read: per layer the dense weights plus the
    // experts in use (batch 1: top-k; batch B: E (1 - (1 - k/E)^B) expected),
    // plus lm_head; bf16 K and V per layer per token, sliding layers at most
    // `window` tokens.
    const double Hd = info.hidden_size, E = info.n_experts, K = info.n_experts_active, L = info.n_layers;
    const double QD = head_dim * info.n_heads, KVD = head_dim * info.n_kv_heads;
    const double dense = 2 * (Hd * (QD + 2 * KVD) + QD * Hd + E * Hd);
    const double expert = (2 * Hd * Hd) * (0.5 + 1.0 / 32) + (Hd * Hd) * (0.5 + 1.0 / 32) + 2 * 3 * Hd;
    const double lm = 2.0 * info.n_vocab * Hd, kv_layer_tok = 2 * KVD * 2;
    // The HBM floor is a GPU figure of gpt-oss's and Kimi Linear's byte counts; other runs report none.
    const bool kimi = model_type == "kimi_linear" && kimi_expert > 0;
    const bool with_floor = info.device == DZ_DEVICE_CUDA && (model_type == "gpt_oss" || kimi);
    auto floor_ms = [&](double b, double ctx_tokens) {
      const double used = E * (1 - std::pow(1 - K / E, b));
      if (kimi) {  // every weight but the embedding table and the experts not in use; states read and written
        const double n_moe = kimi_routed / (E * kimi_expert);
        const double weights =
            double(info.device_bytes) - 2.0 * info.n_vocab * Hd - kimi_routed + n_moe * used * kimi_expert;
        return (weights + b * (2 * kimi_state + ctx_tokens * kimi_latent)) / 4.27e12 * 1e3;
      }
      const double slide = window > 0 ? std::min(ctx_tokens, window) : ctx_tokens;
      const double kv = b * kv_layer_tok * ((L - n_sliding) * ctx_tokens + n_sliding * slide);
      return (L * (dense + used * expert) + lm + kv) / 4.27e12 * 1e3;
    };

    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.page_tokens = 64;
    ap.prefix_cache = 0;
    const int ctx_max = std::max(ctx, long_ctx);
    const uint64_t kv_tokens =
        uint64_t(prefill) * 2 + uint64_t(batch + 1) * uint64_t(ctx_max + 5 * (steps + 2) + 64) + 1024;
    ap.capacity_pages = kv_tokens * 11 / 10 / ap.page_tokens + uint64_t(batch) + 8;  // any family's page size
    dz_kv_arena* arena = nullptr;
    ok(dz_kv_arena_create(m, &ap, &arena), "dz_kv_arena_create");
    {  // What a session costs in cache: bytes per token in the pages, plus its fixed state (recurrent layers,
       // sliding windows, open compressor windows).
      dz_kv_stats ks;
      dz_kv_stats_init(&ks);
      ok(dz_kv_arena_get_stats(arena, &ks), "dz_kv_arena_get_stats");
      r["kv"] = {{"page_tokens", ks.page_tokens},
                 {"page_bytes", ks.page_bytes},
                 {"bytes_per_token", double(ks.page_bytes) / ks.page_tokens},
                 {"state_bytes_per_session", ks.state_bytes}};
      std::fprintf(stderr, "KV cache: %.1f bytes a token + %.1f KiB state a session\n",
                   double(ks.page_bytes) / ks.page_tokens, ks.state_bytes / 1024.0);
    }
    dz_session_params sp;
    dz_session_params_init(&sp);
    sp.prefill_chunk = uint32_t(std::stoul(flag_value(a, "--prefill-chunk", "0")));
    // The first-token runs read 32 tokens from offsets 0..5.
    std::vector<int32_t> prompt(size_t(std::max({prefill, ctx_max, 32 + 6})) + size_t(batch));
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(mix(i) % uint64_t(info.n_vocab));

    // Prefill (one pass of `prefill` tokens): first call warms up, median of 3.
    std::vector<double> pt;
    for (int rep = 0; rep < 4; ++rep) {
      dz_session* s = nullptr;
      ok(dz_session_create(arena, &sp, &s), "dz_session_create");
      t0 = Clock::now();
      ok(dz_session_append(s, prompt.data(), size_t(prefill), DZ_LOGITS_LAST), "prefill");
      if (rep) pt.push_back(secs(t0));
      dz_session_free(s);
    }
    const double pre_s = median(pt);
    r["prefill"] = {{"tokens", prefill},
                    {"chunk", sp.prefill_chunk},
                    {"s", pre_s},
                    {"tokens_per_s", prefill / pre_s},
                    {"runs_s", pt}};
    std::fprintf(stderr, "prefill %d tokens%s: %.1f ms (%.0f tokens/s)\n", prefill,
                 sp.prefill_chunk ? (" in passes of " + std::to_string(sp.prefill_chunk)).c_str() : "", pre_s * 1e3,
                 prefill / pre_s);

    // A chat turn's first token: a 32-token append, then one sample at
    // temperature 0.8 / top_p 0.95 (median of 5 after a warm-up).
    {
      dz_session_params fp = sp;
      fp.sampler.temperature = 0.8f, fp.sampler.top_p = 0.95f;
      std::vector<double> ta, ts;
      for (int rep = 0; rep < 6; ++rep) {
        dz_session* s = nullptr;
        ok(dz_session_create(arena, &fp, &s), "dz_session_create");
        t0 = Clock::now();
        ok(dz_session_append(s, prompt.data() + rep, 32, DZ_LOGITS_LAST), "prefill");
        const double a_s = secs(t0);
        int32_t tok = -1;
        ok(dz_session_sample(s, &tok), "dz_session_sample");
        if (rep) ta.push_back(a_s), ts.push_back(secs(t0) - a_s);
        dz_session_free(s);
      }
      r["first_token"] = {{"prompt_tokens", 32},
                          {"sampler", "temperature 0.8, top_p 0.95"},
                          {"append_ms", median(ta) * 1e3},
                          {"sample_ms", median(ts) * 1e3},
                          {"ms", (median(ta) + median(ts)) * 1e3}};
      std::fprintf(stderr, "first token of a 32-token prompt: append %.2f ms + sample %.2f ms\n", median(ta) * 1e3,
                   median(ts) * 1e3);
    }

    // Decode: b sessions (distinct prompts) prefilled to `context`, then
    // `steps` timed steps (after 2 untimed: the first step of a new shape runs
    // eagerly and the second captures its graph) with CUDA graphs, then as
    // many without (DZ_CUDA_GRAPHS=0) on the same sessions (context + steps + 2).
    struct Timing {
      double graphs_ms = 0, eager_ms = 0, generate_ms = 0, logits_ms = 0, sampled_ms = 0;
      double context_s = 0;  // the sessions' prompts, one append each (a long one: time to first token)
    };
    auto decode = [&](int b, int context) {
      std::vector<dz_session*> ss(static_cast<size_t>(b));
      Timing tm;
      const auto c0 = Clock::now();
      for (size_t i = 0; i < ss.size(); ++i) {
        ok(dz_session_create(arena, &sp, &ss[i]), "dz_session_create");
        ok(dz_session_append(ss[i], prompt.data() + i, size_t(context), DZ_LOGITS_LAST), "prefill");
      }
      tm.context_s = secs(c0);
      if (context >= 16384)
        std::fprintf(stderr, "context: %d x %d tokens appended in %.2f s (%.0f tokens/s)\n", b, context, tm.context_s,
                     double(b) * context / tm.context_s);
      std::vector<int32_t> tok(static_cast<size_t>(b));
      auto run = [&](bool graphs) {
        if (graphs)
          unsetenv("DZ_CUDA_GRAPHS");
        else
          setenv("DZ_CUDA_GRAPHS", "0", 1);
        std::vector<double> t;
        for (int k = 0; k < steps + 2; ++k) {
          for (int i = 0; i < b; ++i) tok[size_t(i)] = int32_t(mix(uint64_t(k * 1000 + i)) % uint64_t(info.n_vocab));
          const auto c0 = Clock::now();
          ok(dz_decode_batch(ss.data(), tok.data(), size_t(b)), "dz_decode_batch");
          if (k >= 2) t.push_back(secs(c0));
        }
        unsetenv("DZ_CUDA_GRAPHS");
        return median(t) * 1e3;
      };
      // dz_generate_step: each session samples (greedy) from its last logits,
      // then the batched step; what a serving loop runs.
      // read_all: dz_decode_batch, then every session's logits row read on the host.
      auto run_generate = [&](bool read_all) {
        std::vector<double> t;
        for (int k = 0; k < steps + 2; ++k) {
          const auto c0 = Clock::now();
          if (read_all) {
            ok(dz_decode_batch(ss.data(), tok.data(), size_t(b)), "dz_decode_batch");
            for (auto s : ss) {
              const float* p;
              size_t rows, nv;
              ok(dz_session_logits(s, &p, &rows, &nv), "dz_session_logits");
            }
          } else {
            ok(dz_generate_step(ss.data(), size_t(b), tok.data()), "dz_generate_step");
          }
          if (k >= 2) t.push_back(secs(c0));
        }
        return median(t) * 1e3;
      };
      tm.graphs_ms = run(true);
      tm.generate_ms = run_generate(false);
      tm.logits_ms = run_generate(true);
      // Sampling at temperature 0.8, top_p 0.95 (rows read on the host, sessions sampled in parallel).
      auto set_temp = [&](float temp) {
        for (size_t i = 0; i < ss.size(); ++i) {
          dz_sampler_params sp;
          dz_sampler_params_init(&sp);
          sp.temperature = temp;
          sp.top_p = temp > 0 ? 0.95f : 1.f;
          sp.seed = i;
          ok(dz_session_set_sampler(ss[i], &sp), "dz_session_set_sampler");
        }
      };
      set_temp(0.8f);
      tm.sampled_ms = run_generate(false);
      set_temp(0.f);
      if (eager) tm.eager_ms = run(false);
      for (auto s : ss) dz_session_free(s);
      return tm;
    };
    json runs = json::array();
    std::vector<int> contexts = {ctx};
    if (long_ctx > 0 && long_ctx != ctx) contexts.push_back(long_ctx);
    std::vector<int> batches = {1};
    if (batch != 1) batches.push_back(batch);
    for (const int b : batches)
      for (const int c : contexts) {
        const Timing tm = decode(b, c);
        const double fl = floor_ms(b, c);
        json e = {{"batch", b},
                  {"ctx", c},
                  {"graphs_ms_per_step", tm.graphs_ms},
                  {"graphs_tokens_per_s", b / tm.graphs_ms * 1e3},
                  {"generate_ms_per_step", tm.generate_ms},
                  {"generate_tokens_per_s", b / tm.generate_ms * 1e3},
                  {"with_logits_read_ms_per_step", tm.logits_ms},
                  {"sampled_ms_per_step", tm.sampled_ms},
                  {"context_append_s", tm.context_s}};
        if (with_floor)
          e["floor_ms"] = fl, e["floor_tokens_per_s"] = b / fl * 1e3, e["graphs_over_floor"] = tm.graphs_ms / fl;
        if (eager) e["eager_ms_per_step"] = tm.eager_ms, e["eager_tokens_per_s"] = b / tm.eager_ms * 1e3;
        std::fprintf(
            stderr,
            "decode batch %d ctx %d: %.3f ms/step%s (%.0f tokens/s), %s%.3f eager; with greedy "
            "sampling (dz_generate_step) %.3f ms/step (%.0f tokens/s), reading every logits row %.3f, sampling at "
            "temperature 0.8 / top_p 0.95 %.3f%s\n",
            b, c, tm.graphs_ms, info.device == DZ_DEVICE_CUDA ? " with CUDA graphs" : "", b / tm.graphs_ms * 1e3,
            eager ? "" : "(skipped) ", tm.eager_ms, tm.generate_ms, b / tm.generate_ms * 1e3, tm.logits_ms,
            tm.sampled_ms, with_floor ? ("; floor " + std::to_string(fl) + " ms").c_str() : "");
        runs.push_back(e);
        if (b == 1 && c == ctx)
          r["decode_batch1"] = {{"ctx", c}, {"ms_per_token", tm.graphs_ms}, {"generate_ms_per_token", tm.generate_ms}};
        if (b == 1 && c == long_ctx) r["decode_batch1_long"] = {{"ctx", c}, {"ms_per_token", tm.graphs_ms}};
        if (with_floor && b == 1 && (c == ctx || c == long_ctx))
          r[c == ctx ? "decode_batch1" : "decode_batch1_long"]["floor_ms"] = fl;
        if (b == batch && b != 1 && c == ctx)
          r["decode_batched"] = {{"batch", b},
                                 {"ctx", c},
                                 {"ms_per_step", tm.graphs_ms},
                                 {"tokens_per_s", b / tm.graphs_ms * 1e3},
                                 {"generate_ms_per_step", tm.generate_ms},
                                 {"generate_tokens_per_s", b / tm.generate_ms * 1e3}};
        if (with_floor && b == batch && b != 1 && c == ctx)
          r["decode_batched"]["floor_ms"] = fl, r["decode_batched"]["floor_tokens_per_s"] = b / fl * 1e3;
      }
    r["decode"] = runs;
    r["note"] =
        std::string(
            "decode steps via dz_decode_batch (CUDA graphs where the family captures them, gpt_oss, unless "
            "DZ_CUDA_GRAPHS=0; 'eager' = without); generate = dz_generate_step with greedy sampling; "
            "with_logits_read = dz_decode_batch then dz_session_logits on every session; sampled = "
            "dz_generate_step at temperature 0.8, top_p 0.95. On the GPU each session's logits row stays on "
            "the device (its argmax computed there) until dz_session_logits reads it; on the CPU rows land in "
            "host memory. ") +
        (kimi ? "Floors count every weight but the embedding table and the routed experts not in use (BF16), each "
                "session's KDA state read and written once and the MLA latents read once, at 4.27e12 B/s"
              : "Floors count weights (MXFP4 experts in use, BF16 dense, lm_head) and bf16 KV read once (sliding "
                "layers: at most the window) at 4.27e12 B/s");
    dz_kv_arena_free(arena);
    dz_model_free(m);
    bench_emit(r, flag_value(a, "--out"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dz bench model: %s\n", e.what());
    return 1;
  }
}

}  // namespace dz::cli
