// gpt-oss on the CUDA backend against transformers' float32 outputs for the
// tiny fixture and against the CPU backend; sessions batched and alone; the
// device holds the checkpoint's bytes (experts stay MXFP4). Skipped (with a
// message) without a GPU; without one, DZ_DEVICE_CUDA must fail cleanly.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "api/handles.h"
#include "dayzero.h"
#include "loader/safetensors.h"
#include "model/gpt_oss.h"
#include "runtime/device.h"
#include "support/gpu.h"

namespace {

const std::string kDir = std::string(DZ_TEST_DATA) + "/gpt_oss_tiny";

using dz::test::have_gpu;

struct Ref {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> logits, margin;
};

std::vector<Ref> refs() {
  dz::SafetensorsFile f(kDir + "/reference.safetensors");
  std::vector<Ref> r;
  const auto& ts = f.tensors();
  auto ints = [](const dz::TensorView& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    for (size_t k = 0; k < v.size(); ++k) {
      int64_t x;
      std::memcpy(&x, t.data + 8 * k, 8);
      v[k] = int32_t(x);
    }
    return v;
  };
  auto floats = [](const dz::TensorView& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  };
  for (int i = 0; ts.count("prompt." + std::to_string(i)); ++i) {
    const std::string s = std::to_string(i);
    r.push_back({ints(ts.at("prompt." + s)), ints(ts.at("greedy." + s)), floats(ts.at("logits." + s)),
                 floats(ts.at("margin." + s))});
  }
  return r;
}

struct Model {
  dz_model* m = nullptr;
  explicit Model(dz_device dev, dz_expert_precision experts = DZ_EXPERTS_AUTO,
                 dz_activation_precision act = DZ_ACTIVATIONS_AUTO, int exact_moe_layers = 0,
                 dz_attention_precision attention = DZ_ATTENTION_AUTO, uint32_t pass_tokens = 0) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.device = dev;
    p.experts = experts;
    p.activations = act;
    p.exact_moe_layers = exact_moe_layers;
    p.attention = attention;
    p.pass_tokens = pass_tokens;
    p.n_threads = 2;
    const dz_status st = dz_model_open(kDir.c_str(), &p, &m);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
  }
  ~Model() { dz_model_free(m); }
};

struct Arena {
  dz_kv_arena* a = nullptr;
  Arena(const Model& m, uint32_t page_tokens) {
    dz_kv_arena_params p;
    dz_kv_arena_params_init(&p);
    p.page_tokens = page_tokens;
    p.capacity_bytes = uint64_t(16) << 20;
    INFO(dz_last_error());
    REQUIRE(dz_kv_arena_create(m.m, &p, &a) == DZ_OK);
  }
  ~Arena() { dz_kv_arena_free(a); }
};

struct Session {
  dz_session* s = nullptr;
  explicit Session(const Arena& a, uint32_t chunk = 0) {
    dz_session_params p;
    dz_session_params_init(&p);
    p.prefill_chunk = chunk;
    REQUIRE(dz_session_create(a.a, &p, &s) == DZ_OK);
  }
  ~Session() { dz_session_free(s); }
  std::vector<float> append(const std::vector<int32_t>& t, dz_logits_mode mode) {
    const dz_status st = dz_session_append(s, t.data(), t.size(), mode);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
    const float* p = nullptr;
    size_t rows = 0, v = 0;
    REQUIRE(dz_session_logits(s, &p, &rows, &v) == DZ_OK);
    return std::vector<float>(p, p + rows * v);
  }
};

double cosine(const float* a, const float* b, size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < n; ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

}  // namespace

TEST_CASE("DZ_DEVICE_CUDA without a GPU fails cleanly; AUTO falls back to the CPU", "[cuda]") {
  if (dz::cuda_compiled() && dz::cuda_device_count() > 0) {
    Model m(DZ_DEVICE_AUTO);
    dz_model_info info;
    dz_model_info_init(&info);
    REQUIRE(dz_model_get_info(m.m, &info) == DZ_OK);
    CHECK(info.device == DZ_DEVICE_CUDA);
    return;
  }
  dz_model_params p;
  dz_model_params_init(&p);
  p.device = DZ_DEVICE_CUDA;
  dz_model* m = nullptr;
  const dz_status st = dz_model_open(kDir.c_str(), &p, &m);
  CHECK((st == DZ_ERR_DEVICE || st == DZ_ERR_UNSUPPORTED));
  CHECK(m == nullptr);
  CHECK(std::string(dz_last_error()).find("CUDA") != std::string::npos);
  Model a(DZ_DEVICE_AUTO);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(a.m, &info) == DZ_OK);
  CHECK(info.device == DZ_DEVICE_CPU);
}

// Experts: NATIVE keeps the fused MXFP4 path (FP16 activations) at every
// batch size; AUTO switches to the FP8 (E4M3 activations) path above 16 tokens
// per expert, i.e. for the T=33 and T=80 prompts here: reported, and only
// guarded against garbage, since this tiny random model amplifies rounding.
//
// The GPU feeds BF16 activations to its GEMMs. This random model has router
// top-4 margins as small as 0.001 (fp32, T=80 prompt), so BF16 rounding alone
// flips some routes at T=80: the CPU backend with the same rounding
// (DZ_ACTIVATIONS_BF16) reproduces the GPU's deviation from the fp32 reference
// (min cosine 0.9486 on the CPU, 0.9482 on the GPU). So the GPU must match
// (a) the CPU with the same rounding at every position, except at a row whose
//     own route is a near-tie there (top-4 margin < 0.01 in some layer, where
//     accumulation order alone can decide), and
// (b) transformers and the fp32 CPU wherever that rounding alone does not move
//     the CPU's logits;
// and such exceptions stay rare.
TEST_CASE("gpt-oss on the GPU: logits match transformers and the CPU backend; device bytes ~ checkpoint", "[cuda]") {
  if (!have_gpu()) return;
  Model gpu(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE), cpu(DZ_DEVICE_CPU), autom(DZ_DEVICE_CUDA, DZ_EXPERTS_AUTO);
  Model cpub(DZ_DEVICE_CPU, DZ_EXPERTS_AUTO, DZ_ACTIVATIONS_BF16);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(gpu.m, &info) == DZ_OK);
  CHECK(info.device == DZ_DEVICE_CUDA);
  const double ratio = double(info.device_bytes) / double(info.weight_bytes);
  std::printf("gpt_oss_tiny on CUDA: device weight bytes %llu, checkpoint %llu (ratio %.4f)\n",
              (unsigned long long)info.device_bytes, (unsigned long long)info.weight_bytes, ratio);
  // Only fp32 copies of the small vectors (norms, biases, sinks) exceed the checkpoint's BF16.
  CHECK(ratio > 0.95);
  CHECK(ratio < 1.10);
  Arena ga(gpu, 16), ca(cpu, 16), aa(autom, 16), ba(cpub, 16);
  const size_t V = size_t(info.n_vocab);
  size_t excused_total = 0, near_tie_total = 0, positions = 0;
  std::vector<float> margins;  // CPU with BF16 activations: [layer][row] router top-4 margins
  dz::gpt_oss_set_router_trace(*cpub.m->family, &margins);
  for (const Ref& r : refs()) {
    Session gs(ga), cs(ca), as(aa), bs(ba, 1024);  // one pass: margins of every row in one trace
    const std::vector<float> al = as.append(r.prompt, DZ_LOGITS_ALL);
    double worst_auto = 1;
    for (size_t t = 0; t < r.prompt.size(); ++t)
      worst_auto = std::min(worst_auto, cosine(al.data() + t * V, r.logits.data() + t * V, V));
    // The FP8 path above MoeOptions::fused_max_tokens_per_expert (14) tokens an expert (top-4 of 8 experts), or
    // up to 16 the streamed W4A8 kernels: the FP8 path's looser bound from 14.
    const bool fp8_path = r.prompt.size() * 4 > 14 * 8;
    std::printf("gpt_oss_tiny CUDA experts AUTO T=%zu (%s path): min cosine vs transformers %.6f\n", r.prompt.size(),
                fp8_path ? "FP8" : "fused", worst_auto);
    CHECK(worst_auto >= (fp8_path ? 0.9 : 0.999));
    margins.clear();
    const std::vector<float> g = gs.append(r.prompt, DZ_LOGITS_ALL), c = cs.append(r.prompt, DZ_LOGITS_ALL),
                             b = bs.append(r.prompt, DZ_LOGITS_ALL);
    REQUIRE(g.size() == r.logits.size());
    const size_t T = r.prompt.size();
    REQUIRE(margins.size() == size_t(info.n_layers) * T);
    double worst_ref = 1, worst_cpu = 1, worst_same = 1, worst_same_kept = 1, worst_ref_kept = 1;
    size_t excused = 0, near_ties = 0;
    for (size_t t = 0; t < T; ++t) {
      const double vs_ref = cosine(g.data() + t * V, r.logits.data() + t * V, V);
      const double vs_cpu = cosine(g.data() + t * V, c.data() + t * V, V);
      const double vs_same = cosine(g.data() + t * V, b.data() + t * V, V);
      const double rounding_alone = cosine(b.data() + t * V, r.logits.data() + t * V, V);
      worst_ref = std::min(worst_ref, vs_ref);
      worst_cpu = std::min(worst_cpu, vs_cpu);
      worst_same = std::min(worst_same, vs_same);
      float margin = INFINITY;
      for (int l = 0; l < info.n_layers; ++l) margin = std::min(margin, margins[size_t(l) * T + t]);
      INFO("T=" << T << " position " << t << ": GPU vs transformers " << vs_ref << ", vs CPU " << vs_cpu
                << ", vs CPU with BF16 activations " << vs_same << "; CPU with BF16 activations vs transformers "
                << rounding_alone << "; smallest router top-4 margin of this row (CPU, BF16 activations) " << margin);
      if (vs_same < 0.999) {
        ++near_ties;
        std::printf("  T=%zu position %zu: GPU vs CPU with BF16 activations %.6f at a router near-tie (margin %.5f)\n",
                    T, t, vs_same, double(margin));
        CHECK(margin < 0.01f);
        continue;
      }
      worst_same_kept = std::min(worst_same_kept, vs_same);
      if (rounding_alone < 0.999) {
        ++excused;  // a route flipped by BF16 rounding: the same on the CPU
        continue;
      }
      worst_ref_kept = std::min(worst_ref_kept, std::min(vs_ref, vs_cpu));
      CHECK(vs_ref >= 0.999);
      CHECK(vs_cpu >= 0.999);
    }
    excused_total += excused;
    near_tie_total += near_ties;
    positions += T;
    std::printf(
        "gpt_oss_tiny CUDA experts NATIVE T=%zu: vs CPU with BF16 activations min cosine %.6f (%.6f away "
        "from %zu near-tie rows); vs transformers %.6f, vs CPU %.6f (%zu positions where BF16 rounding alone "
        "flips a route on the CPU too; elsewhere min %.6f)\n",
        T, worst_same, worst_same_kept, near_ties, worst_ref, worst_cpu, excused, worst_ref_kept);
  }
  dz::gpt_oss_set_router_trace(*cpub.m->family, nullptr);
  // Exceptions stay rare: not a blanket excuse.
  CHECK(excused_total * 10 <= positions);
  CHECK(near_tie_total * 40 <= positions);
}

TEST_CASE("gpt-oss on the GPU: DZ_ATTENTION_BF16 prefills track PRECISE and transformers", "[cuda]") {
  if (!have_gpu()) return;
  Model precise(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE),
      bf16(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE, DZ_ACTIVATIONS_AUTO, 0, DZ_ATTENTION_BF16);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(precise.m, &info) == DZ_OK);
  const size_t V = size_t(info.n_vocab);
  Arena pa(precise, 16), ba(bf16, 16);
  double worst_pair = 1, worst_ref = 1, moved = 0;
  size_t positions = 0, off = 0;  // positions, and those below 0.999 against two terms
  for (const Ref& r : refs()) {
    Session ps(pa), bs(ba);
    const std::vector<float> p = ps.append(r.prompt, DZ_LOGITS_ALL), b = bs.append(r.prompt, DZ_LOGITS_ALL);
    for (size_t t = 0; t < r.prompt.size(); ++t) {
      const double c = cosine(p.data() + t * V, b.data() + t * V, V);
      worst_pair = std::min(worst_pair, c);
      worst_ref = std::min(worst_ref, cosine(b.data() + t * V, r.logits.data() + t * V, V));
      for (size_t v = 0; v < V; ++v) moved = std::max(moved, double(std::fabs(p[t * V + v] - b[t * V + v])));
      ++positions, off += c < 0.999;
    }
  }
  std::printf(
      "gpt_oss_tiny CUDA, one-term (bf16) prefill attention: min cosine vs two terms %.7f (%zu of %zu "
      "positions below 0.999), vs transformers %.6f; max |logit change| %.2e\n",
      worst_pair, off, positions, worst_ref, moved);
  // H200: min 0.980 against both (max logit change 0.66): bf16 queries move this fixture's logits well past
  // the two-term path's 0.999, which is why PRECISE is the default.
  CHECK(worst_pair >= 0.95);
  CHECK(worst_ref >= 0.95);
  CHECK(moved > 0);  // the option reaches the kernels
}

TEST_CASE("gpt-oss on the GPU: greedy continuations match transformers (or diverge at a near-tie)", "[cuda]") {
  if (!have_gpu()) return;
  Model gpu(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE);
  Arena a(gpu, 16);
  for (const Ref& r : refs()) {
    Session s(a);
    s.append(r.prompt, DZ_LOGITS_LAST);
    std::vector<int32_t> got;
    for (size_t k = 0; k < r.greedy.size(); ++k) {
      int32_t t = -1;
      REQUIRE(dz_generate_step(&s.s, 1, &t) == DZ_OK);
      got.push_back(t);
      if (t != r.greedy[k]) break;
    }
    if (got == r.greedy) continue;
    const size_t k = got.size() - 1;
    std::printf("greedy diverges at step %zu (got %d, transformers %d), transformers' top-2 margin %.5f\n", k, got[k],
                r.greedy[k], r.margin[k]);
    CHECK(r.margin[k] < 0.05f);  // a near-tie in the reference, not a wrong model
  }
}

// DZ_EXPERTS_FP8: E4M3 arithmetic at every size (decode on the fused W4A8
// kernels, prefill on the FP8 GEMMs). This tiny random model amplifies E4M3
// rounding (the AUTO FP8 path above reads 0.9957 at T=33), so the bound is
// for garbage; the numbers are printed, and greedy decode steps must run.
TEST_CASE("gpt-oss on the GPU: FP8 experts (W4A8 decode) track transformers and generate", "[cuda]") {
  if (!have_gpu()) return;
  Model fp8(DZ_DEVICE_CUDA, DZ_EXPERTS_FP8), native(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE);
  Arena a(fp8, 16), na(native, 16);
  for (const Ref& r : refs()) {
    Session s(a), ns(na);
    const std::vector<float> l = s.append(r.prompt, DZ_LOGITS_ALL), nl = ns.append(r.prompt, DZ_LOGITS_ALL);
    const size_t V = l.size() / r.prompt.size();
    double worst = 1, worst_native = 1;
    for (size_t t = 0; t < r.prompt.size(); ++t) {
      worst = std::min(worst, cosine(l.data() + t * V, r.logits.data() + t * V, V));
      worst_native = std::min(worst_native, cosine(l.data() + t * V, nl.data() + t * V, V));
    }
    std::printf("gpt_oss_tiny CUDA experts FP8 T=%zu: min cosine vs transformers %.6f, vs NATIVE %.6f\n",
                r.prompt.size(), worst, worst_native);
    CHECK(worst > 0.9);
    std::vector<int32_t> got;  // decode steps: the W4A8 kernels inside the step's CUDA graph
    for (size_t k = 0; k < r.greedy.size(); ++k) {
      int32_t t = -1;
      REQUIRE(dz_generate_step(&s.s, 1, &t) == DZ_OK);
      got.push_back(t);
    }
    size_t same = 0;
    while (same < got.size() && got[same] == r.greedy[same]) ++same;
    std::printf("  greedy: the first %zu of %zu steps as transformers\n", same, got.size());
    for (int32_t t : got) CHECK((t >= 0 && size_t(t) < V));
  }
}

// A decode batch of three sessions (12 token slots, 1.5 tokens an expert):
// AUTO runs gate_up on the W4A8 kernels with two E4M3 terms a value, NATIVE
// keeps fp16 activations; they must agree step by step while their tokens do
// (a different token only at a near-tie). The prompts: the first two
// references and a prefix of the first (the T=80 reference meets routing
// near-ties, where BF16 rounding alone flips an expert: see the tests above).
TEST_CASE("gpt-oss on the GPU: AUTO decode batches (two-term E4M3 activations) track NATIVE", "[cuda]") {
  if (!have_gpu()) return;
  Model aut(DZ_DEVICE_CUDA, DZ_EXPERTS_AUTO), native(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE);
  Arena a(aut, 16), na(native, 16);
  const std::vector<Ref> rs = refs();
  REQUIRE(rs.size() >= 2);
  const std::vector<std::vector<int32_t>> prompts = {
      rs[0].prompt, rs[1].prompt, std::vector<int32_t>(rs[0].prompt.begin(), rs[0].prompt.begin() + 5)};
  std::vector<std::unique_ptr<Session>> ss, ns;
  std::vector<dz_session*> raw, nraw;
  for (const auto& pr : prompts) {
    ss.push_back(std::make_unique<Session>(a));
    ns.push_back(std::make_unique<Session>(na));
    ss.back()->append(pr, DZ_LOGITS_LAST);
    ns.back()->append(pr, DZ_LOGITS_LAST);
    raw.push_back(ss.back()->s);
    nraw.push_back(ns.back()->s);
  }
  double worst = 1;
  std::vector<bool> same(raw.size(), true);  // tokens agreed so far
  for (int k = 0; k < 6; ++k) {
    std::vector<int32_t> t(raw.size()), nt(raw.size());
    REQUIRE(dz_generate_step(raw.data(), raw.size(), t.data()) == DZ_OK);
    REQUIRE(dz_generate_step(nraw.data(), nraw.size(), nt.data()) == DZ_OK);
    for (size_t i = 0; i < raw.size(); ++i) {
      if (!same[i]) continue;
      const float *p, *q;
      size_t rows, v;
      REQUIRE(dz_session_logits(raw[i], &p, &rows, &v) == DZ_OK);
      REQUIRE(dz_session_logits(nraw[i], &q, &rows, &v) == DZ_OK);
      const double c = cosine(p, q, v);
      INFO("step " << k << " session " << i << " cosine AUTO vs NATIVE " << c);
      CHECK(c > 0.999);
      worst = std::min(worst, c);
      if (t[i] != nt[i]) {  // only at a near-tie of NATIVE's logits; the sessions part here
        float top = 0;
        for (size_t j = 0; j < v; ++j) top = std::max(top, std::fabs(q[j]));
        INFO("tokens " << t[i] << " vs " << nt[i] << ": NATIVE logits " << q[t[i]] << " vs " << q[nt[i]]);
        CHECK(q[nt[i]] - q[t[i]] < 1e-2f * top);
        same[i] = false;
      }
    }
  }
  std::printf("gpt_oss_tiny CUDA AUTO decode batch of %zu (W4A8, two E4M3 terms): min cosine vs NATIVE %.7f\n",
              raw.size(), worst);
}

TEST_CASE("gpt-oss on the GPU: batched sessions of different lengths equal each alone; chunked prefill", "[cuda]") {
  if (!have_gpu()) return;
  Model gpu(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE);  // one expert path at every batch size
  Arena a(gpu, 16);
  const std::vector<Ref> rs = refs();
  const size_t steps = 5;
  std::vector<std::vector<int32_t>> alone(rs.size());
  std::vector<std::vector<float>> alone_last(rs.size());
  for (size_t i = 0; i < rs.size(); ++i) {
    Session s(a);
    s.append(rs[i].prompt, DZ_LOGITS_LAST);
    for (size_t k = 0; k < steps; ++k) {
      int32_t t;
      REQUIRE(dz_generate_step(&s.s, 1, &t) == DZ_OK);
      alone[i].push_back(t);
    }
    const float* p;
    size_t rows, v;
    REQUIRE(dz_session_logits(s.s, &p, &rows, &v) == DZ_OK);
    alone_last[i].assign(p, p + v);
  }
  std::vector<std::unique_ptr<Session>> ss;
  std::vector<dz_session*> raw;
  for (size_t i = 0; i < rs.size(); ++i) {
    ss.push_back(std::make_unique<Session>(a, 7));  // chunked prefill, 7 tokens a pass
    ss.back()->append(rs[i].prompt, DZ_LOGITS_LAST);
    raw.push_back(ss.back()->s);
  }
  std::vector<std::vector<int32_t>> batched(rs.size());
  for (size_t k = 0; k < steps; ++k) {
    std::vector<int32_t> t(raw.size());
    REQUIRE(dz_generate_step(raw.data(), raw.size(), t.data()) == DZ_OK);
    for (size_t i = 0; i < raw.size(); ++i) batched[i].push_back(t[i]);
  }
  for (size_t i = 0; i < rs.size(); ++i) {
    CHECK(batched[i] == alone[i]);
    const float* p;
    size_t rows, v;
    REQUIRE(dz_session_logits(raw[i], &p, &rows, &v) == DZ_OK);
    const double c = cosine(p, alone_last[i].data(), v);
    INFO("session " << i << " cosine batched vs alone " << c);
    CHECK(c > 0.99999);
  }
}

// exact_moe_layers: with AUTO, the first and last N MoE layers stay on the
// exact (fused MXFP4) path while the others take FP8 for large batches. The
// T=80 prompt has 40 tokens per expert (FP8 under plain AUTO).
TEST_CASE("gpt-oss on the GPU: exact_moe_layers keeps the first and last MoE layers on the exact path", "[cuda]") {
  if (!have_gpu()) return;
  Model native(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE), all(DZ_DEVICE_CUDA, DZ_EXPERTS_AUTO, DZ_ACTIVATIONS_AUTO, 2),
      ends(DZ_DEVICE_CUDA, DZ_EXPERTS_AUTO, DZ_ACTIVATIONS_AUTO, 1), autom(DZ_DEVICE_CUDA, DZ_EXPERTS_AUTO);
  Arena an(native, 16), aa(all, 16), ae(ends, 16), au(autom, 16);
  const Ref r = refs().back();
  REQUIRE(r.prompt.size() * 4 > 16 * 8);  // AUTO takes FP8 here
  Session sn(an), sa(aa), se(ae), su(au);
  const std::vector<float> n = sn.append(r.prompt, DZ_LOGITS_ALL), a = sa.append(r.prompt, DZ_LOGITS_ALL),
                           e = se.append(r.prompt, DZ_LOGITS_ALL), u = su.append(r.prompt, DZ_LOGITS_ALL);
  CHECK(a == n);  // every layer of this 4-layer model exact: the NATIVE result, bit for bit
  CHECK(e != n);  // the middle layers took FP8
  CHECK(e != u);  // the end layers did not
  const size_t V = n.size() / r.prompt.size();
  double ce = 1, cu = 1;
  for (size_t t = 0; t < r.prompt.size(); ++t) {
    ce = std::min(ce, cosine(e.data() + t * V, n.data() + t * V, V));
    cu = std::min(cu, cosine(u.data() + t * V, n.data() + t * V, V));
  }
  std::printf("gpt_oss_tiny T=%zu min cosine vs the exact path: exact_moe_layers=1 %.6f, plain AUTO %.6f\n",
              r.prompt.size(), ce, cu);
}

// pass_tokens = 256: a 600-token append handed to the forward whole (the
// session's chunk 1024) runs as three device passes, each reading the KV the
// earlier ones wrote; with the session's default chunk (the model's 256) the
// session splits it. Both match one 600-row pass.
TEST_CASE("gpt-oss on the GPU: passes of pass_tokens = 256 match one pass", "[cuda]") {
  if (!have_gpu()) return;
  Model one(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE),
      small(DZ_DEVICE_CUDA, DZ_EXPERTS_NATIVE, DZ_ACTIVATIONS_AUTO, 0, DZ_ATTENTION_AUTO, 256);
  Arena oa(one, 16), sa(small, 16);
  std::vector<int32_t> prompt;
  while (prompt.size() < 600)
    for (const Ref& r : refs()) prompt.insert(prompt.end(), r.prompt.begin(), r.prompt.end());
  prompt.resize(600);
  Session os(oa, 1024), ms(sa, 1024), cs(sa);
  const std::vector<float> o = os.append(prompt, DZ_LOGITS_ALL), m = ms.append(prompt, DZ_LOGITS_ALL),
                           c = cs.append(prompt, DZ_LOGITS_ALL);
  REQUIRE(m.size() == o.size());
  REQUIRE(c.size() == o.size());
  const size_t V = o.size() / prompt.size();
  double worst = 1, worst_chunked = 1;
  for (size_t t = 0; t < prompt.size(); ++t) {
    worst = std::min(worst, cosine(m.data() + t * V, o.data() + t * V, V));
    worst_chunked = std::min(worst_chunked, cosine(c.data() + t * V, o.data() + t * V, V));
  }
  std::printf("gpt_oss_tiny CUDA T=600 in passes of 256: min cosine vs one pass %.9f (session chunks of 256: %.9f)\n",
              worst, worst_chunked);
  CHECK(worst > 0.99999);
  CHECK(worst_chunked > 0.99999);
  for (int k = 0; k < 5; ++k) {
    int32_t a = -1, b = -1;
    REQUIRE(dz_generate_step(&os.s, 1, &a) == DZ_OK);
    REQUIRE(dz_generate_step(&ms.s, 1, &b) == DZ_OK);
    CHECK(a == b);
  }
}
