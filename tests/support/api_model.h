// A model opened through the C API on a chosen backend with a KV arena of
// its own, for the tests that hold the CUDA families to the CPU backend.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api/handles.h"
#include "dayzero.h"
#include "runtime/device.h"
#include "support/family_fixture.h"

namespace dz::test {

struct ApiModel {
  dz_model* m = nullptr;
  dz_kv_arena* arena = nullptr;
  // tweak adjusts the parameters after dz_model_params_init, the device and 2 threads.
  explicit ApiModel(const std::string& dir, dz_device dev, void (*tweak)(dz_model_params&) = nullptr,
                    dz_expert_precision experts = DZ_EXPERTS_AUTO) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.device = dev;
    p.experts = experts;
    p.n_threads = 2;
    if (tweak) tweak(p);
    const dz_status st = dz_model_open(dir.c_str(), &p, &m);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.page_tokens = 16;  // prompts span pages
    ap.capacity_bytes = size_t(64) << 20;
    REQUIRE(dz_kv_arena_create(m, &ap, &arena) == DZ_OK);
  }
  ~ApiModel() {
    dz_kv_arena_free(arena);
    dz_model_free(m);
  }
  ApiModel(const ApiModel&) = delete;
  ApiModel& operator=(const ApiModel&) = delete;
  dz_session* session() const {
    dz_session* s = nullptr;
    REQUIRE(dz_session_create(arena, nullptr, &s) == DZ_OK);
    return s;
  }
};

// Appends tokens; every new row's logits (all) or the last one's.
inline std::vector<float> append_logits(dz_session* s, const std::vector<int32_t>& toks, bool all = true) {
  INFO(dz_last_error());
  REQUIRE(dz_session_append(s, toks.data(), toks.size(), all ? DZ_LOGITS_ALL : DZ_LOGITS_LAST) == DZ_OK);
  const float* l = nullptr;
  size_t rows = 0, nv = 0;
  REQUIRE(dz_session_logits(s, &l, &rows, &nv) == DZ_OK);
  REQUIRE(rows == (all ? toks.size() : size_t(1)));
  return {l, l + rows * nv};
}

// The same random prompt of `prompt` tokens through sessions a and b, then
// `steps` decode steps of the same random tokens: the worst per-row cosine of
// their logits (cosine from family_fixture.h).
inline double worst_cosine_prefill_decode(dz_session* a, dz_session* b, int32_t vocab, size_t prompt, int steps,
                                          std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  std::vector<int32_t> p(prompt);
  for (auto& t : p) t = tok(rng);
  const std::vector<float> x = append_logits(a, p), y = append_logits(b, p);
  const size_t V = size_t(vocab);
  double worst = 1;
  for (size_t t = 0; t < prompt; ++t) worst = std::min(worst, cosine(x.data() + t * V, y.data() + t * V, V));
  for (int i = 0; i < steps; ++i) {
    const int32_t t = tok(rng);
    const std::vector<float> u = append_logits(a, {t}, false), v = append_logits(b, {t}, false);
    worst = std::min(worst, cosine(u.data(), v.data(), V));
  }
  return worst;
}

// DZ_DEVICE_AUTO opens `dir` on the GPU where one is present, else on
// the CPU; DZ_DEVICE_CUDA with parameters `bad` the GPU does not take fails
// cleanly, its message holding `gpu_msg` (without a GPU: "CUDA").
inline void check_auto_and_refusal(const std::string& dir, void (*bad)(dz_model_params&), const char* gpu_msg) {
  dz_model_params p;
  dz_model_params_init(&p);
  p.device = DZ_DEVICE_AUTO;
  dz_model* m = nullptr;
  REQUIRE(dz_model_open(dir.c_str(), &p, &m) == DZ_OK);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(m, &info) == DZ_OK);
  const bool gpu = dz::cuda_compiled() && dz::cuda_device_count() > 0;
  CHECK(info.device == (gpu ? DZ_DEVICE_CUDA : DZ_DEVICE_CPU));
  dz_model_free(m);
  m = nullptr;
  p.device = DZ_DEVICE_CUDA;
  bad(p);
  CHECK(dz_model_open(dir.c_str(), &p, &m) != DZ_OK);
  CHECK(m == nullptr);
  CHECK(std::string(dz_last_error()).find(gpu ? gpu_msg : "CUDA") != std::string::npos);
}

// Sessions of `model` holding prefixes of prompts[b] (lens[b] tokens) each take one
// token alone (on a fork), then the same tokens go through the family in one
// ragged batch (dz_generate_step would pick its own tokens): the worst logits
// cosine between the batch's rows and the forks'.
inline double worst_cosine_ragged_batch(const ApiModel& model, const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<size_t>& lens, size_t V) {
  std::vector<std::vector<float>> alone;
  std::vector<dz_session*> ss;
  for (size_t b = 0; b < lens.size(); ++b) {
    const std::vector<int32_t>& q = prompts[b];
    dz_session* s = model.session();
    append_logits(s, {q.begin(), q.begin() + ptrdiff_t(std::min(lens[b], q.size()))}, false);
    ss.push_back(s);
    dz_session* a = nullptr;
    REQUIRE(dz_session_fork(s, &a) == DZ_OK);
    append_logits(a, {7}, false);
    alone.push_back(append_logits(a, {9}, false));
    dz_session_free(a);
  }
  const int32_t seven[1] = {7};
  for (size_t b = 0; b < ss.size(); ++b) REQUIRE(dz_session_append(ss[b], seven, 1, DZ_LOGITS_LAST) == DZ_OK);
  std::vector<ForwardItem> items(ss.size());
  std::vector<std::vector<float>> got(ss.size(), std::vector<float>(V));
  const int32_t nine[1] = {9};
  for (size_t b = 0; b < ss.size(); ++b) {
    ss[b]->seq->reserve(1);
    items[b].seq = ss[b]->seq.get();
    items[b].tokens = {nine, 1};
    items[b].logits = got[b].data();
  }
  model.m->family->forward(items, {});
  double worst = 1;
  for (size_t b = 0; b < ss.size(); ++b) {
    ss[b]->seq->commit({nine, 1});
    worst = std::min(worst, cosine(got[b].data(), alone[b].data(), V));
  }
  for (dz_session* s : ss) dz_session_free(s);
  return worst;
}

// Graphs on or off for the calls made while it lives (read at each step).
struct GraphsOn {
  explicit GraphsOn(bool on) {
    if (on)
      unsetenv("DZ_CUDA_GRAPHS");
    else
      setenv("DZ_CUDA_GRAPHS", "0", 1);
  }
  ~GraphsOn() { unsetenv("DZ_CUDA_GRAPHS"); }
  GraphsOn(const GraphsOn&) = delete;
  GraphsOn& operator=(const GraphsOn&) = delete;
};

// What graph_decode_check saw.
struct GraphDecode {
  int batch = 0, steps = 0;
  uint64_t replays = 0;        // CUDA graph replays over the GPU model's steps
  int mismatched = 0;          // logits rows of the graphed model not bitwise equal to the eager one's
  int greedy_bad = 0;          // device samples (greedy) not the argmax of their own rows
  std::vector<double> vs_cpu;  // every row's logits cosine against the CPU backend's, ascending
  double median() const { return vs_cpu[vs_cpu.size() / 2]; }
  size_t below(double c) const {
    return size_t(std::count_if(vs_cpu.begin(), vs_cpu.end(), [c](double x) { return x < c; }));
  }
  std::string summary() const {
    return "decode batch " + std::to_string(batch) + ": " + std::to_string(steps) + " steps, " +
           std::to_string(replays) + " graph replays, " + std::to_string(mismatched) + " of " +
           std::to_string(steps * batch) + " logits rows differ from eager; cosine vs CPU min " +
           std::to_string(vs_cpu.front()) + " median " + std::to_string(median()) + ", " +
           std::to_string(below(0.999)) + " rows below 0.999";
  }
};

// `dir` on the GPU twice (CUDA graphs on, and off) and on the CPU (cpu_tweak adjusts its parameters): `batch`
// sessions with prompts of 3, 40, 77 ... tokens, then `steps` decode steps of the same tokens through
// dz_decode_batch, each session's greedy sample (the device's argmax on the GPU) and logits row compared.
inline GraphDecode graph_decode_check(const std::string& dir, void (*cpu_tweak)(dz_model_params&), int batch,
                                      int steps) {
  ApiModel g(dir, DZ_DEVICE_CUDA), e(dir, DZ_DEVICE_CUDA), c(dir, DZ_DEVICE_CPU, cpu_tweak);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(g.m, &info) == DZ_OK);
  const int32_t V = info.n_vocab;
  const ApiModel* models[3] = {&g, &e, &c};
  std::vector<dz_session*> ss[3];
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> pr(static_cast<size_t>(3 + 37 * b));
    for (size_t k = 0; k < pr.size(); ++k) pr[k] = int32_t((k * 131 + size_t(b) * 17 + 5) % size_t(V));
    for (int m = 0; m < 3; ++m) {
      ss[m].push_back(models[m]->session());
      append_logits(ss[m].back(), pr, false);
    }
  }
  GraphDecode r;
  r.batch = batch, r.steps = steps;
  const uint64_t replays0 = dz::cuda_graph_replays();
  for (int k = 0; k < steps; ++k) {
    std::vector<int32_t> t(static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b) t[size_t(b)] = int32_t((k * 97 + b * 31 + 11) % V);
    std::vector<std::vector<float>> rows[3];
    for (int m = 0; m < 3; ++m) {
      GraphsOn on(m != 1);
      INFO(dz_last_error());
      REQUIRE(dz_decode_batch(ss[m].data(), t.data(), ss[m].size()) == DZ_OK);
      for (dz_session* s : ss[m]) {
        int32_t greedy = -1;
        REQUIRE(dz_session_sample(s, &greedy) == DZ_OK);  // on the GPU the device's argmax, before the row is read
        rows[m].push_back(session_last_logits(s));
        const std::vector<float>& l = rows[m].back();
        r.greedy_bad += greedy != int32_t(std::max_element(l.begin(), l.end()) - l.begin());
      }
    }
    for (int b = 0; b < batch; ++b) {
      const std::vector<float>&lg = rows[0][size_t(b)], &le = rows[1][size_t(b)], &lc = rows[2][size_t(b)];
      REQUIRE((le.size() == lg.size() && lc.size() == lg.size()));
      if (std::memcmp(lg.data(), le.data(), lg.size() * 4) != 0) {
        ++r.mismatched;
        INFO("batch " << batch << " step " << k << " session " << b);
        CHECK(cosine(lg.data(), le.data(), lg.size()) > 0.999999);
      }
      r.vs_cpu.push_back(cosine(lg.data(), lc.data(), lg.size()));
    }
  }
  r.replays = dz::cuda_graph_replays() - replays0;
  std::sort(r.vs_cpu.begin(), r.vs_cpu.end());
  for (auto& v : ss)
    for (dz_session* s : v) dz_session_free(s);
  return r;
}

// graph_decode_check at batch 1 and 3, 150 steps each, held to what every family must meet: every logits row of a
// replay bitwise equal to the eager step's, every device greedy sample its row's argmax, at most `eager_steps`
// steps not replayed (a key's first step runs eagerly), and against the CPU a guard: the median cosine above
// `median` and at most 10% of rows below 0.999. Each step's summary goes out as a warning naming `family`.
inline void expect_graph_decode(const char* family, const std::string& dir, void (*cpu_tweak)(dz_model_params&),
                                int eager_steps, double median) {
  for (const int batch : {1, 3}) {
    const GraphDecode r = graph_decode_check(dir, cpu_tweak, batch, 150);
    WARN(family << " " << r.summary());
    CHECK(r.mismatched == 0);
    CHECK(r.greedy_bad == 0);
    CHECK(r.replays >= uint64_t(r.steps - eager_steps));
    CHECK(r.replays <= uint64_t(r.steps));
    CHECK(r.median() > median);
    CHECK(r.below(0.999) * 10 <= r.vs_cpu.size());
  }
}

}  // namespace dz::test
