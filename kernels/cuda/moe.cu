#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/mxfp4_fold.h"
#include "cuda/moe.h"
#include "cuda/moe_decode.cuh"
#include "cuda/moe_one_token.h"
#include "cuda/mxfp4_fold.h"
#include "cuda/mxfp4_gemm.h"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

// wgmma exists only in the sm_90a target: elsewhere the W4A8 kernel body is
// empty and the host does not choose it (Fp8GroupedGemm::supported).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DZ_MOE_SM90A 1
#endif

namespace dz::cuda {

namespace {

constexpr int kPadRows = 16;  // expert segments padded to 16 rows (aligned scale vectors, few GEMM shapes)
constexpr int kRouteThreads = 1024;
// Fused kernel block: 8 warps = (8 / KS) row tiles of 16 rows x KS slices of K
// (split K keeps each warp's dependent chain short when few experts are
// active; partial sums meet in shared memory in a fixed order).
constexpr int kW4Threads = 256;
constexpr int kW4Tokens = 8;         // tokens per MMA tile (n = 8)
constexpr int kW4MaxTokens = 16;     // tokens per weight pass of the per-projection kernels (two tiles)
constexpr int kRouteConvertsX = 16;  // the routing block converts the input up to this many tokens
constexpr int kW8ImageTokens = 512;  // tokens a call whose W4A8 activations are prepared as images

// 2^(s-127) for an E8M0 byte s in 0..254 (s = 0 is the fp32 subnormal 2^-127).
__device__ __forceinline__ float e8m0_to_float(int s) {
  return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(uint32_t(s) << 23);
}

// The layer's activation (MoeShape::act) of one gate/up pair: gpt-oss's
// clamped SwiGLU above (the same bits), or with silu the plain SwiGLU,
// silu(gate) * up, as the CPU reference's Glu::Kind::SwiGLU (precise expf and
// division: gate / inf = -0 for gate < -88, the limit). silu is uniform (a
// kernel argument, or a template argument: a runtime branch in the fused
// W4A16 gate_up kernel cost the gpt-oss instances spills).
// limit > 0 (silu only, DeepSeek-V4): gate <= limit and |up| <= limit first.
__device__ __forceinline__ float glu(float gate, float up, bool silu, float limit = 0) {
  if (silu) {
    if (limit > 0) gate = fminf(gate, limit), up = fminf(fmaxf(up, -limit), limit);
    return gate / (1.f + expf(-gate)) * up;
  }
  return swiglu(gate, up);
}

// ------------------------------------------------------------------ routing
// Counting sort of the T*topk slots by expert; active[i] = {expert, first row,
// token count, 0} of the i-th expert with tokens (one 16-byte load for a fused
// kernel's block). Segment e spans rows [offsets[e], offsets[e+1]) (count
// rounded up to kPadRows; pad rows hold -1). Order inside a segment is
// arbitrary; every row is computed independently. Up to kRouteOneBlock slots
// one block sorts (route_kernel); more go through three launches over
// kRouteChunk-slot chunks (one block's shared-memory atomics took 121 us for
// 65536 slots on an H200).
constexpr int kRouteOneBlock = 4096;
constexpr int kRouteChunk = 2048;
constexpr int kRouteChunkThreads = 256;

// Counts of slots [s0, s1) by expert into cnt (shared, zeroed); invalid ids set err.
__device__ void route_count(const int* ids, int s0, int s1, int E, int* cnt, int* err) {
  for (int s = s0 + int(threadIdx.x); s < s1; s += int(blockDim.x)) {
    const int e = ids[s];
    if (e < 0 || e >= E)
      atomicOr(err, 1);
    else
      atomicAdd(&cnt[e], 1);
  }
}

// Warp 0: exclusive scans of padded counts (off[0..E], shared) and of active
// flags (active, n_active); every thread then writes offsets and counts.
__device__ void route_offsets(const int* cnt, int E, int* off, int* offsets, int* counts, int* active, int* n_active) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int rows = 0, act = 0;
    for (int e = e0; e < e1; ++e) rows += (cnt[e] + kPadRows - 1) / kPadRows * kPadRows, act += cnt[e] > 0;
    int rs = rows, as = act;
    for (int o = 1; o < 32; o <<= 1) {
      const int r2 = __shfl_up_sync(~0u, rs, o), a2 = __shfl_up_sync(~0u, as, o);
      if (lane >= o) rs += r2, as += a2;
    }
    rs -= rows, as -= act;
    for (int e = e0; e < e1; ++e) {
      off[e] = rs;
      rs += (cnt[e] + kPadRows - 1) / kPadRows * kPadRows;
      if (cnt[e]) reinterpret_cast<int4*>(active)[as++] = make_int4(e, off[e], cnt[e], 0);
    }
    if (lane == 31) off[E] = rs, *n_active = as;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    offsets[e] = off[e];
    if (e < E) counts[e] = cnt[e];
  }
}

// Rows r0, r0 + stride, ... below off[E]: expert of each row; pad rows -> -1.
__device__ void route_rows(const int* off, const int* cnt, int E, int r0, int stride, int* row_expert, int* sorted) {
  for (int r = r0; r < off[E]; r += stride) {
    const int e = ptx::segment_of(off, E, r);
    row_expert[r] = e;
    if (r - off[e] >= cnt[e]) sorted[r] = -1;
  }
}

// Slots [s0, s1) to their rows: cur[e] (shared) is the next free row of expert e.
__device__ void route_place(const int* ids, int s0, int s1, int E, int* cur, int* sorted, int* inv) {
  for (int s = s0 + int(threadIdx.x); s < s1; s += int(blockDim.x)) {
    const int e = ids[s];
    if (e < 0 || e >= E) {
      inv[s] = -1;
      continue;
    }
    const int pos = atomicAdd(&cur[e], 1);
    sorted[pos] = s;
    inv[s] = pos;
  }
}

__device__ void x_to_half_row(const float* row, int H, int kpad, __half* out, float* scale_out, float* red);

// Block 0 sorts every slot; blocks 1..T convert the fused path's fp16 input, one token each.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const int* ids, int n_slots, int E, int* counts, int* offsets, int* sorted, int* row_expert, int* inv,
                 int* active, int* n_active, int* err, const float* x, int T, int H, int kpad, __half* xh, float* xs) {
  if (blockIdx.x > 0) {
    __shared__ float red[32];
    const int t = blockIdx.x - 1;
    x_to_half_row(x + int64_t(t) * H, H, kpad, xh + int64_t(t) * kpad, xs + t, red);
    return;
  }
  extern __shared__ int sm[];
  int* cnt = sm;
  int* cur = sm + E;
  int* off = sm + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  route_count(ids, 0, n_slots, E, cnt, err);
  __syncthreads();
  route_offsets(cnt, E, off, offsets, counts, active, n_active);
  for (int e = threadIdx.x; e < E; e += blockDim.x) cur[e] = off[e];
  route_rows(off, cnt, E, int(threadIdx.x), int(blockDim.x), row_expert, sorted);
  __syncthreads();
  route_place(ids, 0, n_slots, E, cur, sorted, inv);
}

// Many slots, 1 of 3: chunk b's counts by expert -> part[b][E].
__global__ void __launch_bounds__(kRouteChunkThreads)
    route_chunk_count_kernel(const int* ids, int n_slots, int E, int* part, int* err) {
  extern __shared__ int cnt[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int s0 = int(blockIdx.x) * kRouteChunk;
  route_count(ids, s0, min(n_slots, s0 + kRouteChunk), E, cnt, err);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) part[int64_t(blockIdx.x) * E + e] = cnt[e];
}

// 2 of 3 (one block): totals, offsets, active list; part[b][e] becomes chunk b's first row of expert e.
__global__ void __launch_bounds__(kRouteThreads)
    route_chunk_scan_kernel(int* part, int nb, int E, int* counts, int* offsets, int* active, int* n_active) {
  extern __shared__ int sm[];
  int* cnt = sm;
  int* off = sm + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int c = 0;
    for (int b = 0; b < nb; ++b) c += part[int64_t(b) * E + e];
    cnt[e] = c;
  }
  __syncthreads();
  route_offsets(cnt, E, off, offsets, counts, active, n_active);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = off[e];
    for (int b = 0; b < nb; ++b) {
      const int c = part[int64_t(b) * E + e];
      part[int64_t(b) * E + e] = run;
      run += c;
    }
  }
}

// 3 of 3: chunk b's slots to their rows; the grid's threads fill the row -> expert map.
__global__ void __launch_bounds__(kRouteChunkThreads)
    route_chunk_place_kernel(const int* ids, int n_slots, int E, const int* part, const int* counts, const int* offsets,
                             int* sorted, int* row_expert, int* inv) {
  extern __shared__ int sm[];
  int* cur = sm;
  int* cnt = sm + E;
  int* off = sm + 2 * E;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    off[e] = offsets[e];
    if (e < E) cur[e] = part[int64_t(blockIdx.x) * E + e], cnt[e] = counts[e];
  }
  __syncthreads();
  const int s0 = int(blockIdx.x) * kRouteChunk;
  route_place(ids, s0, min(n_slots, s0 + kRouteChunk), E, cur, sorted, inv);
  route_rows(off, cnt, E, int(blockIdx.x * blockDim.x + threadIdx.x), int(gridDim.x * blockDim.x), row_expert, sorted);
}

// Block-wide max of v (red: 32 floats of shared memory, free again on return).
__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  __syncthreads();  // red may still be read by an earlier call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < (blockDim.x >> 5) ? red[threadIdx.x & 31] : 0.f;  // (v >= 0: magnitudes)
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  return v;
}

// One token row (whole block, kPer pieces a thread in registers: one load
// round trip): fp32 [H] -> fp16 scaled by a power of two (x / scale in
// [-1, 1]), handed out as 8-value pieces q8 < k8 (zero past H) to put(q8,
// piece); returns the scale. H % 4 == 0 (MoeLayer checks H % 32);
// k8 <= kPer * blockDim.x.
template <int kPer, typename Put>
__device__ __forceinline__ float x_to_half_pieces(const float* x, int H, int k8, Put put, float* red) {
  float4 v[kPer][2];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int q8 = threadIdx.x + j * blockDim.x;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 8 * q8 + 4 * h;
      v[j][h] = q8 < k8 && c < H ? *reinterpret_cast<const float4*>(x + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[j][h].x), fabsf(v[j][h].y)), fmaxf(fabsf(v[j][h].z), fabsf(v[j][h].w))));
    }
  }
  const float scale = pow2_scale(block_max(amax, red)), inv = 1.f / scale;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int q8 = threadIdx.x + j * blockDim.x;
    if (q8 >= k8) continue;
    uint4 p;
    __half2* hp = reinterpret_cast<__half2*>(&p);
    hp[0] = __floats2half2_rn(v[j][0].x * inv, v[j][0].y * inv);
    hp[1] = __floats2half2_rn(v[j][0].z * inv, v[j][0].w * inv);
    hp[2] = __floats2half2_rn(v[j][1].x * inv, v[j][1].y * inv);
    hp[3] = __floats2half2_rn(v[j][1].z * inv, v[j][1].w * inv);
    put(q8, p);
  }
  return scale;
}

// One token row (whole block) -> fp16 [kpad], zero padded, as x_to_half_pieces
// (rows of up to 4 pieces a thread; a strided loop per pass took ~5 us a row);
// the scale goes to *scale_out.
__device__ void x_to_half_row(const float* row, int H, int kpad, __half* out, float* scale_out, float* red) {
  constexpr int kPer = 4;
  const int k8 = kpad / 8;
  float scale;
  if (k8 <= kPer * int(blockDim.x)) {
    scale = x_to_half_pieces<kPer>(
        row, H, k8, [&](int q8, uint4 v) { reinterpret_cast<uint4*>(out)[q8] = v; }, red);
  } else {
    float amax = 0.f;
    for (int k = threadIdx.x; k < H; k += blockDim.x) amax = fmaxf(amax, fabsf(row[k]));
    scale = pow2_scale(block_max(amax, red));
    const float inv = 1.f / scale;
    for (int k = threadIdx.x; k < kpad; k += blockDim.x) out[k] = __float2half_rn(k < H ? row[k] * inv : 0.f);
  }
  if (threadIdx.x == 0) *scale_out = scale;
}

__global__ void __launch_bounds__(256) x_to_half_kernel(const float* x, int H, int kpad, __half* xh, float* xs) {
  pdl_trigger();  // dependents only read xh/xs after their griddepcontrol.wait
  __shared__ float red[32];
  const int t = blockIdx.x;
  x_to_half_row(x + int64_t(t) * H, H, kpad, xh + int64_t(t) * kpad, xs + t, red);
}

// ------------------------------------------------------- fused W4A16 path
struct W4Args {
  const uint8_t* blocks;   // expert 0, [E][rows][nsub][16]
  const uint8_t* scales;   // [E][rows][nsub]
  const uint16_t* bias;    // bf16 [E][rows], or null (zero: W4A16 kernels only, see Impl::w8)
  const __half* act;       // gate_up: xh [T][kpad] (by token); down: act [rows_cap][kpad] (by sorted row)
  const float* act_scale;  // per-token scale: gate_up's (direct, kSilu: written for down), down's (kSilu only)
  const int *sorted, *n_active;
  const int4* active;  // {expert, first row, tokens, 0} per active expert
  int topk, rows, nsub, kpad;
  int ntok;         // token slots staged per pass (1..kW4MaxTokens; > kW4Tokens: two token tiles)
  __half* out_act;  // gate_up: SwiGLU output [rows_cap][out_ld]
  int out_ld;
  float* out_y;  // down: [rows_cap][rows], bias added
  // One token (direct != 0): no routing kernel. Slot y's expert is ids[y] and
  // its row y * kPadRows; gate_up blocks convert x (fp32 [H]) to fp16
  // themselves and write inv (invalid ids: -1 and err).
  int direct, n_experts, H;
  // W4A8 kernels: each pass's staged activations prepared in global memory
  // (w8_image_kernel), one image of img_bytes a pass at img + (row / pass
  // tokens) * img_bytes for the expert's sorted rows; null: staged in the kernel.
  const uint8_t* img;
  int img_bytes;
  // W4A8 gate_up with next_img: its epilogue also writes the down
  // projection's images (next_img_bytes each, kpad = out_ld; w8_down_put).
  uint8_t* next_img;
  int next_img_bytes;
  // W4A8 projections chained through down's images (w8_count_done): gate_up
  // (nonzero) counts its blocks done by expert; down waits for this many of
  // its expert's instead of the whole gate_up grid. 0: off.
  int expert_wait;
  float limit;  // kSilu: MoeShape::silu_limit
  const int* ids;
  const float* x;
  int *inv, *err;
};

// The fold of a sub-block d binades under its chunk's largest scale, 2^(14 -
// d) as a half2: times a code from w4_pairs it is E2M1 * 2^-d, exact down to
// fp16's smallest subnormal (below that rounded as fp16 rounds).
__device__ __forceinline__ uint32_t w4_fold_scale(int d) {
  const uint32_t h = d <= 28 ? uint32_t(29 - d) << 10 : d <= 38 ? 1u << (38 - d) : 0u;
  return h | (h << 16);
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// An 8-element fp16 activation piece x0..x7 in the order of the weight pairs:
// (x0, x4), (x1, x5), (x2, x6), (x3, x7).
__device__ __forceinline__ uint4 w4_piece(uint4 u) {
  return make_uint4(ptx::prmt(u.x, u.z, 0x5410), ptx::prmt(u.x, u.z, 0x7632), ptx::prmt(u.y, u.w, 0x5410),
                    ptx::prmt(u.y, u.w, 0x7632));
}

// The k order inside a 128-wide chunk is permuted identically for both
// operands: lane (g, t) owns sub-block t (32 elements) of the chunk; MMA step
// 2i + h takes elements 8i + {2h, 2h + 4, 2h + 1, 2h + 5} of it (w4_pairs,
// w4_piece). Each row's 4 sub-block scales are folded into the fp16 weights
// relative to the chunk's largest one; that one multiplies the fp32 partial
// sums.

// One 128-wide K chunk of a 16-row MMA tile (rows A = MMA rows 0..7, rows B =
// 8..15) against kN tiles of 8 tokens: wa/wb are this lane's 16-byte sub-block
// (t) of rows A/B, s_a/s_b its E8M0 scales, b(i, n) the 16-byte activation
// piece of token tile n for MMA steps 2i and 2i+1. acc[n][0..1] (row A) and
// acc[n][2..3] (row B) accumulate tokens 8n + 2t and 8n + 2t + 1. The weights
// are decoded once for all token tiles.
template <int kN, typename B>
__device__ __forceinline__ void w4_chunk_n(const uint4 wa, const uint4 wb, const int s_a, const int s_b, B b,
                                           float (&acc)[kN][4]) {
  // Largest scale among the row's nonzero sub-blocks of this chunk (4 lanes t).
  int mA = ((wa.x | wa.y | wa.z | wa.w) & 0x77777777u) ? s_a : -1;
  int mB = ((wb.x | wb.y | wb.z | wb.w) & 0x77777777u) ? s_b : -1;
  mA = max(mA, __shfl_xor_sync(~0u, mA, 1));
  mB = max(mB, __shfl_xor_sync(~0u, mB, 1));
  mA = max(mA, __shfl_xor_sync(~0u, mA, 2));
  mB = max(mB, __shfl_xor_sync(~0u, mB, 2));
  const uint32_t fa2 = w4_fold_scale(max(mA - s_a, 0)), fb2 = w4_fold_scale(max(mB - s_b, 0));
  const float fA = mA < 0 ? 0.f : e8m0_to_float(mA);
  const float fB = mB < 0 ? 0.f : e8m0_to_float(mB);
  // Independent MMA chains: a decode-step warp waits on MMA latency, not on
  // issue (one token tile: two chains, by h; two tiles: one each).
  constexpr int kC = kN == 1 ? 2 : 1;
  float q[kN][kC][4] = {};
  const uint32_t wA[4] = {wa.x, wa.y, wa.z, wa.w}, wB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint4 bv[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) bv[n] = b(i, n);
    uint32_t pA[4], pB[4];
    w4_pairs(wA[i], pA), w4_pairs(wB[i], pB);
#pragma unroll
    for (int j = 0; j < 4; ++j) pA[j] = hmul2(pA[j], fa2), pB[j] = hmul2(pB[j], fb2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t a0 = pA[2 * h], a1 = pB[2 * h], a2 = pA[2 * h + 1], a3 = pB[2 * h + 1];
#pragma unroll
      for (int n = 0; n < kN; ++n)
        ptx::mma_16816(q[n][h % kC], a0, a1, a2, a3, h ? bv[n].z : bv[n].x, h ? bv[n].w : bv[n].y);
    }
  }
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    float s[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = kC == 2 ? q[n][0][j] + q[n][kC - 1][j] : q[n][0][j];
    acc[n][0] += s[0] * fA;
    acc[n][1] += s[1] * fA;
    acc[n][2] += s[2] * fB;
    acc[n][3] += s[3] * fB;
  }
}

// The activation row (fp16 [row][kpad]) of sorted slot i: gate_up reads its
// token's input row, down the slot's own SwiGLU row.
template <bool kGateUp>
__device__ __forceinline__ int act_row(const W4Args& a, int i) {
  return kGateUp ? a.sorted[i] / a.topk : i;
}

// This block's work item {expert, first row, tokens} (grid y: an active
// expert, or with a.direct the token's slot y); false: nothing to do (an
// invalid direct id is flagged and its inv entry set to -1).
template <bool kGateUp, bool kPdl>
__device__ __forceinline__ bool w4_item(const W4Args& a, int4& info) {
  if (a.direct) {
    const int id = a.ids[blockIdx.y];
    const bool ok = id >= 0 && id < a.n_experts;
    if (kGateUp && blockIdx.x == 0 && threadIdx.x == 0) {
      a.inv[blockIdx.y] = ok ? int(blockIdx.y) * kPadRows : -1;
      if (!ok) atomicOr(a.err, 1);
    }
    if (!ok) {
      if (kPdl) pdl_trigger();
      return false;
    }
    info = make_int4(id, int(blockIdx.y) * kPadRows, 1, 0);
    return true;
  }
  const int n_active = *a.n_active;
  info = a.active[min(blockIdx.y, unsigned(gridDim.y) - 1)];  // in parallel with n_active; stale past it
  if (blockIdx.y >= unsigned(n_active)) {
    if (kPdl) pdl_trigger();
    return false;
  }
  return true;
}

// kKS: K split over warps (more warps per row for small batches, where few
// experts leave the grid short); each warp keeps kRing K chunks of weights in
// flight in registers. kN: token tiles of 8 per weight pass (2: up to 16 tokens
// of an expert share one decode of its weights; K split 1 only). kPdl: the
// kernel was launched as a programmatic dependent of the previous one; down
// projections issue their first weight loads before waiting for it.
// Shared memory: activations [chunk][i][token][t] 16-byte pieces for a.ntok
// token slots (what a launch needs; MMA columns past them read the last slot,
// unused). Three blocks per SM with one token tile: a decode step's warps are
// latency-bound, more of them hide more.
// (Measured on an H200 and dropped: cp.async rings in shared memory for more
// bytes in flight, and blocks streaming several row tiles; both slower.)
// kSilu: the plain SwiGLU (MoeActivation::kSilu; glu), else gpt-oss's. Its
// outputs are unbounded: fp16 would overflow past 65504 (gpt-oss's are at most
// 56), so gate_up stages each as v / s^2, s the token's input scale (a power
// of two at least its largest |x|: v / s^2 is silu(g) * u of the scaled input,
// bounded by the weights' row norms), and down multiplies its sums by s^2 back.
template <bool kGateUp, int kKS, int kN, bool kPdl, bool kSilu = false>
__global__ void __launch_bounds__(kW4Threads, kN == 1 ? 3 : 2) w4_kernel(W4Args a) {
  static_assert(kN == 1 || kKS == 1, "two token tiles only without a K split");
  constexpr int kRT = 8 / kKS, kRows = 16 * kRT, kRing = 3;
  extern __shared__ uint4 xs4[];
  __shared__ float4 red[kKS > 1 ? kKS - 1 : 1][kRT][32];
  if (kPdl && kGateUp) pdl_wait(), pdl_trigger();  // routing outputs; the down kernel may start its weight loads
  int4 info;
  if (!w4_item<kGateUp, kPdl>(a, info)) return;
  const int e = info.x, seg = info.y, cnt = info.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp % kRT, ks = warp / kRT;
  const int R0 = blockIdx.x * kRows + rt * 16;
  const bool wactive = R0 < a.rows;
  const int rA = kGateUp ? R0 + 2 * g : R0 + g;
  const int rB = kGateUp ? R0 + 2 * g + 1 : R0 + g + 8;
  const int64_t rowA = int64_t(e) * a.rows + rA, rowB = int64_t(e) * a.rows + rB;
  const uint8_t* bA = a.blocks + rowA * a.nsub * 16;
  const uint8_t* bB = a.blocks + rowB * a.nsub * 16;
  const uint8_t* sA = a.scales + rowA * a.nsub;
  const uint8_t* sB = a.scales + rowB * a.nsub;
  const int nchunk = a.kpad / 128, k8 = a.kpad / 8, NT = a.ntok;
  // K slice ks: chunks ks, ks + kKS, ... (the slices' warps read neighbouring
  // chunks at each ring step: every row streams front to back).
  const int nloc = (nchunk - ks + kKS - 1) / kKS;
  auto chunk = [&](int j) { return ks + j * kKS; };
  const bool has_work = wactive && nloc > 0;
  // This lane's activation pieces of token tile n: xb[n][(c * 4 + i) * 4 * NT].
  const uint4* xb[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) xb[n] = xs4 + min(8 * n + g, NT - 1) * 4 + t;

  auto load = [&](int c, uint4& wa, uint4& wb, int& sa, int& sb) {
    const int sub = c * 4 + t;
    if (sub < a.nsub) {
      wa = ptx::ldg_nc_v4(bA + sub * 16);
      wb = ptx::ldg_nc_v4(bB + sub * 16);
      sa = sA[sub];
      sb = sB[sub];
    } else {
      wa = wb = make_uint4(0, 0, 0, 0);
      sa = sb = 0;
    }
  };
  uint4 ra[kRing], rb[kRing];
  int sa[kRing], sb[kRing];
  auto prefetch = [&] {
#pragma unroll
    for (int p = 0; p < kRing; ++p)
      if (p < nloc) load(chunk(p), ra[p], rb[p], sa[p], sb[p]);
  };
  // The first weight loads go out before the activations are staged (and, for
  // a dependent down projection, before waiting for the gate_up kernel).
  if (has_work) prefetch();
  bool ready = true;
  if (kPdl && !kGateUp) pdl_wait(), pdl_trigger();

  __shared__ int s_row[kW4MaxTokens];
  for (int base = 0; base < cnt; base += NT) {
    const int m = min(NT, cnt - base);
    if (!(kGateUp && a.direct) && int(threadIdx.x) < m)
      s_row[threadIdx.x] = act_row<kGateUp>(a, seg + base + threadIdx.x);
    __syncthreads();
    float x_scale = 1.f;  // direct: the token's input scale
    if (kGateUp && a.direct) {
      __shared__ float xred[32];
      x_scale = x_to_half_pieces<2>(
          a.x, a.H, k8,
          [&](int q8, uint4 v) {
            const int c = q8 >> 4, tt = (q8 >> 2) & 3, ii = q8 & 3;
            xs4[(c * 4 + ii) * 4 + tt] = w4_piece(v);
          },
          xred);
      // The plain SwiGLU's down projection scales its rows by it (below).
      if (kSilu && blockIdx.x == 0 && threadIdx.x == 0) const_cast<float*>(a.act_scale)[0] = x_scale;
    } else {
      for (int gi = 0; gi < m; ++gi) {
        const __half* src = a.act + int64_t(s_row[gi]) * a.kpad;
        for (int q8 = threadIdx.x; q8 < k8; q8 += blockDim.x) {
          const int c = q8 >> 4, tt = (q8 >> 2) & 3, ii = q8 & 3;
          xs4[((c * 4 + ii) * NT + gi) * 4 + tt] = w4_piece(*reinterpret_cast<const uint4*>(src + q8 * 8));
        }
      }
    }
    // The epilogue's operands load now, under the weight stream (bias, the tokens' input scales).
    float biasA = 0.f, biasB = 0.f, xsc[kN][2];
#pragma unroll
    for (int n = 0; n < kN; ++n) xsc[n][0] = xsc[n][1] = 1.f;
    if (wactive && ks == 0) {
      if (a.bias) biasA = bf16_to_float(a.bias[rowA]), biasB = bf16_to_float(a.bias[rowB]);
      if (kGateUp)
#pragma unroll
        for (int n = 0; n < kN; ++n)
          for (int j = 0; j < 2; ++j)
            if (8 * n + 2 * t + j < m) xsc[n][j] = a.direct ? x_scale : a.act_scale[s_row[8 * n + 2 * t + j]];
      if (!kGateUp && kSilu)  // the rows' tokens' input scales (direct: token 0's, written by gate_up)
#pragma unroll
        for (int n = 0; n < kN; ++n)
          for (int j = 0; j < 2; ++j)
            if (8 * n + 2 * t + j < m)
              xsc[n][j] = a.act_scale[a.direct ? 0 : a.sorted[s_row[8 * n + 2 * t + j]] / a.topk];
    }
    __syncthreads();

    float acc[kN][4] = {};
    if (has_work) {
      if (!ready) prefetch();
      ready = false;
      for (int j0 = 0; j0 < nloc; j0 += kRing) {
#pragma unroll
        for (int p = 0; p < kRing; ++p) {
          const int j = j0 + p, c = chunk(j);
          if (j >= nloc) break;
          // Consumed in place, then refilled: no register copies of the slot.
          w4_chunk_n<kN>(
              ra[p], rb[p], sa[p], sb[p], [&](int i, int n) { return xb[n][(c * 4 + i) * 4 * NT]; }, acc);
          if (j + kRing < nloc) load(chunk(j + kRing), ra[p], rb[p], sa[p], sb[p]);
        }
      }
    }
    if (kKS > 1) {  // (kN == 1)
      if (ks > 0) red[ks - 1][rt][lane] = make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
      __syncthreads();
      if (ks != 0) continue;
#pragma unroll
      for (int j = 0; j < kKS - 1; ++j) {  // fixed order: deterministic
        const float4 v = red[j][rt][lane];
        acc[0][0] += v.x, acc[0][1] += v.y, acc[0][2] += v.z, acc[0][3] += v.w;
      }
    }
    if (!wactive) continue;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int tok = 8 * n + 2 * t + j;
        if (tok >= m) continue;
        const int row = seg + base + tok;
        if (kGateUp) {
          float v = glu(acc[n][j] * xsc[n][j] + biasA, acc[n][2 + j] * xsc[n][j] + biasB, kSilu, a.limit);
          if (kSilu) {  // fp16 as v / x_scale^2 (exact: powers of two), not v
            const float r = 1.f / xsc[n][j];
            v = v * r * r;
          }
          a.out_act[int64_t(row) * a.out_ld + (rA >> 1)] = __float2half_rn(v);
        } else if (kSilu) {  // the activations came divided by the token's x_scale^2
          const float s2 = xsc[n][j] * xsc[n][j];
          a.out_y[int64_t(row) * a.rows + rA] = acc[n][j] * s2 + biasA;
          a.out_y[int64_t(row) * a.rows + rB] = acc[n][2 + j] * s2 + biasB;
        } else {
          a.out_y[int64_t(row) * a.rows + rA] = acc[n][j] + biasA;
          a.out_y[int64_t(row) * a.rows + rB] = acc[n][2 + j] + biasB;
        }
      }
  }
}

// The instantiated K splits of the fused kernels.
constexpr int kW4Splits[] = {1, 4, 8};
using W4Fn = void (*)(W4Args);
template <bool kGateUp, bool kPdl, bool kSilu>
W4Fn w4_fn(int ks, int ntile) {
  switch (ks) {
    case 1:
      return ntile == 2 ? w4_kernel<kGateUp, 1, 2, kPdl, kSilu> : w4_kernel<kGateUp, 1, 1, kPdl, kSilu>;
    case 4:
      return w4_kernel<kGateUp, 4, 1, kPdl, kSilu>;
    default:
      return w4_kernel<kGateUp, 8, 1, kPdl, kSilu>;
  }
}
// The same for the layer's activation (silu: MoeActivation::kSilu).
template <bool kGateUp, bool kPdl>
W4Fn w4_fn(int ks, int ntile, bool silu) {
  return silu ? w4_fn<kGateUp, kPdl, true>(ks, ntile) : w4_fn<kGateUp, kPdl, false>(ks, ntile);
}

// ---------------------------------------------------------------- FP8 path
// E4M3 bytes of v * inv (saturating).
__device__ __forceinline__ uint32_t e4m3x4(const float (&v)[4], float inv) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv, v[1] * inv), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv, v[3] * inv), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// A warp's 128-value block (4 values a lane) -> E4M3 with scale amax / 448:
// this lane's 4 bytes and the block's scale.
__device__ __forceinline__ uint32_t quant_1x128(const float (&v)[4], float& sc) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
  sc = amax > 0.f ? amax / 448.f : 1.f;
  return e4m3x4(v, 1.f / sc);
}

// ------------------------------------------- fused W4A8 path (wgmma, sm_90a)
// Few tokens per expert with E4M3 activations (1x128 scales, as the FP8 path):
//  - the MXFP4 rows reach shared memory through the copy engine: per consumer
//    warpgroup a ring of kW8Stages boxes of 64 rows x 128 bytes (two 128-wide
//    K chunks, see kW8Row) that its producer warp keeps in flight without
//    holding registers, and the tile's E8M0 scales in one bulk copy;
//  - consumers decode E2M1 -> E4M3 in registers (a nibble's E2M1 bits placed in
//    an E4M3 byte are its value * 2^-6 exactly: 5 instructions per 8 weights,
//    no table) and run FP8 wgmma m64n8k32 with the weights from registers, one
//    MMA per 32-element sub-block so its scale multiplies the fp32 partial sums;
//  - lane t of a quad takes word t of each sub-block (even nibbles: MMA k
//    4t..4t+3, odd: 16 + 4t..), so activations are staged per sub-block as its
//    even then its odd elements (two core matrices of 8 tokens x 16 bytes).
// Up to 8 tokens of an expert a pass (more: further passes over the weights).
// A block is two consumer warpgroups (two 64-row tiles, or one split over K)
// and a producer warp for each (one thread serving both rings in lockstep let a
// slow ring hold up the other's refills).
constexpr int kW8Consumers = 2;
constexpr int kW8Threads = 160 * kW8Consumers;
// Ring stages a warpgroup: 4 with one row tile a warpgroup, 3 with two (their
// scales take the room; two blocks an SM either way).
constexpr int w8_stages(int tiles) { return tiles == 1 ? 4 : 3; }
// A box is 64 rows x 128 bytes (two chunks: one 128-byte line a row), stored
// with the copy engine's 128-byte swizzle (16-byte piece u of row r at piece
// u ^ (r & 7)), so a warp's loads of one word from 8 rows spread over the
// banks. Boxes of 144 bytes (rows 36 words apart, unswizzled) made each row
// two L2 lines, the second read again by the next box: 64 tokens 630 -> 530
// us with two terms and two tiles a warpgroup (H200, run 72).
constexpr int kW8Row = 128;
constexpr int kW8BlocksPerSm = 2;  // the W4A8 kernels' launch bounds
// Rows a W4A8 block covers: its consumer warpgroups' 64-row tiles, two warpgroups a tile with a K split of 2.
constexpr int w8_rows_per_block(int ks8, int tiles) { return 64 * (kW8Consumers / ks8) * tiles; }
constexpr int kW8StageBytes = 64 * kW8Row;
constexpr int kW8SubBytes = 256;

// Shared-memory layout (offsets from the 1024-aligned base; total includes the alignment slack).
// A pass's activations (act: E4M3 sub-blocks for wgmma, xs: their 1x128
// scales per chunk and MMA column (none for down's two terms: kW8DownInv), ts:
// gate_up's input scale per column) are contiguous: what w8_image_kernel
// prepares and one bulk copy brings.
struct W8Smem {
  int sc, act, xs, ts, red, bar, total;
};
__host__ __device__ inline int w8_act_bytes(int kpad) { return kpad / 32 * kW8SubBytes; }
__host__ __device__ inline int w8_image_bytes(int kpad) {
  return w8_act_bytes(kpad) + kpad / 128 * kW4Tokens * 4 + kW4Tokens * 4;
}
__host__ __device__ inline W8Smem w8_smem(int nsub, int kpad, int tiles) {
  W8Smem L{};
  const int stages = w8_stages(tiles);
  int o = kW8Consumers * stages * kW8StageBytes;
  L.sc = o, o += kW8Consumers * tiles * ((64 * nsub + 15) / 16 * 16);
  L.act = o, o += w8_act_bytes(kpad);
  L.xs = o, o += kpad / 128 * kW4Tokens * 4;
  L.ts = o, o += kW4Tokens * 4;
  L.red = o, o += 128 * 16;
  L.bar = o, o += (2 * kW8Consumers * stages + kW8Consumers + 3) * 8;
  L.total = o + 1024;
  return L;
}

// The E4M3 rounding of what quant_1x128 left over (v / sc minus its bytes q):
// hi + lo keep ~8 significant bits of a value within 2^-10 of its block's
// largest; smaller ones keep fewer (the remainder meets E4M3's subnormals),
// but their products weigh as little.
// mul: a power of two the remainder is stored times (kW8DownLo).
__device__ __forceinline__ uint32_t quant_1x128_rest(const float (&v)[4], float sc, uint32_t q, float mul = 1.f) {
  const float inv = 1.f / sc;  // as quant_1x128
  const float2 h01 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(q & 0xFFFFu), __NV_E4M3)));
  const float2 h23 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(q >> 16), __NV_E4M3)));
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2((v[0] * inv - h01.x) * mul, (v[1] * inv - h01.y) * mul),
                                               __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2((v[2] * inv - h23.x) * mul, (v[3] * inv - h23.y) * mul),
                                               __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// A word's 8 E2M1 nibbles as E4M3 bytes, the even elements (0, 2, 4, 6) or
// the odd ones: E2M1 bits placed at E4M3 bits 7 and 4..2 are the value * 2^-6
// exactly (the 0.5 code lands on an E4M3 subnormal).
__device__ __forceinline__ uint32_t e2m1_even_to_e4m3(uint32_t w) {
  return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
}
__device__ __forceinline__ uint32_t e2m1_odd_to_e4m3(uint32_t w) {
  return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// The down projection's activations as two E4M3 terms: gpt-oss's clamped
// SwiGLU is at most (7 + 1) * 7 = 56 in magnitude, so they take one fixed
// scale, 56 / 448 (E4M3's largest), instead of one a 128 values: E4M3 is as
// fine relative to each value either way, only values under 2^-6 * 56 / 448
// (0.002) meet its subnormals sooner (kW8DownLo), and with no reduction
// gate_up's epilogue writes down's images itself (w8_down_put): the launch
// between the projections that quantized them took 3.8 of 134 us (H200,
// 120b shapes, 8 tokens). The bound is gpt-oss's only: the plain SwiGLU
// (MoeActivation::kSilu) is unbounded, so the layer never runs the W4A8
// kernels for it (w8_chosen).
constexpr float kW8DownInv = 448.f / ((kSwigluLimit + 1.f) * kSwigluLimit);  // 8: a power of two
// Down's second term is stored times 16 (the MMA column's sum divided by it
// again): a remainder is at most half an E4M3 step of its first term (2^-4
// of it), so times 16 stays under 448, and values whose first term is
// subnormal (under 2^-6, 0.002 unscaled) keep 4 more bits than E4M3's
// subnormals would leave: an absolute error under 2^-14 / 8 a value.
constexpr float kW8DownLo = 16.f;
// The fixed scale with two terms only: one E4M3 term keeps down's 1x128
// scales (alone it would leave values under 0.002 an error of up to 2^-10 / 8).
constexpr bool w8_fixed(bool gate_up, bool lo) { return !gate_up && lo; }

// One (token, 128-value chunk) of a pass's activations, 4 values a lane, into
// the staged layout: E4M3 (two terms with kLo: MMA columns 2 gi and 2 gi + 1)
// as each sub-block's even then odd elements, and the chunk's scale (xs;
// kFixed: down's fixed scale, no xs).
template <bool kLo, bool kFixed>
__device__ __forceinline__ void w8_stage_put(const float (&v)[4], int c, int gi, int lane, unsigned char* act,
                                             float* xs) {
  float sc = 1.f / kW8DownInv;
  const uint32_t q = kFixed ? e4m3x4(v, kW8DownInv) : quant_1x128(v, sc);
  const int q8 = (c * 128 + 4 * lane) >> 3, hh = lane & 1, col = kLo ? 2 * gi : gi;
  unsigned char* d = act + (q8 >> 2) * kW8SubBytes + col * 16 + (q8 & 3) * 4 + 2 * hh;
  *reinterpret_cast<uint16_t*>(d) = uint16_t(ptx::prmt(q, 0, 0x20));        // even elements
  *reinterpret_cast<uint16_t*>(d + 128) = uint16_t(ptx::prmt(q, 0, 0x31));  // odd elements
  if (kLo) {
    const uint32_t r = quant_1x128_rest(v, sc, q, kFixed ? kW8DownLo : 1.f);
    *reinterpret_cast<uint16_t*>(d + 16) = uint16_t(ptx::prmt(r, 0, 0x20));
    *reinterpret_cast<uint16_t*>(d + 144) = uint16_t(ptx::prmt(r, 0, 0x31));
  }
  if (!kFixed && lane == 0) {
    xs[c * kW4Tokens + col] = sc;
    if (kLo) xs[c * kW4Tokens + col + 1] = sc;
  }
}

// The W4A8 kernels' activation images (W4Args::img), a warp per (routed
// slot, chunk): the fp16 row the kernel would stage (gate_up: the slot's
// token in xh; down: its SwiGLU row), quantized once instead of by every
// block of the expert. Staging in the kernel put a chain of dependent loads
// (the sorted rows, then the activations) before each block's first MMA
// while its weight ring sat full (H200, 120b shapes, 8 tokens: the kernels
// without that staging 124 vs 146 us).
template <bool kGateUp, bool kLo>
__global__ void __launch_bounds__(256) w8_image_kernel(const W4Args a, int n_slots, uint8_t* images) {
  // The projection after this kernel may launch at once: its weight loads do
  // not wait for this kernel (or the one before it), only its images do.
  pdl_trigger();
  pdl_wait();
  constexpr int kPass = kLo ? kW4Tokens / 2 : kW4Tokens;
  const int nch = a.kpad / 128, lane = threadIdx.x & 31;
  const int w = int(blockIdx.x) * 8 + int(threadIdx.x >> 5);
  if (w >= n_slots * nch) return;
  const int i = w / nch, c = w - i * nch, r = a.inv[i];
  if (r < 0) return;  // an invalid id (flagged by the routing)
  const int row = kGateUp ? i / a.topk : r;
  const uint2 h = *reinterpret_cast<const uint2*>(a.act + int64_t(row) * a.kpad + c * 128 + 4 * lane);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
  const float v[4] = {lo.x, lo.y, hi.x, hi.y};
  unsigned char* img = images + int64_t(r / kPass) * a.img_bytes;
  float* xs = reinterpret_cast<float*>(img + w8_act_bytes(a.kpad));
  w8_stage_put<kLo, w8_fixed(kGateUp, kLo)>(v, c, r % kPass, lane, img, xs);
  if (kGateUp && c == 0 && lane == 0) xs[nch * kW4Tokens + r % kPass] = a.act_scale[row];
}

// gate_up's epilogue (two terms): SwiGLU output o of token gi (fp16 h, the
// bits down would stage) into down's image of the pass (img), as
// w8_stage_put<true, true> puts it: element e of sub-block o / 32 at byte
// e / 2 of the even (e even) or odd half of MMA columns 2 gi (hi) and 2 gi + 1.
__device__ __forceinline__ void w8_down_put(unsigned char* img, int o, int gi, __half h) {
  const float f = __half2float(h) * kW8DownInv;
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  const int e = o & 31;
  unsigned char* d = img + (o >> 5) * kW8SubBytes + (e & 1) * 128 + 2 * gi * 16 + (e >> 1);
  d[0] = q;
  d[16] = __nv_cvt_float_to_fp8((f - __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)))) * kW8DownLo,
                                __NV_SATFINITE, __NV_E4M3);
}

// A pass's activations (m tokens: gate_up's one-token input x when direct,
// else the fp16 rows s_row[] of a.act) staged for the W4A8 MMAs by kWarps warps
// (this one: warp): each quantizes (token gi, chunk c) pairs, 4 values a lane,
// kBatch pairs' loads in flight before the first is quantized.
template <bool kGateUp, bool kLo, int kWarps>
__device__ __forceinline__ void w8_stage_pass(const W4Args& a, int m, int nch, const int* s_row, int warp, int lane,
                                              unsigned char* act, float* xs) {
  constexpr int kBatch = 4;
  const int items = m * nch;
  for (int p0 = warp; p0 < items; p0 += kBatch * kWarps) {
    float v[kBatch][4];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int p = p0 + b * kWarps, gi = p / nch, k = (p - gi * nch) * 128 + 4 * lane;
      v[b][0] = v[b][1] = v[b][2] = v[b][3] = 0.f;
      if (p >= items) continue;
      if (kGateUp && a.direct) {
        if (k < a.H) {
          const float4 f = *reinterpret_cast<const float4*>(a.x + k);
          v[b][0] = f.x, v[b][1] = f.y, v[b][2] = f.z, v[b][3] = f.w;
        }
      } else {
        const uint2 h = *reinterpret_cast<const uint2*>(a.act + int64_t(s_row[gi]) * a.kpad + k);
        const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
        v[b][0] = lo.x, v[b][1] = lo.y, v[b][2] = hi.x, v[b][3] = hi.y;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int p = p0 + b * kWarps, gi = p / nch;
      if (p >= items) break;  // warp-uniform
      w8_stage_put<kLo, w8_fixed(kGateUp, kLo)>(v[b], p - gi * nch, gi, lane, act, xs);
    }
  }
}

#ifdef DZ_MOE_SM90A
// No-swizzle K-major descriptor of one sub-block's staged activations: core
// matrices (8 tokens x 16 bytes) 128 bytes apart along K (leading byte offset).
// Its low word: sub-block s lies at + s * 16 (the 14-bit address field holds
// every shared-memory address, so no carry leaves the word: 32-bit adds, not
// the 64-bit ones that took ~50 instructions a stage); the high word is fixed.
__device__ __forceinline__ uint32_t w8_desc_lo(uint32_t addr) {
  return ((addr & 0x3FFFF) >> 4) | (uint32_t(128 >> 4) << 16);
}
constexpr uint32_t kW8DescHi = 256 >> 4;
// d = A(64 x 32, registers) * B(8 x 32, shared)^T, E4M3, fresh fp32 accumulators.
__device__ __forceinline__ void wgmma_rs_m64n8k32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t db_lo) {
  asm volatile(
      "{\n.reg .b64 db;\nmov.b64 db, {%8, %9};\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, db, 0, 1, 1;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(db_lo), "r"(kW8DescHi));
}
// d = A(64 x 32, registers) * B(16 x 32, shared)^T, E4M3: B's second 8 rows
// (columns 8..15 of d, in d[4..7]) lie sbo bytes after its first.
template <int kSbo>
__device__ __forceinline__ void wgmma_rs_m64n16k32(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                   uint32_t db_lo) {
  asm volatile(
      "{\n.reg .b64 db;\nmov.b64 db, {%12, %13};\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, db, "
      "0, 1, 1;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(db_lo), "n"(kSbo >> 4));
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
// Four E8M0 scale bytes as floats, bytes 0-1 in the low half of v01, 2-3 in
// that of v23 (bits above are ignored): an E8M0 byte s is the float with
// exponent field s (s = 0, 2^-127, reads as 0).
__device__ __forceinline__ void w8_scales_of(uint32_t v01, uint32_t v23, float (&f)[4]) {
  f[0] = __uint_as_float((v01 << 23) & 0x7F800000u), f[1] = __uint_as_float((v01 << 15) & 0x7F800000u);
  f[2] = __uint_as_float((v23 << 23) & 0x7F800000u), f[3] = __uint_as_float((v23 << 15) & 0x7F800000u);
}
// Sub-block scales 4c..4c+3 of a row (at addr, in shared memory) as floats:
// two 16-bit loads (nsub is even).
__device__ __forceinline__ void w8_sub_scales(uint32_t addr, float (&f)[4]) {
  w8_scales_of(lds16(addr), lds16(addr + 2), f);
}

// This lane's words of rows rA / rB of a ring stage's box (64 rows x 128
// bytes, the copy engine's 128-byte swizzle): word u of each row's 8 is
// sub-block u's word t.
__device__ __forceinline__ void w8_box_words(uint32_t box, int rA, int rB, int t, uint32_t (&wa)[8],
                                             uint32_t (&wb)[8]) {
  const uint32_t pa = box + rA * kW8Row + 4 * t, pb = box + rB * kW8Row + 4 * t;
#pragma unroll
  for (int u = 0; u < 8; ++u) wa[u] = lds32(pa + 16 * (u ^ (rA & 7))), wb[u] = lds32(pb + 16 * (u ^ (rB & 7)));
}

// The MMA fragments of chunk cc of a lane's words (a ring stage's 8, or one
// chunk's 4): sub-block b's even and odd nibbles of rows A and B as E4M3.
template <int N>
__device__ __forceinline__ void w8_fragments(const uint32_t (&wa)[N], const uint32_t (&wb)[N], int cc,
                                             uint32_t (&af)[4][4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    af[b][0] = e2m1_even_to_e4m3(wa[4 * cc + b]), af[b][1] = e2m1_even_to_e4m3(wb[4 * cc + b]);
    af[b][2] = e2m1_odd_to_e4m3(wa[4 * cc + b]), af[b][3] = e2m1_odd_to_e4m3(wb[4 * cc + b]);
  }
}

// Chunk c's sub-block scales of rows A and B (scA / scB: the rows' scales in
// shared memory); guard: sub-blocks past K (nsub) get 0 (their bytes are the
// next row's).
__device__ __forceinline__ void w8_chunk_scales(uint32_t scA, uint32_t scB, int c, bool guard, int nsub, float (&fA)[4],
                                                float (&fB)[4]) {
  w8_sub_scales(scA + 4 * c, fA), w8_sub_scales(scB + 4 * c, fB);
  if (guard)
#pragma unroll
    for (int b = 0; b < 4; ++b)
      if (4 * c + b >= nsub) fA[b] = fB[b] = 0.f;
}

// A chunk's four MMAs (sub-block b: fragments af[b], activations at
// descriptor d0 + b sub-blocks) into fresh accumulators q[b], waited for.
__device__ __forceinline__ void w8_mma4(uint32_t (&af)[4][4], uint32_t d0, float (&q)[4][4]) {
  ptx::fence_regs(af);  // the fragments made before the fence (else ptxas injects a warpgroup.arrive an MMA: C7519)
  ptx::wgmma_fence();
#pragma unroll
  for (int b = 0; b < 4; ++b)
    wgmma_rs_m64n8k32(q[b], af[b][0], af[b][1], af[b][2], af[b][3], d0 + uint32_t(b * (kW8SubBytes >> 4)));
  ptx::wgmma_commit();
  ptx::wgmma_wait0();
}

// The same for two passes at once, their activations kSbo bytes apart (n = 16:
// q[b][0..3] the first pass's, q[b][4..7] the second's).
template <int kSbo>
__device__ __forceinline__ void w8_mma4_pair(uint32_t (&af)[4][4], uint32_t d0, float (&q)[4][8]) {
  ptx::fence_regs(af);  // (as w8_mma4)
  ptx::wgmma_fence();
#pragma unroll
  for (int b = 0; b < 4; ++b)
    wgmma_rs_m64n16k32<kSbo>(q[b], af[b][0], af[b][1], af[b][2], af[b][3], d0 + uint32_t(b * (kW8SubBytes >> 4)));
  ptx::wgmma_commit();
  ptx::wgmma_wait0();
}

// A chunk's four MMA results q[b] (sub-block b) into the accumulators: each
// times its sub-block's scale, and (kFixed false) the chunk's activation
// scales of this lane's columns, at xs_addr (two floats). The order of the
// sums is fixed: every W4A8 kernel gives the same bits.
template <bool kFixed>
__device__ __forceinline__ void w8_fold(float (&q)[4][4], const float (&fA)[4], const float (&fB)[4], uint32_t xs_addr,
                                        float (&acc)[4]) {
  // kFixed (down: one fixed scale, in the epilogue): straight into acc; else
  // into partial sums p, then times the activation scales.
  float p[4] = {0.f, 0.f, 0.f, 0.f};
  float(&dst)[4] = kFixed ? acc : p;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(q[b][i])::"memory");
    dst[0] += q[b][0] * fA[b], dst[1] += q[b][1] * fA[b];
    dst[2] += q[b][2] * fB[b], dst[3] += q[b][3] * fB[b];
  }
  if (!kFixed) {
    const float x0 = __uint_as_float(lds32(xs_addr)), x1 = __uint_as_float(lds32(xs_addr + 4));
    acc[0] += p[0] * x0, acc[1] += p[1] * x1, acc[2] += p[2] * x0, acc[3] += p[3] * x1;
  }
}
#endif

// A W4A8 tile's results for one pass (acc: this lane's MMA columns 2t, 2t + 1
// of rows A and B) into the outputs: gate_up's SwiGLU (and, with two terms and
// a.next_img, down's image img of the pass), down's rows with their biases.
// row0: the pass's first sorted row; m: its tokens; ts(j, tok): gate_up's
// input scale of this lane's column j.
template <bool kGateUp, bool kLo, typename Ts>
__device__ __forceinline__ void w8_store_pass(const W4Args& a, float (&acc)[4], int row0, int m, int64_t img, int T0,
                                              int rA, int rB, int t, float biasA, float biasB, Ts ts) {
  // The E2M1 placement's 2^-6 (and down's fixed activation scale).
  constexpr float kPost = w8_fixed(kGateUp, kLo) ? 64.f / kW8DownInv : 64.f;
  if (kLo) {  // hi + lo terms of token t
    constexpr float kLoPost = kGateUp ? 1.f : 1.f / kW8DownLo;
    acc[0] += acc[1] * kLoPost, acc[2] += acc[3] * kLoPost;
  }
#pragma unroll
  for (int j = 0; j < (kLo ? 1 : 2); ++j) {
    const int tok = kLo ? t : 2 * t + j;
    if (tok >= m) continue;
    const int row = row0 + tok;
    if (kGateUp) {
      const float x = ts(j, tok);
      // gpt-oss's activation only: the layer never runs these kernels for the
      // plain SwiGLU (w8_chosen; down's fixed scale kW8DownInv assumes its bound).
      const __half h = __float2half_rn(swiglu(acc[j] * kPost * x + biasA, acc[2 + j] * kPost * x + biasB));
      a.out_act[int64_t(row) * a.out_ld + ((T0 + rA) >> 1)] = h;
      if (kLo && a.next_img) w8_down_put(a.next_img + img * a.next_img_bytes, (T0 + rA) >> 1, tok, h);
    } else {
      a.out_y[int64_t(row) * a.rows + T0 + rA] = acc[j] * kPost + biasA;
      a.out_y[int64_t(row) * a.rows + T0 + rB] = acc[2 + j] * kPost + biasB;
    }
  }
}

// Down beside gate_up's last wave (W4Args::expert_wait): each gate_up block
// counts itself done in its expert's active entry (its fourth int, zeroed by
// the routing) once its consumer threads have arrived on a barrier after
// their stores; down's producers wait for their expert's count instead of the
// whole gate_up grid (griddepcontrol.wait), so the experts gate_up finishes
// first go on to down while its last blocks run. (Down's blocks launch only
// once every gate_up block has started: its launch trigger comes first thing,
// so a waiting block never holds up one it waits for.) The consumers arrive
// whether counting or not: a branch or a warp barrier after their MMA loop
// made ptxas serialize the streamed kernels' MMAs.
__device__ __forceinline__ int* w8_done(const W4Args& a) { return const_cast<int*>(&a.active[blockIdx.y].w); }
// A producer thread: the block's consumers done (their arrivals on done_bar: release), then the count.
__device__ __forceinline__ void w8_count_done(const W4Args& a, uint32_t done_bar) {
  ptx::mbar_wait(done_bar, 0);  // (acquire: the release below is cumulative over the consumers' stores)
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(w8_done(a)) : "memory");
}
__device__ __forceinline__ void w8_wait_done(const W4Args& a) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(w8_done(a)) : "memory");
    if (v >= a.expert_wait) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");  // gate_up's generic writes -> the copy engine's reads
}
// Down's producer before reading gate_up's outputs: its expert's count, or the whole grid.
template <bool kPdl>
__device__ __forceinline__ void w8_wait_gate_up(const W4Args& a) {
  if (a.expert_wait)
    w8_wait_done(a);
  else if (kPdl)
    pdl_wait();
}

// kLo: two E4M3 terms a token (x / scale = hi + lo, lo the E4M3 rounding of
// the remainder: ~8 significant bits, as BF16), staged as MMA columns 2i and
// 2i + 1 of token i under the same scale and summed in the epilogue; 4 tokens
// a pass instead of 8, no other cost.
// kTPW: row tiles a warpgroup streams one after another (K split 1 only):
// its ring runs on from one tile into the next, and the block's setup
// (routing, activation staging, the scales' copy) serves them all.
template <bool kGateUp, int kKS, bool kPdl, bool kLo, int kTPW>
__global__ void __launch_bounds__(kW8Threads, kW8BlocksPerSm)
    w8_kernel(const W4Args a, const __grid_constant__ CUtensorMap wmap) {
#ifdef DZ_MOE_SM90A
  static_assert(kTPW == 1 || kKS == 1, "several tiles a warpgroup only without a K split");
  constexpr int kTiles = kW8Consumers / kKS;              // row tiles side by side (one a warpgroup, or one shared)
  constexpr int kPass = kLo ? kW4Tokens / 2 : kW4Tokens;  // tokens a pass over the weights
  constexpr int kW8Stages = w8_stages(kTPW);
  extern __shared__ unsigned char w8_raw[];
  unsigned char* const sm =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(w8_raw) + 1023) & ~uintptr_t(1023));
  const W8Smem L = w8_smem(a.nsub, a.kpad, kTPW);
  const uint32_t base = ptx::smem_u32(sm);
  // wg broadcast from lane 0: the compiler then knows it is warp-uniform, and
  // the MMA descriptors derived from it stay in uniform registers.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const uint32_t bar0 = base + L.bar;  // full[w][s], empty[w][s], scales[w]
  auto full = [&](int w, int st) { return bar0 + 8 * (w * kW8Stages + st); };
  auto empty = [&](int w, int st) { return bar0 + 8 * ((kW8Consumers + w) * kW8Stages + st); };
  auto sbar = [&](int w) { return bar0 + 8 * (2 * kW8Consumers * kW8Stages + w); };
  // A pass's activation image in shared memory (a.img), and every consumer warp done with it.
  const uint32_t abar = bar0 + 8 * (2 * kW8Consumers * kW8Stages + kW8Consumers), aempty = abar + 8;
  const uint32_t done_bar = abar + 16;  // every consumer thread past its stores
  if (tid == 0) {
    for (int w = 0; w < kW8Consumers; ++w) {
      for (int st = 0; st < kW8Stages; ++st) ptx::mbar_init(full(w, st), 1), ptx::mbar_init(empty(w, st), 4);
      ptx::mbar_init(sbar(w), 1);
    }
    ptx::mbar_init(abar, 1), ptx::mbar_init(aempty, 4 * kW8Consumers), ptx::mbar_init(done_bar, 128 * kW8Consumers);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (kPdl && kGateUp) pdl_wait(), pdl_trigger();  // routing outputs; the down kernel may start its weight loads
  int4 info;
  if (!w4_item<kGateUp, kPdl>(a, info)) return;
  const int e = info.x, seg = info.y, cnt = info.z;
  const int nch = a.kpad / 128, nst = (nch + 1) / 2, per = (nst + kKS - 1) / kKS;
  // Warpgroup w's q-th 64-row tile and its range of stages; ntiles(w): its
  // tiles inside the projection (a prefix of the kTPW).
  auto tile0 = [&](int w, int q) { return ((int(blockIdx.x) * kTPW + q) * kTiles + w % kTiles) * 64; };
  auto ntiles = [&](int w) {
    int c = 0;
    while (c < kTPW && tile0(w, c) < a.rows) ++c;
    return c;
  };
  auto s_begin = [&](int w) { return min(nst, (w / kTiles) * per); };
  auto s_len = [&](int w) { return ntiles(w) > 0 ? min(nst, s_begin(w) + per) - s_begin(w) : 0; };
  const int sc_bytes = (64 * a.nsub + 15) / 16 * 16;
  auto sc_at = [&](int w, int q) { return L.sc + (w * kTPW + q) * sc_bytes; };

  if (wg == kW8Consumers) {  // producer warps: warp w keeps ring w full, on its own
    const int w = (tid >> 5) & (kW8Consumers - 1);
    if ((tid & 31) == 0 && s_len(w) > 0) {
      const int nt = ntiles(w);
      ptx::mbar_arrive_expect_tx(sbar(w), uint32_t(nt * 64 * a.nsub));
      for (int q = 0; q < nt; ++q)
        ptx::bulk_g2s(base + sc_at(w, q), a.scales + (int64_t(e) * a.rows + tile0(w, q)) * a.nsub,
                      uint32_t(64 * a.nsub), sbar(w));
      int n = 0;
      // Ring 0's producer brings each pass's activation image (a.img): the
      // first after the ring's first fill (down: once gate_up's rows are
      // there), the next ones once every consumer warp is done with the last.
      const bool img = a.img && w == 0;
      const int first_fill = min(kW8Stages, nt * s_len(w));
      auto copy_image = [&](int base_t) {
        const uint32_t bytes = uint32_t(a.img_bytes);
        ptx::mbar_arrive_expect_tx(abar, bytes);
        ptx::bulk_g2s(base + L.act, a.img + int64_t((seg + base_t) / kPass) * bytes, bytes, abar);
      };
      for (int base_t = 0; base_t < cnt; base_t += kPass) {
        if (img && base_t > 0) ptx::mbar_wait(aempty, (base_t / kPass - 1) & 1), copy_image(base_t);
        for (int q = 0; q < nt; ++q)
          for (int j = 0; j < s_len(w); ++j, ++n) {
            const int st = n % kW8Stages, ph = (n / kW8Stages) & 1;
            ptx::mbar_wait(empty(w, st), ph ^ 1);
            ptx::mbar_arrive_expect_tx(full(w, st), kW8StageBytes);
            ptx::tma_2d(base + (w * kW8Stages + st) * kW8StageBytes, &wmap, full(w, st), (s_begin(w) + j) * 128,
                        e * a.rows + tile0(w, q));
            if (img && n + 1 == first_fill) {
              if (!kGateUp) w8_wait_gate_up<kPdl>(a);  // the images: gate_up's epilogue or the image kernel
              copy_image(0);
            }
          }
      }
    }
    if (kPdl) pdl_trigger();
    if (kGateUp && a.expert_wait && tid == 128 * kW8Consumers) w8_count_done(a, done_bar);
    return;
  }

  // Consumers.
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int len = s_len(wg), sb0 = s_begin(wg), ks = wg / kTiles, nt = ntiles(wg);
  const int rA = kGateUp ? 16 * warp + 2 * g : 16 * warp + g, rB = kGateUp ? rA + 1 : rA + 8;  // tile rows
  const uint32_t desc_lo = w8_desc_lo(base + L.act);
  const uint32_t xs0 = base + L.xs;
  float4* const red = reinterpret_cast<float4*>(sm + L.red);
  if (kPdl && !kGateUp) {  // the SwiGLU rows (through images: the producer's wait)
    if (!a.expert_wait) pdl_wait();
    pdl_trigger();
  }
  __shared__ int s_row[kW4Tokens];  // this pass's activation rows (act_row)
  int n = 0;
  for (int base_t = 0; base_t < cnt; base_t += kPass) {
    const int m = min(kPass, cnt - base_t);
    float tok_scale[2] = {1.f, 1.f};
    if (a.img) {  // the image the producer brings
      ptx::mbar_wait(abar, (base_t / kPass) & 1);
      if (kGateUp && nt > 0 && ks == 0)
        for (int j = 0; j < 2; ++j) {
          const int tok = kLo ? t : 2 * t + j;  // this lane's MMA columns 2t, 2t + 1
          if (tok < m) tok_scale[j] = reinterpret_cast<const float*>(sm + L.ts)[tok];
        }
    } else {
      if (!(kGateUp && a.direct) && tid < m) s_row[tid] = act_row<kGateUp>(a, seg + base_t + tid);
      ptx::named_sync(1, 128 * kW8Consumers);  // the previous pass's activations are read; s_row written
      w8_stage_pass<kGateUp, kLo, 4 * kW8Consumers>(a, m, nch, s_row, tid >> 5, lane, sm + L.act,
                                                    reinterpret_cast<float*>(sm + L.xs));
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma's reads
      // The epilogue's operands load now (the tokens' input scales; biases a tile).
      if (kGateUp && !a.direct && nt > 0 && ks == 0)
        for (int j = 0; j < 2; ++j) {
          const int tok = kLo ? t : 2 * t + j;  // this lane's MMA columns 2t, 2t + 1
          if (tok < m) tok_scale[j] = a.act_scale[s_row[tok]];
        }
      ptx::named_sync(1, 128 * kW8Consumers);
    }
    if (len > 0 && base_t == 0) ptx::mbar_wait(sbar(wg), 0);

    // The stage's two chunks: fragments decoded from the box's words, four
    // MMAs a chunk under one wait, then the sub-block and activation scales.
    // guard: chunks reaching past K (the last stage only).
    float acc[4];
    uint32_t scA = 0, scB = 0;  // this tile's scales of rows A and B
    auto stage = [&](uint32_t box, int c0, bool guard, auto release) {
      uint32_t wa[8], wb[8];
      w8_box_words(box, rA, rB, t, wa, wb);
      release();
      const int nc = guard ? min(2, nch - c0) : 2;
      const uint32_t d0 = desc_lo + uint32_t(4 * c0 * (kW8SubBytes >> 4));
      // One chunk at a time (decode, four MMAs, wait, scales): half the
      // fragments and accumulators live at once (both chunks under one wait
      // left the 96 registers of two blocks an SM short: spills in the loop).
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        uint32_t af[4][4];
        w8_fragments(wa, wb, cc, af);
        // No branch around the MMAs (the compiler would serialize them): a chunk
        // past K has zero weights (the copy engine's fill) and reads the
        // stage's first chunk of activations, giving exact zeros, unused.
        float q[4][4];
        w8_mma4(af, d0 + uint32_t(4 * (cc < nc ? cc : 0) * (kW8SubBytes >> 4)), q);
        if (cc >= nc) break;
        const int c = c0 + cc;
        float fA[4], fB[4];
        w8_chunk_scales(scA, scB, c, guard, a.nsub, fA, fB);
        w8_fold<w8_fixed(kGateUp, kLo)>(q, fA, fB, xs0 + (c * kW4Tokens + 2 * t) * 4, acc);
      }
    };
    const int full_chunks = a.nsub / 4;  // chunks wholly inside K
    for (int q = 0; q < kTPW; ++q) {
      const bool active = q < nt;
      if (q > 0 && !active) break;  // (the first tile's K-split reduction below runs either way)
      const int T0 = tile0(wg, q);
      scA = base + sc_at(wg, q) + rA * a.nsub, scB = base + sc_at(wg, q) + rB * a.nsub;
      float biasA = 0.f, biasB = 0.f;
      if (active && ks == 0) {
        biasA = bf16_to_float(a.bias[int64_t(e) * a.rows + T0 + rA]);
        biasB = bf16_to_float(a.bias[int64_t(e) * a.rows + T0 + rB]);
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      for (int j = 0; j < len; ++j, ++n) {
        const int st = n % kW8Stages, c0 = 2 * (sb0 + j);
        ptx::mbar_wait(full(wg, st), (n / kW8Stages) & 1);
        const uint32_t box = base + (wg * kW8Stages + st) * kW8StageBytes;
        auto release = [&] {  // this warp is done with the box
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(empty(wg, st));
        };
        if (c0 + 2 <= full_chunks)
          stage(box, c0, false, release);
        else
          stage(box, c0, true, release);
      }
      if (kKS > 1) {
        if (ks > 0) red[tid & 127] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        ptx::named_sync(2, 128 * kW8Consumers);
        if (ks != 0) continue;
        const float4 v = red[tid & 127];
        acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
      }
      if (!active) continue;
      w8_store_pass<kGateUp, kLo>(a, acc, seg + base_t, m, (seg + base_t) / kPass, T0, rA, rB, t, biasA, biasB,
                                  [&](int j, int) { return tok_scale[j]; });
    }
    if (a.img) {  // this warp is done with the pass's activations (its MMAs have completed)
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(aempty);
    }
  }
  if (kGateUp) ptx::mbar_arrive(done_bar);
#endif
}

// The W4A8 kernel for a K split (1 or 2), one or two E4M3 terms, and row tiles a warpgroup (1 or 2; K split 1).
template <bool kGateUp, bool kPdl>
auto w8_fn(int ks, bool lo, int tiles) {
  if (ks == 2) return lo ? w8_kernel<kGateUp, 2, kPdl, true, 1> : w8_kernel<kGateUp, 2, kPdl, false, 1>;
  if (tiles == 2) return lo ? w8_kernel<kGateUp, 1, kPdl, true, 2> : w8_kernel<kGateUp, 1, kPdl, false, 2>;
  return lo ? w8_kernel<kGateUp, 1, kPdl, true, 1> : w8_kernel<kGateUp, 1, kPdl, false, 1>;
}
// The W4A8 kernels with the activations streamed a stage at a time: each ring
// stage brings, beside its 64 rows x 256 K of weights, the same K range of up
// to kP passes' images (2 KB of E4M3 a pass and, where they have them, the
// two chunks' scales), so the weights decoded once serve kP * kPass tokens of
// an expert and shared memory holds no whole image (whole images of 16 or 32
// MMA columns cost a ring stage or a block an SM: run 94). The weights' part
// of a stage is released once a warp holds its words, the activations' part
// once its MMAs are done. K split 1, one 64-row tile a warpgroup; images
// only (a.img: the image kernel's, or gate_up's for down).
constexpr int kW8ActStage = 8 * kW8SubBytes;   // a stage's 8 sub-blocks of one pass's image
constexpr int kW8XsStage = 2 * kW4Tokens * 4;  // and its two chunks' activation scales
constexpr int w8s_stages(int passes) { return passes <= 2 ? 4 : 3; }
struct W8sSmem {
  int w, act, xs, sc, bar, total;
};
__host__ __device__ inline W8sSmem w8s_smem(int nsub, int passes) {
  W8sSmem L{};
  const int S = w8s_stages(passes);
  int o = 0;
  L.w = o, o += kW8Consumers * S * kW8StageBytes;
  L.act = o, o += kW8Consumers * S * passes * kW8ActStage;
  L.xs = o, o += kW8Consumers * S * passes * kW8XsStage;
  L.sc = o, o += kW8Consumers * ((64 * nsub + 15) / 16 * 16);
  L.bar = o, o += (3 * kW8Consumers * S + kW8Consumers + 1) * 8;
  L.total = o + 1024;
  return L;
}

template <bool kGateUp, bool kPdl, bool kLo, int kP>
__global__ void __launch_bounds__(kW8Threads, kW8BlocksPerSm)
    w8s_kernel(const W4Args a, const __grid_constant__ CUtensorMap wmap) {
#ifdef DZ_MOE_SM90A
  constexpr int kPass = kLo ? kW4Tokens / 2 : kW4Tokens;  // tokens an image
  constexpr int kGroup = kP * kPass;                      // tokens a read of the weights
  constexpr int S = w8s_stages(kP);
  constexpr bool kFixed = w8_fixed(kGateUp, kLo);
  extern __shared__ unsigned char w8_raw[];
  unsigned char* const sm =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(w8_raw) + 1023) & ~uintptr_t(1023));
  const W8sSmem L = w8s_smem(a.nsub, kP);
  const uint32_t base = ptx::smem_u32(sm);
  // wg broadcast from lane 0: the compiler then knows it is warp-uniform, and
  // the MMA descriptors derived from it stay in uniform registers.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const uint32_t bar0 = base + L.bar;  // full[w][s], wempty[w][s], aempty[w][s], scales[w]
  auto full = [&](int w, int st) { return bar0 + 8 * (w * S + st); };
  auto wempty = [&](int w, int st) { return bar0 + 8 * ((kW8Consumers + w) * S + st); };
  auto aempty = [&](int w, int st) { return bar0 + 8 * ((2 * kW8Consumers + w) * S + st); };
  auto sbar = [&](int w) { return bar0 + 8 * (3 * kW8Consumers * S + w); };
  const uint32_t done_bar = bar0 + 8 * (3 * kW8Consumers * S + kW8Consumers);  // the tiles' consumers past their stores
  auto wbox = [&](int w, int st) { return base + L.w + (w * S + st) * kW8StageBytes; };
  auto abox = [&](int w, int st, int p) { return base + L.act + ((w * S + st) * kP + p) * kW8ActStage; };
  auto xbox = [&](int w, int st, int p) { return base + L.xs + ((w * S + st) * kP + p) * kW8XsStage; };
  if (tid == 0) {
    for (int w = 0; w < kW8Consumers; ++w) {
      for (int st = 0; st < S; ++st)
        ptx::mbar_init(full(w, st), 1), ptx::mbar_init(wempty(w, st), 4), ptx::mbar_init(aempty(w, st), 4);
      ptx::mbar_init(sbar(w), 1);
    }
    const int tiles = min(kW8Consumers, (a.rows - int(blockIdx.x) * kW8Consumers * 64 + 63) / 64);
    ptx::mbar_init(done_bar, 128 * tiles);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (kPdl && kGateUp) pdl_wait(), pdl_trigger();  // routing and images; the down kernel may start its weight loads
  int4 info;
  if (!w4_item<kGateUp, kPdl>(a, info)) return;
  const int e = info.x, seg = info.y, cnt = info.z;
  const int nch = a.kpad / 128, nst = (nch + 1) / 2, groups = (cnt + kGroup - 1) / kGroup;
  const int img0 = seg / kPass;  // the expert's first image (segments start at multiples of kPadRows)
  const int act_bytes = w8_act_bytes(a.kpad), sc_bytes = (64 * a.nsub + 15) / 16 * 16;
  auto tile0 = [&](int w) { return (int(blockIdx.x) * kW8Consumers + w) * 64; };
  auto passes = [&](int g) { return min(kP, (cnt - g * kGroup + kPass - 1) / kPass); };

  if (wg == kW8Consumers) {  // producer warps: warp w keeps ring w full, on its own
    const int w = (tid >> 5) & (kW8Consumers - 1);
    if ((tid & 31) == 0 && tile0(w) < a.rows) {
      ptx::mbar_arrive_expect_tx(sbar(w), uint32_t(64 * a.nsub));
      ptx::bulk_g2s(base + L.sc + w * sc_bytes, a.scales + (int64_t(e) * a.rows + tile0(w)) * a.nsub,
                    uint32_t(64 * a.nsub), sbar(w));
      // Stage n: group n / nst, K stage n % nst (two chunks; the last may hold one).
      auto weights = [&](int n) {
        const int st = n % S, g = n / nst, j = n % nst, nc = min(2, nch - 2 * j);
        const int act = passes(g) * nc * (kW8ActStage + (kFixed ? 0 : kW8XsStage)) / 2;
        ptx::mbar_arrive_expect_tx(full(w, st), uint32_t(kW8StageBytes + act));
        ptx::tma_2d(wbox(w, st), &wmap, full(w, st), j * 128, e * a.rows + tile0(w));
      };
      auto acts = [&](int n) {
        const int st = n % S, g = n / nst, j = n % nst, nc = min(2, nch - 2 * j);
        for (int p = 0; p < passes(g); ++p) {
          const uint8_t* im = a.img + int64_t(img0 + g * kP + p) * a.img_bytes;
          ptx::bulk_g2s(abox(w, st, p), im + j * kW8ActStage, uint32_t(nc * kW8ActStage / 2), full(w, st));
          if (!kFixed)
            ptx::bulk_g2s(xbox(w, st, p), im + act_bytes + j * kW8XsStage, uint32_t(nc * kW8XsStage / 2), full(w, st));
        }
      };
      const int total = groups * nst, first = min(S, total);
      for (int n = 0; n < first; ++n) weights(n);
      if (!kGateUp) w8_wait_gate_up<kPdl>(a);  // down's images: gate_up's epilogue
      for (int n = 0; n < first; ++n) acts(n);
      for (int n = S; n < total; ++n) {
        const uint32_t ph = ((n / S) & 1) ^ 1;
        ptx::mbar_wait(wempty(w, n % S), ph);
        weights(n);
        ptx::mbar_wait(aempty(w, n % S), ph);
        acts(n);
      }
    }
    if (kPdl) pdl_trigger();
    if (kGateUp && a.expert_wait && tid == 128 * kW8Consumers) w8_count_done(a, done_bar);
    return;
  }

  // Consumers.
  if (kPdl && !kGateUp) pdl_trigger();  // (their inputs come through the producers)
  const int T0 = tile0(wg);
  if (T0 >= a.rows) return;  // (not among done_bar's arrivals)
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rA = kGateUp ? 16 * warp + 2 * g : 16 * warp + g, rB = kGateUp ? rA + 1 : rA + 8;  // tile rows
  const uint32_t scA = base + L.sc + wg * sc_bytes + rA * a.nsub, scB = base + L.sc + wg * sc_bytes + rB * a.nsub;
  const float biasA = bf16_to_float(a.bias[int64_t(e) * a.rows + T0 + rA]);
  const float biasB = bf16_to_float(a.bias[int64_t(e) * a.rows + T0 + rB]);
  const int full_chunks = a.nsub / 4;  // chunks wholly inside K
  ptx::mbar_wait(sbar(wg), 0);
  int n = 0;
  for (int gi = 0; gi < groups; ++gi) {
    const int np = passes(gi), base_t = gi * kGroup, m = min(kGroup, cnt - base_t);
    float acc[kP][4] = {};
    for (int j = 0; j < nst; ++j, ++n) {
      const int st = n % S, c0 = 2 * j, nc = min(2, nch - c0);
      const bool guard = c0 + 2 > full_chunks;
      ptx::mbar_wait(full(wg, st), (n / S) & 1);
      uint32_t wa[8], wb[8];
      w8_box_words(wbox(wg, st), rA, rB, t, wa, wb);
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(wempty(wg, st));
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        uint32_t af[4][4];
        w8_fragments(wa, wb, cc, af);
        float fA[4], fB[4];
        w8_chunk_scales(scA, scB, c0 + cc, guard, a.nsub, fA, fB);
        // A chunk past K (zero weights) reads the stage's first chunk of activations: exact zeros, unused.
        const uint32_t dc = uint32_t(4 * (cc < nc ? cc : 0) * (kW8SubBytes >> 4));
        if (kP == 1) {
          float q[4][4];
          w8_mma4(af, w8_desc_lo(abox(wg, st, 0)) + dc, q);
          if (cc < nc) w8_fold<kFixed>(q, fA, fB, xbox(wg, st, 0) + (cc * kW4Tokens + 2 * t) * 4, acc[0]);
        } else {
          // Passes two at a time, one n = 16 MMA a sub-block (a pair's second
          // pass past the group's reads a stale slot: unused).
#pragma unroll
          for (int p = 0; p < kP; p += 2) {
            if (p > 0 && p >= np) break;  // (a group has a first pass: no branch around its MMAs)
            float q[4][8];
            w8_mma4_pair<kW8ActStage>(af, w8_desc_lo(abox(wg, st, p)) + dc, q);
            if (cc >= nc) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if (h && p + 1 >= np) break;
              float qh[4][4];
#pragma unroll
              for (int b = 0; b < 4; ++b)
#pragma unroll
                for (int i = 0; i < 4; ++i) qh[b][i] = q[b][4 * h + i];
              w8_fold<kFixed>(qh, fA, fB, xbox(wg, st, p + h) + (cc * kW4Tokens + 2 * t) * 4, acc[p + h]);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(aempty(wg, st));
    }
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      if (p >= np) break;
      const int64_t img = img0 + gi * kP + p;
      // gate_up's input scales: the image's, after its activations and their 1x128 scales.
      const float* ts = reinterpret_cast<const float*>(a.img + img * a.img_bytes + act_bytes + nch * kW4Tokens * 4);
      w8_store_pass<kGateUp, kLo>(a, acc[p], seg + base_t + p * kPass, m - p * kPass, img, T0, rA, rB, t, biasA, biasB,
                                  [&](int, int tok) { return ts[tok]; });
    }
  }
  if (kGateUp) ptx::mbar_arrive(done_bar);
#endif
}

// The streamed W4A8 kernel for one or two E4M3 terms and 1, 2 or 4 passes a read of the weights.
template <bool kGateUp, bool kPdl>
auto w8s_fn(bool lo, int passes) {
  if (passes >= 4) return lo ? w8s_kernel<kGateUp, kPdl, true, 4> : w8s_kernel<kGateUp, kPdl, false, 4>;
  if (passes == 2) return lo ? w8s_kernel<kGateUp, kPdl, true, 2> : w8s_kernel<kGateUp, kPdl, false, 2>;
  return lo ? w8s_kernel<kGateUp, kPdl, true, 1> : w8s_kernel<kGateUp, kPdl, false, 1>;
}

// Block kb of sorted row r of expert segment [off, off + mp): q [rows][nkb * 128],
// the segment's scales [kb][mp] from qs + nkb * off (the layout the FP8 GEMMs
// take), or with xs_ld > 0 as Mxfp4Gemm takes them: each sub-block's words in
// register order, the scales [kb][xs_ld] by row.
__device__ __forceinline__ void store_1x128(uint32_t word, float sc, int lane, int r, int kb, int nkb, int off, int mp,
                                            uint8_t* q, float* qs, int64_t xs_ld) {
  const int w = xs_ld ? (lane & ~7) | mxfp4_gemm_x_word(lane & 7) : lane;
  reinterpret_cast<uint32_t*>(q + int64_t(r) * nkb * 128)[kb * 32 + w] = word;
  if (lane == 0) qs[xs_ld ? int64_t(kb) * xs_ld + r : int64_t(nkb) * off + int64_t(kb) * mp + (r - off)] = sc;
}

constexpr int kMaxTopk = 8;  // routed slots of a token held in registers (combine)

// Warps 0..T*G-1 (G groups of kGatherBlocks 128-column blocks): token t's
// input blocks, read once, quantized 1x128 and written to each of the token's
// routed rows (inv); the warp's loads all go out first. Warps T*G..T*G+E-1:
// expert e's pad rows (zero, scale 1).
constexpr int kGatherBlocks = 4;
__global__ void gather_quant_kernel(const float* x, int T, int H, int nkb, int topk, int E, const int* inv,
                                    const int* ids, const int* counts, const int* offsets, uint8_t* q, float* qs,
                                    int64_t xs_ld) {
  const int warp = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  const int G = (nkb + kGatherBlocks - 1) / kGatherBlocks;
  if (warp >= T * G + E) return;
  if (warp >= T * G) {
    const int e = warp - T * G, off = offsets[e], mp = offsets[e + 1] - off;
    for (int r = off + counts[e]; r < off + mp; ++r)
      for (int kb = 0; kb < nkb; ++kb) store_1x128(0u, 1.f, lane, r, kb, nkb, off, mp, q, qs, xs_ld);
    return;
  }
  const int t = warp % T, kb0 = warp / T * kGatherBlocks;
  const float* row = x + int64_t(t) * H;
  float v[kGatherBlocks][4];
#pragma unroll
  for (int u = 0; u < kGatherBlocks; ++u) {
    const int c = (kb0 + u) * 128 + lane * 4;
    if (c + 3 < H) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(row + c));
      v[u][0] = f.x, v[u][1] = f.y, v[u][2] = f.z, v[u][3] = f.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[u][i] = c + i < H ? row[c + i] : 0.f;
    }
  }
  uint32_t word[kGatherBlocks];
  float sc[kGatherBlocks];
#pragma unroll
  for (int u = 0; u < kGatherBlocks; ++u) word[u] = quant_1x128(v[u], sc[u]);
  for (int k = 0; k < topk; ++k) {
    const int p = inv[t * topk + k];
    if (p < 0) continue;
    const int e = ids[t * topk + k], off = offsets[e], mp = offsets[e + 1] - off;
#pragma unroll
    for (int u = 0; u < kGatherBlocks; ++u)
      if (kb0 + u < nkb) store_1x128(word[u], sc[u], lane, p, kb0 + u, nkb, off, mp, q, qs, xs_ld);
  }
}
// Blocks of 256 threads for T tokens and E experts' pad rows.
unsigned gather_quant_blocks(int T, int nkb, int E) {
  return unsigned((int64_t(T) * ((nkb + kGatherBlocks - 1) / kGatherBlocks) + E + 7) / 8);
}

// One warp per (sorted row of [r0, r0 + nrows), kSwigluBlocks 128-column
// blocks): D1 [rows][2I] bf16 (interleaved gate/up) + bias (b1 null: none) ->
// SwiGLU (glu; silu nonzero: the plain one) -> fp8 1x128 [rows][kpad_i]; pad
// rows give zeros. A warp's 16-byte loads all go out before its first block is
// computed (a warp per block and row was latency-bound at ~2 TB/s; a warp per
// whole row left one expert's launch short of warps).
constexpr int kSwigluBlocks = 4;
__global__ void swiglu_quant_kernel(const __nv_bfloat16* d1, int I, int nkb, const uint16_t* b1, int silu, float limit,
                                    const int* sorted, const int* row_expert, const int* offsets, int r0, int nrows,
                                    uint8_t* q, float* qs, int64_t xs_ld) {
  const int warp = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  const int groups = (nkb + kSwigluBlocks - 1) / kSwigluBlocks;
  if (warp >= nrows * groups) return;
  const int r = r0 + warp % nrows, kb0 = warp / nrows * kSwigluBlocks;
  const int e = row_expert[r];
  const int off = offsets[e], mp = offsets[e + 1] - off;
  const bool real = sorted[r] >= 0;
  const __nv_bfloat16* drow = d1 + int64_t(r) * 2 * I;
  const uint16_t* brow = b1 + int64_t(e) * 2 * I;
  uint4 raw[kSwigluBlocks], bias[kSwigluBlocks];
#pragma unroll
  for (int u = 0; u < kSwigluBlocks; ++u) {
    const int j0 = (kb0 + u) * 128 + lane * 4;
    // I % 4 == 0: a lane's 4 columns are all in range or all out.
    const bool in = real && kb0 + u < nkb && j0 < I;
    raw[u] = in ? *reinterpret_cast<const uint4*>(drow + 2 * j0) : make_uint4(0, 0, 0, 0);
    bias[u] = in && b1 ? __ldg(reinterpret_cast<const uint4*>(brow + 2 * j0)) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kSwigluBlocks; ++u) {
    const int kb = kb0 + u;
    if (kb >= nkb) break;
    const int j0 = kb * 128 + lane * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (real && j0 < I) {
      const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      const uint32_t bw[4] = {bias[u].x, bias[u].y, bias[u].z, bias[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float gate = bf16_to_float(uint16_t(w[i] & 0xFFFF)) + bf16_to_float(uint16_t(bw[i] & 0xFFFF));
        const float up = bf16_to_float(uint16_t(w[i] >> 16)) + bf16_to_float(uint16_t(bw[i] >> 16));
        v[i] = glu(gate, up, silu, limit);
      }
    }
    float sc;
    const uint32_t word = quant_1x128(v, sc);
    store_1x128(word, sc, lane, r, kb, nkb, off, mp, q, qs, xs_ld);
  }
}
// Blocks of 256 threads for nrows rows.
unsigned swiglu_quant_blocks(int nrows, int nkb) {
  return unsigned((int64_t(nrows) * ((nkb + kSwigluBlocks - 1) / kSwigluBlocks) + 7) / 8);
}

// Whole-K scales (Mxfp4Gemm with gk): a block of kQrThreads quantizes a row
// of kpad values, get(c, v) giving values c..c+3 (zeros past the row's end),
// under one scale amax / 448 (1 for a zero row): each 4-byte word to word
// mxfp4_gemm_x_word of its sub-block of every destination row dst(i) < ndst
// (negative: skipped), the scale to qs. Rows of up to kQrChunks * 4 *
// kQrThreads values are read once, their loads all issued first (a warp a
// row, read twice, ran at ~2.6 TB/s); longer ones twice.
constexpr int kQrThreads = 128, kQrChunks = 8;
template <typename Get, typename Dst>
__device__ __forceinline__ void quant_row_whole_k(Get get, int kpad, int ndst, Dst dst, uint8_t* q, float* qs) {
  __shared__ float wmax[kQrThreads / 32];
  const int tid = int(threadIdx.x);
  auto absmax = [](const float(&v)[4]) {
    return fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  };
  auto put = [&](int c, const float(&v)[4], float inv) {
    const uint32_t word = e4m3x4(v, inv);
    const int at = mxfp4_gemm_x_byte(c);  // c % 4 == 0: the word's first byte
    for (int i = 0; i < ndst; ++i) {
      const int r = dst(i);
      if (r >= 0) *reinterpret_cast<uint32_t*>(q + int64_t(r) * kpad + at) = word;
    }
  };
  auto block_scale = [&](float amax) {
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
    if ((tid & 31) == 0) wmax[tid >> 5] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kQrThreads / 32; ++w) amax = fmaxf(amax, wmax[w]);
    const float sc = amax > 0.f ? amax / 448.f : 1.f;
    if (tid == 0)
      for (int i = 0; i < ndst; ++i)
        if (dst(i) >= 0) qs[dst(i)] = sc;
    return sc;
  };
  constexpr int kStep = 4 * kQrThreads;
  float amax = 0.f;
  if (kpad <= kQrChunks * kStep) {
    float v[kQrChunks][4];
#pragma unroll
    for (int u = 0; u < kQrChunks; ++u) {
      const int c = tid * 4 + u * kStep;
      if (c < kpad)
        get(c, v[u]);
      else
        v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < kQrChunks; ++u) amax = fmaxf(amax, absmax(v[u]));
    const float inv = 1.f / block_scale(amax);
#pragma unroll
    for (int u = 0; u < kQrChunks; ++u)
      if (tid * 4 + u * kStep < kpad) put(tid * 4 + u * kStep, v[u], inv);
    return;
  }
  for (int c = tid * 4; c < kpad; c += kStep) {
    float v[4];
    get(c, v);
    amax = fmaxf(amax, absmax(v));
  }
  const float inv = 1.f / block_scale(amax);
  for (int c = tid * 4; c < kpad; c += kStep) {
    float v[4];
    get(c, v);
    put(c, v, inv);
  }
}

// Blocks 0..T-1: token t's input row, quantized once, to each of its routed
// rows (inv); blocks T..T+E-1: expert e's pad rows (zero, scale 1).
__global__ void __launch_bounds__(kQrThreads)
    gather_quant_row_kernel(const float* x, int T, int H, int kph, int topk, const int* inv, const int* counts,
                            const int* offsets, uint8_t* q, float* qs) {
  const int b = int(blockIdx.x);
  if (b >= T) {
    const int e = b - T, r0 = offsets[e] + counts[e], r1 = offsets[e + 1];
    for (int r = r0; r < r1; ++r) {
      for (int c = int(threadIdx.x) * 4; c < kph; c += 4 * kQrThreads)
        *reinterpret_cast<uint32_t*>(q + int64_t(r) * kph + c) = 0u;
      if (threadIdx.x == 0) qs[r] = 1.f;
    }
    return;
  }
  const float* row = x + int64_t(b) * H;
  const int* dst = inv + int64_t(b) * topk;
  quant_row_whole_k(
      [&](int c, float(&v)[4]) {
        if (c + 3 < H && (H & 3) == 0) {
          const float4 f = __ldg(reinterpret_cast<const float4*>(row + c));
          v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] = c + i < H ? row[c + i] : 0.f;
        }
      },
      kph, topk, [&](int i) { return dst[i]; }, q, qs);
}

// A block per sorted row of [r0, r0 + nrows): swiglu_quant_kernel's values
// (pad rows zero) under one scale a row.
__global__ void __launch_bounds__(kQrThreads)
    swiglu_quant_row_kernel(const __nv_bfloat16* d1, int I, int kpi, const uint16_t* b1, int silu, float limit,
                            const int* sorted, const int* row_expert, int r0, uint8_t* q, float* qs) {
  const int r = r0 + int(blockIdx.x);
  const bool real = sorted[r] >= 0;
  const __nv_bfloat16* drow = d1 + int64_t(r) * 2 * I;
  const uint16_t* brow = b1 ? b1 + int64_t(row_expert[r]) * 2 * I : nullptr;
  quant_row_whole_k(
      [&](int c, float(&v)[4]) {
        v[0] = v[1] = v[2] = v[3] = 0.f;
        if (!real || c >= I) return;  // I % 4 == 0
        const uint4 raw = *reinterpret_cast<const uint4*>(drow + 2 * c);
        const uint4 bias = brow ? __ldg(reinterpret_cast<const uint4*>(brow + 2 * c)) : make_uint4(0, 0, 0, 0);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w}, bw[4] = {bias.x, bias.y, bias.z, bias.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float gate = bf16_to_float(uint16_t(w[i] & 0xFFFF)) + bf16_to_float(uint16_t(bw[i] & 0xFFFF));
          const float up = bf16_to_float(uint16_t(w[i] >> 16)) + bf16_to_float(uint16_t(bw[i] >> 16));
          v[i] = glu(gate, up, silu, limit);
        }
      },
      kpi, 1, [r](int) { return r; }, q, qs);
}

// 8 consecutive values of a row as float: fp32 (two 16-byte loads) or bf16 (one).
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 r = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v[2 * i] = bf16_to_float(uint16_t(w[i] & 0xFFFF)), v[2 * i + 1] = bf16_to_float(uint16_t(w[i] >> 16));
}

// out[t] (+)= sum_k w[t][k] * (y[inv[t,k]] (+ bias[e_k])), fixed order: deterministic.
// kVec8: each thread takes 8 consecutive values (16-byte loads; H % 8 == 0 and
// 16-byte aligned rows), otherwise one.
template <typename T, bool kBias, bool kPdl = false, bool kVec8 = false>
__global__ void combine_kernel(const T* y, const int* inv, const int* ids, const float* gw, int topk,
                               const uint16_t* bias, int H, float* out, int accumulate) {
  if (kPdl) pdl_wait(), pdl_trigger();
  const int t = blockIdx.x;
  // The token's slots first (topk <= kMaxTopk: in registers), so that the expert
  // rows load together instead of one dependent pair of loads per slot.
  int pos[kMaxTopk], ex[kMaxTopk];
  float g[kMaxTopk];
  const bool regs = topk <= kMaxTopk;
  if (regs) {
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      pos[k] = k < topk ? inv[t * topk + k] : -1;
      g[k] = k < topk ? gw[t * topk + k] : 0.f;
      ex[k] = kBias && k < topk ? ids[t * topk + k] : 0;
    }
  }
  if constexpr (kVec8) {  // (topk <= kMaxTopk: the host checks)
    for (int n = 8 * int(blockIdx.y * blockDim.x + threadIdx.x); n < H; n += 8 * int(gridDim.y * blockDim.x)) {
      float acc[8] = {};
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {  // fixed order: deterministic
        if (pos[k] < 0) continue;
        float v[8];
        load8(y + int64_t(pos[k]) * H + n, v);
        if (kBias) {
          float b[8];
          load8(reinterpret_cast<const __nv_bfloat16*>(bias) + int64_t(ex[k]) * H + n, b);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] += b[i];
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += g[k] * v[i];
      }
      float4* op = reinterpret_cast<float4*>(out + int64_t(t) * H + n);
      if (accumulate) {
        const float4 a = op[0], b = op[1];
        acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
        acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
      }
      op[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      op[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  } else {
    for (int n = blockIdx.y * blockDim.x + threadIdx.x; n < H; n += gridDim.y * blockDim.x) {
      float acc = 0.f;
      if (regs) {
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {  // fixed order: deterministic
          if (pos[k] < 0) continue;
          float v = float(y[int64_t(pos[k]) * H + n]);
          if (kBias) v += bf16_to_float(bias[int64_t(ex[k]) * H + n]);
          acc += g[k] * v;
        }
      } else {
        for (int k = 0; k < topk; ++k) {
          const int p = inv[t * topk + k];
          if (p < 0) continue;
          float v = float(y[int64_t(p) * H + n]);
          if (kBias) v += bf16_to_float(bias[int64_t(ids[t * topk + k]) * H + n]);
          acc += gw[t * topk + k] * v;
        }
      }
      out[int64_t(t) * H + n] = accumulate ? out[int64_t(t) * H + n] + acc : acc;
    }
  }
}

int64_t kpad_of(int k) { return cpu::fold_kpad(k); }

// combine_kernel: a block per token and slice of H, about 1024 blocks when T is small
// (one block per token left a decode step's combine at ~9 us).
dim3 combine_grid(int T, int H, int per_thread = 1, int threads = 256) {
  const int slices = std::max(1, std::min((H / per_thread + threads - 1) / threads, 1024 / std::max(T, 1)));
  return dim3(unsigned(T), unsigned(slices));
}

}  // namespace

// What a layer reserves at construction (elements per buffer, and bytes in
// all). Buffers that only some paths use are sized for what kAuto takes at
// max_tokens under the options given, and grow on first use past that (a
// forced path, options changed later, weights without whole-K tables): the
// fused path's fp16 activations and fp32 outputs up to its largest tokens
// per expert; gate_up's bf16 output only below the whole-K threshold where
// gpt-oss's SwiGLU epilogue writes down's input (755 MB at 16384 tokens of
// gpt-oss-120b otherwise); the FP8 expert workspace not at all for gpt-oss,
// whose experts fold by whole-K tables and never into it.
constexpr size_t kGemmWsBytes = size_t(32) << 20;  // a cuBLASLt workspace per FP8-path stream

// Sorted rows of T tokens' slots, each expert's padded to kPadRows (at most rows_cap).
int64_t sorted_rows(const MoeShape& s, int64_t T, int64_t rows_cap) {
  return std::min(rows_cap, T * s.topk + int64_t(s.n_experts) * (kPadRows - 1));
}

struct MoeScratchPlan {
  int64_t kph = 0, kpi = 0, slots = 0, rows_cap = 0, xs_ld = 0, img_tokens = 0, img_passes = 0;
  int64_t fused_rows = 0, d1_rows = 0;
  size_t ws_fp8 = 0, ws_scales = 0, bytes = 0;
};

MoeScratchPlan moe_scratch_plan(const MoeShape& s, int maxT, const MoeOptions& opt) {
  MoeScratchPlan p;
  const int64_t E = s.n_experts, H = s.hidden, I = s.intermediate, k = s.topk, pad = E * (kPadRows - 1);
  p.kph = kpad_of(s.hidden), p.kpi = kpad_of(s.intermediate);
  p.slots = int64_t(maxT) * k;
  p.rows_cap = p.slots + pad;
  p.xs_ld = (p.rows_cap + 3) / 4 * 4;  // Mxfp4Gemm's scale layout [kb][xs_ld] (the others need rows_cap a block)
  // Rows of the tokens that give tokens_per_expert.
  auto rows_for = [&](double tokens_per_expert) {
    const double t = std::ceil(std::max(tokens_per_expert, 1.0) * double(E) / double(k));
    return sorted_rows(s, int64_t(std::min<double>(t, maxT)), p.rows_cap);
  };
  p.fused_rows = rows_for(std::max(opt.fused_max_tokens_per_expert, opt.fused_streamed_max_tokens_per_expert));
  const bool glu_epilogue = s.act == MoeActivation::kGptOss && opt.fp8_whole_k == 0 && opt.fp8_whole_k_glu;
  p.d1_rows = glu_epilogue ? rows_for(opt.fp8_whole_k_min_tokens_per_expert) : p.rows_cap;
  p.img_tokens = std::min(maxT, kW8ImageTokens);
  const int64_t tile = std::min(opt.tile_experts, s.n_experts);
  if (s.act != MoeActivation::kGptOss || opt.fp8_whole_k < 0) {
    p.ws_fp8 = size_t(2 * tile) * (size_t(2 * I) * p.kph + size_t(H) * p.kpi);
    p.ws_scales = size_t(2) * (tile * (size_t(2 * I) * (p.kph / 128) + size_t(H) * (p.kpi / 128)) + 8);
  }
  p.img_passes = (p.img_tokens * k + pad + 3) / 4;  // the W4A8 images: a pass of 4 sorted rows
  // (In the order the constructor allocates them; DevicePool rounds each to 256 bytes.)
  const size_t sizes[] = {size_t(E) * 4,
                          size_t(E + 1) * 4,
                          size_t(p.rows_cap) * 4,
                          size_t(p.rows_cap) * 4,
                          size_t(p.slots) * 4,
                          size_t(4 * E) * 4,
                          4,
                          4,
                          size_t(std::max<int64_t>(1, (p.slots + kRouteChunk - 1) / kRouteChunk) * E) * 4,
                          size_t(maxT) * p.kph * 2,
                          size_t(maxT) * 4,
                          size_t(p.fused_rows) * p.kpi * 2,
                          size_t(p.fused_rows) * H * 4,
                          size_t(p.rows_cap) * p.kph,
                          size_t(p.xs_ld) * (p.kph / 128) * 4,
                          size_t(p.rows_cap) * p.kpi,
                          size_t(p.xs_ld) * (p.kpi / 128) * 4,
                          size_t(p.d1_rows) * 2 * I * 2,
                          size_t(p.rows_cap) * H * 2,
                          size_t(p.img_passes) * w8_image_bytes(int(p.kph)),
                          size_t(p.img_passes) * w8_image_bytes(int(p.kpi)),
                          p.ws_fp8,
                          p.ws_scales * 4,
                          one_token_img_bytes(s),
                          one_token_counts(s) * 4,
                          kGemmWsBytes * size_t(opt.gemm_streams)};
  for (size_t b : sizes) p.bytes += b ? (b + 255) / 256 * 256 : 0;
  return p;
}

size_t MoeLayer::reserved_bytes(const MoeShape& shape, int max_tokens, const MoeOptions& opt) {
  return moe_scratch_plan(shape, max_tokens, opt).bytes;
}

struct MoeLayer::Impl {
  Context& ctx;
  MoeShape s;
  MoeOptions opt;
  int max_tokens;
  int64_t kph, kpi, rows_cap, xs_ld;
  // FP8 path: experts of a tile spread over gemm_streams streams, each with
  // its own cuBLASLt workspace and plans.
  std::vector<cudaStream_t> gs;
  Fp8Gemm gemm;          // one plan cache; a workspace slice per stream
  Fp8GroupedGemm ggemm;  // MoeOptions::fp8_gemm
  // MoeOptions::fp8_ws_tile_n = 128 takes effect only where a folding block
  // fits beside the narrow GEMM block on this device (asked once, when first wanted).
  int narrow_fold_fits = -1;
  bool narrow_fits() {
    if (narrow_fold_fits < 0) narrow_fold_fits = Fp8GroupedGemm::narrow_leaves_room_for_fold() ? 1 : 0;
    return narrow_fold_fits == 1;
  }
  Mxfp4Gemm mgemm;  // MoeOptions::fp8_mxfp4_gemm
  DeviceArray<uint8_t> gemm_ws;
  static constexpr size_t kGemmWs = kGemmWsBytes;
  cudaEvent_t ev_fork{};
  std::vector<cudaEvent_t> ev_join;
  // routing
  DeviceArray<int> counts, offsets, sorted, row_expert, inv, active, n_active, err, route_part;
  // fused path
  DeviceArray<__half> xh, act16;
  DeviceArray<float> xs, y32;
  // FP8 path
  DeviceArray<uint8_t> a1, a2;
  DeviceArray<float> a1s, a2s;
  DeviceArray<__nv_bfloat16> d1, d2;
  // the FP8 expert workspace: 2 tiles x tile_experts x (w1 + w2)
  DeviceArray<uint8_t> ws_fp8;
  DeviceArray<float> ws_scales;
  bool w8_fits = false;                      // the W4A8 kernels can run here (device, build, shared memory)
  int n_sms = 132;                           // multiprocessors of the device
  int tile_cap = 0;                          // experts per workspace tile it was sized for
  DeviceArray<uint8_t> w8_img, w8_img_down;  // W4A8 images: gate_up's, and down's (written by gate_up)
  // One token streamed (MoeOptions::fused_one_token_stream): down's images
  // and the slots' done counts (zero between calls).
  DeviceArray<uint8_t> ot_img;
  DeviceArray<int> ot_counts;
  int img_tokens = 0;       // tokens the images are sized for
  bool w8s_fits[3] = {};    // the streamed W4A8 kernels' shared memory fits (1, 2, 4 passes)
  int* h_counts = nullptr;  // pinned: counts[E], offsets[E+1]
  cudaEvent_t ev_ready[2]{}, ev_free[2]{};

  // The experts' activation is the plain SwiGLU (MoeShape::act).
  bool silu() const { return s.act == MoeActivation::kSilu; }

  // Growth past the construction's plan (MoeScratchPlan) where a call needs
  // more than n: straight to the full size, so a buffer grows once. The old
  // one is kept until the layer goes, since a CUDA graph captured earlier may
  // still point into it. Out of pool memory: an error naming it.
  std::vector<std::shared_ptr<void>> retired;
  template <typename T>
  bool grow(DeviceArray<T>& a, size_t need, size_t full, const char* what) {
    if (a.size() >= need) return false;
    DeviceArray<T> b(ctx.pool(), std::max(need, full), what);
    if (a.get()) retired.push_back(std::make_shared<DeviceArray<T>>(std::move(a)));
    a = std::move(b);
    return true;
  }
  int64_t rows_for(int T) const { return sorted_rows(s, T, rows_cap); }

  Impl(Context& c, const MoeShape& sh, int maxT, const MoeOptions& o)
      : ctx(c), s(sh), opt(o), max_tokens(maxT), gemm(c) {
    check(s.n_experts > 0 && s.topk > 0 && s.topk <= s.n_experts && s.hidden % 32 == 0 && s.hidden % 16 == 0 &&
              s.intermediate % 32 == 0 && s.intermediate > 0 && s.hidden > 0 && maxT > 0,
          DZ_ERR_INVALID_ARGUMENT, "MoeLayer: unsupported shape E=", s.n_experts, " topk=", s.topk, " H=", s.hidden,
          " I=", s.intermediate);
    check(s.act == MoeActivation::kGptOss || s.act == MoeActivation::kSilu, DZ_ERR_INVALID_ARGUMENT,
          "MoeLayer: unknown activation ", int(s.act));
    check(s.silu_limit >= 0 && (s.silu_limit == 0 || s.act == MoeActivation::kSilu), DZ_ERR_INVALID_ARGUMENT,
          "MoeLayer: silu_limit ", s.silu_limit, " (>= 0, with the plain SwiGLU only)");
    check(opt.tile_experts >= 1, DZ_ERR_INVALID_ARGUMENT, "tile_experts must be >= 1");
    tile_cap = std::min(opt.tile_experts, s.n_experts);
    check(opt.gemm_streams >= 1 && opt.gemm_streams <= 16, DZ_ERR_INVALID_ARGUMENT, "gemm_streams must be 1..16");
    const MoeScratchPlan plan = moe_scratch_plan(s, maxT, opt);
    kph = plan.kph, kpi = plan.kpi, rows_cap = plan.rows_cap, xs_ld = plan.xs_ld;
    const int64_t slots = plan.slots;
    DevicePool& P = ctx.pool();
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    counts = DeviceArray<int>(P, E, "moe counts");
    offsets = DeviceArray<int>(P, E + 1, "moe offsets");
    sorted = DeviceArray<int>(P, rows_cap, "moe sorted slots");
    row_expert = DeviceArray<int>(P, rows_cap, "moe row experts");
    inv = DeviceArray<int>(P, slots, "moe slot rows");
    active = DeviceArray<int>(P, 4 * size_t(E), "moe active experts");
    n_active = DeviceArray<int>(P, 1, "moe active count");
    err = DeviceArray<int>(P, 1, "moe error flag");
    route_part = DeviceArray<int>(P, size_t(std::max<int64_t>(1, (slots + kRouteChunk - 1) / kRouteChunk)) * E,
                                  "moe routing chunk counts");
    xh = DeviceArray<__half>(P, size_t(maxT) * kph, "moe fp16 input");
    xs = DeviceArray<float>(P, maxT, "moe input scales");
    act16 = DeviceArray<__half>(P, size_t(plan.fused_rows) * kpi, "moe fp16 activations");
    y32 = DeviceArray<float>(P, size_t(plan.fused_rows) * H, "moe expert outputs");
    a1 = DeviceArray<uint8_t>(P, size_t(rows_cap) * kph, "moe fp8 input");
    a1s = DeviceArray<float>(P, size_t(xs_ld) * (kph / 128), "moe fp8 input scales");
    a2 = DeviceArray<uint8_t>(P, size_t(rows_cap) * kpi, "moe fp8 activations");
    a2s = DeviceArray<float>(P, size_t(xs_ld) * (kpi / 128), "moe fp8 activation scales");
    d1 = DeviceArray<__nv_bfloat16>(P, size_t(plan.d1_rows) * 2 * I, "moe gate_up output");
    d2 = DeviceArray<__nv_bfloat16>(P, size_t(rows_cap) * H, "moe down output");
    // The W4A8 kernels' activation images: one a pass of 4 sorted rows (two
    // terms; 8 with one), for up to kW8ImageTokens tokens.
    img_tokens = int(plan.img_tokens);
    w8_img = DeviceArray<uint8_t>(P, size_t(plan.img_passes) * w8_image_bytes(int(kph)), "moe W4A8 activation images");
    w8_img_down = DeviceArray<uint8_t>(P, size_t(plan.img_passes) * w8_image_bytes(int(kpi)), "moe W4A8 down images");
    // Two tiles in flight: fold the next while the GEMMs use this one (+8
    // scales: alignment). Not reserved for gpt-oss (grown on first use).
    if (plan.ws_fp8) {
      ws_fp8 = DeviceArray<uint8_t>(P, plan.ws_fp8, "FP8 expert workspace");
      ws_scales = DeviceArray<float>(P, plan.ws_scales, "FP8 expert workspace scales");
    }
    // DZ_MOE_ONE_TOKEN_STREAM=1 / 0: one token streamed or not, whatever the options (A/B timings of a model).
    if (const char* e = std::getenv("DZ_MOE_ONE_TOKEN_STREAM"); e && (e[0] == '0' || e[0] == '1') && e[1] == 0)
      opt.fused_one_token_stream = e[0] == '1';
    // DZ_MOE_ONE_TOKEN_CONFIG=groups,warps,stages[,cooperative]: its block shape (OneTokenConfig) for such runs.
    if (const char* e = std::getenv("DZ_MOE_ONE_TOKEN_CONFIG")) {
      OneTokenConfig c;
      int coop = 1;
      if (std::sscanf(e, "%d,%d,%d,%d", &c.groups, &c.group_warps, &c.stages, &coop) >= 3)
        c.cooperative = coop != 0, opt.one_token = c;
    }
    ot_img = DeviceArray<uint8_t>(P, one_token_img_bytes(s), "moe one-token images");
    ot_counts = DeviceArray<int>(P, one_token_counts(s), "moe one-token counts");
    DZ_CUDA_CHECK(cudaMemsetAsync(ot_counts.get(), 0, ot_counts.bytes(), ctx.stream()));
    DZ_CUDA_CHECK(cudaMemsetAsync(err.get(), 0, sizeof(int), ctx.stream()));
    // gate_up's epilogue never writes down's sub-blocks past I (kpi > I): zeros.
    DZ_CUDA_CHECK(cudaMemsetAsync(w8_img_down.get(), 0, w8_img_down.bytes(), ctx.stream()));
    // Padding columns of the fp16 activations are never written by the kernels.
    DZ_CUDA_CHECK(cudaMemsetAsync(act16.get(), 0, act16.bytes(), ctx.stream()));
    DZ_CUDA_CHECK(cudaMallocHost(&h_counts, sizeof(int) * (2 * E + 1)));
    gemm_ws = DeviceArray<uint8_t>(P, kGemmWs * opt.gemm_streams, "cuBLASLt workspaces");
    DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
    for (int i = 0; i < opt.gemm_streams; ++i) {
      cudaStream_t q;
      DZ_CUDA_CHECK(cudaStreamCreateWithFlags(&q, cudaStreamNonBlocking));
      gs.push_back(q);
      cudaEvent_t ev;
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      ev_join.push_back(ev);
    }
    for (int i = 0; i < 2; ++i) {
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_ready[i], cudaEventDisableTiming));
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_free[i], cudaEventDisableTiming));
    }
    const int smem = int(kW4MaxTokens * std::max(kph, kpi) * 2);
    for (int ks : kW4Splits)
      for (int nt : {1, 2})
        for (auto k : {w4_fn<true, false>(ks, nt, silu()), w4_fn<true, true>(ks, nt, silu()),
                       w4_fn<false, false>(ks, nt, silu()), w4_fn<false, true>(ks, nt, silu())})
          DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    // The W4A8 kernels: sm_90a only, and where their shared memory fits a block.
    int smem8 = 0;
    for (int tiles : {1, 2})
      smem8 = std::max({smem8, w8_smem(H / 32, int(kph), tiles).total, w8_smem(I / 32, int(kpi), tiles).total});
    int optin = 0, dev = 0;
    DZ_CUDA_CHECK(cudaGetDevice(&dev));
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    w8_fits = Fp8GroupedGemm::supported() && smem8 <= optin;
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
    if (w8_fits) {
      for (int ks : {1, 2})
        for (bool lo : {false, true})
          for (int tiles : {1, 2})
            for (auto k : {w8_fn<true, false>(ks, lo, tiles), w8_fn<true, true>(ks, lo, tiles),
                           w8_fn<false, false>(ks, lo, tiles), w8_fn<false, true>(ks, lo, tiles)})
              DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem8));
      for (int ps : {1, 2, 4}) {
        const int smem_s = std::max(w8s_smem(H / 32, ps).total, w8s_smem(I / 32, ps).total);
        w8s_fits[ps == 4 ? 2 : ps - 1] = smem_s <= optin;
        for (bool lo : {false, true})
          for (auto k : {w8s_fn<true, false>(lo, ps), w8s_fn<true, true>(lo, ps), w8s_fn<false, false>(lo, ps),
                         w8s_fn<false, true>(lo, ps)})
            DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_s));
      }
    }
    DZ_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  }

  ~Impl() {
    for (auto q : gs) cudaStreamSynchronize(q), cudaStreamDestroy(q);
    for (auto ev : ev_join) cudaEventDestroy(ev);
    if (ev_fork) cudaEventDestroy(ev_fork);
    for (int i = 0; i < 2; ++i) {
      if (ev_ready[i]) cudaEventDestroy(ev_ready[i]);
      if (ev_free[i]) cudaEventDestroy(ev_free[i]);
    }
    if (h_counts) cudaFreeHost(h_counts);
  }

  // with_x: also convert x to the fused path's fp16 input (small T only).
  void route(const int* ids, int T, const float* x_small) {
    const int E = s.n_experts, n_slots = T * s.topk;
    if (n_slots > kRouteOneBlock && !x_small) {
      const int nb = (n_slots + kRouteChunk - 1) / kRouteChunk;
      cudaStream_t st = ctx.stream();
      route_chunk_count_kernel<<<nb, kRouteChunkThreads, sizeof(int) * E, st>>>(ids, n_slots, E, route_part.get(),
                                                                                err.get());
      DZ_CUDA_LAUNCH_CHECK();
      route_chunk_scan_kernel<<<1, kRouteThreads, sizeof(int) * (2 * E + 1), st>>>(
          route_part.get(), nb, E, counts.get(), offsets.get(), active.get(), n_active.get());
      DZ_CUDA_LAUNCH_CHECK();
      route_chunk_place_kernel<<<nb, kRouteChunkThreads, sizeof(int) * (3 * E + 1), st>>>(
          ids, n_slots, E, route_part.get(), counts.get(), offsets.get(), sorted.get(), row_expert.get(), inv.get());
      DZ_CUDA_LAUNCH_CHECK();
      return;
    }
    // Small batches: the fused path's fp16 input conversion rides along (one launch less).
    const unsigned blocks = 1 + (x_small ? unsigned(T) : 0u);
    route_kernel<<<blocks, kRouteThreads, sizeof(int) * (3 * E + 1), ctx.stream()>>>(
        ids, T * s.topk, E, counts.get(), offsets.get(), sorted.get(), row_expert.get(), inv.get(), active.get(),
        n_active.get(), err.get(), x_small, T, s.hidden, int(kph), xh.get(), xs.get());
    DZ_CUDA_LAUNCH_CHECK();
  }

  // One token through moe_one_token.h's stream (no routing launch; fp16
  // activations as the W4A16 kernels), unless E4M3 arithmetic is asked for
  // (one W4A8 term: DZ_EXPERTS_FP8).
  bool streams_one(int T, const MoeWeights& w) const {
    return T == 1 && opt.fused_one_token_stream && !(opt.fused_w4a8 && opt.fused_w4a8_terms == 1) &&
           one_token_moe_supported(s, w, opt.one_token);
  }

  void fused(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out, int accumulate) {
    cudaStream_t st = ctx.stream();
    if (streams_one(T, w)) {
      one_token_moe(s, w, x, ids, gw, out, accumulate != 0, OneTokenScratch{ot_img.get(), ot_counts.get()}, err.get(),
                    n_sms, opt.pdl && pdl_enabled(), st, opt.one_token);
      return;
    }
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    if (grow(act16, size_t(rows_for(T)) * kpi, size_t(rows_cap) * kpi, "moe fp16 activations"))
      DZ_CUDA_CHECK(cudaMemsetAsync(act16.get(), 0, act16.bytes(), st));  // padding columns read as zeros
    grow(y32, size_t(rows_for(T)) * H, size_t(rows_cap) * H, "moe expert outputs");
    if (T > kRouteConvertsX) {
      x_to_half_kernel<<<T, 256, 0, st>>>(x, H, int(kph), xh.get(), xs.get());
      DZ_CUDA_LAUNCH_CHECK();
    }
    const unsigned max_active = unsigned(std::min<int64_t>(E, int64_t(T) * s.topk));
    W4Args a{};
    a.limit = s.silu_limit;
    if (direct(T)) {  // grid y = topk: one block row per routed slot
      a.direct = 1, a.n_experts = E, a.H = H, a.ids = ids, a.x = x, a.err = err.get();
    }
    a.sorted = sorted.get();
    a.inv = inv.get();  // direct: gate_up writes it; the W4A8 image kernels read it
    a.active = reinterpret_cast<const int4*>(active.get());
    a.n_active = n_active.get();
    a.topk = s.topk;
    // gate_up + SwiGLU
    a.blocks = w.w1_blocks, a.scales = w.w1_scales, a.bias = w.b1;
    a.act = xh.get(), a.act_scale = xs.get();
    a.rows = 2 * I, a.nsub = H / 32, a.kpad = int(kph);
    a.out_act = act16.get(), a.out_ld = int(kpi);
    // Token slots per weight pass (an expert gets each token at most once): 16
    // (two MMA token tiles) without a K split once experts average more than 8
    // tokens; fewer leave the larger staging buffer idle (64 tokens of 128
    // experts: 0.79 vs 0.66 ms with 16 slots on an H200).
    const int ks = w4_split(T);
    const bool two_tiles = ks == 1 && double(T) * s.topk > opt.fused_two_token_tiles_above * E;
    a.ntok = std::min(T, two_tiles ? kW4MaxTokens : kW4Tokens);
    const bool pdl = opt.pdl && pdl_enabled();
    check(opt.fused_w4a8_terms == 1 || opt.fused_w4a8_terms == 2, DZ_ERR_INVALID_ARGUMENT,
          "fused_w4a8_terms must be 1 or 2, not ", opt.fused_w4a8_terms);
    check(opt.fused_w4a8_tiles >= 0 && opt.fused_w4a8_tiles <= 2, DZ_ERR_INVALID_ARGUMENT,
          "fused_w4a8_tiles must be 0 (auto), 1 or 2, not ", opt.fused_w4a8_tiles);
    const int tiles = opt.fused_w4a8_tiles ? opt.fused_w4a8_tiles : w8_tiles(T);
    const bool images = w8_images(T), w4a8 = w8_chosen(T);
    const int ks8 = w8_split(T);
    W4Args d = a;  // down
    d.blocks = w.w2_blocks, d.scales = w.w2_scales, d.bias = w.b2;
    d.act = act16.get(), d.act_scale = silu() ? xs.get() : nullptr;  // (the plain SwiGLU's activations are scaled)
    d.rows = H, d.nsub = I / 32, d.kpad = int(kpi);
    d.out_y = y32.get();
    // Both projections on the W4A8 kernels with two terms: gate_up writes down's images.
    const bool chained = images && w4a8 && opt.fused_w4a8_terms == 2 && w8(2 * I, a) && w8(H, d);
    if (chained) a.next_img = w8_img_down.get(), a.next_img_bytes = w8_image_bytes(d.kpad);
    // Chained: down's experts wait for their own gate_up blocks, not the whole grid (w8_count_done).
    const bool expert_wait = chained && pdl && opt.fused_w4a8_expert_wait && !a.direct;
    a.expert_wait = expert_wait ? 1 : 0;
    const int passes = w8_passes(T);
    const unsigned gu_blocks =
        launch_w4<true>(ks, ks8, pdl, w4a8, tiles, passes, 2 * I, max_active, st, a, images ? T * s.topk : 0);
    d.expert_wait = expert_wait ? int(gu_blocks) : 0;
    launch_w4<false>(ks, ks8, pdl, w4a8, tiles, passes, H, max_active, st, d, images ? T * s.topk : 0, chained);
    const bool v8 = vec8(y32.get(), nullptr, out);
    const auto comb = v8 ? (pdl ? combine_kernel<float, false, true, true> : combine_kernel<float, false, false, true>)
                         : (pdl ? combine_kernel<float, false, true> : combine_kernel<float, false, false>);
    launch(comb, v8 ? combine_grid(T, H, 8, 128) : combine_grid(T, H), dim3(v8 ? 128 : 256), 0, st, pdl,
           (const float*)y32.get(), (const int*)inv.get(), ids, gw, s.topk, (const uint16_t*)nullptr, H, out,
           accumulate);
  }

  // One token, per-projection kernels: no routing launch (see MoeOptions);
  // gate_up's blocks convert the input 2 pieces a thread.
  bool direct(int T) const { return T == 1 && opt.fused_one_token_direct && kph / 8 <= 2 * kW4Threads; }

  // The W4A8 kernels can run a projection of this many rows (an sm_90a build and device, 64-row tiles, an even number
  // of sub-blocks a row, 16-byte aligned weights for the copy engine; gpt-oss's activation only, w8_chosen; a bias:
  // they add it unconditionally, so a projection without one runs on the W4A16 kernels, which take null as zero).
  bool w8(int rows, const W4Args& a) const {
    return !silu() && a.bias && rows % 64 == 0 && a.nsub % 2 == 0 && w8_fits && aligned16(a.blocks) &&
           aligned16(a.scales);
  }

  static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
  // Whether the combine can take 8 values a thread (16-byte loads and stores).
  bool vec8(const void* y, const void* bias, const float* out) const {
    return s.hidden % 8 == 0 && s.topk <= kMaxTopk && aligned16(y) && aligned16(bias) && aligned16(out);
  }

  // One projection of the fused path: W4A8 (K split ks8) where it runs, else W4A16 (K split ks).
  template <bool G>
  // img_slots: the routed slots whose activations go through images (0: staged in the kernel);
  // img_written: the previous kernel wrote them (down's, by gate_up).
  // passes: > 0, the streamed W4A8 kernel with that many passes a read of the weights (where images run).
  // Returns the W4A8 grid's blocks an expert (each counts itself done: w8_count_done; 0: the W4A16 kernels ran).
  unsigned launch_w4(int ks, int ks8, bool pdl, bool w4a8, int tiles, int passes, int rows, unsigned max_active,
                     cudaStream_t st, W4Args a, int img_slots, bool img_written = false) {
    if (w4a8 && w8(rows, a)) {  // two warpgroups a block: two 64-row tiles, or one split over K
      CUtensorMap map;
      const cuuint64_t dims[2] = {cuuint64_t(a.nsub) * 16, cuuint64_t(s.n_experts) * rows};
      const cuuint64_t strides[1] = {cuuint64_t(a.nsub) * 16};
      const cuuint32_t box[2] = {kW8Row, 64};
      encode_tensor_map(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.blocks, dims, strides, box,
                        CU_TENSOR_MAP_SWIZZLE_128B, G ? "MoE gate_up blocks" : "MoE down blocks");
      if (ks8 == 2) tiles = 1;
      const bool lo = opt.fused_w4a8_terms == 2;
      // (One token's gate_up converts its input itself.)
      const bool img_kernel = !img_written && img_slots > 0 && !(G && a.direct);
      uint8_t* const img = G ? w8_img.get() : w8_img_down.get();
      a.img = img_written || img_kernel ? img : nullptr, a.img_bytes = w8_image_bytes(a.kpad);
      if (img_kernel) {
        const unsigned warps = unsigned(img_slots) * unsigned(a.kpad / 128);
        launch(lo ? w8_image_kernel<G, true> : w8_image_kernel<G, false>, dim3((warps + 7) / 8), dim3(256), 0, st, pdl,
               a, img_slots, img);
      }
      if (passes > 0 && ks8 == 1 && a.img) {  // activations streamed by stage, passes a read of the weights
        const dim3 grid(unsigned((rows + 64 * kW8Consumers - 1) / (64 * kW8Consumers)), max_active);
        launch(pdl ? w8s_fn<G, true>(lo, passes) : w8s_fn<G, false>(lo, passes), grid, dim3(kW8Threads),
               size_t(w8s_smem(a.nsub, passes).total), st, pdl, a, map);
        return grid.x;
      }
      const int per_block = w8_rows_per_block(ks8, tiles);
      const dim3 grid(unsigned((rows + per_block - 1) / per_block), max_active);
      launch(pdl ? w8_fn<G, true>(ks8, lo, tiles) : w8_fn<G, false>(ks8, lo, tiles), grid, dim3(kW8Threads),
             size_t(w8_smem(a.nsub, a.kpad, tiles).total), st, pdl, a, map);
      return grid.x;
    }
    const int per_block = 16 * (8 / ks), ntile = a.ntok > kW4Tokens ? 2 : 1;
    const dim3 grid(unsigned((rows + per_block - 1) / per_block), max_active);
    const size_t smem = size_t(a.ntok) * a.kpad * 2;
    launch(pdl ? w4_fn<G, true>(ks, ntile, silu()) : w4_fn<G, false>(ks, ntile, silu()), grid, dim3(kW4Threads), smem,
           st, pdl, a);
    return 0;
  }

  // The W4A8 kernels' K split (1 or 2 warpgroups a tile) for T tokens: 2 only
  // for one token's slots (H200, run 73: 2 tokens 56.9 us with 1 vs 60.7 with
  // 2 at 120b shapes); a fused_k_split of 4 or 8 asks for 2.
  int w8_split(int T) const {
    if (opt.fused_k_split) return opt.fused_k_split == 1 ? 1 : 2;
    return int64_t(T) * s.topk <= 4 ? 2 : 1;
  }

  // Row tiles a W4A8 warpgroup streams (MoeOptions::fused_w4a8_tiles = 0):
  // 2 from one to 1.5 tokens an expert on average, or below one once the
  // gate_up grid of two-tile blocks (256 rows, two blocks an SM) still fills
  // 1.5 waves with the experts T tokens reach under uniform routing; else 1.
  int w8_tiles(int T) const {
    const int E = s.n_experts;
    const double tpe = double(T) * s.topk / E;
    if (tpe >= 1.0) return tpe < 1.5 ? 2 : 1;
    const double reached = E * (1.0 - std::pow(1.0 - double(s.topk) / E, double(T)));
    return reached * std::ceil(2.0 * s.intermediate / w8_rows_per_block(1, 2)) >= 1.5 * kW8BlocksPerSm * n_sms ? 2 : 1;
  }

  // The W4A8 kernels' activations as images (W4Args::img) for T tokens.
  bool w8_images(int T) const { return opt.fused_w4a8_images && T <= img_tokens; }

  // The fused path takes the W4A8 kernels for T tokens (where a projection's
  // shape allows: w8): without images (staged in the blocks) only up to
  // fused_w4a8_stream_above tokens an expert. Never for the plain SwiGLU:
  // down's two E4M3 terms take one fixed scale (kW8DownInv) that holds only
  // for gpt-oss's bound of 56 (the options stay as the caller set them).
  bool w8_chosen(int T) const {
    const double tpe = double(T) * s.topk / s.n_experts;
    return opt.fused_w4a8 && !silu() && w8_fits && tpe <= opt.fused_w4a8_max_tokens_per_expert &&
           (w8_images(T) || tpe <= opt.fused_w4a8_stream_above) && int64_t(T) * s.topk > opt.fused_w4a8_min_slots;
  }

  // The fused path streams the W4A8 activations for T tokens (K split 1).
  bool w8_streams(int T) const { return w8_chosen(T) && w8_images(T) && w8_split(T) == 1 && w8_passes(T) > 0; }

  // Passes a read of the weights for the streamed W4A8 kernels (0: the
  // whole-image kernels): MoeOptions::fused_w4a8_passes, or auto.
  int w8_passes(int T) const {
    int p = opt.fused_w4a8_passes;
    check(p >= -1 && p <= 4 && p != 3, DZ_ERR_INVALID_ARGUMENT,
          "fused_w4a8_passes must be -1 (off), 0 (auto), 1, 2 or 4, not ", p);
    if (p < 0) return 0;
    if (p == 0) {
      const double tpe = double(T) * s.topk / s.n_experts;
      const int pass = opt.fused_w4a8_terms == 2 ? kW4Tokens / 2 : kW4Tokens;
      if (tpe <= opt.fused_w4a8_stream_above) return 0;
      p = tpe * 1.5 <= 2 * pass ? 2 : 4;  // (one pass a read: whole images are faster)
    }
    return w8s_fits[p == 4 ? 2 : p - 1] ? p : 0;
  }

  // The fused kernels' K split for T tokens.
  int w4_split(int T) const {
    const int ks = opt.fused_k_split ? opt.fused_k_split : (int64_t(T) * s.topk <= 8 ? 4 : 1);
    check(ks == 1 || ks == 4 || ks == 8, DZ_ERR_INVALID_ARGUMENT, "fused_k_split must be 0 (auto), 1, 4 or 8");
    return ks;
  }

  // Launch, optionally as a programmatic dependent of the previous kernel in the stream.
  template <typename... P, typename... A>
  static void launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl, A... args) {
    launch_maybe_pdl(pdl, k, grid, block, smem, st, args...);
  }

  // Experts e[0..n) (their sorted rows consecutive) as GEMM groups: each
  // one's first sorted row and rows, and the rows they span from r0.
  struct ExpertGroups {
    std::vector<int> off, cnt;
    int r0 = 0, nrows = 0;
  };
  static ExpertGroups expert_groups(const int* e, int n, const int* ho) {
    ExpertGroups g;
    for (int i = 0; i < n; ++i) g.off.push_back(ho[e[i]]), g.cnt.push_back(ho[e[i] + 1] - ho[e[i]]);
    g.r0 = g.off[0], g.nrows = g.off.back() + g.cnt.back() - g.r0;
    return g;
  }
  // Between the projections: SwiGLU + 1x128 quantization of sorted rows [r0,
  // r0 + nrows) of d1 into a2 (ld > 0: Mxfp4Gemm's layout, store_1x128;
  // whole: its layout with one scale a row).
  void swiglu_between(int r0, int nrows, const uint16_t* b1, int64_t ld, cudaStream_t st, bool whole = false) {
    if (whole) {
      if (nrows > 0)
        swiglu_quant_row_kernel<<<unsigned(nrows), kQrThreads, 0, st>>>(d1.get(), s.intermediate, int(kpi), b1,
                                                                        silu() ? 1 : 0, s.silu_limit, sorted.get(),
                                                                        row_expert.get(), r0, a2.get(), a2s.get());
      DZ_CUDA_LAUNCH_CHECK();
      return;
    }
    const int nkb_i = int(kpi / 128);
    swiglu_quant_kernel<<<swiglu_quant_blocks(nrows, nkb_i), 256, 0, st>>>(
        d1.get(), s.intermediate, nkb_i, b1, silu() ? 1 : 0, s.silu_limit, sorted.get(), row_expert.get(),
        offsets.get(), r0, nrows, a2.get(), a2s.get(), ld);
    DZ_CUDA_LAUNCH_CHECK();
  }

  // Experts e[0..n): GEMM1 over all of them, SwiGLU + 1x128 quantization of
  // those rows, GEMM2, one grouped launch per projection on st. g1 / g2 carry
  // only the weights of the two projections.
  void grouped_gemms(const int* e, int n, const int* ho, int rows_total, Fp8GroupedArgs g1, Fp8GroupedArgs g2,
                     const uint16_t* b1, cudaStream_t st) {
    const ExpertGroups eg = expert_groups(e, n, ho);
    for (Fp8GroupedArgs* g : {&g1, &g2}) {
      g->rows_total = rows_total, g->offsets = eg.off.data(), g->counts = eg.cnt.data(), g->groups = n;
      g->max_blocks = opt.fp8_grouped_blocks;
    }
    g1.x = a1.get(), g1.xs = a1s.get(), g1.d = d1.get(), g1.n = 2 * s.intermediate, g1.k = int(kph);
    ggemm.run(g1, st);
    swiglu_between(eg.r0, eg.nrows, b1, 0, st);
    g2.x = a2.get(), g2.xs = a2s.get(), g2.d = d2.get(), g2.n = s.hidden, g2.k = int(kpi);
    ggemm.run(g2, st);
  }

  // Whether the FP8 path's GEMMs for T tokens run as Mxfp4Gemm (the experts
  // decoded in the MMA's registers; MoeOptions::fp8_mxfp4_gemm): both
  // projections need exact group tables and K a multiple of 64.
  bool mxfp4_gemm_runs(const MoeWeights& w, int T) const {
    const double tpe = double(T) * s.topk / s.n_experts;
    const bool skip = tpe > opt.fp8_mxfp4_skip_above && tpe <= opt.fp8_mxfp4_skip_upto;
    const bool want =
        opt.fp8_mxfp4_gemm > 0 || (opt.fp8_mxfp4_gemm == 0 && tpe <= opt.fp8_mxfp4_max_tokens_per_expert && !skip);
    return want && opt.fp8_gemm != 1 && w.w1_gmax && w.w2_gmax && s.hidden % 64 == 0 && s.intermediate % 64 == 0 &&
           Mxfp4Gemm::supported();
  }

  // Whether they run with whole-K scales (MoeOptions::fp8_whole_k): both
  // projections need exact whole-K tables.
  bool whole_k_runs(const MoeWeights& w, int T) const {
    const double tpe = double(T) * s.topk / s.n_experts;
    const bool want = opt.fp8_whole_k > 0 ||
                      (opt.fp8_whole_k == 0 && opt.fp8_gemm == 0 && tpe > opt.fp8_whole_k_min_tokens_per_expert);
    return want && opt.fp8_gemm != 1 && w.w1_gk && w.w2_gk && s.hidden % 64 == 0 && s.intermediate % 64 == 0 &&
           Mxfp4Gemm::supported();
  }

  // With whole-K scales, gate_up's epilogue takes gpt-oss's SwiGLU and
  // writes down's E4M3 input itself (MoeOptions::fp8_whole_k_glu).
  bool glu_epilogue() const { return opt.fp8_whole_k_glu && !silu(); }

  // The same with Mxfp4Gemm (X already quantized in its layout; whole: with
  // one scale a row, the weights under the whole-K tables).
  void mxfp4_gemms(const MoeWeights& w, const int* e, int n, const int* ho, int rows_total, cudaStream_t st,
                   bool whole) {
    const int H = s.hidden, I = s.intermediate;
    const ExpertGroups eg = expert_groups(e, n, ho);
    Mxfp4GemmArgs g;
    g.xs_ld = xs_ld, g.rows_total = rows_total, g.experts = e, g.w_experts = s.n_experts;
    g.offsets = eg.off.data(), g.counts = eg.cnt.data(), g.groups = n;
    g.max_blocks = opt.fp8_grouped_blocks, g.tile_tokens = whole ? 0 : opt.fp8_mxfp4_tile_tokens;
    g.x = a1.get(), g.xs = a1s.get(), g.d = d1.get(), g.n = 2 * I, g.k = int(kph);
    g.w = Mxfp4Stack{w.w1_blocks, w.w1_scales, 2 * I, H, w.w1_gmax}, g.gk = whole ? w.w1_gk : nullptr;
    // gpt-oss's SwiGLU in gate_up's epilogue (fp8_whole_k_glu): down's input
    // straight from the MMAs' registers, one scale for every row.
    const bool glu = whole && glu_epilogue();
    if (glu) {
      // Down's K padding past I must read as zeros (E4M3 0x7F would be NaN).
      if (kpi > I)
        DZ_CUDA_CHECK(cudaMemset2DAsync(a2.get() + size_t(eg.r0) * kpi + I, size_t(kpi), 0, size_t(kpi - I),
                                        size_t(eg.nrows), st));
      g.d = nullptr, g.q = a2.get(), g.q_ld = int64_t(kpi), g.bias = w.b1;
    }
    mgemm.run(g, st);
    if (!glu) swiglu_between(eg.r0, eg.nrows, w.b1, xs_ld, st, whole);
    g.q = nullptr, g.bias = nullptr;
    g.x = a2.get(), g.xs = glu ? nullptr : a2s.get(), g.x_scale = glu ? 1.f / kGluInv : 0.f, g.d = d2.get(), g.n = H,
    g.k = int(kpi);
    g.w = Mxfp4Stack{w.w2_blocks, w.w2_scales, H, I, w.w2_gmax}, g.gk = whole ? w.w2_gk : nullptr;
    mgemm.run(g, st);
  }

  void fp8(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out, int accumulate) {
    check(opt.fp8_gemm >= 0 && opt.fp8_gemm <= 2, DZ_ERR_INVALID_ARGUMENT, "fp8_gemm must be 0 (auto), 1 or 2");
    cudaStream_t st = ctx.stream(), aux = ctx.aux_stream();
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    DZ_CUDA_CHECK(cudaMemcpyAsync(h_counts, counts.get(), sizeof(int) * E, cudaMemcpyDeviceToHost, st));
    DZ_CUDA_CHECK(cudaMemcpyAsync(h_counts + E, offsets.get(), sizeof(int) * (E + 1), cudaMemcpyDeviceToHost, st));
    for (int i = 0; i < 2; ++i) DZ_CUDA_CHECK(cudaEventRecord(ev_free[i], st));
    DZ_CUDA_CHECK(cudaStreamSynchronize(st));
    const int* hc = h_counts;
    const int* ho = h_counts + E;
    const int rows_total = ho[E];
    const int nkb_h = int(kph / 128), nkb_i = int(kpi / 128);
    const bool whole = whole_k_runs(w, T);
    const bool regs = whole || mxfp4_gemm_runs(w, T);
    // gate_up's bf16 output, unless its epilogue writes down's input (glu_epilogue).
    if (!(whole && glu_epilogue()))
      grow(d1, size_t(rows_total) * 2 * I, size_t(rows_cap) * 2 * I, "moe gate_up output");
    if (whole) {
      gather_quant_row_kernel<<<unsigned(T + E), kQrThreads, 0, st>>>(x, T, H, int(kph), s.topk, inv.get(),
                                                                      counts.get(), offsets.get(), a1.get(), a1s.get());
    } else {
      gather_quant_kernel<<<gather_quant_blocks(T, nkb_h, E), 256, 0, st>>>(x, T, H, nkb_h, s.topk, E, inv.get(), ids,
                                                                            counts.get(), offsets.get(), a1.get(),
                                                                            a1s.get(), regs ? xs_ld : 0);
    }
    DZ_CUDA_LAUNCH_CHECK();
    std::vector<int> act_e;
    for (int e = 0; e < E; ++e)
      if (hc[e]) act_e.push_back(e);
    if (regs && !act_e.empty()) {
      mxfp4_gemms(w, act_e.data(), int(act_e.size()), ho, rows_total, st, whole);
      act_e.clear();  // nothing left for the paths below
    }
    // Auto: the grouped kernel where it runs, folding inside up to
    // fp8_grouped_max_tokens_per_expert, on the workspace tiles above.
    const bool grouped = opt.fp8_gemm == 2 || (opt.fp8_gemm == 0 && Fp8GroupedGemm::supported());
    // Fold groups of 64 rows for each projection whose weights come with an
    // exact group table (the grouped kernel only: cuBLASLt's scale modes are
    // 1x128 and 128x128).
    const bool grp = grouped && opt.fp8_group_scales;
    const Mxfp4Stack W1{w.w1_blocks, w.w1_scales, 2 * I, H, grp ? w.w1_gmax : nullptr},
        W2{w.w2_blocks, w.w2_scales, H, I, grp ? w.w2_gmax : nullptr};
    const size_t w1_fp8 = size_t(2 * I) * kph, w2_fp8 = size_t(H) * kpi;
    const size_t w1_sc = size_t(fold_scale_count(W1)), w2_sc = size_t(fold_scale_count(W2));
    // The workspace holds tiles of tile_cap experts (options changed later cannot grow it).
    const int tile = std::max(1, std::min(opt.tile_experts, tile_cap));
    check(opt.fp8_ws_tile_n == 128 || opt.fp8_ws_tile_n == 192, DZ_ERR_INVALID_ARGUMENT, "fp8_ws_tile_n ",
          opt.fp8_ws_tile_n, " (128 or 192)");
    const bool fold_in =
        opt.fp8_fold_in_gemm && (opt.fp8_gemm == 2 || double(T) * s.topk / E <= opt.fp8_grouped_max_tokens_per_expert);
    if (grouped && fold_in && !act_e.empty()) {
      // The grouped GEMMs fold the experts' MXFP4 weights themselves: no FP8
      // workspace, no folding pass; one launch per projection for every active expert.
      Fp8GroupedArgs g1, g2;
      g1.w4 = W1, g2.w4 = W2;
      g1.experts = g2.experts = act_e.data();
      g1.w4_experts = g2.w4_experts = E;
      grouped_gemms(act_e.data(), int(act_e.size()), ho, rows_total, g1, g2, w.b1, st);
      act_e.clear();  // nothing left for the workspace tiles below
    }
    if (!act_e.empty()) {  // the experts fold into the workspace (grown once, for tile_cap experts)
      const size_t ws = 2 * size_t(tile_cap) * (w1_fp8 + w2_fp8), ws_sc = 2 * (size_t(tile_cap) * (w1_sc + w2_sc) + 8);
      grow(ws_fp8, ws, ws, "FP8 expert workspace");
      grow(ws_scales, ws_sc, ws_sc, "FP8 expert workspace scales");
    }
    for (size_t t0 = 0, ti = 0; t0 < act_e.size(); t0 += tile, ++ti) {
      const int n = int(std::min<size_t>(tile, act_e.size() - t0));
      const int buf = int(ti % 2);
      uint8_t* f1 = ws_fp8.get() + size_t(buf) * tile * (w1_fp8 + w2_fp8);
      uint8_t* f2 = f1 + size_t(tile) * w1_fp8;
      // Each projection's scales start 16-byte aligned (1x128 ones go by tensor
      // copy; a tile of 64-row group scales need not fill whole 16 bytes).
      const size_t sc1 = (size_t(tile) * w1_sc + 3) / 4 * 4, sc2 = (size_t(tile) * w2_sc + 3) / 4 * 4;
      float* s1 = ws_scales.get() + size_t(buf) * (sc1 + sc2);
      float* s2 = s1 + sc1;
      DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[buf], 0));
      mxfp4_fold_experts(W1, act_e.data() + t0, n, Fp8Slots{f1, s1}, aux);
      mxfp4_fold_experts(W2, act_e.data() + t0, n, Fp8Slots{f2, s2}, aux);
      DZ_CUDA_CHECK(cudaEventRecord(ev_ready[buf], aux));
      DZ_CUDA_CHECK(cudaStreamWaitEvent(st, ev_ready[buf], 0));
      if (grouped) {
        Fp8GroupedArgs g1, g2;
        const bool folds_beside = t0 + size_t(tile) < act_e.size();  // the next tile folds during these GEMMs
        g1.tile_n = g2.tile_n = opt.fp8_ws_tile_n == 128 && folds_beside && narrow_fits() ? 128 : 192;
        g1.w = f1, g1.w_stride = int64_t(w1_fp8), g1.ws = s1, g1.ws_stride = int64_t(w1_sc);
        g2.w = f2, g2.w_stride = int64_t(w2_fp8), g2.ws = s2, g2.ws_stride = int64_t(w2_sc);
        g1.ws_row_group = W1.gmax ? kFoldRowGroup : 1;
        g2.ws_row_group = W2.gmax ? kFoldRowGroup : 1;
        grouped_gemms(act_e.data() + t0, n, ho, rows_total, g1, g2, w.b1, st);
        DZ_CUDA_CHECK(cudaEventRecord(ev_free[buf], st));
        continue;
      }
      // Each expert: GEMM1 -> SwiGLU + 1x128 quantization -> GEMM2, on one of gs.
      const int S = int(gs.size());
      DZ_CUDA_CHECK(cudaEventRecord(ev_fork, st));
      for (int q = 0; q < std::min(S, n); ++q) DZ_CUDA_CHECK(cudaStreamWaitEvent(gs[size_t(q)], ev_fork, 0));
      for (int i = 0; i < n; ++i) {
        const int e = act_e[t0 + i];
        const int off = ho[e], mp = ho[e + 1] - ho[e];
        cudaStream_t q = gs[size_t(i % S)];
        uint8_t* wsp = gemm_ws.get() + size_t(i % S) * kGemmWs;
        gemm.run(a1.get() + size_t(off) * kph, a1s.get() + size_t(nkb_h) * off, f1 + i * w1_fp8, s1 + i * w1_sc,
                 d1.get() + size_t(off) * 2 * I, mp, 2 * I, int(kph), q, wsp, kGemmWs);
        swiglu_between(off, mp, w.b1, 0, q);
        gemm.run(a2.get() + size_t(off) * kpi, a2s.get() + size_t(nkb_i) * off, f2 + i * w2_fp8, s2 + i * w2_sc,
                 d2.get() + size_t(off) * H, mp, H, int(kpi), q, wsp, kGemmWs);
      }
      for (int q = 0; q < std::min(S, n); ++q) {
        DZ_CUDA_CHECK(cudaEventRecord(ev_join[size_t(q)], gs[size_t(q)]));
        DZ_CUDA_CHECK(cudaStreamWaitEvent(st, ev_join[size_t(q)], 0));
      }
      DZ_CUDA_CHECK(cudaEventRecord(ev_free[buf], st));
    }
    // Down's bias added here (none without w.b2).
    const bool v8 = vec8(d2.get(), w.b2, out);
    const auto comb =
        w.b2 ? (v8 ? combine_kernel<__nv_bfloat16, true, false, true> : combine_kernel<__nv_bfloat16, true>)
             : (v8 ? combine_kernel<__nv_bfloat16, false, false, true> : combine_kernel<__nv_bfloat16, false>);
    launch(comb, v8 ? combine_grid(T, H, 8, 128) : combine_grid(T, H), dim3(v8 ? 128 : 256), 0, st, false, d2.get(),
           inv.get(), ids, gw, s.topk, w.b2, H, out, accumulate);
    // Later calls must not refold into a buffer the aux stream may still be writing.
    DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[0], 0));
    DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[1], 0));
  }
};

MoeLayer::MoeLayer(Context& ctx, const MoeShape& shape, int max_tokens, const MoeOptions& opt)
    : p_(std::make_unique<Impl>(ctx, shape, max_tokens, opt)), shape_(shape) {}

MoeLayer::~MoeLayer() = default;

MoeOptions& MoeLayer::options() { return p_->opt; }

MoePath MoeLayer::choose(int T) const {
  const double per_expert = double(T) * shape_.topk / shape_.n_experts;
  if (per_expert <= p_->opt.fused_max_tokens_per_expert) return MoePath::kFused;
  return per_expert <= p_->opt.fused_streamed_max_tokens_per_expert && p_->w8_streams(T) ? MoePath::kFused
                                                                                         : MoePath::kFp8;
}

void MoeLayer::forward(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out,
                       MoePath path, bool accumulate) {
  check(T >= 1 && T <= p_->max_tokens, DZ_ERR_INVALID_ARGUMENT, "MoeLayer::forward: ", T, " tokens (scratch sized for ",
        p_->max_tokens, ")");
  // (The biases may be null: zero.)
  check(x && ids && gw && out && w.w1_blocks && w.w1_scales && w.w2_blocks && w.w2_scales, DZ_ERR_INVALID_ARGUMENT,
        "MoeLayer::forward: null pointer");
  if (path == MoePath::kAuto) path = choose(T);
  if (!(path == MoePath::kFused && (p_->direct(T) || p_->streams_one(T, w))))
    p_->route(ids, T, path == MoePath::kFused && T <= kRouteConvertsX ? x : nullptr);
  if (path == MoePath::kFused)
    p_->fused(w, x, ids, gw, T, out, accumulate ? 1 : 0);
  else
    p_->fp8(w, x, ids, gw, T, out, accumulate ? 1 : 0);
}

size_t MoeLayer::fp8_workspace_bytes() const { return p_->ws_fp8.bytes() + p_->ws_scales.bytes(); }

size_t MoeLayer::scratch_bytes() const {
  const Impl& q = *p_;
  return q.counts.bytes() + q.offsets.bytes() + q.sorted.bytes() + q.row_expert.bytes() + q.inv.bytes() +
         q.active.bytes() + q.xh.bytes() + q.xs.bytes() + q.act16.bytes() + q.y32.bytes() + q.a1.bytes() +
         q.a1s.bytes() + q.a2.bytes() + q.a2s.bytes() + q.d1.bytes() + q.d2.bytes() + q.w8_img.bytes() +
         q.w8_img_down.bytes() + q.ot_img.bytes() + q.ot_counts.bytes();
}

int* MoeLayer::error_flag() { return p_->err.get(); }

int MoeLayer::take_error() {
  int h = 0;
  DZ_CUDA_CHECK(cudaMemcpyAsync(&h, p_->err.get(), sizeof h, cudaMemcpyDeviceToHost, p_->ctx.stream()));
  DZ_CUDA_CHECK(cudaMemsetAsync(p_->err.get(), 0, sizeof(int), p_->ctx.stream()));
  DZ_CUDA_CHECK(cudaStreamSynchronize(p_->ctx.stream()));
  return h;
}

}  // namespace dz::cuda
