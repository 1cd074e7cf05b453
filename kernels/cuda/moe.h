// The MXFP4 mixture-of-experts layer on the device (gpt-oss experts):
//   route -> sort token slots by expert -> either
//   fused path (few tokens per expert): W4A16 tensor-core kernels that read
//     MXFP4 straight from HBM and decode in registers (no FP8 copy),
//   FP8 path (many tokens per expert): fold the routed experts into one FP8
//     workspace (tiles, double-buffered on a second stream) -> per-expert
//     cuBLASLt FP8 GEMMs with 1x128 scales (or one grouped GEMM launch per
//     projection and tile: MoeOptions::fp8_gemm; the grouped kernel folding
//     inside itself, or Mxfp4Gemm folding in the MMA's registers:
//     fp8_mxfp4_gemm) -> SwiGLU -> down GEMMs,
//   -> weighted combine.
// gpt-oss semantics: gate/up rows interleaved (gate = row 2j, up = row 2j+1),
// gate = min(gate, 7), up = clamp(up, -7, 7), a = (up + 1) * gate * sigmoid(1.702 gate);
// or (MoeShape::act = kSilu, DeepSeek-V3.2's experts uploaded in the same row
// order) the plain SwiGLU a = silu(gate) * up. Biases are optional (null: zero).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "cuda/fp8_gemm.h"
#include "cuda/fp8_grouped_gemm.h"
#include "runtime/cuda/context.h"

namespace dz::cuda {

// The experts' activation of gate_up's interleaved rows (gate = row 2j, up = row 2j + 1).
enum class MoeActivation {
  // gpt-oss's clamped SwiGLU: gate = min(gate, 7), up = clamp(up, -7, 7),
  // a = (up + 1) * gate * sigmoid(1.702 gate); |a| <= 56.
  kGptOss = 0,
  // The plain SwiGLU (DeepSeek-V3.2): a = silu(gate) * up = gate * sigmoid(gate) * up,
  // no clamp, unbounded. The fused path then runs the W4A16 kernels only (the
  // W4A8 kernels' down projection takes one fixed activation scale that holds
  // only for gpt-oss's bound: as if MoeOptions::fused_w4a8 were false), their
  // fp16 activations divided by the token's input scale squared (fp16 would
  // overflow past 65504), and the FP8 path above fused_max_tokens_per_expert
  // (its 1x128 scales take any range). docs/cuda-moe.md.
  kSilu = 1,
};

struct MoeShape {
  int n_experts = 0, topk = 0;
  int hidden = 0;        // H: input/output features (multiple of 32 and 16)
  int intermediate = 0;  // I: SwiGLU width (gate_up has 2I rows)
  MoeActivation act = MoeActivation::kGptOss;
  // kSilu: > 0 clamps first, gate <= silu_limit and |up| <= silu_limit (DeepSeek-V4's experts).
  float silu_limit = 0;
};

// One layer's experts on the device, checkpoint layout (MXFP4 blocks/scales,
// BF16 biases): w1 = gate_up [E][2I][H/32][16], w2 = down [E][H][I/32][16].
// The biases are optional: null is a zero bias (DeepSeek's experts have none).
struct MoeWeights {
  const uint8_t *w1_blocks = nullptr, *w1_scales = nullptr;
  const uint16_t* b1 = nullptr;  // bf16 [E][2I] (interleaved as w1's rows), or null
  const uint8_t *w2_blocks = nullptr, *w2_scales = nullptr;
  const uint16_t* b2 = nullptr;  // bf16 [E][H], or null
  // Optional group tables (mxfp4_group_table), each given only where every
  // 64-row fold group of its projection is exact: the FP8 path's grouped GEMMs
  // then fold that projection by 64-row groups (MoeOptions::fp8_group_scales).
  const uint8_t *w1_gmax = nullptr, *w2_gmax = nullptr;
  // Optional whole-K tables (mxfp4_whole_k_table), each given only where every
  // 64-row group of its projection folds exactly over all of K: the FP8 path
  // may then run Mxfp4Gemm with whole-K scales (MoeOptions::fp8_whole_k).
  const uint8_t *w1_gk = nullptr, *w2_gk = nullptr;
};

enum class MoePath { kAuto = 0, kFused = 1, kFp8 = 2 };

// The one-token stream (moe_one_token.h): groups of group_warps consumer
// warps a block (built: 6 x 2, 3 x 4, 1 x 12, 2 x 6, 4 x 4, 2 x 8, 8 x 2,
// 4 x 2, 8 x 1); stages: the ring's stages a group (0: as many as fit, up
// to 8 a block); launches: 1 (down's units streamed right after gate_up's) or 2
// (a launch a projection). 6 x 2 was the fastest shape alone and in the model
// on an H100 (bench/results/2026-12-06-h100-one-token-stream.md, runs 25-28).
// Diagnostics for dz bench moe (the output is then wrong): probe bits
// kProbeNoMath (the consumers release each unit without its arithmetic: the
// stream's own time), kProbeNoWait (down's units do not wait for gate_up's); trace: device
// int64 [blocks][kOneTokenTraceUnits][3] of %globaltimer ns (the producer's
// issue, the consumers' arrival, their release of each unit).
struct OneTokenConfig {
  enum : int { kProbeNoMath = 1, kProbeNoWait = 2 };
  int groups = 6, group_warps = 2, stages = 0, launches = 1;
  int probe = 0;
  long long* trace = nullptr;
  // A cooperative launch: the driver starts the grid only once all its blocks fit at once. Without it, two
  // streams each running the stream (two models decoding on one GPU) could each hold part of the GPU and
  // wait for the rest forever. false only for dz bench moe's timing of what it costs.
  bool cooperative = true;
};
constexpr int kOneTokenTraceUnits = 32;

struct MoeOptions {
  // Fused path while tokens * topk / n_experts <= this. Measured on an H200
  // (bench/results/2026-12-02-h200-run36.md, run 43), fused vs FP8 path at 12
  // / 16 tokens per expert: 128 experts (gpt-oss-120b) 1.10 / 1.45 vs 1.25 /
  // 1.26 ms; 32 experts (gpt-oss-20b) 0.31 / 0.38 vs 0.36 / 0.36 ms: the
  // paths cross at ~14 and ~15 (16 before the FP8 path's idle warpgroups
  // stopped multiplying padding rows).
  double fused_max_tokens_per_expert = 14.0;
  int tile_experts = 16;  // experts per FP8 workspace tile (two tiles in flight; more than the layer has: all)
  int gemm_streams = 4;   // experts of a tile run concurrently on this many streams
  int fused_k_split = 0;  // fused kernels: K split over 1, 4 or 8 warps (0: 4 up to 8 token slots, else 1)
  // W4A16 kernels without a K split: 16 token slots a weight pass (two MMA
  // token tiles sharing one decode) once tokens * topk / n_experts is above
  // this, else 8 (an expert with more tokens takes more passes). H200
  // (2026-12-01-h200-run19.md, run 24), 8 vs 16 slots: 128 experts 4 / 6 / 8
  // tokens an expert 737 / 864 / 1080 vs 864 / 915 / 956 us; 32 experts 4 /
  // 6 / 8: 198 / 240 / 316 vs 231 / 240 / 253 us. At 8 on average many
  // experts get a ninth token and a second pass.
  double fused_two_token_tiles_above = 7.0;
  bool pdl = true;  // fused kernels as programmatic dependent launches
  // One token on the per-projection fused kernels: they read the router's ids
  // themselves and gate_up converts the input (no routing launch).
  bool fused_one_token_direct = true;
  // One token as a stream of the routed experts' bytes (moe_one_token.h:
  // one persistent launch, a copy-engine ring a group of consumer warps, fp16
  // mma.sync on the exactly decoded weights) instead of the per-projection
  // kernels, where it runs (sm_90, gpt-oss's activation) and E4M3 arithmetic
  // is not asked for (one W4A8 term). H100, run 32 of
  // bench/results/2026-12-06-h100-one-token-stream.md: the layer at 120b
  // shapes 28.0-28.2 us against 36.4 for the W4A16 kernels' K split (a plain
  // read of its bytes 21.8); a gpt-oss-20b decode step at batch 1 2.058-2.082
  // ms against 2.133-2.201 with it off, passes alternating.
  bool fused_one_token_stream = true;
  OneTokenConfig one_token;
  // W4A8 fused kernels: E4M3 activations (1x128 scales, as the FP8 path) on
  // FP8 wgmma, the weights streamed into shared memory by the copy engine, for
  // tokens * topk / n_experts <= fused_w4a8_max_tokens_per_expert and more
  // than fused_w4a8_min_slots token slots (tokens * topk: below, the W4A16
  // kernels' K split is faster in the model). sm_90a, projections of a multiple of 64 rows
  // and an even number of 32-element sub-blocks a row; elsewhere the W4A16
  // kernels run. fused_w4a8_terms E4M3 terms a value: 1 costs accuracy (the
  // gpt-oss fixture's min logits cosine 0.9964 vs 0.99999 with fp16
  // activations: DZ_EXPERTS_FP8 only); 2 (x / scale = hi + lo, lo the E4M3
  // rounding of the remainder: ~8 significant bits, as BF16, in two MMA
  // columns; 4 tokens of an expert a pass instead of 8) is the default.
  // H200 (bench/results/2026-12-01-h200-run18.md), two terms vs W4A16 at
  // gpt-oss-120b shapes (128 experts): 4 / 8 / 16 / 32 / 48 tokens 94 / 159 /
  // 263 / 429 / 512 us vs 103 / 180 / 298 / 478 / 549; 64 tokens (2 an
  // expert) 634 vs 621, 1 token 39.7 vs 35.3 (K split), 2 tokens a tie; at 32
  // experts 8 tokens 129 vs 142, 16 tokens 184 vs 180. Up to 2 tokens an
  // expert since 2026-12-02-h200-run52.md (run 53: two row tiles a
  // warpgroup, 32-bit descriptor adds):
  // 120b shapes 64 / 96 / 128 tokens (2 / 3 / 4 an expert) 554 / 696 / 837 vs
  // W4A16 626 / 691 / 747 us; 32 experts 16 / 24 tokens 181 / 218 vs 175 / 193.
  // With 128-byte boxes (2026-12-02-h200-run71.md, run 73): 96 tokens (3 an
  // expert) W4A16 669 vs 685 us, so the limit stays; 2 tokens (8 slots) 56.9
  // vs W4A16 60.3 us (32 experts 57.0 vs 58.5), so from 5 slots; one token (4
  // slots) 35.8 vs 35.4 (run 74): W4A16's K split.
  // Up to 4 tokens an expert since the activation images below
  // (bench/results/2026-12-03-h200-run106.md, run 105): 120b shapes 128 / 256
  // tokens (4 / 8 an expert) 683 / 1129 vs W4A16 703 / 953 us; 32 experts 32
  // / 64 tokens 195 / 306 vs 192 / 241. Up to 16 since the streamed
  // activations below (fused_w4a8_passes; run 121).
  // One token: since down's images come from gate_up (run 112) the W4A8
  // kernels (two terms, K split 2) win the layer alone, 32.3 vs W4A16 34.5 us
  // (run 113), but lose the gpt-oss-20b decode step they sit in: 2.010-2.053
  // vs 1.928-1.954 ms, four alternating pairs (2026-12-03-h200-run119.md);
  // again on today's kernels (run 306, 2026-12-04-h200-run300.md): 2.010 /
  // 2.036 vs 1.912 / 1.912 ms a step at batch 1 (32.3 vs 35.0 us alone).
  // Read as false for MoeActivation::kSilu (down's fixed activation scale
  // assumes gpt-oss's bound): the layer takes the W4A16 kernels, and with them
  // (fused_streamed_max_tokens_per_expert needs the streamed W4A8 kernels) the
  // FP8 path above fused_max_tokens_per_expert.
  bool fused_w4a8 = true;
  double fused_w4a8_max_tokens_per_expert = 16.0;
  int fused_w4a8_min_slots = 4;
  int fused_w4a8_terms = 2;
  // W4A8 kernels: each pass's activations quantized once (by a small kernel
  // before gate_up; down's two terms by gate_up's epilogue, one term by a
  // kernel before down) and brought into a block by one bulk copy beside its
  // first weight stages (false: every block of the expert quantizes them
  // itself after loading its sorted rows; the same bits). The in-block
  // staging kept each block's first MMA a chain of dependent loads behind its
  // full weight ring. H200 (run 105), 120b shapes, two terms, one tile a
  // warpgroup, images vs staged: 8 / 64 / 128 tokens 139.5 / 462 / 683 vs
  // 145.7 / 577 / 916 us; 32 experts 16 tokens 141.6 vs 171.2. One token's
  // gate_up still converts its input itself (no routing launch to follow).
  bool fused_w4a8_images = true;
  // W4A8 projections chained through down's images (two terms, programmatic
  // dependent launches): down's blocks wait for their own expert's gate_up
  // blocks (a count in the routing's active list) instead of the whole gate_up
  // grid, so down runs beside gate_up's last wave. The same bits. H200
  // (bench/results/2026-12-04-h200-run133.md), expert vs grid wait: 32
  // experts 64 / 96 / 128 tokens 202.7 / 244.6 / 302.6 vs 210.9 / 259.9 /
  // 320.5 us; 120b shapes within the noise.
  bool fused_w4a8_expert_wait = true;
  // 64-row tiles each W4A8 warpgroup streams in turn without a K split: with
  // 2 its copy ring runs on from one tile into the next (3 stages instead of
  // 4) and a block's setup serves twice the rows, but half the blocks leave
  // a longer last wave; 0 (auto): 2 from one to 1.5 tokens an expert on
  // average, or below one once the two-tile blocks still fill 1.5 waves of
  // the GPU with the experts the tokens reach (uniform routing), else 1.
  // Since down waits for its own experts (fused_w4a8_expert_wait) rather than
  // gate_up's last wave, two tiles pay from fewer blocks: 120b shapes 4 / 6 /
  // 8 tokens (345 / 500 / 660 two-tile gate_up blocks, 264 a wave) 80.4 /
  // 108.0 / 131.6 us with one tile vs 88.5 / 103.2 / 124.9 with two (H200,
  // 2026-12-04-h200-run135.md: run 140, three runs; three waves before). With
  // activation images (run 105), one vs two tiles: 120b shapes 8 / 64 / 128
  // tokens 139.5 / 462 / 683 vs 147.3 / 468 / 692 us, 32 experts 8 / 16 / 32
  // tokens 104.5 / 141.6 / 194.8 vs 99.0 / 164.7 / 218.6. Before, H200 (2026-12-01-h200-run19.md), two terms, one vs
  // two tiles: 120b shapes (128 experts) 8 / 16 / 32 / 64 tokens 160 / 260 / 421 / 623 vs 165 / 257 / 391 / 569 us; 32
  // experts 4 / 8 / 16 tokens 88 / 126 / 186 vs 102 / 118 / 190 us. Run 86 (2026-12-02-h200-run76.md), 120b shapes 4 /
  // 8 / 12 / 16 / 24 tokens 89.6 / 148.0 / 189.9 / 245.9 / 315.8 vs 98.7 / 149.8 / 182.6 / 233.9 / 292.4 us (2.5 waves
  // of two-tile blocks at 8 tokens, 3.5 at 12); 32 experts 4 / 8 tokens 85.2 / 120.4 vs 95.4 / 110.4.
  int fused_w4a8_tiles = 0;
  // W4A8 kernels with activation images: the activations streamed into each
  // ring stage beside its weights, for fused_w4a8_passes passes (4 tokens of
  // an expert each with two terms, 8 with one; two passes share n = 16 MMAs)
  // a read of the weights: 1, 2 or 4; -1 never; 0 (auto) above
  // fused_w4a8_stream_above tokens an expert on average, 2 passes where 1.5x
  // that average fits them, else 4 (the same bits either way). Without images
  // (more tokens than they are sized for) W4A8 runs up to
  // fused_w4a8_stream_above only. H200 (bench/results/2026-12-04-h200-run121.md,
  // run 122), two terms, streamed 2 / 4 passes vs whole images vs W4A16: 120b
  // shapes 128 / 256 / 384 tokens (4 / 8 / 12 an expert) 584 / 846 / 1127 and
  // 644 / 774 / 927 vs 648 / 1038 / 1468 vs 697 / 924 / 1075 us; 32 experts
  // 32 / 64 / 96 / 128 tokens (4 / 8 / 12 / 16) 165 / 236 / 318 / 375 and 182 /
  // 210 / 264 / 323 vs 193 / 294 / 417 / 503 vs 192 / 241 / 303 / 386. One pass
  // a read loses to whole images (712 vs 648 at 4 an expert); at 2 an expert
  // whole images won against unpaired passes (run 121: 462 vs 491).
  int fused_w4a8_passes = 0;
  double fused_w4a8_stream_above = 3.0;
  // Fused path also up to this many tokens an expert where its W4A8 kernels
  // stream the activations (fused_w4a8_passes): H200 (run 123,
  // bench/results/2026-12-04-h200-run121.md), 16 tokens an expert: 128 experts
  // 1.130 vs the FP8 path's 1.250 ms, 32 experts 0.319 vs 0.360 ms; the
  // gpt-oss-20b decode step at 128 sessions (16 an expert, now in CUDA graphs)
  // 9.92-9.98 vs 11.11-11.16 ms (run 124, alternating).
  double fused_streamed_max_tokens_per_expert = 16.0;
  // E4M3 arithmetic at every size (DZ_EXPERTS_FP8): one E4M3 term a value,
  // W4A8 kernels at every slot count up to 16 tokens an expert (8 before the
  // streamed activations; 120b shapes at 16: 826 us vs the FP8 path's 1231,
  // run 121), the FP8 path above.
  void use_e4m3_activations() {
    fused_w4a8 = true;
    fused_w4a8_terms = 1;
    fused_w4a8_min_slots = 0;
    fused_max_tokens_per_expert = fused_w4a8_max_tokens_per_expert = 16.0;
  }
  // Grouped FP8 GEMM blocks (0: one per SM); fewer leave SMs to the next tile's
  // weight folding, which runs concurrently on the aux stream.
  int fp8_grouped_blocks = 0;
  // FP8 path GEMMs: 1 per-expert cuBLASLt calls on gemm_streams streams; 2 one
  // grouped launch per projection for all experts of a workspace tile
  // (fp8_grouped_gemm.h; sm_90a only, DZ_ERR_UNSUPPORTED elsewhere); 0 auto:
  // grouped where supported (folding inside up to
  // fp8_grouped_max_tokens_per_expert, on the workspace above), else 1.
  // Measured at gpt-oss-120b shapes on an H200: folding inside faster up to
  // 256 tokens per expert (bench/results/2026-12-01-h200-run10.md: 8192 tokens
  // 4.45 vs 5.13 ms for cuBLASLt); at 512, once the kernel's FP8-weight tiles
  // were 128 x 192 (2026-12-02-h200-run87.md, run 89: timed in
  // alternation), on the workspace 6.62 ms vs 7.24 folding inside and 6.75
  // for cuBLASLt (16384 tokens). With 64-row weight scales (fp8_group_scales,
  // run 137, 2026-12-04-h200-run135.md), folding inside vs on the workspace at
  // 128 / 160 / 192 / 224 / 256 tokens an expert: 2.15 / 3.31 / 3.21 / 3.41 /
  // 4.07 ms vs 2.78 / 3.21 / 3.29 / 3.53 / 3.86: they cross near 240.
  int fp8_gemm = 0;
  double fp8_grouped_max_tokens_per_expert = 224.0;
  // Grouped FP8 GEMMs fold the MXFP4 experts inside the kernel (its producer
  // warps write the FP8 tiles to shared memory) instead of a folding pass into
  // the FP8 workspace first; the same FP8 bytes and scales either way. H200,
  // gpt-oss-120b shapes (run 10): 1024 / 4096 / 8192 tokens 1.56 / 2.59 /
  // 4.45 ms vs 2.70 / 3.51 / 4.85 ms folding first (cuBLASLt: 3.34 / 3.82 / 5.13).
  // Auto (fp8_gemm 0) folds inside only up to fp8_grouped_max_tokens_per_expert.
  bool fp8_fold_in_gemm = true;
  // Tile columns of the grouped kernel on the FP8 workspace (Fp8GroupedArgs::
  // tile_n): 192, or 128 for every workspace tile but the last, whose GEMMs
  // then run in the narrow block that leaves each SM room for a block of the
  // folding kernel, so the next tile folds beside them instead of between
  // them (where this device has the room: Fp8GroupedGemm::
  // narrow_leaves_room_for_fold). The same bits either way. Measured slower
  // (run 312: the narrow GEMM loses 24% of its speed, which eats what the
  // hidden folding saves; 16384 tokens 6.16 vs 5.75 ms): kept as the
  // benchmark's auto_n128 variant and off (docs/cuda-moe.md).
  int fp8_ws_tile_n = 192;
  // The FP8 path's grouped GEMMs take one weight scale per 64 rows and K
  // block where the weights carry exact group tables (MoeWeights::w1_gmax):
  // the same products in the tensor cores (each row's FP8 values a power of
  // two apart from its 1x128 fold), and a promotion of one FFMA an
  // accumulator instead of an FMUL and an FFMA.
  bool fp8_group_scales = true;
  // The FP8 path's GEMMs as Mxfp4Gemm (mxfp4_gemm.h) where both projections
  // carry exact group tables (MoeWeights::w1_gmax, w2_gmax) and fp8_gemm is
  // not 1: the weights are the MMA's A operand, each consumer thread folding
  // its MXFP4 words to E4M3 in registers (the folding kernel's bytes), the
  // tokens its N; no FP8 workspace, no folding pass, no refold of a W tile in
  // shared memory for each 128-row M tile. 1: always; -1: never; 0 (auto): up
  // to fp8_mxfp4_max_tokens_per_expert, except from above
  // fp8_mxfp4_skip_above up to fp8_mxfp4_skip_upto tokens an expert, where
  // the grouped kernel's one full 128-row M tile an expert is ahead.
  // H200 (bench/results/2026-12-04-h200-run218.md, run 231), MXFP4 GEMM vs the
  // grouped kernels, gpt-oss-120b shapes: 1024 / 2048 / 4096 / 16384 tokens
  // (32 / 64 / 128 / 512 an expert) 1.115 / 1.488 / 1.709 / 7.039 ms vs 1.206
  // / 1.430 / 2.054 / 5.699 (run 230: 3072 / 8192 / 12288 tokens 1.457 /
  // 3.563 / 5.304 vs 1.506 / 3.746 / 4.706); gpt-oss-20b shapes (32 experts):
  // 512 / 1024 / 2048 / 4096 tokens (64 / 128 / 256 / 512) 0.403 / 0.479 /
  // 0.886 / 1.639 vs 0.392 / 0.582 / 0.957 / 1.405. Its consumers' folding
  // and promotion are issue-bound at two warps a scheduler, so beyond 256
  // tokens an expert the grouped kernel on experts folded once into the
  // workspace wins. fp8_mxfp4_tile_tokens: 64, 128 or 160 tokens a tile (0:
  // the one with the least padded work).
  int fp8_mxfp4_gemm = 0;
  double fp8_mxfp4_max_tokens_per_expert = 256.0;
  double fp8_mxfp4_skip_above = 48.0, fp8_mxfp4_skip_upto = 80.0;
  int fp8_mxfp4_tile_tokens = 0;
  // The FP8 path's GEMMs as Mxfp4Gemm with whole-K scales where both
  // projections carry whole-K tables (MoeWeights::w1_gk, w2_gk) and fp8_gemm
  // is 0: the input and SwiGLU's output quantized with one scale a row, each
  // expert's weights under one scale a 64-row group, the MMAs accumulating
  // over all of K with no promotion, so tiles of 256 tokens fit and nothing is
  // folded ahead. 1: at every FP8-path size; -1: never; 0 (auto): above
  // fp8_whole_k_min_tokens_per_expert tokens an expert. H100
  // (bench/results/2026-12-06-h100-whole-k.md, runs 10, 12), gpt-oss-120b
  // shapes: 4096 / 16384 tokens (128 / 512 an expert) 1.543 / 4.156 ms vs
  // 1.698 / 6.258 without; 20b shapes (32 experts): 1024 / 2048 / 4096 / 16384
  // tokens 0.444 / 0.609 / 1.132 / 4.058 vs 0.487 / 0.872 / 1.581 / 4.545. At 64 an
  // expert (120b, 2048 tokens) it was behind, 1.458 vs 1.431 (run 2, before
  // the narrow last tiles); 96 is between.
  int fp8_whole_k = 0;
  double fp8_whole_k_min_tokens_per_expert = 96.0;
  // With whole-K scales and gpt-oss's SwiGLU: gate_up's epilogue writes down's
  // E4M3 input itself under one fixed scale (Mxfp4GemmArgs::q; the SwiGLU's
  // bound of 56 makes it safe), so no bf16 D1 is written or read and no pass
  // quantizes between the projections. false: that pass (amax / 448 a row).
  // H100, in alternation (bench/results/2026-12-06-h100-swiglu-epilogue.md):
  // 120b shapes 4096 / 16384 tokens 1.798 / 4.648 ms vs 1.846 / 5.053 with
  // the pass; 20b 1.180 / 4.678 vs 1.267 / 5.128.
  bool fp8_whole_k_glu = true;
};

class MoeLayer {
 public:
  // Scratch for up to max_tokens tokens per call; one instance serves every
  // layer of a model (the FP8 workspace is shared).
  MoeLayer(Context& ctx, const MoeShape& shape, int max_tokens, const MoeOptions& opt = {});
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // out[T][H] = sum_k gate_w[t][k] * expert_{ids[t][k]}(x[t]) on ctx.stream()
  // (accumulate: out += that, e.g. straight into the residual stream; out
  // must not alias x then).
  // x [T][H] fp32, ids [T][topk] int32 (each in [0, E)), gate_w [T][topk]
  // fp32, all on the device. The fused path runs entirely on the device
  // (capturable in a CUDA graph); the FP8 path reads the per-expert counts
  // back to the host once.
  void forward(const MoeWeights& w, const float* x, const int* ids, const float* gate_w, int T, float* out,
               MoePath path = MoePath::kAuto, bool accumulate = false);

  // The path kAuto takes for T tokens (fused_max_tokens_per_expert,
  // fused_streamed_max_tokens_per_expert).
  MoePath choose(int T) const;
  MoeOptions& options();  // tunables read at each forward (the bench varies them)
  const MoeShape& shape() const { return shape_; }
  size_t fp8_workspace_bytes() const;  // the shared FP8 expert workspace (both tiles)
  size_t scratch_bytes() const;        // everything else this layer reserved
  // What a layer made with these arguments reserves from the pool at
  // construction, both of the above (gpt-oss sizes its pool by it). Buffers
  // only some paths use are sized for the paths kAuto takes at max_tokens
  // and grow from the pool on first use past that: the fused path forced on
  // many tokens, gpt-oss's experts without whole-K tables (FP8 workspace and
  // gate_up's bf16 output), options changed after construction.
  static size_t reserved_bytes(const MoeShape& shape, int max_tokens, const MoeOptions& opt = {});
  // Nonzero when an expert id was out of range in a call since the last check (syncs).
  int take_error();
  // The device flag take_error() reads, for callers that read and reset it on
  // their stream themselves (inside a CUDA graph: no sync).
  int* error_flag();

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
  MoeShape shape_;
};

}  // namespace dz::cuda
