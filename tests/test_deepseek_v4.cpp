// DeepSeek-V4 on the CPU backend: its operators (mHC mixing weights, the
// streaming softmax pool of the KV compressors, sqrt-softplus and hash
// routing, the clamped SwiGLU) against float64 definitions written here, and
// the whole model against an independent float64 numpy implementation
// (tests/data/deepseek_v4_tiny, made by tools/reference/deepseek_v4_fixtures.py:
// full-sequence compression and masks, naive attention): logits, greedy
// decode, prefill in pieces, ragged batches, prefix reuse through state
// snapshots, failed calls that must leave a session as it was, bad configs.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cpu/compress.h"
#include "cpu/hyper_connection.h"
#include "cpu/moe.h"
#include "support/api_model.h"
#include "support/family_fixture.h"
#include "support/gpu.h"
#include "support/safetensors_writer.h"

namespace {

using dz::test::cosine;
using dz::test::FixtureModel;
using dz::test::Reference;
using dz::test::Runner;
const char* kName = "deepseek_v4_tiny";

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1) {
  std::normal_distribution<float> nd(0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

}  // namespace

TEST_CASE("mHC: mixing weights, collapse and expand equal their float64 definitions", "[deepseek_v4]") {
  std::mt19937 rng(41);
  for (int n : {1, 2, 4, 6}) {
    dz::cpu::HcDims d;
    d.n = n;
    d.hidden = 37;
    d.sinkhorn_iters = 20;
    d.hc_eps = 1e-6f;
    const int M = (2 + n) * n;
    for (int trial = 0; trial < 20; ++trial) {
      const std::vector<float> mix = randn(size_t(M), rng, 3), base = randn(size_t(M), rng), scale = randn(3, rng);
      std::vector<float> pre(static_cast<size_t>(n)), post(static_cast<size_t>(n)), comb(static_cast<size_t>(n * n));
      dz::cpu::hc_weights(d, mix.data(), base.data(), scale.data(), pre.data(), post.data(), comb.data());
      // float64: softmax rows + eps, columns once, then (rows, columns) 19 times.
      std::vector<double> c(size_t(n * n));
      for (int j = 0; j < n; ++j) {
        double mx = -1e300, s = 0;
        for (int k = 0; k < n; ++k)
          mx = std::max(mx, c[size_t(j * n + k)] =
                                double(mix[size_t(2 * n + j * n + k)]) * scale[2] + base[size_t(2 * n + j * n + k)]);
        for (int k = 0; k < n; ++k) s += std::exp(c[size_t(j * n + k)] - mx);
        for (int k = 0; k < n; ++k) c[size_t(j * n + k)] = std::exp(c[size_t(j * n + k)] - mx) / s + 1e-6;
      }
      for (int it = 0; it < 20; ++it) {
        if (it > 0)
          for (int j = 0; j < n; ++j) {
            double s = 0;
            for (int k = 0; k < n; ++k) s += c[size_t(j * n + k)];
            for (int k = 0; k < n; ++k) c[size_t(j * n + k)] /= s + 1e-6;
          }
        for (int k = 0; k < n; ++k) {
          double s = 0;
          for (int j = 0; j < n; ++j) s += c[size_t(j * n + k)];
          for (int j = 0; j < n; ++j) c[size_t(j * n + k)] /= s + 1e-6;
        }
      }
      double err = 0, col_err = 0, row_err = 0;
      for (int j = 0; j < n; ++j) {
        err = std::max(
            err, std::fabs(pre[size_t(j)] - (sigmoid(double(mix[size_t(j)]) * scale[0] + base[size_t(j)]) + 1e-6)));
        err = std::max(
            err, std::fabs(post[size_t(j)] - 2 * sigmoid(double(mix[size_t(n + j)]) * scale[1] + base[size_t(n + j)])));
        double rs = 0, cs = 0;
        for (int k = 0; k < n; ++k) {
          err = std::max(err, std::fabs(comb[size_t(j * n + k)] - c[size_t(j * n + k)]));
          rs += comb[size_t(j * n + k)], cs += comb[size_t(k * n + j)];
        }
        row_err = std::max(row_err, std::fabs(rs - 1)), col_err = std::max(col_err, std::fabs(cs - 1));
      }
      INFO("n " << n << ": max |diff| " << err << ", row sums off by " << row_err << ", columns by " << col_err);
      CHECK(err < 1e-6);
      CHECK(col_err < 1e-5);  // the last step normalises columns
      CHECK(row_err < 0.1);   // rows converge (Sinkhorn-Knopp; 20 steps leave a few % on peaked logits)
      // Collapse and expand.
      const std::vector<float> x = randn(size_t(n * d.hidden), rng), y = randn(size_t(d.hidden), rng);
      std::vector<float> out(size_t(d.hidden)), xe = x;
      dz::cpu::hc_collapse(d, x.data(), pre.data(), out.data());
      dz::cpu::hc_expand(d, xe.data(), y.data(), post.data(), comb.data());
      double cerr = 0;
      for (int64_t h = 0; h < d.hidden; ++h) {
        double s = 0;
        for (int j = 0; j < n; ++j) s += double(pre[size_t(j)]) * x[size_t(j * d.hidden + h)];
        cerr = std::max(cerr, std::fabs(out[size_t(h)] - s));
        for (int k = 0; k < n; ++k) {
          double e = double(post[size_t(k)]) * y[size_t(h)];
          for (int j = 0; j < n; ++j) e += double(comb[size_t(j * n + k)]) * x[size_t(j * d.hidden + h)];
          cerr = std::max(cerr, std::fabs(xe[size_t(k * d.hidden + h)] - e));
        }
      }
      CHECK(cerr < 1e-5);
    }
  }
}

TEST_CASE("compressor pool: streaming softmax equals the batch softmax over the window", "[deepseek_v4]") {
  std::mt19937 rng(7);
  const int64_t D = 19;
  for (int64_t m : {1, 4, 8, 128}) {
    for (float spread : {0.5f, 5.0f, 60.0f}) {  // 60: logits far apart, the running max moves often
      const std::vector<float> v = randn(size_t(m * D), rng), g = randn(size_t(m * D), rng, spread),
                               bias = randn(size_t(m * D), rng);
      std::vector<float> pool(size_t(dz::cpu::pool_floats(D)), 0.0f), out(static_cast<size_t>(D));
      dz::cpu::pool_result(pool.data(), D, out.data());
      CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0; }));  // empty
      for (int64_t s = 0; s < m; ++s)
        dz::cpu::pool_push(pool.data(), D, v.data() + s * D, g.data() + s * D, bias.data() + s * D);
      dz::cpu::pool_result(pool.data(), D, out.data());
      double err = 0;
      for (int64_t c = 0; c < D; ++c) {
        double mx = -1e300, z = 0, acc = 0;
        for (int64_t s = 0; s < m; ++s) mx = std::max(mx, double(g[size_t(s * D + c)]) + bias[size_t(s * D + c)]);
        for (int64_t s = 0; s < m; ++s) {
          const double e = std::exp(double(g[size_t(s * D + c)]) + bias[size_t(s * D + c)] - mx);
          z += e, acc += e * v[size_t(s * D + c)];
        }
        err = std::max(err, std::fabs(out[size_t(c)] - acc / z));
      }
      INFO("window " << m << ", logit spread " << spread << ": max |diff| " << err);
      CHECK(err < 2e-5);
      dz::cpu::pool_clear(pool.data(), D);
      CHECK(std::all_of(pool.begin(), pool.end(), [](float x) { return x == 0; }));
    }
  }
}

TEST_CASE("sqrt-softplus routing (scored and hashed) and the clamped SwiGLU match their definitions", "[deepseek_v4]") {
  std::mt19937 rng(3);
  const int E = 16, k = 4;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> logits = randn(E, rng, 4), bias = randn(E, rng, 0.3f);
    logits[0] = 30;  // softplus's linear branch
    std::vector<int32_t> idx(k), want(E);
    std::vector<float> w(k);
    dz::cpu::router_sqrt_softplus(logits.data(), bias.data(), E, k, nullptr, 1.5f, idx.data(), w.data());
    std::vector<double> s(E);
    for (int e = 0; e < E; ++e) s[size_t(e)] = std::sqrt(std::log1p(std::exp(double(logits[size_t(e)]))));
    for (int e = 0; e < E; ++e) want[size_t(e)] = e;
    std::sort(want.begin(), want.end(),
              [&](int a, int b) { return s[size_t(a)] + bias[size_t(a)] > s[size_t(b)] + bias[size_t(b)]; });
    std::vector<int32_t> got = idx;
    std::sort(got.begin(), got.end());
    std::vector<int32_t> top(want.begin(), want.begin() + k);
    std::sort(top.begin(), top.end());
    CHECK(got == top);
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s[size_t(idx[size_t(j)])];
    for (int j = 0; j < k; ++j) CHECK(w[size_t(j)] == Approx(s[size_t(idx[size_t(j)])] / sum * 1.5).epsilon(1e-6));
    // Hashed: the table's experts, weighted the same way.
    const int32_t fixed[k] = {5, 1, 9, 2};
    dz::cpu::router_sqrt_softplus(logits.data(), nullptr, E, k, fixed, 1.0f, idx.data(), w.data());
    sum = 0;
    for (int j = 0; j < k; ++j) sum += s[size_t(fixed[j])];
    for (int j = 0; j < k; ++j) {
      CHECK(idx[size_t(j)] == fixed[j]);
      CHECK(w[size_t(j)] == Approx(s[size_t(fixed[j])] / sum).epsilon(1e-6));
    }
  }
  dz::cpu::Glu g;
  g.kind = dz::cpu::Glu::Kind::ClampedSwiGLU;
  g.limit = 1.25f;
  const int64_t I = 64;
  const std::vector<float> h = randn(size_t(2 * I), rng, 2);
  std::vector<float> out(static_cast<size_t>(I));
  dz::cpu::glu(g, h.data(), I, out.data());
  int clamped = 0;
  for (int64_t i = 0; i < I; ++i) {
    const double a = std::min(double(h[size_t(i)]), 1.25), u = std::clamp(double(h[size_t(I + i)]), -1.25, 1.25);
    clamped += h[size_t(i)] > 1.25 || std::fabs(h[size_t(I + i)]) > 1.25;
    CHECK(out[size_t(i)] == Approx(a * sigmoid(a) * u).margin(1e-6));
  }
  CHECK(clamped > 0);
}

// The fixture also holds transformers 5.17's DeepseekV4ForCausalLM logits (float32, CPU) on the same weights
// (tools/reference/deepseek_v4_fixtures.py --transformers, run on the GPU machine, where transformers is).
TEST_CASE("deepseek_v4 matches a float64 reference and transformers: logits and greedy decode", "[deepseek_v4]") {
  const auto& fx = dz::test::family_fixture(kName);
  FixtureModel model(kName);
  const size_t V = size_t(model.vocab());
  REQUIRE(fx.refs.size() == 3);
  double worst_all = 1, diff_all = 0, hf_diff_all = 0;
  for (size_t i = 0; i < fx.refs.size(); ++i) {
    const Reference& ref = fx.refs[i];
    const size_t T = ref.prompt.size();
    Runner run(model);
    const std::vector<float> logits = run.append(ref.prompt);
    const auto [worst, max_diff] = dz::test::compare_logits(logits.data(), ref.logits.data(), T, V);
    INFO("prompt " << i << " (T=" << T << "): worst cosine " << worst << ", max |diff| " << max_diff);
    CHECK(worst >= 0.99999);
    CHECK(max_diff < 1e-3);
    worst_all = std::min(worst_all, worst);
    diff_all = std::max(diff_all, max_diff);
    const auto hf = fx.floats.find("hf_logits." + std::to_string(i));
    REQUIRE(hf != fx.floats.end());
    REQUIRE(hf->second.size() == T * V);
    const auto [hf_worst, hf_diff] = dz::test::compare_logits(logits.data(), hf->second.data(), T, V);
    INFO("against transformers: worst cosine " << hf_worst << ", max |diff| " << hf_diff);
    CHECK(hf_worst >= 0.99999);
    CHECK(hf_diff < 5e-5);
    for (size_t t = 0; t < T; ++t)
      CHECK(dz::test::argmax(&logits[t * V], V) == dz::test::argmax(&hf->second[t * V], V));
    hf_diff_all = std::max(hf_diff_all, hf_diff);
    const std::vector<int32_t> greedy =
        dz::test::greedy_decode(run, {logits.end() - ptrdiff_t(V), logits.end()}, ref.greedy.size());
    INFO("smallest reference margin " << *std::min_element(ref.margin.begin(), ref.margin.end()));
    CHECK(greedy == ref.greedy);
  }
  WARN("deepseek_v4: worst per-position logits cosine " << worst_all << ", max |logit diff| " << diff_all
                                                        << " against the float64 reference, " << hf_diff_all
                                                        << " against transformers 5.17");
}

TEST_CASE("deepseek_v4: prefill in any pieces, then decode, equals one full prefill", "[deepseek_v4]") {
  FixtureModel model(kName);
  const Reference& ref = dz::test::family_fixture(kName).refs[2];
  const size_t V = size_t(model.vocab()), T = ref.prompt.size();
  for (uint32_t page : {16u, 5u}) {  // 5: entries straddle pages
    Runner full(model, page, 512);
    const std::vector<float> want = full.append(ref.prompt);
    for (const std::vector<size_t>& cuts :
         std::vector<std::vector<size_t>>{{1, 149}, {64, 64, 22}, {17, 1, 1, 100, 31}, {3, 5, 7, 11, 13, 111}}) {
      Runner run(model, page, 512);
      size_t t0 = 0;
      double diff = 0;
      for (size_t len : cuts) {
        const std::vector<int32_t> part(ref.prompt.begin() + ptrdiff_t(t0), ref.prompt.begin() + ptrdiff_t(t0 + len));
        const std::vector<float> got = run.append(part);
        for (size_t k = 0; k < got.size(); ++k) diff = std::max(diff, double(std::fabs(got[k] - want[t0 * V + k])));
        t0 += len;
      }
      REQUIRE(t0 == T);
      INFO("page " << page << ", " << cuts.size() << " pieces: max |logit diff| " << diff);
      CHECK(diff < 1e-4);
    }
  }
}

TEST_CASE("deepseek_v4: a ragged batch computes what each sequence computes alone", "[deepseek_v4]") {
  FixtureModel model(kName);
  const auto& refs = dz::test::family_fixture(kName).refs;
  const size_t V = size_t(model.vocab());
  const std::vector<size_t> lens = {5, 31, 70};
  const std::vector<int32_t> more = {7, 9, 11, 200, 3};
  std::vector<std::vector<float>> alone;
  for (size_t b = 0; b < lens.size(); ++b) {
    Runner r(model);
    const std::vector<int32_t>& p = refs[b].prompt;
    r.append({p.begin(), p.begin() + ptrdiff_t(std::min(lens[b], p.size()))});
    alone.push_back(r.append(more));
  }
  Runner r(model);
  for (size_t b = 0; b < lens.size(); ++b) {
    const std::vector<int32_t>& p = refs[b].prompt;
    r.append({p.begin(), p.begin() + ptrdiff_t(std::min(lens[b], p.size()))}, false, b);
  }
  std::vector<dz::ForwardItem> items(lens.size());
  std::vector<std::vector<float>> got(lens.size(), std::vector<float>(more.size() * V));
  for (size_t b = 0; b < lens.size(); ++b) {
    r.seq(b).reserve(more.size());
    items[b].seq = &r.seq(b);
    items[b].tokens = more;
    items[b].all_logits = true;
    items[b].logits = got[b].data();
  }
  model.family().forward(items, {});
  for (size_t b = 0; b < lens.size(); ++b) {
    r.seq(b).commit(more);
    double diff = 0;
    for (size_t k = 0; k < more.size() * V; ++k) diff = std::max(diff, double(std::fabs(got[b][k] - alone[b][k])));
    INFO("sequence " << b << ": max |diff| " << diff);
    CHECK(diff < 1e-5);
  }
}

TEST_CASE("deepseek_v4 through the C API: prefix reuse restores snapshots, fork, failed calls change nothing",
          "[deepseek_v4]") {
  dz::test::hybrid_session_scenario(kName, 16u << 20, [](dz_kv_arena* arena) {
    // The state slot holds the windows and the open compressor pools: 4 layers x 8 x 32 (windows), 2 CSA layers x
    // (2 x 3 x 32 + 2 x 3 x 16), 1 HCA layer x 3 x 32 floats.
    dz_kv_stats ks;
    dz_kv_stats_init(&ks);
    REQUIRE(dz_kv_arena_get_stats(arena, &ks) == DZ_OK);
    CHECK(ks.state_bytes == (4 * 8 * 32 + 2 * (6 * 32 + 6 * 16) + 3 * 32) * sizeof(float));
    CHECK(ks.state_slots_used == 3);
  });
}

TEST_CASE("deepseek_v4: bad checkpoints fail with clear errors", "[deepseek_v4]") {
  const dz::test::ConfigProbe probe(kName);
  const std::vector<dz::test::ConfigProbe::Case> cases = {
      {"an unknown layer type", [](nlohmann::json& c) { c["layer_types"][1] = "full_attention"; }, DZ_ERR_FORMAT,
       "layer_types[1]"},
      {"an unknown MoE layer type", [](nlohmann::json& c) { c["mlp_layer_types"][0] = "dense"; }, DZ_ERR_FORMAT,
       "mlp_layer_types[0]"},
      {"another router score", [](nlohmann::json& c) { c["scoring_func"] = "softmax"; }, DZ_ERR_UNSUPPORTED,
       "scoring_func"},
      {"several KV heads", [](nlohmann::json& c) { c["num_key_value_heads"] = 2; }, DZ_ERR_UNSUPPORTED,
       "num_key_value_heads"},
      {"o_groups not dividing the heads", [](nlohmann::json& c) { c["o_groups"] = 3; }, DZ_ERR_FORMAT, "o_groups"},
      {"a rotary dimension above the indexer's",
       [](nlohmann::json& c) {
         for (const char* k : {"main", "compress"}) c["rope_parameters"][k]["partial_rotary_factor"] = 0.75;
       },
       DZ_ERR_FORMAT, "exceeds head_dim 32 or index_head_dim 16"},
      {"rotary dimensions that differ by layer type",
       [](nlohmann::json& c) { c["rope_parameters"]["main"]["partial_rotary_factor"] = 0.5; }, DZ_ERR_UNSUPPORTED,
       "rotary dimensions differ"},
      {"a shape that disagrees with the tensors", [](nlohmann::json& c) { c["q_lora_rank"] = 48; }, DZ_ERR_FORMAT,
       "q_a_proj"},
      {"a hash layer where the checkpoint has a scored router",
       [](nlohmann::json& c) { c["mlp_layer_types"][2] = "hash_moe"; }, DZ_ERR_NOT_FOUND, "tid2eid"},
  };
  probe.check_cases(cases);
  // The checkpoint's own spellings: compress_ratios and num_hash_layers open the same model.
  nlohmann::json legacy = probe.base;
  legacy.erase("layer_types");
  legacy.erase("mlp_layer_types");
  legacy.erase("compress_rates");
  legacy["compress_ratios"] = {0, 4, 128, 4};
  legacy["num_hash_layers"] = 2;
  legacy["compress_rate_hca"] = 16;  // where the fixture's HCA rate differs from 128
  // compress_ratios name rates 4 and 128 only: 128 marks the HCA layer, compress_rate_hca sets its rate.
  // The rope fields flat, as DeepSeek's config.json has them: rope_theta for sliding layers, compress_rope_theta
  // and rope_scaling (YaRN) for the compressed ones.
  const nlohmann::json comp = legacy["rope_parameters"]["compress"];
  legacy.erase("rope_parameters");
  legacy["rope_scaling"] = {{"type", "yarn"},
                            {"factor", comp["factor"]},
                            {"original_max_position_embeddings", comp["original_max_position_embeddings"]},
                            {"beta_fast", comp["beta_fast"]},
                            {"beta_slow", comp["beta_slow"]}};
  legacy["qk_rope_head_dim"] = 8;
  legacy.erase("partial_rotary_factor");
  const auto [st, msg] = probe.open(legacy);
  INFO(msg);
  REQUIRE(st == DZ_OK);
  const Reference& ref = dz::test::family_fixture(kName).refs[1];
  FixtureModel renamed(probe.dir.string());
  Runner run(renamed);
  const std::vector<float> logits = run.append(ref.prompt);
  const auto d = dz::test::compare_logits(logits.data(), ref.logits.data(), ref.prompt.size(), size_t(renamed.vocab()));
  INFO("DeepSeek's config fields: max |logit diff| " << d.max_abs);
  CHECK(d.max_abs < 1e-3);
}

namespace {

// The fixture's tensors by name (transformers layout), as raw bytes.
std::map<std::string, dz::test::RawTensor> fixture_tensors() {
  dz::WeightStore ws(dz::test::kFixtureData + "/" + kName);
  std::map<std::string, dz::test::RawTensor> out;
  for (const auto& [name, t] : ws.all())
    out[name] = {name, dz::dtype_name(t->dtype), t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)};
  return out;
}

std::vector<float> as_f32(const dz::test::RawTensor& t) {
  size_t n = 1;
  for (int64_t d : t.shape) n *= size_t(d);
  std::vector<float> v(n);
  REQUIRE((t.dtype == "F32" || t.dtype == "BF16"));
  for (size_t i = 0; i < n; ++i) {
    if (t.dtype == "F32") {
      std::memcpy(&v[i], t.bytes.data() + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, t.bytes.data() + 2 * i, 2);
      v[i] = float(dz::test::bf16_to_double(b));
    }
  }
  return v;
}

dz::test::RawTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  dz::test::RawTensor t{name, "F32", std::move(shape), std::vector<uint8_t>(v.size() * 4)};
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

// E4M3 values and E2M1 values, decoded here from their bit fields.
float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8, e - 7);
  return s ? -mag : mag;
}
float e2m1_value(uint8_t c) {
  static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  return (c & 8) ? -mag[c & 7] : mag[c & 7];
}
// The nearest code of a value table (the first on ties); codes whose value is NaN are skipped.
template <class F>
uint8_t nearest_code(float x, int n_codes, F value) {
  uint8_t best = 0;
  float err = INFINITY;
  for (int c = 0; c < n_codes; ++c) {
    const float v = value(uint8_t(c));
    if (std::isnan(v)) continue;
    if (std::fabs(v - x) < err) err = std::fabs(v - x), best = uint8_t(c);
  }
  return best;
}

// W [rows x cols] as E4M3 with a power-of-two scale per 128x128 block (E8M0 bytes); deq gets the values it
// stands for.
std::pair<dz::test::RawTensor, dz::test::RawTensor> quantize_fp8(const std::string& base, int64_t rows, int64_t cols,
                                                                 const std::vector<float>& w, std::vector<float>& deq) {
  const int64_t B = 128, rb = (rows + B - 1) / B, cb = (cols + B - 1) / B;
  dz::test::RawTensor q{base + ".weight", "F8_E4M3", {rows, cols}, std::vector<uint8_t>(size_t(rows * cols))};
  dz::test::RawTensor s{base + ".scale", "F8_E8M0", {rb, cb}, std::vector<uint8_t>(size_t(rb * cb))};
  deq.assign(w.size(), 0);
  for (int64_t bi = 0; bi < rb; ++bi)
    for (int64_t bj = 0; bj < cb; ++bj) {
      float amax = 0;
      for (int64_t r = bi * B; r < std::min(rows, (bi + 1) * B); ++r)
        for (int64_t c = bj * B; c < std::min(cols, (bj + 1) * B); ++c)
          amax = std::max(amax, std::fabs(w[size_t(r * cols + c)]));
      const int e = amax > 0 ? int(std::ceil(std::log2(amax / 448.0f))) : 0;
      s.bytes[size_t(bi * cb + bj)] = uint8_t(e + 127);
      const float scale = std::ldexp(1.0f, e);
      for (int64_t r = bi * B; r < std::min(rows, (bi + 1) * B); ++r)
        for (int64_t c = bj * B; c < std::min(cols, (bj + 1) * B); ++c) {
          const uint8_t code = nearest_code(w[size_t(r * cols + c)] / scale, 256, e4m3_value);
          q.bytes[size_t(r * cols + c)] = code;
          deq[size_t(r * cols + c)] = e4m3_value(code) * scale;
        }
    }
  return {q, s};
}

// W [rows x cols] as FP4 E2M1 pairs (first value in the low nibble) with an E8M0 scale per 32 columns.
std::pair<dz::test::RawTensor, dz::test::RawTensor> quantize_fp4(const std::string& base, int64_t rows, int64_t cols,
                                                                 const std::vector<float>& w, std::vector<float>& deq) {
  dz::test::RawTensor q{base + ".weight", "I8", {rows, cols / 2}, std::vector<uint8_t>(size_t(rows * cols / 2))};
  dz::test::RawTensor s{base + ".scale", "F8_E8M0", {rows, cols / 32}, std::vector<uint8_t>(size_t(rows * cols / 32))};
  deq.assign(w.size(), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / 32; ++g) {
      float amax = 0;
      for (int64_t c = g * 32; c < g * 32 + 32; ++c) amax = std::max(amax, std::fabs(w[size_t(r * cols + c)]));
      const int e = amax > 0 ? int(std::ceil(std::log2(amax / 6.0f))) : 0;
      s.bytes[size_t(r * (cols / 32) + g)] = uint8_t(e + 127);
      const float scale = std::ldexp(1.0f, e);
      for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
        const uint8_t code = nearest_code(w[size_t(r * cols + c)] / scale, 16, e2m1_value);
        q.bytes[size_t((r * cols + c) / 2)] |= uint8_t(c % 2 ? code << 4 : code);
        deq[size_t(r * cols + c)] = e2m1_value(code) * scale;
      }
    }
  return {q, s};
}

// DeepSeek's name for a transformers name of the fixture (experts aside).
std::string native_name(const std::string& hf) {
  static const std::pair<const char*, const char*> top[] = {
      {"model.embed_tokens.weight", "embed.weight"}, {"lm_head.weight", "head.weight"},
      {"model.norm.weight", "norm.weight"},          {"model.hc_head.hc_fn", "hc_head_fn"},
      {"model.hc_head.hc_base", "hc_head_base"},     {"model.hc_head.hc_scale", "hc_head_scale"}};
  for (const auto& [a, b] : top)
    if (hf == a) return b;
  static const std::pair<const char*, const char*> layer[] = {
      {"self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"},
      {"self_attn.compressor.indexer.kv_proj", "attn.indexer.compressor.wkv"},
      {"self_attn.compressor.indexer.gate_proj", "attn.indexer.compressor.wgate"},
      {"self_attn.compressor.indexer.kv_norm", "attn.indexer.compressor.norm"},
      {"self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"},
      {"self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"},
      {"self_attn.compressor.position_bias", "attn.compressor.ape"},
      {"self_attn.compressor.kv_proj", "attn.compressor.wkv"},
      {"self_attn.compressor.gate_proj", "attn.compressor.wgate"},
      {"self_attn.compressor.kv_norm", "attn.compressor.norm"},
      {"self_attn.sinks", "attn.attn_sink"},
      {"self_attn.q_a_proj", "attn.wq_a"},
      {"self_attn.q_b_proj", "attn.wq_b"},
      {"self_attn.q_a_norm", "attn.q_norm"},
      {"self_attn.kv_proj", "attn.wkv"},
      {"self_attn.kv_norm", "attn.kv_norm"},
      {"self_attn.o_a_proj", "attn.wo_a"},
      {"self_attn.o_b_proj", "attn.wo_b"},
      {"input_layernorm", "attn_norm"},
      {"post_attention_layernorm", "ffn_norm"},
      {"attn_hc.", "hc_attn_"},
      {"ffn_hc.", "hc_ffn_"},
      {"mlp.gate.e_score_correction_bias", "ffn.gate.bias"},
      {"mlp.gate.", "ffn.gate."},
      {"mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"},
      {"mlp.shared_experts.up_proj", "ffn.shared_experts.w3"},
      {"mlp.shared_experts.down_proj", "ffn.shared_experts.w2"}};
  const std::string pre = "model.layers.";
  REQUIRE(hf.rfind(pre, 0) == 0);
  const size_t dot = hf.find('.', pre.size());
  const std::string idx = hf.substr(pre.size(), dot - pre.size()), rest = hf.substr(dot + 1);
  for (const auto& [a, b] : layer)
    if (rest.rfind(a, 0) == 0) return "layers." + idx + "." + b + rest.substr(std::strlen(a));
  FAIL("no native name for " << hf);
  return {};
}

// The fixture in DeepSeek's own layout (native) and, in transformers' layout, its twin holding the same values;
// quantised: the q/kv/output projections and shared experts in FP8, the routed experts in FP4 (the twin holds
// their decoded values, in F32).
void native_checkpoint(bool quantised, std::vector<dz::test::RawTensor>& native,
                       std::vector<dz::test::RawTensor>& twin) {
  const auto hf = fixture_tensors();
  const int64_t E = 8, I = 32, H = 64;
  for (const auto& [name, t] : hf) {
    const bool experts = name.find("mlp.experts.") != std::string::npos;
    const bool fp8 = quantised && (name.find("q_b_proj.weight") != std::string::npos ||
                                   name.find("self_attn.kv_proj.weight") != std::string::npos ||
                                   name.find("o_b_proj.weight") != std::string::npos ||
                                   name.find("shared_experts.") != std::string::npos);
    if (experts) {
      if (name.find("gate_up_proj") == std::string::npos && name.find("down_proj") == std::string::npos) continue;
      const bool up = name.find("gate_up_proj") != std::string::npos;
      const std::vector<float> w = as_f32(t);
      std::vector<float> twin_w(w.size());
      const std::string layer =
          name.substr(std::strlen("model.layers."), name.find(".mlp") - std::strlen("model.layers."));
      const int64_t rows = up ? 2 * I : H, cols = up ? H : I;
      for (int64_t e = 0; e < E; ++e) {
        const std::string base = "layers." + layer + ".ffn.experts." + std::to_string(e) + ".";
        for (int part = 0; part < (up ? 2 : 1); ++part) {
          const int64_t n = up ? I : H;
          const std::vector<float> sub(w.begin() + (e * rows + part * n) * cols,
                                       w.begin() + (e * rows + part * n + n) * cols);
          const std::string wname = base + (up ? (part ? "w3" : "w1") : "w2");
          std::vector<float> deq = sub;
          if (quantised) {
            auto [q, s] = quantize_fp4(wname, n, cols, sub, deq);
            native.push_back(q), native.push_back(s);
          } else {
            native.push_back(f32_tensor(wname + ".weight", {n, cols}, sub));
          }
          std::copy(deq.begin(), deq.end(), twin_w.begin() + (e * rows + part * n) * cols);
        }
      }
      twin.push_back(f32_tensor(name, t.shape, twin_w));
      continue;
    }
    const std::string nn = native_name(name);
    if (fp8) {
      std::vector<float> deq;
      auto [q, s] =
          quantize_fp8(nn.substr(0, nn.size() - std::strlen(".weight")), t.shape[0], t.shape[1], as_f32(t), deq);
      native.push_back(q), native.push_back(s);
      twin.push_back(f32_tensor(name, t.shape, deq));
    } else {
      dz::test::RawTensor c = t;
      c.name = nn;
      native.push_back(c);
      twin.push_back(t);
    }
  }
}

}  // namespace

TEST_CASE("deepseek_v4 from DeepSeek's own checkpoint layout: names, per-expert tensors, FP8 and FP4 weights",
          "[deepseek_v4]") {
  namespace fs = std::filesystem;
  const Reference& ref = dz::test::family_fixture(kName).refs[1];
  const size_t V = 320, T = ref.prompt.size();
  nlohmann::json cfg;
  std::ifstream(fs::path(dz::test::kFixtureData) / kName / "config.json") >> cfg;
  auto run = [&](const fs::path& dir, const std::vector<dz::test::RawTensor>& ts) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    dz::test::write_sharded(dir, ts, 2);
    std::ofstream(dir / "config.json") << cfg.dump();
    FixtureModel m(dir.string());
    Runner r(m);
    return r.append(ref.prompt);
  };
  for (const bool quantised : {false, true}) {
    std::vector<dz::test::RawTensor> native, twin;
    native_checkpoint(quantised, native, twin);
    const fs::path tmp = dz::test::temp_dir("dsv4-native");
    const std::vector<float> a = run(tmp / "native", native), b = run(tmp / "twin", twin);
    const auto [worst, diff] = dz::test::compare_logits(a.data(), b.data(), T, V);
    INFO((quantised ? "FP8/FP4" : "BF16")
         << " native layout against its transformers-layout twin: worst cosine " << worst << ", max |diff| " << diff);
    CHECK(diff < 1e-5);
    if (!quantised) {  // the same values: the same logits as the fixture, and its reference
      const auto [w2, d2] = dz::test::compare_logits(a.data(), ref.logits.data(), T, V);
      CHECK(d2 < 1e-3);
    } else {  // quantisation moved the values, so the comparison above was not of identical checkpoints
      const auto [w2, d2] = dz::test::compare_logits(a.data(), ref.logits.data(), T, V);
      INFO("FP8/FP4 against the BF16 reference: worst cosine " << w2 << ", max |diff| " << d2);
      CHECK(d2 > 1e-2);
    }
    fs::remove_all(tmp);
  }
}

// DeepSeek's own layout with FP8 projections and FP4 routed experts on the GPU
// (the FP4 experts stay MXFP4 on the device: cuda::MoeLayer with V4's clamped
// SwiGLU, the fused kernels (NATIVE) and AUTO's choice) against the CPU on the
// same checkpoint; tolerances as tests/test_deepseek_v4_cuda.cpp states them.
TEST_CASE("deepseek_v4 on the GPU from DeepSeek's layout with FP8 and FP4 weights matches the CPU",
          "[cuda][deepseek_v4]") {
  if (!dz::test::have_gpu()) return;
  namespace fs = std::filesystem;
  std::vector<dz::test::RawTensor> native, twin;
  native_checkpoint(true, native, twin);
  const fs::path dir = dz::test::temp_dir("dsv4-native-gpu");
  dz::test::write_sharded(dir, native, 2);
  nlohmann::json cfg;
  std::ifstream(fs::path(dz::test::kFixtureData) / kName / "config.json") >> cfg;
  cfg["index_topk"] = 4096;  // the indexer keeps every entry
  std::ofstream(dir / "config.json") << cfg.dump();
  const Reference& ref = dz::test::family_fixture(kName).refs[2];
  const size_t V = 320, T = ref.prompt.size();
  for (const dz_expert_precision ex : {DZ_EXPERTS_NATIVE, DZ_EXPERTS_AUTO}) {
    dz::test::ApiModel gpu(dir.string(), DZ_DEVICE_CUDA, nullptr, ex), cpu(dir.string(), DZ_DEVICE_CPU);
    dz_session *gs = gpu.session(), *cs = cpu.session();
    const std::vector<float> g = dz::test::append_logits(gs, ref.prompt), h = dz::test::append_logits(cs, ref.prompt);
    double worst = 1, sum = 0;
    size_t below = 0, below99 = 0;
    for (size_t t = 0; t < T; ++t) {
      const double cv = cosine(g.data() + t * V, h.data() + t * V, V);
      worst = std::min(worst, cv), sum += cv, below += cv < 0.999, below99 += cv < 0.99;
    }
    WARN("deepseek_v4 GPU, DeepSeek's layout, FP8 projections and FP4 experts ("
         << (ex == DZ_EXPERTS_NATIVE ? "NATIVE" : "AUTO") << "): logits cosine vs CPU worst " << worst << ", mean "
         << sum / double(T) << ", " << below << " of " << T << " rows below 0.999, " << below99 << " below 0.99");
    if (ex == DZ_EXPERTS_NATIVE) {  // BF16 activations: as the fixture's test
      CHECK(sum / double(T) >= 0.997);
      CHECK(below * 10 <= T);
    } else {  // the FP8 path also rounds the experts' activations to FP8 (3 mantissa bits): more flipped routes
      CHECK(sum / double(T) >= 0.995);
      CHECK(below99 * 10 <= T);
    }
    dz_session_free(gs);
    dz_session_free(cs);
  }
  fs::remove_all(dir);
}
