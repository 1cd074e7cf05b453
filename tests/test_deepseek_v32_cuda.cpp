// DeepSeek-V3.2 on the CUDA backend against the CPU backend (FP8 indexer: the
// GPU's indexer arithmetic) and transformers, on the MXFP4 fixture and the
// default model; ragged batches against sessions alone. Skipped (with a
// message) without a GPU; without one, DZ_DEVICE_CUDA must fail cleanly.
//
// Tolerances. The GPU rounds the projections' inputs to BF16 and caches the
// latent in BF16; the CPU computes in fp32. Discrete choices amplify that
// rounding: a token whose experts nearly tie may take others (and then its
// latent in later layers, which every later token attends to, differs), and
// both backends score the indexer on E4M3 keys and queries of slightly
// different vectors, so where two keys' scores nearly tie the selections
// differ. The random fixture is full of such ties (the CPU's own FP8 and
// exact indexer modes agree on 72-96% of its selections); the trained
// default model much less so.
//  - Arithmetic, with no discrete choice left: every position selected
//    (index_topk past the prompts) and every expert routed (top-k = all, all
//    groups), DZ_EXPERTS_NATIVE (the experts' FP16 path at every size):
//    every row's logits cosine against the CPU >= 0.999; greedy continuations
//    equal, or diverging where the CPU's top two logits lie within 0.05.
//  - The checkpoints' own configs, NATIVE: against transformers >= 0.999 at
//    the rows whose visible positions index_topk covers, except rows whose
//    route lies within kNearRoute of another (counted, reported); the mean
//    cosine against the CPU >= 0.9995 for the default model.
//  - AUTO (FP8 experts, E4M3 activations, in long prompts): the default
//    model's mean >= 0.999. The random fixture's means are reported and only
//    guarded against garbage (>= 0.9).
// The selections themselves are held to the CPU on identical E4M3 bytes by
// the indexer's own GPU tests.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "api/handles.h"
#include "dayzero.h"
#include "model/deepseek_v32.h"
#include "runtime/device.h"
#include "support/api_model.h"
#include "support/family_fixture.h"
#include "support/gpu.h"
#include "support/safetensors_writer.h"

namespace {

using dz::test::ApiModel;
using dz::test::append_logits;
using dz::test::cosine;
using dz::test::have_gpu;
// The CPU backend with the GPU's indexer arithmetic.
void fp8_indexer(dz_model_params& p) { p.indexer = DZ_INDEXER_FP8; }

// Greedy steps from the session's state; the logits row before each choice.
std::vector<int32_t> greedy(dz_session* s, size_t steps, std::vector<std::vector<float>>* rows) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < steps; ++i) {
    rows->push_back(dz::test::session_last_logits(s));
    int32_t t = -1;
    INFO(dz_last_error());
    REQUIRE(dz_generate_step(&s, 1, &t) == DZ_OK);
    out.push_back(t);
  }
  return out;
}

// The CPU family's routing margins, each row's smallest over the MoE layers.
struct RouteMargins {
  dz::DsaTrace trace;
  std::vector<float> rows;
  explicit RouteMargins(dz_model* cpu) {
    trace.on_route = [this](int, const float* m, int64_t n) {
      if (rows.size() < size_t(n)) rows.resize(size_t(n), INFINITY);
      for (int64_t r = 0; r < n; ++r) rows[size_t(r)] = std::min(rows[size_t(r)], m[r]);
    };
    dz::deepseek_v32_set_trace(*cpu->family, &trace);
  }
};
// A route this close to another choice may flip under the GPU's BF16
// rounding of the router's input (sigmoid scores move by ~1e-3 at most).
constexpr float kNearRoute = 0.005f;

double top2_margin(const std::vector<float>& v) {
  std::vector<float> c(v);
  std::partial_sort(c.begin(), c.begin() + 2, c.end(), std::greater<float>());
  return double(c[0]) - double(c[1]);
}

struct Case {
  const char* name;
  std::string model_dir, fixture;  // the reference's fixture folder
};

}  // namespace

TEST_CASE("deepseek_v32 DZ_DEVICE_CUDA without a GPU fails cleanly; with one, AUTO takes it", "[cuda]") {
  // DZ_INDEXER_EXACT is not on the GPU: a clear error either way.
  dz::test::check_auto_and_refusal(
      std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny", [](dz_model_params& p) { p.indexer = DZ_INDEXER_EXACT; },
      "DZ_INDEXER_EXACT");
}

TEST_CASE("deepseek_v32 on the GPU: logits match the CPU backend and transformers; greedy decode", "[cuda]") {
  if (!have_gpu()) return;
  const Case cases[] = {{"deepseek_v32_mxfp4", std::string(DZ_TEST_DATA) + "/deepseek_v32_mxfp4", "deepseek_v32_mxfp4"},
                        {"dayzero-tiny", std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny", "dayzero_tiny"}};
  for (const Case& c : cases) {
    SECTION(c.name) {
      const dz::test::FamilyFixture& fx = dz::test::family_fixture(c.fixture);
      dz::test::ConfigProbe probe(c.model_dir);
      const size_t topk = probe.base["index_topk"].get<size_t>();
      const struct {
        bool all_selected;
        dz_expert_precision experts;
      } variants[] = {{true, DZ_EXPERTS_NATIVE}, {false, DZ_EXPERTS_NATIVE}, {false, DZ_EXPERTS_AUTO}};
      for (const auto& vr : variants) {
        const bool all_selected = vr.all_selected, native = vr.experts == DZ_EXPERTS_NATIVE;
        nlohmann::json cfg = probe.base;
        if (all_selected) {  // no discrete choice: every position, every expert
          cfg["index_topk"] = 1024;
          cfg["num_experts_per_tok"] = cfg["n_routed_experts"];
          cfg["topk_group"] = cfg["n_group"];
        }
        const std::string dir = probe.with(cfg);
        ApiModel gpu(dir, DZ_DEVICE_CUDA, nullptr, vr.experts), cpu(dir, DZ_DEVICE_CPU, fp8_indexer);
        dz_model_info info;
        dz_model_info_init(&info);
        REQUIRE(dz_model_get_info(gpu.m, &info) == DZ_OK);
        REQUIRE(info.device == DZ_DEVICE_CUDA);
        RouteMargins rm(cpu.m);
        double worst = 1, sum = 0, worst_ref = 1;
        size_t n = 0, near = 0, diverged = 0;
        for (const dz::test::Reference& ref : fx.refs) {
          const size_t T = ref.prompt.size(), V = ref.logits.size() / T;
          dz_session *gs = gpu.session(), *cs = cpu.session();
          rm.rows.assign(T, INFINITY);
          const std::vector<float> g = append_logits(gs, ref.prompt), h = append_logits(cs, ref.prompt);
          for (size_t t = 0; t < T; ++t) {
            const double cv = cosine(g.data() + t * V, h.data() + t * V, V);
            sum += cv, ++n;
            if (native && !all_selected && rm.rows[t] < kNearRoute) {  // BF16 rounding may pick other experts
              ++near;
              continue;
            }
            worst = std::min(worst, cv);
            if (t < topk && !all_selected)
              worst_ref = std::min(worst_ref, cosine(g.data() + t * V, ref.logits.data() + t * V, V));
          }
          if (all_selected) {
            std::vector<std::vector<float>> grow, crow;
            const size_t steps = std::min<size_t>(ref.greedy.size(), 8);
            const std::vector<int32_t> gg = greedy(gs, steps, &grow), cg = greedy(cs, steps, &crow);
            const size_t d = size_t(std::mismatch(gg.begin(), gg.end(), cg.begin()).first - gg.begin());
            if (d < steps) {
              ++diverged;
              INFO(c.name << ": greedy diverges at step " << d << ", CPU top-2 margin " << top2_margin(crow[d]));
              CHECK(top2_margin(crow[d]) < 0.05);
            }
            for (size_t i = 0; i < std::min(d + 1, steps); ++i)
              CHECK(cosine(grow[i].data(), crow[i].data(), V) >= 0.999);
          }
          dz_session_free(gs);
          dz_session_free(cs);
        }
        dz::deepseek_v32_set_trace(*cpu.m->family, nullptr);
        const double mean = sum / double(n);
        WARN(c.name << (all_selected ? " (every position and expert" : " (index_topk " + std::to_string(topk))
                    << (native ? ", NATIVE experts)" : ", AUTO experts)")
                    << ": GPU vs CPU (FP8 indexer) logits cosine worst " << worst << ", mean " << mean
                    << "; vs transformers where index_topk covers every position, worst " << worst_ref << "; "
                    << diverged << " greedy continuations diverge at a near-tie; " << near << " of " << n
                    << " rows left out of the worst cases (a route within " << kNearRoute << " of another)");
        const bool trained = c.fixture == std::string("dayzero_tiny");
        if (native && !all_selected) CHECK(worst_ref >= 0.999);
        if (all_selected)
          CHECK(worst >= 0.999);
        else
          CHECK(mean >= (trained ? (native ? 0.9995 : 0.999) : 0.9));
      }
    }
  }
}

TEST_CASE("deepseek_v32 on the GPU: a ragged batch computes what each session computes alone", "[cuda]") {
  if (!have_gpu()) return;
  const std::string dir = std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny";
  ApiModel gpu(dir, DZ_DEVICE_CUDA);
  const dz::test::FamilyFixture& fx = dz::test::family_fixture("dayzero_tiny");
  REQUIRE(fx.refs.size() >= 2);
  const std::vector<int32_t>&p0 = fx.refs[0].prompt, &p1 = fx.refs[1].prompt;
  // Alone.
  std::vector<int32_t> alone0, alone1;
  std::vector<std::vector<float>> l0, l1;
  {
    dz_session *a = gpu.session(), *b = gpu.session();
    append_logits(a, p0);
    append_logits(b, p1);
    alone0 = greedy(a, 6, &l0);
    alone1 = greedy(b, 6, &l1);
    dz_session_free(a);
    dz_session_free(b);
  }
  // Together: both prompts in one step's batch, then batched decode steps.
  dz_session* s[2] = {gpu.session(), gpu.session()};
  REQUIRE(dz_session_append(s[0], p0.data(), p0.size(), DZ_LOGITS_LAST) == DZ_OK);
  REQUIRE(dz_session_append(s[1], p1.data(), p1.size(), DZ_LOGITS_LAST) == DZ_OK);
  std::vector<int32_t> both0, both1;
  double worst = 1;
  for (int i = 0; i < 6; ++i) {
    worst = std::min({worst, cosine(dz::test::session_last_logits(s[0]).data(), l0[size_t(i)].data(), l0[0].size()),
                      cosine(dz::test::session_last_logits(s[1]).data(), l1[size_t(i)].data(), l1[0].size())});
    int32_t t[2] = {-1, -1};
    INFO(dz_last_error());
    REQUIRE(dz_generate_step(s, 2, t) == DZ_OK);
    both0.push_back(t[0]);
    both1.push_back(t[1]);
  }
  WARN("batched vs alone: worst logits cosine " << worst);
  CHECK(worst >= 0.9999);
  CHECK(both0 == alone0);
  CHECK(both1 == alone1);
  dz_session_free(s[0]);
  dz_session_free(s[1]);
}

// DeepSeek's own MLA shape (a 512 + 64 latent, 16 heads: the tensor-core
// sparse attention) in a random two-layer checkpoint written here, with no
// discrete choice (every position selected, every expert routed): the
// arithmetic against the CPU backend, prefill and decode steps.
TEST_CASE("deepseek_v32 on the GPU at DeepSeek's latent shape (tensor-core sparse MLA) matches the CPU", "[cuda]") {
  if (!have_gpu()) return;
  namespace fs = std::filesystem;
  const int64_t H = 256, NH = 16, QL = 128, R = 512, RO = 64, NO = 128, VD = 128, IH = 64, ID = 128, V = 512;
  const int64_t I = 512, IM = 128, E = 16;
  std::mt19937 rng(32);
  dz::test::RandomTensors rt{rng, {}};
  auto mat = [&](const std::string& n, int64_t rows, int64_t cols) { rt.mat(n, rows, cols); };
  auto vec = [&](const std::string& n, int64_t len, float base, float sd) { rt.vec(n, len, base, sd); };
  auto fp4 = [&](const std::string& n, int64_t rows, int64_t cols) { rt.fp4(n, rows, cols); };
  mat("model.embed_tokens.weight", V, H);
  mat("lm_head.weight", V, H);
  vec("model.norm.weight", H, 1.f, 0.1f);
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".", a = p + "self_attn.";
    vec(p + "input_layernorm.weight", H, 1.f, 0.1f);
    vec(p + "post_attention_layernorm.weight", H, 1.f, 0.1f);
    mat(a + "q_a_proj.weight", QL, H);
    vec(a + "q_a_layernorm.weight", QL, 1.f, 0.1f);
    mat(a + "q_b_proj.weight", NH * (NO + RO), QL);
    mat(a + "kv_a_proj_with_mqa.weight", R + RO, H);
    vec(a + "kv_a_layernorm.weight", R, 1.f, 0.1f);
    mat(a + "kv_b_proj.weight", NH * (NO + VD), R);
    mat(a + "o_proj.weight", H, NH * VD);
    mat(a + "indexer.wq_b.weight", IH * ID, QL);
    mat(a + "indexer.wk.weight", ID, H);
    mat(a + "indexer.weights_proj.weight", IH, H);
    vec(a + "indexer.k_norm.weight", ID, 1.f, 0.1f);
    vec(a + "indexer.k_norm.bias", ID, 0.f, 0.1f);
    if (l == 0) {
      mat(p + "mlp.gate_proj.weight", I, H);
      mat(p + "mlp.up_proj.weight", I, H);
      mat(p + "mlp.down_proj.weight", H, I);
      continue;
    }
    mat(p + "mlp.gate.weight", E, H);
    vec(p + "mlp.gate.e_score_correction_bias", E, 0.f, 0.01f);
    for (int e = 0; e < E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      fp4(x + "gate_proj", IM, H);
      fp4(x + "up_proj", IM, H);
      fp4(x + "down_proj", H, IM);
    }
    mat(p + "mlp.shared_experts.gate_proj.weight", IM, H);
    mat(p + "mlp.shared_experts.up_proj.weight", IM, H);
    mat(p + "mlp.shared_experts.down_proj.weight", H, IM);
  }
  const fs::path dir = dz::test::temp_dir("dsv32-mla512");
  dz::test::write_safetensors(dir / "model.safetensors", rt.ts);
  nlohmann::json cfg;
  std::ifstream(std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny/config.json") >> cfg;
  cfg["hidden_size"] = H, cfg["num_attention_heads"] = NH, cfg["num_key_value_heads"] = NH, cfg["q_lora_rank"] = QL;
  cfg["kv_lora_rank"] = R, cfg["qk_rope_head_dim"] = RO, cfg["qk_nope_head_dim"] = NO, cfg["v_head_dim"] = VD;
  cfg["qk_head_dim"] = NO + RO, cfg["head_dim"] = RO, cfg["index_n_heads"] = IH, cfg["index_head_dim"] = ID;
  cfg["index_topk"] = 2048, cfg["vocab_size"] = V, cfg["num_hidden_layers"] = 2, cfg["intermediate_size"] = I;
  cfg["moe_intermediate_size"] = IM, cfg["n_routed_experts"] = E, cfg["num_experts_per_tok"] = E;
  cfg["n_group"] = 1, cfg["topk_group"] = 1, cfg["mlp_layer_types"] = {"dense", "sparse"};
  cfg["layer_types"] = {"deepseek_sparse_attention", "deepseek_sparse_attention"};
  cfg["quantization_config"]["modules_to_not_convert"] = {
      "model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts",
      "model.layers.0.mlp",       "model.embed_tokens",      "lm_head"};
  std::ofstream(dir / "config.json") << cfg.dump(2);
  {
    ApiModel gpu(dir.string(), DZ_DEVICE_CUDA, nullptr, DZ_EXPERTS_NATIVE),
        cpu(dir.string(), DZ_DEVICE_CPU, fp8_indexer);
    dz_session *gs = gpu.session(), *cs = cpu.session();
    const double worst = dz::test::worst_cosine_prefill_decode(gs, cs, int32_t(V), 90, 4, rng);
    WARN("MLA 512 + 64 x 16 heads: GPU vs CPU worst logits cosine " << worst << " (90-token prefill, 4 decode steps)");
    CHECK(worst >= 0.999);
    dz_session_free(gs);
    dz_session_free(cs);
  }
  fs::remove_all(dir);
}

// Decode steps replayed from CUDA graphs against the same steps launched
// eagerly, bit for bit, and against the CPU backend (graph_decode_check in
// support/api_model.h): 150 steps from prompts of 3, 40 and 77 tokens cross
// 16-token pages, the padded page count's and the indexer grid's power-of-two
// buckets and the default model's index_topk (64).
TEST_CASE("deepseek_v32 on the GPU: decode steps as CUDA graphs equal eager steps bitwise and match the CPU",
          "[cuda]") {
  if (!have_gpu()) return;
  // Steps not replayed: the first of each key (eager, setting up plans and scratch) and the one after a scratch
  // buffer grew, a handful of keys over these steps. Against the CPU, forced tokens out of the model's
  // distribution meet routing and indexer near-ties (an H200 saw 12 of 450 rows below 0.999 at batch 3, median
  // 0.999995).
  dz::test::expect_graph_decode("deepseek_v32", std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny", fp8_indexer, 16,
                                0.9995);
}
