// Kimi Linear on the CPU backend: the KDA kernels (chunked prefill and
// recurrent decode against a float64 recurrence written here), the short
// convolution, and the whole model against an independent float64 numpy
// implementation (tests/data/kimi_linear_bf16, made by
// tools/reference/kimi_linear_fixtures.py: per-token recurrence, naive
// attention): logits, the recurrent states left in the arena, greedy decode,
// chunked prefill, ragged batches, prefix reuse through state snapshots, and
// failed calls that must leave a session as it was.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cpu/kda.h"
#include "support/family_fixture.h"

namespace {

using dz::test::argmax;
using dz::test::cosine;
using dz::test::FixtureModel;
using dz::test::Reference;
using dz::test::Runner;
const char* kName = "kimi_linear_bf16";

// KDA inputs for one sequence: q, k L2-normalised (q also scaled), g <= 0
// spread from strong to weak decay, beta in (0, 1).
struct KdaInputs {
  dz::cpu::KdaDims d;
  int64_t n;
  std::vector<float> q, k, v, g, beta;
  KdaInputs(int heads, int dim, int64_t n_tokens, uint64_t seed) : n(n_tokens) {
    d.n_heads = heads;
    d.head_dim = dim;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0, 1);
    const size_t P = size_t(d.proj());
    q.resize(size_t(n) * P), k.resize(q.size()), v.resize(q.size()), g.resize(q.size()), beta.resize(size_t(n) * heads);
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (auto& x : g) x = -std::exp(4 * ud(rng) - 5) * (ud(rng) < 0.05f ? 20.0f : 1.0f);
    for (auto& x : beta) x = ud(rng);
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h)
        for (auto* vec : {&q, &k}) {
          float* x = vec->data() + size_t(t) * P + size_t(h) * dim;
          double ss = 0;
          for (int c = 0; c < dim; ++c) ss += double(x[c]) * x[c];
          for (int c = 0; c < dim; ++c) x[c] = float(x[c] / std::sqrt(ss) / (vec == &q ? std::sqrt(dim) : 1.0));
        }
  }
};

// The definition in float64, state [H][D][D] in double.
void kda_f64(const KdaInputs& in, std::vector<double>& S, std::vector<double>& out) {
  const int D = in.d.head_dim, NH = in.d.n_heads;
  const size_t P = size_t(in.d.proj());
  out.assign(size_t(in.n) * P, 0);
  for (int h = 0; h < NH; ++h) {
    double* s = S.data() + size_t(h) * D * D;
    for (int64_t t = 0; t < in.n; ++t) {
      const size_t o = size_t(t) * P + size_t(h) * D;
      for (int r = 0; r < D; ++r)
        for (int c = 0; c < D; ++c) s[r * D + c] *= std::exp(double(in.g[o + size_t(r)]));
      for (int c = 0; c < D; ++c) {
        double mem = 0;
        for (int r = 0; r < D; ++r) mem += s[r * D + c] * in.k[o + size_t(r)];
        const double delta = in.beta[size_t(t) * NH + size_t(h)] * (in.v[o + size_t(c)] - mem);
        for (int r = 0; r < D; ++r) s[r * D + c] += in.k[o + size_t(r)] * delta;
      }
      for (int c = 0; c < D; ++c) {
        double acc = 0;
        for (int r = 0; r < D; ++r) acc += s[r * D + c] * in.q[o + size_t(r)];
        out[o + size_t(c)] = acc;
      }
    }
  }
}

// The float state slice of KDA layer j (in layer order) of a sequence.
const float* kda_state(dz::kv::Sequence& s, const dz::cpu::KdaDims& d, int j) {
  return reinterpret_cast<const float*>(s.state_ptr()) + size_t(j) * d.state_floats();
}

dz::cpu::KdaDims fixture_dims() {
  dz::cpu::KdaDims d;
  d.n_heads = 2, d.head_dim = 16, d.conv_kernel = 4;
  return d;
}
const int kKdaLayers[] = {0, 1, 3};  // model.layers indices of the fixture's KDA layers

}  // namespace

TEST_CASE("KDA: chunked and recurrent forms equal a float64 recurrence, across calls and chunk sizes", "[kimi]") {
  for (int dim : {16, 64}) {
    const KdaInputs in(3, dim, 203, 11 + uint64_t(dim));
    const size_t SS = size_t(in.d.n_heads) * dim * dim, P = size_t(in.d.proj());
    std::vector<double> S64(SS, 0.0), ref;
    kda_f64(in, S64, ref);
    double scale = 0;
    for (double x : ref) scale = std::max(scale, std::fabs(x));
    REQUIRE(scale > 0.1);  // the outputs are not vanishing
    // Split points so calls start mid-chunk and continue a nonzero state.
    for (const std::vector<int64_t>& cuts : std::vector<std::vector<int64_t>>{{203}, {1, 64, 138}, {100, 1, 1, 101}}) {
      for (int chunk : {64, 16, 7, 1, 0}) {  // 0: the recurrent form
        dz::ThreadPool pool(2);
        std::vector<float> S(SS, 0.f), out(ref.size());
        int64_t t0 = 0;
        for (int64_t len : cuts) {
          const size_t o = size_t(t0) * P;
          if (chunk)
            dz::cpu::kda_chunked(in.d, in.q.data() + o, in.k.data() + o, in.v.data() + o, int64_t(P), in.g.data() + o,
                                 int64_t(P), in.beta.data() + size_t(t0) * 3, len, S.data(), out.data() + o, &pool,
                                 chunk);
          else
            dz::cpu::kda_recurrent(in.d, in.q.data() + o, in.k.data() + o, in.v.data() + o, int64_t(P), in.g.data() + o,
                                   int64_t(P), in.beta.data() + size_t(t0) * 3, len, S.data(), out.data() + o, &pool);
          t0 += len;
        }
        REQUIRE(t0 == in.n);
        double err = 0, serr = 0;
        for (size_t i = 0; i < ref.size(); ++i) err = std::max(err, std::fabs(out[i] - ref[i]));
        for (size_t i = 0; i < SS; ++i) serr = std::max(serr, std::fabs(S[i] - S64[i]));
        INFO("D " << dim << ", chunk " << chunk << ", " << cuts.size() << " calls: max |out err| " << err
                  << " (outputs up to " << scale << "), max |state err| " << serr);
        CHECK(err < 2e-5);
        CHECK(serr < 2e-5);
      }
    }
  }
}

TEST_CASE("KDA: the short convolution continues across calls; the gate and norm match their definitions", "[kimi]") {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  const int K = 4;
  const int64_t C = 6, n = 9;
  std::vector<float> x(size_t(n * C)), w(size_t(C * K));
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng);
  std::vector<float> whole(x.size()), parts(x.size()), h1(size_t((K - 1) * C), 0.f), h2(h1);
  dz::cpu::short_conv_silu(x.data(), n, C, C, w.data(), K, h1.data(), whole.data());
  for (auto [t0, len] : {std::pair<int64_t, int64_t>{0, 2}, {2, 1}, {3, 6}})
    dz::cpu::short_conv_silu(x.data() + t0 * C, len, C, C, w.data(), K, h2.data(), parts.data() + t0 * C);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int i = 0; i < K; ++i)
        if (t - (K - 1) + i >= 0) acc += double(w[size_t(c * K + i)]) * x[size_t((t - (K - 1) + i) * C + c)];
      const double want = acc / (1 + std::exp(-acc));
      CHECK(std::fabs(whole[size_t(t * C + c)] - want) < 1e-6);
      CHECK(parts[size_t(t * C + c)] == whole[size_t(t * C + c)]);
    }
  CHECK(h1 == h2);
  CHECK(std::equal(h1.begin(), h1.end(), x.begin() + (n - (K - 1)) * C));  // the last K - 1 inputs
  // kda_prepare: gate and beta.
  dz::cpu::KdaDims d;
  d.n_heads = 2, d.head_dim = 4;
  std::vector<float> q(8), k(8), g(8), beta(2), a_log{0.3f, -1.2f}, dt(8);
  for (auto* v : {&q, &k, &g, &dt}) std::generate(v->begin(), v->end(), [&] { return 3 * nd(rng); });
  g[0] = 40, g[1] = -40;  // softplus at both ends
  beta = {-2.f, 0.5f};
  const std::vector<float> g0 = g, q0 = q;
  dz::cpu::kda_prepare(d, 1, q.data(), k.data(), 8, g.data(), 8, a_log.data(), dt.data(), beta.data());
  for (int c = 0; c < 8; ++c) {
    const double z = double(g0[size_t(c)]) + dt[size_t(c)];
    const double want = -std::exp(double(a_log[size_t(c / 4)])) * std::log1p(std::exp(z));
    CHECK(std::fabs(g[size_t(c)] - want) <= 1e-6 * std::max(1.0, std::fabs(want)));
  }
  CHECK(std::fabs(beta[0] - 1 / (1 + std::exp(2.0))) < 1e-7);
  double ss = 0, qs = 0;
  for (int c = 0; c < 4; ++c) ss += double(q0[size_t(c)]) * q0[size_t(c)];
  for (int c = 0; c < 4; ++c) qs += double(q[size_t(c)]) * q[size_t(c)];
  CHECK(std::fabs(qs - ss / (ss + 1e-6) / 4) < 1e-6);  // unit norm, times d_k^-0.5
}

TEST_CASE("kimi_linear matches a float64 reference: logits, KDA states, greedy decode", "[kimi]") {
  const auto& fx = dz::test::family_fixture(kName);
  FixtureModel model(kName);
  const size_t V = size_t(model.vocab());
  const dz::cpu::KdaDims d = fixture_dims();
  REQUIRE(fx.refs.size() == 3);
  double worst_all = 1, diff_all = 0, state_all = 0;
  for (size_t i = 0; i < fx.refs.size(); ++i) {
    const Reference& ref = fx.refs[i];
    const size_t T = ref.prompt.size();
    Runner run(model);
    const std::vector<float> logits = run.append(ref.prompt);
    const auto [worst, max_diff] = dz::test::compare_logits(logits.data(), ref.logits.data(), T, V);
    // The arena's state slot after the prompt: each KDA layer's convolution history and S.
    double state_diff = 0;
    for (int j = 0; j < 3; ++j) {
      const std::string key = std::to_string(i) + "." + std::to_string(kKdaLayers[j]);
      const std::vector<float>& conv = fx.floats.at("conv." + key);
      const std::vector<float>& S = fx.floats.at("state." + key);
      REQUIRE(conv.size() == d.conv_floats());
      REQUIRE(S.size() == d.state_floats() - d.conv_floats());
      const float* got = kda_state(run.seq(), d, j);
      for (size_t k = 0; k < conv.size(); ++k) state_diff = std::max(state_diff, double(std::fabs(got[k] - conv[k])));
      for (size_t k = 0; k < S.size(); ++k)
        state_diff = std::max(state_diff, double(std::fabs(got[conv.size() + k] - S[k])));
    }
    INFO("prompt " << i << " (T=" << T << "): worst cosine " << worst << ", max |diff| " << max_diff
                   << ", max |state diff| " << state_diff);
    CHECK(worst >= 0.99999);
    CHECK(max_diff < 1e-3);
    CHECK(state_diff < 1e-4);
    worst_all = std::min(worst_all, worst);
    diff_all = std::max(diff_all, max_diff);
    state_all = std::max(state_all, state_diff);
    // Greedy continuation: each step one token through the recurrence and one MLA query.
    const std::vector<int32_t> greedy =
        dz::test::greedy_decode(run, {logits.end() - ptrdiff_t(V), logits.end()}, ref.greedy.size());
    INFO("smallest reference margin " << *std::min_element(ref.margin.begin(), ref.margin.end()));
    CHECK(greedy == ref.greedy);
  }
  WARN("kimi_linear: worst per-position logits cosine " << worst_all << ", max |logit diff| " << diff_all
                                                        << ", max |state diff| " << state_all
                                                        << " against the float64 reference");
}

TEST_CASE("kimi_linear: prefill in any pieces, then decode, equals one full prefill", "[kimi]") {
  FixtureModel model(kName);
  const Reference& ref = dz::test::family_fixture(kName).refs[2];
  const size_t V = size_t(model.vocab()), T = ref.prompt.size();
  const dz::cpu::KdaDims d = fixture_dims();
  Runner full(model);
  const std::vector<float> want = full.append(ref.prompt);
  for (const std::vector<size_t>& cuts :
       std::vector<std::vector<size_t>>{{1, 149}, {64, 64, 22}, {17, 1, 1, 100, 31}}) {
    Runner run(model);
    size_t t0 = 0;
    double diff = 0;
    for (size_t len : cuts) {
      const std::vector<int32_t> part(ref.prompt.begin() + ptrdiff_t(t0), ref.prompt.begin() + ptrdiff_t(t0 + len));
      const std::vector<float> got = run.append(part);
      for (size_t k = 0; k < got.size(); ++k) diff = std::max(diff, double(std::fabs(got[k] - want[t0 * V + k])));
      t0 += len;
    }
    REQUIRE(t0 == T);
    double sdiff = 0;
    for (int j = 0; j < 3; ++j) {
      const float *a = kda_state(run.seq(), d, j), *b = kda_state(full.seq(), d, j);
      for (size_t k = 0; k < d.state_floats(); ++k) sdiff = std::max(sdiff, double(std::fabs(a[k] - b[k])));
    }
    INFO(cuts.size() << " pieces: max |logit diff| " << diff << ", max |state diff| " << sdiff);
    CHECK(diff < 1e-4);
    CHECK(sdiff < 1e-5);
  }
}

TEST_CASE("kimi_linear: a ragged batch computes what each sequence computes alone", "[kimi]") {
  FixtureModel model(kName);
  const auto& refs = dz::test::family_fixture(kName).refs;
  const size_t V = size_t(model.vocab());
  // Alone: prompt prefixes, then two more tokens each.
  const std::vector<size_t> lens = {5, 40, 70};
  std::vector<std::vector<float>> alone;
  for (size_t b = 0; b < lens.size(); ++b) {
    Runner r(model);
    const std::vector<int32_t>& p = refs[b].prompt;
    r.append({p.begin(), p.begin() + ptrdiff_t(std::min(lens[b], p.size()))});
    alone.push_back(r.append({7, 9}));
  }
  Runner r(model);
  for (size_t b = 0; b < lens.size(); ++b) {
    const std::vector<int32_t>& p = refs[b].prompt;
    r.append({p.begin(), p.begin() + ptrdiff_t(std::min(lens[b], p.size()))}, false, b);
  }
  std::vector<dz::ForwardItem> items(lens.size());
  std::vector<std::vector<float>> got(lens.size(), std::vector<float>(2 * V));
  const std::vector<int32_t> two = {7, 9};
  for (size_t b = 0; b < lens.size(); ++b) {
    r.seq(b).reserve(2);
    items[b].seq = &r.seq(b);
    items[b].tokens = two;
    items[b].all_logits = true;
    items[b].logits = got[b].data();
  }
  model.family().forward(items, {});
  for (size_t b = 0; b < lens.size(); ++b) {
    r.seq(b).commit(two);
    double diff = 0;
    for (size_t k = 0; k < 2 * V; ++k) diff = std::max(diff, double(std::fabs(got[b][k] - alone[b][k])));
    INFO("sequence " << b << ": max |diff| " << diff);
    CHECK(diff < 1e-5);
  }
}

TEST_CASE("kimi_linear through the C API: prefix reuse restores snapshots, fork, failed calls change nothing",
          "[kimi]") {
  dz::test::hybrid_session_scenario(kName, 64u << 20, [](dz_kv_arena* arena) {
    // One state slot per session, snapshots at the chunk ends 32 ... 144.
    dz_kv_stats ks;
    dz_kv_stats_init(&ks);
    REQUIRE(dz_kv_arena_get_stats(arena, &ks) == DZ_OK);
    CHECK(ks.state_bytes == 3 * fixture_dims().state_floats() * sizeof(float));
    CHECK(ks.state_slots_used == 3);
    CHECK(ks.state_snapshots_total == 64);
    CHECK(ks.state_snapshots_used == 5);
    CHECK(ks.bytes_total >= (1 + 64 + 64) * ks.state_bytes + ks.pages_total * ks.page_bytes);
  });
}

TEST_CASE("kimi_linear: bad checkpoints fail with clear errors", "[kimi]") {
  const dz::test::ConfigProbe probe(kName);
  const nlohmann::json& base = probe.base;
  const std::vector<dz::test::ConfigProbe::Case> cases = {
      {"RoPE in MLA", [](nlohmann::json& c) { c["mla_use_nope"] = false; }, DZ_ERR_UNSUPPORTED, "mla_use_nope"},
      {"a low-rank query", [](nlohmann::json& c) { c["q_lora_rank"] = 16; }, DZ_ERR_UNSUPPORTED, "q_lora_rank"},
      {"a layer listed twice",
       [](nlohmann::json& c) {
         c["linear_attn_config"]["full_attn_layers"] = {2, 3};
       },
       DZ_ERR_FORMAT, "twice"},
      {"a layer in no list",
       [](nlohmann::json& c) {
         c["linear_attn_config"]["kda_layers"] = {1, 2};
       },
       DZ_ERR_FORMAT, "layer 4"},
      {"no layer kinds", [](nlohmann::json& c) { c.erase("linear_attn_config"); }, DZ_ERR_FORMAT, "kda_layers"},
      {"wrong KDA head size", [](nlohmann::json& c) { c["linear_attn_config"]["head_dim"] = 8; }, DZ_ERR_FORMAT,
       "model.layers.0.self_attn."},
      {"groups that do not divide the experts", [](nlohmann::json& c) { c["num_expert_group"] = 3; }, DZ_ERR_FORMAT,
       "groups"},
      {"a missing layer",
       [](nlohmann::json& c) {
         c["num_hidden_layers"] = 5;
         c["linear_attn_config"]["kda_layers"] = {1, 2, 4, 5};
       },
       DZ_ERR_NOT_FOUND, "model.layers.4."},
      {"softmax router", [](nlohmann::json& c) { c["moe_router_activation_func"] = "softmax"; }, DZ_ERR_UNSUPPORTED,
       "softmax"},
  };
  {
    const auto [st, msg] = probe.open(base);
    INFO(msg);
    REQUIRE(st == DZ_OK);
  }
  {
    // The same model under transformers' and DeepSeek's field names: layer_types instead of the 1-based
    // lists, flat linear-attention sizes, the MoE fields' other spellings.
    nlohmann::json c = base;
    const auto lac = c["linear_attn_config"];
    c.erase("linear_attn_config");
    c["layer_types"] = {"linear_attention", "linear_attention", "full_attention", "linear_attention"};
    c["linear_num_heads"] = lac["num_heads"];
    c["linear_head_dim"] = lac["head_dim"];
    c["linear_conv_kernel_dim"] = lac["short_conv_kernel_size"];
    for (const auto& [from, to] :
         std::vector<std::pair<std::string, std::string>>{{"num_experts", "num_local_experts"},
                                                          {"num_experts_per_token", "num_experts_per_tok"},
                                                          {"num_shared_experts", "n_shared_experts"},
                                                          {"moe_renormalize", "norm_topk_prob"},
                                                          {"num_expert_group", "n_group"},
                                                          {"model_max_length", "max_position_embeddings"}}) {
      c[to] = c[from];
      c.erase(from);
    }
    std::ofstream(probe.dir / "config.json") << c.dump();
    const Reference& ref = dz::test::family_fixture(kName).refs[1];
    FixtureModel renamed(probe.dir.string());
    Runner run(renamed);
    const std::vector<float> logits = run.append(ref.prompt);
    const auto d =
        dz::test::compare_logits(logits.data(), ref.logits.data(), ref.prompt.size(), size_t(renamed.vocab()));
    INFO("other field names: max |logit diff| " << d.max_abs);
    CHECK(d.max_abs < 1e-3);
  }
  probe.check_cases(cases);
}
