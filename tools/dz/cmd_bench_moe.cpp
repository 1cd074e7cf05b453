// dz bench moe: the MXFP4 MoE layer on the GPU at gpt-oss-120b shapes (E=128,
// top-4, H=I=2880; random MXFP4 weights and routing) for several token counts.
// Both device paths are timed at every size (fused W4A16 / W4A8 kernels and
// the FP8 path: folding + grouped or cuBLASLt GEMMs), giving the measured
// tokens-per-expert threshold between them; the fused kernels' variants are
// timed too (K split, PDL), with the achieved fraction of HBM bandwidth on the
// FP4 expert bytes.
// Median of CUDA-event timings; L2 flushed before every timed call and the
// routing rotated among several sets; the fused path replays CUDA graphs.
// --dump DIR writes the weights, inputs, routing and outputs for the PyTorch
// peers (tools/bench/moe_peers.py).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/fill.h"
#include "cuda/fp8_grouped_gemm.h"
#include "cuda/moe.h"
#include "cuda/moe_one_token.h"
#include "cuda/mxfp4_fold.h"
#include "cuda/mxfp4_gemm.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench moe [--tokens 1,8,64,128,256,384,512,1024,2048,4096,16384] [--reps N] [--experts 128] [--topk 4]\n"
    "                    [--hidden 2880] [--intermediate 2880] [--threshold TPE] [--tile N] [--gemm-streams S]\n"
    "                    [--no-components] [--w4a8]\n"
    "                    [--fp8-gemm auto|auto_nowhole|whole|auto_fold|mxfp4|auto_tN|auto_nN|cublaslt|grouped|\n"
    "                                grouped_ws[_rows]|LIST]\n"
    "                    [--grouped-blocks N]\n"
    "                    [--bw-ceiling 4.27e12] [--fp8-ceiling 1490e12] [--dump DIR] [--out FILE.json]\n"
    "MXFP4 MoE layer on the GPU: fused (W4A8 / W4A16 kernels) vs FP8 (fold + FP8 GEMMs) paths, JSON results.\n"
    "--w4a8: the fused path's default with the W4A8 kernels on (as DZ_EXPERTS_FP8); either way both\n"
    "kernel families are timed as variants at every size.\n"
    "--fp8-gemm: the FP8 path's GEMMs, per-expert cuBLASLt, our grouped kernel (folding the\n"
    "MXFP4 experts itself; grouped_ws: on experts folded into the FP8 workspace first) or auto\n"
    "(the library's default: up to 256 tokens per expert, except from 49 to 80, the MXFP4 GEMM,\n"
    "weights decoded in the MMA's registers, where both projections fold exactly by 64-row groups;\n"
    "otherwise grouped, folding inside up to 224 tokens per expert and on the workspace above; auto_fold:\n"
    "never the MXFP4 GEMM; mxfp4: it at every size, auto_t64|t128|t160: with that many tokens a\n"
    "tile; auto_n128|n192: the grouped kernel on the FP8 workspace with tiles that many columns wide\n"
    "(n128: the narrow block, the next workspace tile folding beside it; the last tile at 192));\n"
    "above 96 tokens an expert auto takes the MXFP4 GEMM with whole-K scales (one scale a row of\n"
    "the activations, one a 64-row group of each expert over all of K) where both projections fold\n"
    "exactly that way: whole takes it at every size, auto_nowhole never;\n"
    "of a comma list the first is fp8_ms, every one listed is timed in\n"
    "alternation (fp8_gemm_ms) and its output compared with the first's. A _rows suffix\n"
    "(auto_rows, grouped_rows, grouped_ws_rows): weight scales per row (1x128) instead of per\n"
    "64-row group, which the grouped kernel takes where every 64-row group folds exactly.\n"
    "A _pass suffix (auto_pass, whole_pass): with whole-K scales, SwiGLU and the quantization of\n"
    "down's input as a pass of their own (amax / 448 a row) instead of in gate_up's epilogue\n"
    "(one fixed scale, 1/8: gpt-oss's SwiGLU is at most 56).\n"
    "Up to 64 tokens, step_ms also times the layer as a decode step runs it: 2-8 calls back to back in one\n"
    "graph, each on experts of its own (disjoint routing sets), beside a plain read chained the same way.\n"
    "One token also times the stream's shapes (fused_variants_ms: stream_gGxW_sS).\n"
    "--grouped-blocks: persistent blocks of the grouped GEMM (default 0: one per SM).\n";

}  // namespace

#ifndef DZ_WITH_CUDA
int bench_moe(const Args& a) { return bench_needs_cuda(a, kUsage, "dz bench moe"); }
#else

namespace {
using namespace dz::cuda;

// Whether g ends with suffix; if so, g loses it (--fp8-gemm's _pass and _rows).
bool take_suffix(std::string& g, const std::string& suffix) {
  if (g.size() <= suffix.size() || g.compare(g.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  g.resize(g.size() - suffix.size());
  return true;
}

template <typename T>
void write_bin(const std::string& path, const T* dev, size_t n) {
  std::vector<T> h(n);
  DZ_CUDA_CHECK(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(h.data()), std::streamsize(n * sizeof(T)));
  check(bool(f), DZ_ERR_IO, "cannot write ", path);
}

// A routing set of T tokens: K distinct experts a token from pick() (an
// expert id), gate weights exp(nd(rng)) normalised per token; seen marks the
// experts used (E of them).
template <typename Pick>
void draw_routing(int T, int K, int E, Pick pick, std::normal_distribution<float>& nd, std::mt19937& rng,
                  std::vector<int>& ids, std::vector<float>& gw, std::vector<char>& seen) {
  ids.assign(size_t(T) * K, 0), gw.assign(size_t(T) * K, 0.f), seen.assign(size_t(E), 0);
  for (int t = 0; t < T; ++t) {
    float sum = 0;
    for (int k = 0; k < K; ++k) {
      int e;
      bool dup;
      do {
        e = pick();
        dup = false;
        for (int q = 0; q < k; ++q) dup |= ids[size_t(t * K + q)] == e;
      } while (dup);
      ids[size_t(t * K + k)] = e, seen[size_t(e)] = 1;
      gw[size_t(t * K + k)] = std::exp(nd(rng));
      sum += gw[size_t(t * K + k)];
    }
    for (int k = 0; k < K; ++k) gw[size_t(t * K + k)] /= sum;
  }
}

double diff_metric(const std::vector<float>& x, const std::vector<float>& y) {
  double xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) xy += double(x[i]) * y[i], xx += double(x[i]) * x[i] + double(y[i]) * y[i];
  return xx > 0 ? 1.0 - 2.0 * xy / xx : 0.0;
}

}  // namespace

int bench_moe(const Args& a) {
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(a,
                 {"--tokens", "--reps", "--experts", "--topk", "--hidden", "--intermediate", "--threshold", "--tile",
                  "--gemm-streams", "--no-components", "--bw-ceiling", "--fp8-ceiling", "--fp8-gemm",
                  "--grouped-blocks", "--w4a8", "--dump", "--out", "--help"},
                 "bench moe");
  const std::vector<int> tokens =
      parse_int_list(flag_value(a, "--tokens", "1,8,64,128,256,384,512,1024,2048,4096,16384"));
  const int reps = std::stoi(flag_value(a, "--reps", "20"));
  MoeShape sh;
  sh.n_experts = std::stoi(flag_value(a, "--experts", "128"));
  sh.topk = std::stoi(flag_value(a, "--topk", "4"));
  sh.hidden = std::stoi(flag_value(a, "--hidden", "2880"));
  sh.intermediate = std::stoi(flag_value(a, "--intermediate", "2880"));
  MoeOptions opt;  // the library's defaults unless a flag says otherwise
  opt.fused_max_tokens_per_expert =
      std::stod(flag_value(a, "--threshold", std::to_string(opt.fused_max_tokens_per_expert)));
  auto int_flag = [&](const char* flag, int dflt) { return std::stoi(flag_value(a, flag, std::to_string(dflt))); };
  opt.tile_experts = int_flag("--tile", opt.tile_experts);
  if (has_flag(a, "--w4a8")) opt.use_e4m3_activations();  // as DZ_EXPERTS_FP8
  opt.gemm_streams = int_flag("--gemm-streams", opt.gemm_streams);
  std::vector<std::string> fp8_gemms;
  {
    std::stringstream ss(flag_value(a, "--fp8-gemm", "auto"));
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      static const char* const known[] = {"auto",      "cublaslt",     "grouped",         "grouped_ws",
                                          "auto_rows", "grouped_rows", "grouped_ws_rows", "auto_fold",
                                          "mxfp4",     "auto_t64",     "auto_t128",       "auto_t160",
                                          "auto_n128", "auto_n192",    "whole",           "auto_nowhole"};
      std::string base = item;
      take_suffix(base, "_pass");
      if (std::find(std::begin(known), std::end(known), base) == std::end(known)) {
        std::fprintf(stderr,
                     "dz bench moe: --fp8-gemm takes auto, auto_nowhole, whole, auto_fold, auto_t64|t128|t160, "
                     "auto_n128|n192, cublaslt, "
                     "grouped and/or "
                     "grouped_ws (the last three with or without _rows; any with _pass), not '%s'\n",
                     item.c_str());
        return 2;
      }
      fp8_gemms.push_back(item);
    }
    if (fp8_gemms.empty()) fp8_gemms.push_back("cublaslt");
  }
  // grouped_ws: the grouped GEMMs on experts folded into the FP8 workspace first.
  // _rows: 1x128 weight scales even where the 64-row groups fold exactly.
  // auto_fold: auto without the MXFP4 GEMM (folding into shared memory or the
  // workspace as before it); mxfp4: the MXFP4 GEMM at every size; auto_tN:
  // that with N tokens a tile; whole: the MXFP4 GEMM with whole-K scales at
  // every size; auto_nowhole: auto without them. _pass: with whole-K scales,
  // SwiGLU's quantization as a pass of its own, not in gate_up's epilogue.
  auto set_gemm = [](MoeOptions& o, std::string g) {
    o.fp8_whole_k_glu = !take_suffix(g, "_pass");
    o.fp8_group_scales = !take_suffix(g, "_rows");
    o.fp8_gemm = g == "grouped" || g == "grouped_ws" ? 2 : g == "cublaslt" ? 1 : 0;
    o.fp8_fold_in_gemm = g != "grouped_ws";
    o.fp8_mxfp4_gemm = g == "auto_fold" ? -1 : g.rfind("auto_t", 0) == 0 || g == "mxfp4" ? 1 : 0;
    o.fp8_mxfp4_tile_tokens = g.rfind("auto_t", 0) == 0 ? std::stoi(g.substr(6)) : 0;
    o.fp8_ws_tile_n =
        g.rfind("auto_n", 0) == 0 && g != "auto_nowhole" ? std::stoi(g.substr(6)) : MoeOptions{}.fp8_ws_tile_n;
    // whole: the MXFP4 GEMM with whole-K scales at every FP8-path size; only
    // auto (and auto_rows) choose it by size.
    o.fp8_whole_k = g == "whole" ? 1 : g == "auto" ? 0 : -1;
  };
  set_gemm(opt, fp8_gemms[0]);
  opt.fp8_grouped_blocks = int_flag("--grouped-blocks", opt.fp8_grouped_blocks);
  const double bw_ceiling = std::stod(flag_value(a, "--bw-ceiling", "4.27e12"));
  const double fp8_ceiling = std::stod(flag_value(a, "--fp8-ceiling", "1490e12"));
  const std::string dump = flag_value(a, "--dump", "");
  const std::string out_path = flag_value(a, "--out", "");
  const int E = sh.n_experts, K = sh.topk, H = sh.hidden, I = sh.intermediate;
  const int max_T = *std::max_element(tokens.begin(), tokens.end());

  try {
    ContextOptions co;
    co.pool_bytes = size_t(24) << 30;
    Context ctx(co);
    cudaStream_t st = ctx.stream();
    DevicePool& P = ctx.pool();
    // Weights: random MXFP4 codes, scale bytes 118..122 (|w| ~ 2^-9 .. 2^-5 * 6, like trained experts).
    const size_t w1n = size_t(E) * 2 * I * H, w2n = size_t(E) * H * I;
    DeviceArray<uint8_t> w1b(P, w1n / 2, "w1 blocks"), w1s(P, w1n / 32, "w1 scales");
    DeviceArray<uint8_t> w2b(P, w2n / 2, "w2 blocks"), w2s(P, w2n / 32, "w2 scales");
    DeviceArray<uint16_t> b1(P, size_t(E) * 2 * I, "b1"), b2(P, size_t(E) * H, "b2");
    fill_random_u8(w1b.get(), w1b.size(), 11, 0, 255, st);
    fill_random_u8(w2b.get(), w2b.size(), 12, 0, 255, st);
    fill_random_u8(w1s.get(), w1s.size(), 13, 118, 122, st);
    fill_random_u8(w2s.get(), w2s.size(), 14, 118, 122, st);
    fill_random_bf16(b1.get(), b1.size(), 15, 0.05f, st);
    fill_random_bf16(b2.get(), b2.size(), 16, 0.05f, st);
    const size_t expert_fp4_bytes = (size_t(2) * I * H + size_t(H) * I) / 2 + (size_t(2) * I * H + size_t(H) * I) / 32;

    // Load-time spread check (what a model load reports), and the 64-row
    // group tables, given to the layer where every group folds exactly.
    uint64_t nan1 = 0, nan2 = 0;
    cpu::FoldStats fs = mxfp4_fold_check_device(Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H}, E, &nan1, st);
    fs.merge(mxfp4_fold_check_device(Mxfp4Stack{w2b.get(), w2s.get(), H, I}, E, &nan2, st));
    cpu::FoldStats fs64;
    const DeviceArray<uint8_t> w1g =
                                   mxfp4_exact_group_table(P, Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H}, E, &fs64, st),
                               w2g = mxfp4_exact_group_table(P, Mxfp4Stack{w2b.get(), w2s.get(), H, I}, E, &fs64, st);
    cpu::FoldStats fsk;
    const DeviceArray<uint8_t> w1k = mxfp4_exact_whole_k_table(P, Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H}, E, &fsk,
                                                               st),
                               w2k = mxfp4_exact_whole_k_table(P, Mxfp4Stack{w2b.get(), w2s.get(), H, I}, E, &fsk, st);
    MoeWeights W{w1b.get(), w1s.get(), b1.get(), w2b.get(), w2s.get(), b2.get()};
    W.w1_gmax = w1g.get(), W.w2_gmax = w2g.get();
    W.w1_gk = w1k.get(), W.w2_gk = w2k.get();
    const bool groups_exact = W.w1_gmax != nullptr;  // gate_up's, for the components below

    // Components: folding throughput, and one FP8 GEMM (N = 2I, K = H padded) per M.
    nlohmann::json comp;
    if (!has_flag(a, "--no-components")) {
      const int n_ex = std::min(E, 16);
      const int64_t kph = cpu::fold_kpad(H), kpi = cpu::fold_kpad(I);
      DeviceArray<uint8_t> f1(P, size_t(n_ex) * 2 * I * kph, "fold1"), f2(P, size_t(n_ex) * H * kpi, "fold2");
      DeviceArray<float> s1(P, size_t(n_ex) * 2 * I * (kph / 128), "fold1 s"),
          s2(P, size_t(n_ex) * H * (kpi / 128), "s2");
      std::vector<int> idl(static_cast<size_t>(n_ex), 0);
      for (int i = 0; i < n_ex; ++i) idl[size_t(i)] = i * (E / n_ex);
      cudaEvent_t e0, e1;
      DZ_CUDA_CHECK(cudaEventCreate(&e0));
      DZ_CUDA_CHECK(cudaEventCreate(&e1));
      // GPU ms a call of fn over calls back-to-back calls, after one warm call.
      auto ms_per_call = [&](int calls, auto&& fn) {
        fn();
        ctx.sync();
        DZ_CUDA_CHECK(cudaEventRecord(e0, st));
        for (int i = 0; i < calls; ++i) fn();
        DZ_CUDA_CHECK(cudaEventRecord(e1, st));
        DZ_CUDA_CHECK(cudaEventSynchronize(e1));
        float t = 0;
        DZ_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        return double(t) / calls;
      };
      auto fold_on = [&](cudaStream_t q) {
        mxfp4_fold_experts(Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H}, idl.data(), n_ex, Fp8Slots{f1.get(), s1.get()},
                           q);
        mxfp4_fold_experts(Mxfp4Stack{w2b.get(), w2s.get(), H, I}, idl.data(), n_ex, Fp8Slots{f2.get(), s2.get()}, q);
      };
      const double fold_ms = ms_per_call(5, [&] { fold_on(st); });
      const double fold_bytes =
          double(n_ex) * expert_fp4_bytes + double(f1.bytes() + f2.bytes() + s1.bytes() + s2.bytes());
      comp["fold_experts"] = n_ex;
      comp["fold_ms"] = fold_ms;
      comp["fold_bytes_per_s"] = fold_bytes / (fold_ms * 1e-3);
      // The same experts folded by 64-row groups (the grouped kernel's other scale layout).
      DeviceArray<uint8_t> f1g(P, groups_exact ? f1.size() : 1, "fold1 groups");
      DeviceArray<float> s1g(P, size_t(n_ex) * (2 * I / kFoldRowGroup) * (kph / 128), "fold1 group s");
      if (groups_exact)
        mxfp4_fold_experts(Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H, w1g.get()}, idl.data(), n_ex,
                           Fp8Slots{f1g.get(), s1g.get()}, st);
      Fp8Gemm gemm(ctx);
      const int max_m = 2048;
      DeviceArray<uint8_t> xq(P, size_t(max_m) * kph, "gemm x");
      DeviceArray<float> xqs(P, size_t(max_m) * (kph / 128), "gemm xs");
      DeviceArray<uint16_t> dd(P, size_t(max_m) * 2 * I, "gemm d");
      fill_random_u8(xq.get(), xq.size(), 77, 0, 0x7E, st);
      fill_random_f32(xqs.get(), xqs.size(), 78, 1.f, st);
      nlohmann::json gl = nlohmann::json::array();
      for (int m : {16, 64, 128, 512, 2048}) {
        auto one = [&](int i) {
          const int sl = i % n_ex;
          gemm.run(xq.get(), xqs.get(), f1.get() + size_t(sl) * 2 * I * kph,
                   s1.get() + size_t(sl) * 2 * I * (kph / 128), dd.get(), m, 2 * I, int(kph), st);
        };
        one(0);
        ctx.sync();
        const int calls = 32;
        DZ_CUDA_CHECK(cudaEventRecord(e0, st));
        const auto h0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) one(i);
        const double host = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
        DZ_CUDA_CHECK(cudaEventRecord(e1, st));
        DZ_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        DZ_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        const double per = ms / calls;
        gl.push_back({{"m", m},
                      {"n", 2 * I},
                      {"k", kph},
                      {"gpu_ms_per_call", per},
                      {"host_ms_per_call", host / calls},
                      {"tflops", 2.0 * m * 2 * I * kph / (per * 1e-3) / 1e12}});
        std::fprintf(stderr, "gemm m=%5d n=%d k=%ld: %.4f ms/call (host %.4f) %.0f TFLOP/s\n", m, 2 * I, long(kph), per,
                     host / calls, 2.0 * m * 2 * I * kph / (per * 1e-3) / 1e12);
      }
      comp["gemm"] = gl;
      // The grouped kernel over the n_ex folded experts, m rows each.
      if (Fp8GroupedGemm::supported()) {
        Fp8GroupedGemm gg;
        DeviceArray<uint8_t> xg(P, size_t(n_ex) * max_m * kph, "grouped x");
        DeviceArray<float> xgs(P, size_t(n_ex) * max_m * (kph / 128), "grouped xs");
        DeviceArray<uint16_t> dg(P, size_t(n_ex) * max_m * 2 * I, "grouped d");
        fill_random_u8(xg.get(), xg.size(), 79, 0, 0x7E, st);
        fill_random_f32(xgs.get(), xgs.size(), 80, 1.f, st);
        // gate_up over the n_ex folded experts, m rows each (off, cnt: the
        // groups' rows, kept alive by the caller); grp: 64-row weight scales.
        std::vector<int> off(static_cast<size_t>(n_ex)), cnt(static_cast<size_t>(n_ex));
        auto grouped_args = [&](int m, bool grp, int tile_n) {
          for (int i = 0; i < n_ex; ++i) off[size_t(i)] = i * m, cnt[size_t(i)] = m;
          Fp8GroupedArgs ga;
          ga.x = xg.get(), ga.xs = xgs.get(), ga.rows_total = int64_t(n_ex) * m, ga.w = f1.get();
          ga.w_stride = int64_t(2 * I) * kph, ga.ws = s1.get(), ga.ws_stride = int64_t(2 * I) * (kph / 128);
          ga.d = dg.get(), ga.n = 2 * I, ga.k = int(kph), ga.offsets = off.data(), ga.counts = cnt.data();
          ga.groups = n_ex, ga.tile_n = tile_n;
          if (grp)
            ga.w = f1g.get(), ga.ws = s1g.get(), ga.ws_stride = int64_t(2 * I / kFoldRowGroup) * (kph / 128),
            ga.ws_row_group = kFoldRowGroup;
          return ga;
        };
        nlohmann::json gj = nlohmann::json::array();
        for (int m : {64, 128, 512, 2048})
          for (int grp = 0; grp < (groups_exact ? 2 : 1); ++grp)
            for (int tile_n : {192, 128}) {
              const Fp8GroupedArgs ga = grouped_args(m, grp != 0, tile_n);
              const double per = ms_per_call(10, [&] { gg.run(ga, st); }),
                           tf = 2.0 * n_ex * m * 2 * I * kph / (per * 1e-3) / 1e12;
              const char* scales = grp ? "64x128" : "1x128";
              gj.push_back({{"groups", n_ex},
                            {"m", m},
                            {"n", 2 * I},
                            {"k", kph},
                            {"weight_scales", scales},
                            {"tile_n", tile_n},
                            {"gpu_ms_per_call", per},
                            {"tflops", tf}});
              std::fprintf(stderr,
                           "grouped gemm %d x m=%5d n=%d k=%ld, %s weight scales, %d columns a tile: %.4f ms/call %.0f "
                           "TFLOP/s\n",
                           n_ex, m, 2 * I, long(kph), scales, tile_n, per, tf);
            }
        comp["grouped_gemm"] = gj;
        // The workspace path's overlap: the GEMM over 16 x 512 rows (64-row
        // scales) while the folding kernel folds 16 other experts' both
        // projections on the aux stream (lowest priority), each tile width.
        if (groups_exact) {
          cudaStream_t aux = ctx.aux_stream();
          cudaEvent_t fork, join;
          DZ_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
          DZ_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
          nlohmann::json bj = nlohmann::json::array();
          const int m = 512;
          for (int tile_n : {192, 128}) {
            const Fp8GroupedArgs ga = grouped_args(m, true, tile_n);
            const double alone = ms_per_call(10, [&] { gg.run(ga, st); });
            const double both = ms_per_call(5, [&] {
              DZ_CUDA_CHECK(cudaEventRecord(fork, st));
              DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, fork, 0));
              fold_on(aux);
              gg.run(ga, st);
              DZ_CUDA_CHECK(cudaEventRecord(join, aux));
              DZ_CUDA_CHECK(cudaStreamWaitEvent(st, join, 0));
            });
            bj.push_back({{"groups", n_ex},
                          {"m", m},
                          {"n", 2 * I},
                          {"tile_n", tile_n},
                          {"gemm_ms", alone},
                          {"fold_ms", fold_ms},
                          {"together_ms", both},
                          {"hidden_fraction_of_fold", (alone + fold_ms - both) / fold_ms}});
            std::fprintf(stderr,
                         "grouped gemm %d x m=%d, %d columns, beside folding %d experts: %.4f ms (gemm alone %.4f, "
                         "fold alone %.4f: %.0f%% of the fold hidden)\n",
                         n_ex, m, tile_n, n_ex, both, alone, fold_ms, 100.0 * (alone + fold_ms - both) / fold_ms);
          }
          comp["grouped_gemm_beside_fold"] = bj;
          DZ_CUDA_CHECK(cudaEventDestroy(fork));
          DZ_CUDA_CHECK(cudaEventDestroy(join));
        }
        // The MXFP4 GEMM on the same experts' MXFP4 bytes (X bytes as they are: the
        // order of K inside a sub-block changes no timing), every tile width.
        if (Mxfp4Gemm::supported() && groups_exact) {
          Mxfp4Gemm mg;
          // n_ex groups of m tokens over gate_up's weights; the caller sets the scales.
          std::vector<int> off(static_cast<size_t>(n_ex)), cnt(static_cast<size_t>(n_ex));
          auto mx_args = [&](int m) {
            for (int i = 0; i < n_ex; ++i) off[size_t(i)] = i * m, cnt[size_t(i)] = m;
            Mxfp4GemmArgs ma;
            ma.x = xg.get(), ma.xs = xgs.get(), ma.rows_total = int64_t(n_ex) * m;
            ma.w = Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H};
            ma.experts = idl.data(), ma.w_experts = E, ma.d = dg.get(), ma.n = 2 * I, ma.k = int(kph);
            ma.offsets = off.data(), ma.counts = cnt.data(), ma.groups = n_ex;
            return ma;
          };
          nlohmann::json mj = nlohmann::json::array();
          for (int m : {64, 128, 512, 2048})
            for (int tile : {0, 64, 128, 160}) {
              Mxfp4GemmArgs ma = mx_args(m);
              ma.xs_ld = (int64_t(n_ex) * m + 3) / 4 * 4, ma.w.gmax = w1g.get(), ma.tile_tokens = tile;
              const double per = ms_per_call(10, [&] { mg.run(ma, st); }),
                           tf = 2.0 * n_ex * m * 2 * I * kph / (per * 1e-3) / 1e12;
              mj.push_back({{"groups", n_ex},
                            {"m", m},
                            {"n", 2 * I},
                            {"k", kph},
                            {"tile_tokens", mg.last_tile_tokens()},
                            {"auto", tile == 0},
                            {"gpu_ms_per_call", per},
                            {"tflops", tf}});
              std::fprintf(stderr, "mxfp4 gemm %d x m=%5d n=%d k=%ld, %s%d tokens a tile: %.4f ms/call %.0f TFLOP/s\n",
                           n_ex, m, 2 * I, long(kph), tile ? "" : "auto: ", mg.last_tile_tokens(), per, tf);
            }
          comp["mxfp4_gemm"] = mj;
          // The same with whole-K scales (X's by row, W's by 64-row group over
          // all of K): no promotion a K block, tiles of up to 256 tokens.
          DeviceArray<uint8_t> gk(P, size_t(E) * (2 * I / 64), "whole-K table");
          const cpu::FoldStats fk = mxfp4_whole_k_table(Mxfp4Stack{w1b.get(), w1s.get(), 2 * I, H}, E, gk.get(), st);
          nlohmann::json wj = nlohmann::json::array();
          // (ride: an expert's last tokens on the tile before them, auto / off / on.)
          // (probe: the kernel with parts left out, timings only; Mxfp4GemmArgs::probe.)
          // (glu: gpt-oss's SwiGLU in the epilogue, E4M3 out; Mxfp4GemmArgs::q; 2: staged, Mxfp4GemmArgs::stage_q.)
          for (auto [m, ride, probe, glu] :
               {std::tuple{128, 0, 0, 0}, std::tuple{300, -1, 0, 0}, std::tuple{300, 1, 0, 0}, std::tuple{512, 0, 0, 0},
                std::tuple{512, 0, 0, 1}, std::tuple{532, -1, 0, 0}, std::tuple{532, 1, 0, 0}, std::tuple{532, 1, 0, 1},
                std::tuple{2048, 0, 0, 0}, std::tuple{2048, 0, 0, 1}, std::tuple{512, 0, 0, 2},
                std::tuple{532, 1, 0, 2}, std::tuple{2048, 0, 0, 2}, std::tuple{512, 0, 1, 0}, std::tuple{512, 0, 2, 0},
                std::tuple{512, 0, 3, 0}, std::tuple{512, 0, 8, 0}, std::tuple{2048, 0, 8, 0}}) {
            if (fk.lossy_groups) break;
            Mxfp4GemmArgs ma = mx_args(m);
            ma.gk = gk.get(), ma.ride_along = ride, ma.probe = probe;
            ma.stage_q = glu ? glu - 1 : -1;
            if (glu)  // D's bytes hold the E4M3 output (I bytes a row of 4I)
              ma.d = nullptr, ma.q = reinterpret_cast<uint8_t*>(dg.get()), ma.q_ld = I, ma.bias = b1.get();
            const double per = ms_per_call(10, [&] { mg.run(ma, st); }),
                         tf = 2.0 * n_ex * m * 2 * I * kph / (per * 1e-3) / 1e12;
            wj.push_back({{"groups", n_ex},
                          {"m", m},
                          {"n", 2 * I},
                          {"k", kph},
                          {"ride_along", mg.last_ride_along()},
                          {"probe", probe},
                          {"swiglu_epilogue", glu != 0},
                          {"staged_q", glu == 2},
                          {"gpu_ms_per_call", per},
                          {"tflops", tf}});
            std::fprintf(
                stderr, "mxfp4 gemm, whole-K scales, %d x m=%5d n=%d k=%ld%s%s%s: %.4f ms/call %.0f TFLOP/s\n", n_ex, m,
                2 * I, long(kph), mg.last_ride_along() ? ", last tokens riding" : "",
                glu ? (glu == 2 ? ", SwiGLU in the epilogue (E4M3 out, staged)" : ", SwiGLU in the epilogue (E4M3 out)")
                    : "",
                probe ? (" (probe " + std::to_string(probe) + ": timing only)").c_str() : "", per, tf);
          }
          comp["mxfp4_gemm_whole_k"] = wj;
          comp["whole_k_table"] = {
              {"groups", fk.groups}, {"lossy_groups", fk.lossy_groups}, {"max_spread", fk.max_spread}};
        }
      }
      std::fprintf(stderr, "fold %d experts: %.3f ms, %.2f TB/s (read+write)\n", n_ex, comp["fold_ms"].get<double>(),
                   comp["fold_bytes_per_s"].get<double>() / 1e12);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }

    MoeLayer layer(ctx, sh, max_T, opt);
    // What every variant returns to: the options with the library's A/B overrides from the environment
    // (DZ_MOE_ONE_TOKEN_STREAM, DZ_MOE_ONE_TOKEN_CONFIG), as a model's layer takes them.
    opt = layer.options();
    GpuTimer timer(ctx);
    constexpr int kSets = 4;  // routing sets rotated between calls

    nlohmann::json meta = bench_meta();
    meta["gpu"] = ctx.describe();
    nlohmann::json j = {{"bench", "moe"},
                        {"meta", meta},
                        {"shape", {{"experts", E}, {"topk", K}, {"hidden", H}, {"intermediate", I}}},
                        {"ceilings", {{"hbm_bytes_per_s", bw_ceiling}, {"fp8_flops", fp8_ceiling}}},
                        {"fp8_workspace_bytes", layer.fp8_workspace_bytes()},
                        {"scratch_bytes", layer.scratch_bytes()},
                        {"tile_experts", opt.tile_experts},
                        {"narrow_gemm_leaves_room_for_fold", Fp8GroupedGemm::narrow_leaves_room_for_fold()},
                        {"gemm_streams", opt.gemm_streams},
                        {"fp8_gemm", fp8_gemms},
                        {"fp8_grouped_blocks", opt.fp8_grouped_blocks},
                        {"fold_check",
                         {{"groups", fs.groups},
                          {"lossy_groups", fs.lossy_groups},
                          {"zero_groups", fs.zero_groups},
                          {"max_spread", fs.max_spread},
                          {"nan_scales", nan1 + nan2}}},
                        {"fold_check_64x128",
                         {{"groups", fs64.groups},
                          {"lossy_groups", fs64.lossy_groups},
                          {"zero_groups", fs64.zero_groups},
                          {"max_spread", fs64.max_spread},
                          {"group_scales_used", {W.w1_gmax != nullptr, W.w2_gmax != nullptr}}}},
                        {"fold_check_whole_k",
                         {{"groups", fsk.groups},
                          {"lossy_groups", fsk.lossy_groups},
                          {"max_spread", fsk.max_spread},
                          {"whole_k_tables", {W.w1_gk != nullptr, W.w2_gk != nullptr}}}},
                        {"timing", "median of CUDA-event times, L2 flushed (256 MiB read) before each call, " +
                                       std::to_string(kSets) + " routing sets rotated; fused path as CUDA graphs"},
                        {"step_timing",
                         "step_*: up to 64 tokens, 2-8 calls back to back in one graph on disjoint "
                         "experts, L2 flushed before it, the graph's time over the calls"},
                        {"components", comp},
                        {"results", nlohmann::json::array()}};
    if (!dump.empty()) {
      write_bin(dump + "/w1_blocks.bin", w1b.get(), w1b.size());
      write_bin(dump + "/w1_scales.bin", w1s.get(), w1s.size());
      write_bin(dump + "/w2_blocks.bin", w2b.get(), w2b.size());
      write_bin(dump + "/w2_scales.bin", w2s.get(), w2s.size());
      write_bin(dump + "/b1.bin", b1.get(), b1.size());
      write_bin(dump + "/b2.bin", b2.get(), b2.size());
    }

    std::mt19937 rng(1234);
    std::uniform_int_distribution<int> pick(0, E - 1);
    std::normal_distribution<float> nd(0.f, 1.f);
    double threshold_tpe = 0;  // largest tokens-per-expert where the fused path won
    for (int T : tokens) {
      DeviceArray<float> x(P, size_t(T) * H, "x"), out_f(P, size_t(T) * H, "out fused"),
          out_8(P, size_t(T) * H, "out fp8");
      fill_random_f32(x.get(), x.size(), 100 + T, 1.f, st);
      std::vector<DeviceArray<int> > ids;
      std::vector<DeviceArray<float> > gws;
      double distinct = 0;
      std::vector<int> hid;
      std::vector<float> hgw;
      std::vector<char> seen;
      for (int s = 0; s < kSets; ++s) {
        draw_routing(
            T, K, E, [&] { return pick(rng); }, nd, rng, hid, hgw, seen);
        for (char c : seen) distinct += c;
        ids.emplace_back(P, hid.size(), "ids");
        gws.emplace_back(P, hgw.size(), "gate weights");
        DZ_CUDA_CHECK(cudaMemcpy(ids.back().get(), hid.data(), hid.size() * 4, cudaMemcpyHostToDevice));
        DZ_CUDA_CHECK(cudaMemcpy(gws.back().get(), hgw.data(), hgw.size() * 4, cudaMemcpyHostToDevice));
      }
      distinct /= kSets;
      DZ_CUDA_CHECK(cudaDeviceSynchronize());  // pageable copies may land after they return
      const int r = std::max(5, T >= 4096 ? reps / 4 : reps);
      // Fused path: one CUDA graph per routing set (thread-local capture), for
      // each variant (K split over 1, 4 or 8 warps; programmatic dependent
      // launch on/off); the default options are what "fused_ms" reports.
      // W4A8 variants run at every size; defaults: the options as given.
      auto time_fused = [&](int ks, bool pdl, bool direct = true, int w4a8_terms = 0, bool defaults = false,
                            int w4a8_tiles = 0, int w4a8_passes = -1) {
        if (!defaults) {
          layer.options().fused_w4a8_passes = w4a8_passes;
          layer.options().fused_w4a8_stream_above = 1e9;  // W4A8 staged (no images) at any size
          layer.options().fused_one_token_direct = direct && opt.fused_one_token_direct;
          layer.options().fused_one_token_stream = false;  // its own variant, "stream"
          layer.options().fused_w4a8 = w4a8_terms > 0;
          layer.options().fused_w4a8_terms = std::max(1, w4a8_terms);
          layer.options().fused_w4a8_tiles = w4a8_tiles;
          layer.options().fused_w4a8_max_tokens_per_expert = 1e9;
          layer.options().fused_w4a8_min_slots = 0;
          layer.options().fused_k_split = ks;
          layer.options().pdl = pdl;
        }
        std::vector<cudaGraphExec_t> graphs(kSets);
        for (int s = 0; s < kSets; ++s) {
          layer.forward(W, x.get(), ids[s].get(), gws[s].get(), T, out_f.get(), MoePath::kFused);  // warm
          cudaGraph_t g;
          DZ_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
          layer.forward(W, x.get(), ids[s].get(), gws[s].get(), T, out_f.get(), MoePath::kFused);
          DZ_CUDA_CHECK(cudaStreamEndCapture(st, &g));
          DZ_CUDA_CHECK(cudaGraphInstantiate(&graphs[s], g, 0));
          DZ_CUDA_CHECK(cudaGraphDestroy(g));
        }
        const double ms =
            timer.median_ms(r, kSets, [&](int i) { DZ_CUDA_CHECK(cudaGraphLaunch(graphs[size_t(i % kSets)], st)); });
        for (auto ge : graphs) cudaGraphExecDestroy(ge);
        layer.options() = opt;
        return ms;
      };
      nlohmann::json variants = nlohmann::json::object();
      // The fused path's output for routing set 0 with options set by set(o),
      // and the largest difference between two such outputs.
      auto fused_out = [&](auto set) {
        set(layer.options());
        layer.forward(W, x.get(), ids[0].get(), gws[0].get(), T, out_f.get(), MoePath::kFused);
        ctx.sync();
        std::vector<float> h(size_t(T) * H);
        DZ_CUDA_CHECK(cudaMemcpy(h.data(), out_f.get(), h.size() * 4, cudaMemcpyDeviceToHost));
        layer.options() = opt;
        return h;
      };
      auto max_abs = [](const std::vector<float>& u, const std::vector<float>& v) {
        double m = 0;
        for (size_t i = 0; i < u.size(); ++i) m = std::max(m, double(std::fabs(u[i] - v[i])));
        return m;
      };
      double stream_vs_w4a16 = -1;  // one token streamed vs the W4A16 kernels (relative RMS; -1: not run)
      double images_diff = -1;      // W4A8 with activation images vs staged in the blocks (max abs; -1: not run)
      double stream_diff = -1;      // W4A8 streamed activations vs whole images (max abs; -1: not run)
      if (T <= 4096) {
        // K split over 1, 4 or 8 warps (8 only up to 64 tokens, with PDL).
        for (int ks : {1, 4, 8})
          for (bool pdl : {false, true})
            if (ks != 8 || (T <= 64 && pdl))
              variants["ks" + std::to_string(ks) + (pdl ? "_pdl" : "")] = time_fused(ks, pdl);
        if (T == 1) variants["ks4_pdl_routing_kernel"] = time_fused(4, true, false);  // one token, routed
        if (T == 1) {  // one token streamed (moe_one_token.h), and its output against the W4A16 kernels'
          layer.options().fused_one_token_stream = true;
          variants["stream"] = time_fused(0, false, true, 0, true);
          // The stream with configuration c (time_fused restores the options), and a block shape's name.
          auto time_stream = [&](const OneTokenConfig& c) {
            layer.options().fused_one_token_stream = true;
            layer.options().one_token = c;
            return time_fused(0, false, true, 0, true);
          };
          auto shape = [](int groups, int warps) {
            return "stream_g" + std::to_string(groups) + "x" + std::to_string(warps);
          };
          // Its block shapes (groups x warps a group), ring stages a group (s0: as many as fit) and
          // launches (l2: one a projection).
          for (auto gw2 : {std::pair{3, 4}, {1, 12}, {2, 6}, {4, 4}, {6, 2}, {2, 8}, {8, 2}, {4, 2}, {8, 1}})
            for (int stages : {0, 1, 2, 4})
              for (int launches : {1, 2}) {
                if (launches == 2 && !(gw2.first == 3 && stages == 0)) continue;
                if (stages > 0 && gw2.first * stages > 8) continue;  // (more than the shared memory holds)
                variants[shape(gw2.first, gw2.second) + "_s" + std::to_string(stages) + (launches == 2 ? "_l2" : "")] =
                    time_stream(OneTokenConfig{gw2.first, gw2.second, stages, launches});
              }
          // What the cooperative launch costs (OneTokenConfig::cooperative; plain launches can wait forever
          // beside another such launch).
          OneTokenConfig plain;
          plain.cooperative = false;
          variants["stream_plain_launch"] = time_stream(plain);
          // Where the stream's time goes (OneTokenConfig::probe; wrong outputs): without the arithmetic, also
          // without down's waits for gate_up; 6 x 2 and 3 x 4 warps.
          for (auto gw2 : {std::pair{6, 2}, {3, 4}})
            for (int probe : {1, 3})
              variants[shape(gw2.first, gw2.second) + "_probe" + std::to_string(probe)] =
                  time_stream(OneTokenConfig{gw2.first, gw2.second, 0, 1, probe});
          // DZ_BENCH_ONE_TOKEN_TRACE=PREFIX: one call's timeline a unit (OneTokenConfig::trace) as
          // PREFIX_pP.csv, the layer's block shape, for the probes P 0 (the real stream), 1 and 3.
          if (const char* tp = std::getenv("DZ_BENCH_ONE_TOKEN_TRACE")) {
            int dev = 0, nb = 0;
            DZ_CUDA_CHECK(cudaGetDevice(&dev));
            DZ_CUDA_CHECK(cudaDeviceGetAttribute(&nb, cudaDevAttrMultiProcessorCount, dev));
            DeviceArray<long long> tr(P, size_t(nb) * kOneTokenTraceUnits * 3, "one-token trace");
            for (int probe : {0, 1, 3}) {
              DZ_CUDA_CHECK(cudaMemset(tr.get(), 0, tr.bytes()));
              layer.options().fused_one_token_stream = true;
              OneTokenConfig& c = layer.options().one_token;
              c = opt.one_token;  // (DZ_MOE_ONE_TOKEN_CONFIG's, if set)
              c.probe = probe, c.trace = tr.get();
              for (int rep = 0; rep < 3; ++rep)  // the last of three calls, L2 flushed before it
                timer.flush_l2(),
                    layer.forward(W, x.get(), ids[0].get(), gws[0].get(), T, out_f.get(), MoePath::kFused);
              ctx.sync();
              layer.options() = opt;
              std::vector<long long> h(size_t(nb) * kOneTokenTraceUnits * 3);
              DZ_CUDA_CHECK(cudaMemcpy(h.data(), tr.get(), h.size() * 8, cudaMemcpyDeviceToHost));
              std::ofstream f(std::string(tp) + "_p" + std::to_string(probe) + ".csv");
              // Each unit's projection (0 gate_up, 1 down) and slot, as the kernel's plan deals them.
              const OneTokenPlan plan = one_token_plan(sh, nb);
              f << "block,i,issue_ns,arrive_ns,release_ns,proj,slot\n";
              for (int b = 0; b < nb; ++b)
                for (int i = 0; i < kOneTokenTraceUnits; ++i) {
                  const long long* e = &h[(size_t(b) * kOneTokenTraceUnits + i) * 3];
                  if (!e[0]) continue;
                  const bool whole = i == kOneTokenTraceUnits - 1;  // the block's own times: no unit
                  const OneTokenPlan::Unit u = whole ? OneTokenPlan::Unit{-1, -1, -1} : plan.unit(b, i);
                  f << b << ',' << i << ',' << e[0] << ',' << e[1] << ',' << e[2] << ',' << u.proj << ',' << u.slot
                    << '\n';
                }
            }
          }
          layer.options() = opt;
          const auto w4 = fused_out([](MoeOptions& o) { o.fused_one_token_stream = false, o.fused_w4a8 = false; });
          const auto sm = fused_out([](MoeOptions& o) { o.fused_one_token_stream = true; });
          double num = 0, den = 0;
          for (size_t i = 0; i < w4.size(); ++i)
            num += double(sm[i] - w4[i]) * (sm[i] - w4[i]), den += double(w4[i]) * w4[i];
          stream_vs_w4a16 = std::sqrt(num / std::max(den, 1e-300));
        }
        if (T >= 8) {  // 16 token slots a pass (two MMA token tiles) whatever the tokens per expert
          layer.options().fused_two_token_tiles_above = 0.0;  // kept by time_fused, which then restores opt
          variants["ks1_pdl_16slots"] = time_fused(1, true);
        }
        // W4A8 (E4M3 activations, FP8 wgmma, weights through the copy engine), one E4M3 term a value
        // (w4a8_*) or two (w4a8x2_*: hi + lo): both block shapes, and two row tiles a warpgroup (_t2).
        if (Fp8GroupedGemm::supported())
          for (int terms : {1, 2}) {
            const std::string name = terms == 2 ? "w4a8x2" : "w4a8";
            for (int ks : {1, 4})
              variants[name + "_ks" + std::to_string(ks) + "_pdl"] = time_fused(ks, true, true, terms, false, 1);
            variants[name + "_ks1_t2_pdl"] = time_fused(1, true, true, terms, false, 2);
            // Activations streamed by stage, 1 / 2 / 4 passes a read of the weights (_s1, _s2, _s4).
            for (int ps : {1, 2, 4})
              variants[name + "_s" + std::to_string(ps) + "_pdl"] = time_fused(1, true, true, terms, false, 1, ps);
          }
        // The streamed kernels against the whole-image ones (two terms, one tile a warpgroup): max abs, 0 = same bits.
        if (Fp8GroupedGemm::supported() && T <= 512) {
          auto streamed = [&](int ps) {
            return fused_out([&](MoeOptions& o) {
              o.fused_w4a8 = true, o.fused_w4a8_terms = 2, o.fused_w4a8_tiles = 1, o.fused_k_split = 1;
              o.fused_w4a8_max_tokens_per_expert = 1e9, o.fused_w4a8_min_slots = 0, o.fused_w4a8_passes = ps;
            });
          };
          const std::vector<float> h0 = streamed(-1);
          stream_diff = 0;
          for (int ps : {1, 2, 4}) stream_diff = std::max(stream_diff, max_abs(h0, streamed(ps)));
        }
        // Two terms with each block staging its activations itself (no image kernels), and
        // whether both ways give the same bits (routing set 0, each K split / tiles variant).
        if (Fp8GroupedGemm::supported() && T <= 512) {
          images_diff = 0;
          for (int ks : {1, 4})
            for (int tl : {1, 2}) {
              if (ks == 4 && tl == 2) continue;
              const std::string name = "w4a8x2_ks" + std::to_string(ks) + (tl == 2 ? "_t2" : "") + "_pdl_staged";
              layer.options().fused_w4a8_images = false;
              variants[name] = time_fused(ks, true, true, 2, false, tl);
              auto staged = [&](bool images) {
                return fused_out([&](MoeOptions& o) {
                  o.fused_w4a8 = true, o.fused_w4a8_terms = 2, o.fused_w4a8_tiles = tl, o.fused_k_split = ks;
                  o.fused_w4a8_max_tokens_per_expert = 1e9, o.fused_w4a8_min_slots = 0, o.fused_w4a8_images = images;
                  o.fused_w4a8_passes = -1, o.fused_w4a8_stream_above = 1e9;
                });
              };
              images_diff = std::max(images_diff, max_abs(staged(true), staged(false)));
            }
        }
      }
      const double ms_fused = time_fused(0, false, true, 0, true);
      // AUTO with down waiting for the whole gate_up grid instead of its own
      // experts' blocks (where both run on chained W4A8 kernels), between
      // AUTO above and AUTO again (the drift over the three), and whether the
      // two waits give the same bits.
      double wait_diff = -1;
      if (T <= 4096) {
        layer.options().fused_w4a8_expert_wait = false;
        variants["auto_grid_wait"] = time_fused(0, false, true, 0, true);
        variants["auto_again"] = time_fused(0, false, true, 0, true);
        wait_diff =
            max_abs(fused_out([](MoeOptions& o) { o.fused_w4a8_expert_wait = false; }), fused_out([](MoeOptions&) {}));
      }
      // The FP8 path with each GEMM implementation listed (the first is
      // ms_fp8), timed in alternation (one call of each per round, after
      // warm calls of each) so that clock drift over the run, e.g. after the
      // fused path's long calls at large sizes, weighs on all alike; and each
      // one's output against the first's on routing set 0.
      const size_t nv = fp8_gemms.size();
      std::vector<double> host;
      std::vector<std::vector<double> > samples(nv);
      auto fp8_call = [&](size_t v, int i, float* out) {
        set_gemm(layer.options(), fp8_gemms[v]);
        const auto h0 = std::chrono::steady_clock::now();
        layer.forward(W, x.get(), ids[size_t(i % kSets)].get(), gws[size_t(i % kSets)].get(), T, out, MoePath::kFp8);
        if (v == 0)
          host.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count());
      };
      for (size_t v = 0; v < nv; ++v)
        for (int i = 0; i < kSets; ++i) fp8_call(v, i, out_8.get());
      host.clear();
      for (int i = 0; i < r; ++i)
        for (size_t v = 0; v < nv; ++v)
          samples[v].push_back(timer.median_ms(1, 0, [&](int) { fp8_call(v, i, out_8.get()); }));
      layer.options() = opt;
      const double ms_fp8 = median(samples[0]);
      nlohmann::json gemm_ms = nlohmann::json::object(), gemm_diff = nlohmann::json::object(),
                     gemm_max_abs = nlohmann::json::object();
      gemm_ms[fp8_gemms[0]] = ms_fp8;
      if (nv > 1) {
        DeviceArray<float> out_v(P, size_t(T) * H, "out fp8 variant");
        std::vector<float> h0(x.size()), hv(x.size());
        layer.forward(W, x.get(), ids[0].get(), gws[0].get(), T, out_8.get(), MoePath::kFp8);
        ctx.sync();  // the layer runs on a non-blocking stream: cudaMemcpy alone would not wait for it
        DZ_CUDA_CHECK(cudaMemcpy(h0.data(), out_8.get(), h0.size() * 4, cudaMemcpyDeviceToHost));
        for (size_t v = 1; v < nv; ++v) {
          gemm_ms[fp8_gemms[v]] = median(samples[v]);
          fp8_call(v, 0, out_v.get());
          ctx.sync();
          DZ_CUDA_CHECK(cudaMemcpy(hv.data(), out_v.get(), hv.size() * 4, cudaMemcpyDeviceToHost));
          gemm_diff[fp8_gemms[v]] = diff_metric(h0, hv);
          double mx = 0;
          for (size_t q = 0; q < h0.size(); ++q) mx = std::max(mx, double(std::fabs(h0[q] - hv[q])));
          gemm_max_abs[fp8_gemms[v]] = mx;
        }
        layer.options() = opt;
      }
      // Outputs of both paths on routing set 0, and their agreement.
      layer.forward(W, x.get(), ids[0].get(), gws[0].get(), T, out_f.get(), MoePath::kFused);
      layer.forward(W, x.get(), ids[0].get(), gws[0].get(), T, out_8.get(), MoePath::kFp8);
      ctx.sync();
      check(layer.take_error() == 0, DZ_ERR_INTERNAL, "expert id out of range in the benchmark");
      std::vector<float> hf(x.size()), h8(x.size());
      DZ_CUDA_CHECK(cudaMemcpy(hf.data(), out_f.get(), hf.size() * 4, cudaMemcpyDeviceToHost));
      DZ_CUDA_CHECK(cudaMemcpy(h8.data(), out_8.get(), h8.size() * 4, cudaMemcpyDeviceToHost));
      const double agree = diff_metric(hf, h8);
      const double tpe = double(T) * K / E;
      if (ms_fused < ms_fp8) threshold_tpe = std::max(threshold_tpe, tpe);
      const MoePath chosen = layer.choose(T);
      const double ms_best = std::min(ms_fused, ms_fp8);
      const double bytes = distinct * double(expert_fp4_bytes);
      const double flops = 2.0 * T * K * (2.0 * I * H + double(H) * I);
      // Median ms of one CUDA graph of what work() enqueues on st, after warm launches.
      auto graph_ms = [&](int warm, auto work) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        DZ_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        work();
        DZ_CUDA_CHECK(cudaStreamEndCapture(st, &g));
        DZ_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
        DZ_CUDA_CHECK(cudaGraphDestroy(g));
        const double ms = timer.median_ms(r, warm, [&](int) { DZ_CUDA_CHECK(cudaGraphLaunch(ge, st)); });
        cudaGraphExecDestroy(ge);
        return ms;
      };
      // The same FP4 byte count read plainly in two dependent launches (the
      // gate_up and down shares): what a small batch's bytes can take at best,
      // ramp-up and tail included; the fused path's time against it.
      double ms_read = -1;
      const size_t gu_bytes = size_t(bytes * 2 / 3) / 16 * 16, dn_bytes = size_t(bytes / 3) / 16 * 16;
      if (gu_bytes <= w1b.size() && dn_bytes <= w2b.size())  // a CUDA graph, as the fused path
        ms_read = graph_ms(1, [&] {
          stream_read(w1b.get(), gu_bytes, timer.sink(), st);
          stream_read(w2b.get(), dn_bytes, timer.sink(), st);
        });
      // The layer as a decode step runs it: n calls back to back in one
      // graph (each on the previous call's heels, its launch paid while the
      // previous one runs), every call on its own experts (routing sets
      // drawn from disjoint parts of the experts, so no call finds another's
      // bytes in the L2), the L2 flushed before the graph; a call's time is
      // the graph's over n. The plain read is chained the same way, each
      // call's pair of reads on bytes of its own.
      double ms_step = -1, ms_step_read = -1, step_bytes = 0;
      // (Parts of at least twice a call's routed slots: each call's experts drawn as from all of them.)
      const int n_step = std::min(8, E / std::max(1, 2 * T * K));
      if (T <= 64 && n_step >= 2) {
        std::mt19937 srng(4321u + unsigned(T));  // (its own: the other sizes' routing sets stay as they were)
        std::normal_distribution<float> snd(0.f, 1.f);
        std::vector<int> perm(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
        std::shuffle(perm.begin(), perm.end(), srng);
        const int part = E / n_step;
        std::vector<DeviceArray<int> > sids;
        std::vector<DeviceArray<float> > sgws;
        std::vector<double> sbytes;
        std::uniform_int_distribution<int> in_part(0, part - 1);
        for (int c = 0; c < n_step; ++c) {
          draw_routing(
              T, K, E, [&] { return perm[size_t(c * part + in_part(srng))]; }, snd, srng, hid, hgw, seen);
          sbytes.push_back(double(std::count(seen.begin(), seen.end(), 1)) * double(expert_fp4_bytes));
          sids.emplace_back(P, hid.size(), "step ids");
          sgws.emplace_back(P, hgw.size(), "step gate weights");
          DZ_CUDA_CHECK(cudaMemcpy(sids.back().get(), hid.data(), hid.size() * 4, cudaMemcpyHostToDevice));
          DZ_CUDA_CHECK(cudaMemcpy(sgws.back().get(), hgw.data(), hgw.size() * 4, cudaMemcpyHostToDevice));
        }
        DZ_CUDA_CHECK(cudaDeviceSynchronize());
        for (double b : sbytes) step_bytes += b;
        auto time_chain = [&](auto call) {  // a call's share of the chain's graph
          return graph_ms(2,
                          [&] {
                            for (int c = 0; c < n_step; ++c) call(c);
                          }) /
                 n_step;
        };
        auto call = [&](int c) {  // the step's c-th call
          layer.forward(W, x.get(), sids[size_t(c)].get(), sgws[size_t(c)].get(), T, out_f.get(), MoePath::kFused);
        };
        layer.options() = opt;
        for (int c = 0; c < n_step; ++c) call(c);  // warm (plans, attributes) outside the capture
        ms_step = time_chain(call);
        const size_t gu = size_t(step_bytes / n_step * 2 / 3) / 16 * 16, dn = size_t(step_bytes / n_step / 3) / 16 * 16;
        if (gu * n_step <= w1b.size() && dn * n_step <= w2b.size())
          ms_step_read = time_chain([&](int c) {
            stream_read(w1b.get() + size_t(c) * gu, gu, timer.sink(), st);
            stream_read(w2b.get() + size_t(c) * dn, dn, timer.sink(), st);
          });
        step_bytes /= n_step;
        check(layer.take_error() == 0, DZ_ERR_INTERNAL, "expert id out of range in the benchmark's step chain");
      }
      auto or_null = [](bool ok, double v) { return ok ? nlohmann::json(v) : nlohmann::json(); };
      nlohmann::json row = {
          {"tokens", T},
          {"tokens_per_expert", tpe},
          {"distinct_experts", distinct},
          {"fp4_bytes", bytes},
          {"flops", flops},
          {"fused_ms", ms_fused},
          {"fp8_ms", ms_fp8},
          {"auto_path", chosen == MoePath::kFused ? "fused" : "fp8"},
          {"auto_ms", chosen == MoePath::kFused ? ms_fused : ms_fp8},
          {"fused_hbm_fraction", bytes / (ms_fused * 1e-3) / bw_ceiling},
          {"best_hbm_fraction", bytes / (ms_best * 1e-3) / bw_ceiling},
          {"fp8_tflops", flops / (ms_fp8 * 1e-3) / 1e12},
          {"best_tflops", flops / (ms_best * 1e-3) / 1e12},
          {"fp8_peak_fraction", flops / (ms_fp8 * 1e-3) / fp8_ceiling},
          {"best_peak_fraction", flops / (ms_best * 1e-3) / fp8_ceiling},
          {"fused_vs_fp8_diff", agree},
          {"plain_read_ms", or_null(ms_read > 0, ms_read)},
          {"plain_read_hbm_fraction", or_null(ms_read > 0, bytes / (ms_read * 1e-3) / bw_ceiling)},
          {"fused_vs_plain_read", or_null(ms_read > 0, ms_read / ms_fused)},
          {"step_calls", ms_step > 0 ? n_step : 0},
          {"step_fp4_bytes", or_null(ms_step > 0, step_bytes)},
          {"step_ms", or_null(ms_step > 0, ms_step)},
          {"step_hbm_fraction", or_null(ms_step > 0, step_bytes / (ms_step * 1e-3) / bw_ceiling)},
          {"step_plain_read_ms", or_null(ms_step_read > 0, ms_step_read)},
          {"step_plain_read_hbm_fraction", or_null(ms_step_read > 0, step_bytes / (ms_step_read * 1e-3) / bw_ceiling)},
          {"fp8_host_ms", median(host)},
          {"fused_variants_ms", variants},
          {"w4a8_images_vs_staged_max_abs", images_diff},
          {"stream_vs_w4a16_rel_rms", stream_vs_w4a16},
          {"w4a8_streamed_vs_images_max_abs", stream_diff},
          {"expert_wait_vs_grid_wait_max_abs", wait_diff},
          {"fp8_gemm_ms", gemm_ms},
          {"fp8_gemm_diff_vs_first", gemm_diff},
          {"fp8_gemm_max_abs_vs_first", gemm_max_abs},
      };
      j["results"].push_back(row);
      std::fprintf(stderr, "moe T=%6d  fused %9.4f ms  fp8 %9.4f ms  (hbm %.0f%%, fp8 %.0f TFLOP/s)  diff %.2e\n", T,
                   ms_fused, ms_fp8, 100 * bytes / (ms_best * 1e-3) / bw_ceiling, flops / (ms_fp8 * 1e-3) / 1e12,
                   agree);
      if (ms_read > 0)
        std::fprintf(stderr, "moe T=%6d  a plain read of the same bytes %9.4f ms (hbm %.0f%%): fused at %.0f%% of it\n",
                     T, ms_read, 100 * bytes / (ms_read * 1e-3) / bw_ceiling, 100 * ms_read / ms_fused);
      if (ms_step > 0)
        std::fprintf(stderr,
                     "moe T=%6d  in a step (%d calls back to back, each on its own experts): %9.4f ms a call (hbm "
                     "%.0f%% on %.1f MB); a plain read so %9.4f ms (hbm %.0f%%)\n",
                     T, n_step, ms_step, 100 * step_bytes / (ms_step * 1e-3) / bw_ceiling, step_bytes / 1e6,
                     ms_step_read, 100 * step_bytes / (ms_step_read * 1e-3) / bw_ceiling);
      for (size_t v = 1; v < fp8_gemms.size(); ++v) {
        const double ms_v = gemm_ms[fp8_gemms[v]].get<double>();
        std::fprintf(stderr, "moe T=%6d  fp8 with %s GEMMs %9.3f ms (%.0f TFLOP/s), with %s %9.3f ms; diff %.2e\n", T,
                     fp8_gemms[v].c_str(), ms_v, flops / (ms_v * 1e-3) / 1e12, fp8_gemms[0].c_str(), ms_fp8,
                     gemm_diff[fp8_gemms[v]].get<double>());
      }
      if (!dump.empty()) {
        const std::string p = dump + "/T" + std::to_string(T) + "_";
        write_bin(p + "x.bin", x.get(), x.size());
        write_bin(p + "ids.bin", ids[0].get(), ids[0].size());
        write_bin(p + "gw.bin", gws[0].get(), gws[0].size());
        float* best = ms_fused < ms_fp8 ? out_f.get() : out_8.get();
        write_bin(p + "out.bin", best, x.size());
      }
    }
    j["measured_fused_max_tokens_per_expert"] = threshold_tpe;
    if (!dump.empty()) {
      std::ofstream f(dump + "/meta.json");
      f << j.dump(2) << "\n";
    }
    bench_emit(j, out_path);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench moe: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace dz::cli
