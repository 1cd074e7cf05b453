// dz indexer-fp8: what the FP8 indexer mode (Hadamard rotation, E4M3 queries
// and keys with one scale per 128 dims, as DeepSeek's inference code runs the
// DSA indexer) changes in a DeepSeek-V3.2 model against the exact indexer, on
// real text cut into windows:
//  - end to end: both modes run the whole model; per-layer top-k recall of the
//    FP8 run's selections against the exact run's, per-position logits cosine,
//    next-token (argmax) agreement;
//  - same inputs: the exact run's indexer inputs of every layer scored again by
//    the FP8 kernel and, in float64, with one quantisation step at a time, so
//    the loss can be attributed (keys only, queries only, rotation, scale
//    format, BF16 for comparison), plus the score gap at the top-k cutoff.
// Recall counts only rows with more visible tokens than k (t >= k): below that
// every mode keeps every token.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "api/handles.h"
#include "bench_common.h"
#include "commands.h"
#include "cpu/fp8.h"
#include "cpu/indexer.h"
#include "model/deepseek_v32.h"
#include "model_args.h"

namespace dz::cli {

namespace {

enum class Fmt { F32, BF16, E4M3, E4M3_POW2 };

struct Variant {
  const char* name;
  bool rotate;
  Fmt q, k;
};

// One quantisation step at a time; "e4m3 q,k rotated" is what the FP8 mode computes.
const Variant kVariants[] = {
    {"bf16 q,k", false, Fmt::BF16, Fmt::BF16},
    {"e4m3 k only, rotated", true, Fmt::F32, Fmt::E4M3},
    {"e4m3 k, bf16 q, rotated", true, Fmt::BF16, Fmt::E4M3},
    {"e4m3 q only, rotated", true, Fmt::E4M3, Fmt::F32},
    {"e4m3 q,k rotated", true, Fmt::E4M3, Fmt::E4M3},
    {"e4m3 q,k rotated, pow2 scales", true, Fmt::E4M3_POW2, Fmt::E4M3_POW2},
    {"e4m3 q,k not rotated", false, Fmt::E4M3, Fmt::E4M3},
};

constexpr size_t kFp8Mode = 4;  // kVariants[kFp8Mode] is what DZ_INDEXER_FP8 computes

float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;  // nearest, ties to even (inputs are finite)
  std::memcpy(&x, &u, 4);
  return x;
}

// v (D values) as the variant stores it, dequantised, in the rotated basis when `rotate`.
std::vector<double> represent(const float* v, int D, bool rotate, Fmt f) {
  std::vector<float> r(v, v + D);
  if (rotate) cpu::hadamard(r.data(), D);
  std::vector<double> out(static_cast<size_t>(D));
  if (f == Fmt::E4M3 || f == Fmt::E4M3_POW2) {
    const int blk = std::min(D, 128);
    std::vector<uint8_t> b(static_cast<size_t>(blk));
    for (int o = 0; o < D; o += blk) {
      const float s = cpu::fp8_quantize_block(r.data() + o, blk, f == Fmt::E4M3_POW2, b.data());
      for (int j = 0; j < blk; ++j) out[size_t(o + j)] = double(cpu::e4m3_to_f32(b[size_t(j)])) * double(s);
    }
  } else {
    for (int j = 0; j < D; ++j)
      out[size_t(j)] = f == Fmt::BF16 ? double(round_bf16(r[size_t(j)])) : double(r[size_t(j)]);
  }
  return out;
}

// score(t, s) = sum_h w[h] H^-0.5 ReLU(q_h . k_s) D^-0.5 in float64 over the given representations.
double score(const std::vector<double>& q, const float* w, const std::vector<double>& k, int H, int D) {
  double acc = 0;
  for (int h = 0; h < H; ++h) {
    double d = 0;
    for (int j = 0; j < D; ++j) d += q[size_t(h * D + j)] * k[size_t(j)];
    if (d > 0) acc += double(w[h]) / std::sqrt(double(H)) * d / std::sqrt(double(D));
  }
  return acc;
}

// Indices of the k largest (ties to the lower index).
std::vector<int32_t> topk(const std::vector<double>& s, int k) {
  std::vector<int32_t> idx(s.size());
  for (size_t i = 0; i < s.size(); ++i) idx[i] = int32_t(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return s[size_t(a)] != s[size_t(b)] ? s[size_t(a)] > s[size_t(b)] : a < b;
  });
  idx.resize(size_t(k));
  return idx;
}

double overlap(const int32_t* a, const int32_t* b, int k) {
  std::set<int32_t> sa(a, a + k);
  int hit = 0;
  for (int j = 0; j < k; ++j) hit += int(sa.count(b[j]));
  return double(hit) / double(k);
}

double cosine(const float* a, const float* b, size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < n; ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

struct Run {
  dz_model* model = nullptr;
  dz_kv_arena* arena = nullptr;
  ~Run() {
    dz_kv_arena_free(arena);
    dz_model_free(model);
  }
};

// Per layer of one window: indexer inputs (exact run) and selections.
struct Capture {
  int H = 0, D = 0, K = 0;
  std::map<int, std::vector<float>> q, w, k;
  std::map<int, std::vector<int32_t>> sel;
};

// One prefill of `ids` with the trace attached; all logits [T x V].
std::vector<float> prefill(Run& r, const std::vector<int32_t>& ids, Capture& cap, bool inputs) {
  const size_t T = ids.size();
  DsaTrace tr;
  tr.on_select = [&](int l, size_t, int64_t pos0, const int32_t* s, int64_t n, int k) {
    auto& v = cap.sel[l];
    cap.K = k;
    v.resize(T * size_t(k));
    std::copy(s, s + n * k, v.begin() + pos0 * k);
  };
  if (inputs) {
    const Config& cfg = r.model->config;
    cap.H = int(cfg.json().at("index_n_heads").get<int>());
    cap.D = int(cfg.json().at("index_head_dim").get<int>());
    tr.on_indexer = [&](int l, size_t, int64_t pos0, const float* q, const float* w, const float* k, int64_t n) {
      const size_t H = size_t(cap.H), D = size_t(cap.D);
      auto &vq = cap.q[l], &vw = cap.w[l], &vk = cap.k[l];
      vq.resize(T * H * D), vw.resize(T * H), vk.resize(T * D);
      std::copy(q, q + n * int64_t(H * D), vq.begin() + pos0 * int64_t(H * D));
      std::copy(w, w + n * int64_t(H), vw.begin() + pos0 * int64_t(H));
      std::copy(k, k + n * int64_t(D), vk.begin() + pos0 * int64_t(D));
    };
  }
  deepseek_v32_set_trace(*r.model->family, &tr);
  dz_session* s = nullptr;
  const float* lg = nullptr;
  size_t rows = 0, V = 0;
  const bool ok = dz_session_create(r.arena, nullptr, &s) == DZ_OK &&
                  dz_session_append(s, ids.data(), T, DZ_LOGITS_ALL) == DZ_OK &&
                  dz_session_logits(s, &lg, &rows, &V) == DZ_OK && rows == T;
  deepseek_v32_set_trace(*r.model->family, nullptr);
  std::vector<float> out;
  if (ok) out.assign(lg, lg + T * V);
  dz_session_free(s);
  if (!ok) throw std::runtime_error(std::string("forward failed: ") + dz_last_error());
  return out;
}

// Greedy continuation of `prompt` for n tokens (no trace attached).
std::vector<int32_t> greedy(Run& r, const std::vector<int32_t>& prompt, size_t n) {
  dz_session* s = nullptr;
  std::vector<int32_t> out;
  bool ok = dz_session_create(r.arena, nullptr, &s) == DZ_OK &&
            dz_session_append(s, prompt.data(), prompt.size(), DZ_LOGITS_LAST) == DZ_OK;
  while (ok && out.size() < n) {
    const float* lg = nullptr;
    size_t rows = 0, V = 0;
    ok = dz_session_logits(s, &lg, &rows, &V) == DZ_OK;
    if (!ok) break;
    const float* last = lg + (rows - 1) * V;
    out.push_back(int32_t(std::max_element(last, last + V) - last));
    ok = dz_session_append(s, &out.back(), 1, DZ_LOGITS_LAST) == DZ_OK;
  }
  dz_session_free(s);
  if (!ok) throw std::runtime_error(std::string("generation failed: ") + dz_last_error());
  return out;
}

}  // namespace

int cmd_indexer_fp8(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz indexer-fp8 --text FILE [--model DIR] [--window N] [--windows N] [--json OUT]\n\n"
        "Measures the FP8 indexer mode of a DeepSeek-V3.2 model against its exact indexer on the\n"
        "text (tokenized as a whole with the model's tokenizer, cut into windows of N tokens): top-k\n"
        "recall per layer (rows with more than k visible tokens), logits cosine, argmax agreement,\n"
        "and which quantisation step loses most (float64 rescoring of the exact run's inputs).\n\n"
        "  --model DIR    model directory (default models/dayzero-tiny)\n"
        "  --text FILE    UTF-8 text\n"
        "  --window N     tokens per window (default 256)\n"
        "  --windows N    at most N windows (default: all whole windows)\n"
        "  --json OUT     also write the results as JSON\n%s",
        kModelOptionsHelp);
    return 0;
  }
  reject_unknown(a, with_model_options({"--model", "--text", "--window", "--windows", "--json", "--help"}),
                 "indexer-fp8");
  const std::string dir = flag_value(a, "--model", "models/dayzero-tiny"), text_path = flag_value(a, "--text");
  const size_t window = size_t(std::stoul(flag_value(a, "--window", "256")));
  const size_t max_windows = size_t(std::stoul(flag_value(a, "--windows", "1000000")));
  if (text_path.empty() || window < 2) {
    std::fprintf(stderr, "dz indexer-fp8: --text is required and --window must be >= 2 (see --help)\n");
    return 2;
  }
  std::ifstream tf(text_path, std::ios::binary);
  if (!tf) {
    std::fprintf(stderr, "dz indexer-fp8: cannot read %s\n", text_path.c_str());
    return 2;
  }
  std::stringstream ss;
  ss << tf.rdbuf();
  const std::string text = ss.str();

  std::string err;
  Run ex, f8;
  for (int m = 0; m < 2; ++m) {
    dz_model_params mp;
    if (!parse_model_options(a, &mp, &err)) {
      std::fprintf(stderr, "dz indexer-fp8: %s\n", err.c_str());
      return 2;
    }
    mp.indexer = m ? DZ_INDEXER_FP8 : DZ_INDEXER_EXACT;
    Run& r = m ? f8 : ex;
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.capacity_pages = (window + 63) / 64 + 2;
    ap.prefix_cache = 0;  // every window computes every position (the trace sees all of them)
    if (dz_model_open(dir.c_str(), &mp, &r.model) != DZ_OK || dz_kv_arena_create(r.model, &ap, &r.arena) != DZ_OK) {
      std::fprintf(stderr, "dz indexer-fp8: %s\n", dz_last_error());
      return 1;
    }
  }
  if (!ex.model->tokenizer) {
    std::fprintf(stderr, "dz indexer-fp8: %s has no tokenizer\n", dir.c_str());
    return 1;
  }
  size_t n_ids = 0;
  std::vector<int32_t> ids(text.size() + 16);
  if (dz_tokenize(ex.model->tokenizer, text.data(), text.size(), 0, ids.data(), ids.size(), &n_ids) != DZ_OK) {
    std::fprintf(stderr, "dz indexer-fp8: %s\n", dz_last_error());
    return 1;
  }
  ids.resize(n_ids);
  const size_t n_win = std::min(max_windows, n_ids / window);
  if (n_win == 0) {
    std::fprintf(stderr, "dz indexer-fp8: %zu tokens, fewer than one window of %zu\n", n_ids, window);
    return 2;
  }

  constexpr size_t NV = sizeof(kVariants) / sizeof(kVariants[0]);
  int K = 0, n_layers = 0;
  std::vector<double> e2e_recall, kernel_recall, kernel_pow2_recall, exact_check;  // per layer sums
  std::vector<std::vector<double>> var_recall;                                     // [layer][variant]
  // Per row, over the row's top score: the gap between the k-th and (k+1)-th exact score, the largest and the
  // RMS change of a score by FP8.
  std::vector<double> gaps, perturb, perturb_rms;
  size_t rows_counted = 0, swap_possible = 0, n_pos = 0, n_pos_k = 0, agree = 0, agree_k = 0;
  double cos_min = 1, cos_sum = 0, cos_min_k = 1, cos_sum_k = 0;
  int worst_rank = 0;  // largest exact rank (1-based) of a token the FP8 mode keeps that exact drops
  std::vector<double> cosines;
  constexpr size_t kGreedy = 16;  // tokens generated after each window's first half
  size_t greedy_same = 0, greedy_prefix = 0;

  try {
    for (size_t wi = 0; wi < n_win; ++wi) {
      const std::vector<int32_t> win(ids.begin() + ptrdiff_t(wi * window), ids.begin() + ptrdiff_t((wi + 1) * window));
      Capture ce, cf;
      const std::vector<float> le = prefill(ex, win, ce, true), lf = prefill(f8, win, cf, false);
      const size_t T = window, V = le.size() / T;
      K = ce.K;
      const int H = ce.H, D = ce.D;
      if (wi == 0) {
        n_layers = int(ce.sel.size());
        e2e_recall.assign(size_t(n_layers), 0), kernel_recall.assign(size_t(n_layers), 0);
        kernel_pow2_recall.assign(size_t(n_layers), 0), exact_check.assign(size_t(n_layers), 0);
        var_recall.assign(size_t(n_layers), std::vector<double>(NV, 0));
      }
      for (size_t t = 0; t < T; ++t) {
        const double c = cosine(lf.data() + t * V, le.data() + t * V, V);
        const auto argmax = [&](const std::vector<float>& x) {
          return std::max_element(x.begin() + ptrdiff_t(t * V), x.begin() + ptrdiff_t((t + 1) * V)) - x.begin();
        };
        const bool same = argmax(lf) == argmax(le);
        cos_min = std::min(cos_min, c), cos_sum += c, ++n_pos, agree += same, cosines.push_back(c);
        if (t >= size_t(K)) cos_min_k = std::min(cos_min_k, c), cos_sum_k += c, ++n_pos_k, agree_k += same;
      }
      for (int l = 0; l < n_layers; ++l) {
        const auto &q = ce.q[l], &w = ce.w[l], &kk = ce.k[l];
        // The FP8 kernel on the exact run's inputs (one page holding the window's keys).
        std::vector<std::vector<int32_t>> ksel;
        for (bool p2 : {false, true}) {
          const cpu::IndexerConfig cfg{H, D, K, cpu::IndexerMode::Fp8, p2};
          const size_t kb = cpu::indexer_key_bytes(cfg);
          std::vector<float> store((T * kb + 3) / 4);
          uint8_t* base = reinterpret_cast<uint8_t*>(store.data());
          for (size_t s = 0; s < T; ++s) cpu::indexer_encode_key(cfg, kk.data() + s * size_t(D), base + s * kb);
          const uint8_t* pages[1] = {base};
          std::vector<int64_t> vis(T);
          for (size_t t = 0; t < T; ++t) vis[t] = int64_t(t) + 1;
          std::vector<int32_t> out(T * size_t(K));
          cpu::indexer_select(cfg, q.data(), w.data(), int64_t(T), vis.data(),
                              cpu::PagedRows{pages, uint32_t(T), kb, 0}, {}, out.data(), nullptr, nullptr);
          ksel.push_back(std::move(out));
        }
        // Per variant: the representations of every key, then each row's scores.
        std::vector<std::vector<std::vector<double>>> keys(NV);
        for (size_t v = 0; v < NV; ++v)
          for (size_t s = 0; s < T; ++s)
            keys[v].push_back(represent(kk.data() + s * size_t(D), D, kVariants[v].rotate, kVariants[v].k));
        for (size_t t = size_t(K); t < T; ++t) {
          const float* qt = q.data() + t * size_t(H * D);
          const float* wt = w.data() + t * size_t(H);
          std::vector<double> qx;  // exact: unrotated fp32 q
          for (int h = 0; h < H; ++h) {
            const std::vector<double> r = represent(qt + h * D, D, false, Fmt::F32);
            qx.insert(qx.end(), r.begin(), r.end());
          }
          std::vector<double> sx(t + 1);
          for (size_t s = 0; s <= t; ++s) {
            std::vector<double> kx(kk.begin() + ptrdiff_t(s * size_t(D)), kk.begin() + ptrdiff_t((s + 1) * size_t(D)));
            sx[s] = score(qx, wt, kx, H, D);
          }
          const std::vector<int32_t> tx = topk(sx, K);
          exact_check[size_t(l)] += overlap(tx.data(), ce.sel[l].data() + t * size_t(K), K);
          e2e_recall[size_t(l)] += overlap(ce.sel[l].data() + t * size_t(K), cf.sel[l].data() + t * size_t(K), K);
          kernel_recall[size_t(l)] += overlap(tx.data(), ksel[0].data() + t * size_t(K), K);
          kernel_pow2_recall[size_t(l)] += overlap(tx.data(), ksel[1].data() + t * size_t(K), K);
          std::vector<double> sorted = sx;
          std::sort(sorted.begin(), sorted.end(), std::greater<>());
          const double top = std::max(std::fabs(sorted[0]), 1e-30);
          const double gap = (sorted[size_t(K - 1)] - sorted[size_t(K)]) / top;
          for (size_t v = 0; v < NV; ++v) {
            std::vector<double> qv;
            for (int h = 0; h < H; ++h) {
              const std::vector<double> r = represent(qt + h * D, D, kVariants[v].rotate, kVariants[v].q);
              qv.insert(qv.end(), r.begin(), r.end());
            }
            std::vector<double> sv(t + 1);
            double dmax = 0, d2 = 0;
            for (size_t s = 0; s <= t; ++s) {
              sv[s] = score(qv, wt, keys[v][s], H, D);
              dmax = std::max(dmax, std::fabs(sv[s] - sx[s]));
              d2 += (sv[s] - sx[s]) * (sv[s] - sx[s]);
            }
            const std::vector<int32_t> tv = topk(sv, K);
            var_recall[size_t(l)][v] += overlap(tx.data(), tv.data(), K);
            if (v == kFp8Mode) {  // the FP8 mode's own arithmetic
              gaps.push_back(gap), perturb.push_back(dmax / top),
                  perturb_rms.push_back(std::sqrt(d2 / double(t + 1)) / top);
              swap_possible += 2 * dmax / top > gap;
              std::vector<int32_t> rank(t + 1);
              const std::vector<int32_t> order = topk(sx, int(t + 1));
              for (size_t j = 0; j < order.size(); ++j) rank[size_t(order[j])] = int32_t(j + 1);
              for (int32_t x : tv) worst_rank = std::max(worst_rank, rank[size_t(x)]);
            }
          }
          if (l == 0) ++rows_counted;
        }
      }
      const std::vector<int32_t> half(win.begin(), win.begin() + ptrdiff_t(T / 2));
      const std::vector<int32_t> ge = greedy(ex, half, kGreedy), gf = greedy(f8, half, kGreedy);
      size_t p = 0;
      while (p < kGreedy && ge[p] == gf[p]) ++p;
      greedy_prefix += p, greedy_same += p == kGreedy;
      std::fprintf(stderr, "\rwindow %zu/%zu", wi + 1, n_win);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ndz indexer-fp8: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "\n");

  nlohmann::json j = bench_meta();
  j["what"] = "indexer-fp8";
  j["model"] = dir;
  j["text"] = text_path;
  j["tokens"] = n_ids;
  j["windows"] = n_win;
  j["window"] = window;
  j["index_topk"] = K;
  j["rows_per_layer"] = rows_counted;
  const double R = double(std::max<size_t>(1, rows_counted));
  auto per_layer = [&](const std::vector<double>& v) {
    nlohmann::json o = nlohmann::json::array();
    double mean = 0;
    for (double x : v) o.push_back(x / R), mean += x / R;
    return nlohmann::json{{"per_layer", o}, {"mean", mean / double(v.size())}};
  };
  j["recall_end_to_end"] = per_layer(e2e_recall);
  j["recall_same_inputs_fp8_kernel"] = per_layer(kernel_recall);
  j["recall_same_inputs_fp8_kernel_pow2"] = per_layer(kernel_pow2_recall);
  j["recall_exact_kernel_vs_float64"] = per_layer(exact_check);
  nlohmann::json vars = nlohmann::json::object();
  for (size_t v = 0; v < NV; ++v) {
    std::vector<double> col;
    for (int l = 0; l < n_layers; ++l) col.push_back(var_recall[size_t(l)][v]);
    vars[kVariants[v].name] = per_layer(col);
  }
  j["recall_same_inputs_float64_variants"] = vars;
  j["cutoff"] = {{"median_gap_over_top_score", median(gaps)},
                 {"median_max_fp8_score_change_over_top_score", median(perturb)},
                 {"median_rms_fp8_score_change_over_top_score", median(perturb_rms)},
                 {"rows_where_2x_change_exceeds_gap", double(swap_possible) / double(std::max<size_t>(1, gaps.size()))},
                 {"worst_exact_rank_kept_by_fp8", worst_rank}};
  j["logits_cosine"] = {
      {"all_positions", {{"min", cos_min}, {"mean", cos_sum / double(n_pos)}}},
      {"positions_t_ge_k", {{"min", cos_min_k}, {"mean", cos_sum_k / double(std::max<size_t>(1, n_pos_k))}}}};
  std::sort(cosines.begin(), cosines.end());
  auto below = [&](double x) {
    return double(std::lower_bound(cosines.begin(), cosines.end(), x) - cosines.begin()) / double(cosines.size());
  };
  j["logits_cosine"]["all_positions"]["p1"] = cosines[cosines.size() / 100];
  j["logits_cosine"]["all_positions"]["fraction_below_0.999"] = below(0.999);
  j["logits_cosine"]["all_positions"]["fraction_below_0.99"] = below(0.99);
  j["greedy_continuation"] = {{"tokens", kGreedy},
                              {"prompt", "first half of each window"},
                              {"identical_fraction", double(greedy_same) / double(n_win)},
                              {"mean_common_prefix", double(greedy_prefix) / double(n_win)}};
  j["argmax_agreement"] = {{"all_positions", double(agree) / double(n_pos)},
                           {"positions_t_ge_k", double(agree_k) / double(std::max<size_t>(1, n_pos_k))}};
  bench_emit(j, flag_value(a, "--json"));
  return 0;
}

}  // namespace dz::cli
