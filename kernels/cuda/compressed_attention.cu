#include <cuda_bf16.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/compressed_attention.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxHeadDim = 512, kPer = kMaxHeadDim / 32;

__device__ __forceinline__ float* entry_at(const EntryPages& p, int row, int64_t w, int c) {
  const int tf = int(p.token_bytes / 4);
  const int64_t t = w * p.rate + c / tf;
  uint8_t* page = p.rows[row][t / p.page_tokens];
  return reinterpret_cast<float*>(page + size_t(t % p.page_tokens) * p.token_bytes) + c % tf;
}

// Entry w's channels [off, off + n) into dst, by one warp: one page lookup a
// token slot the entry spans, then the slot's floats (contiguous) by the lanes.
__device__ __forceinline__ void warp_load_entry(const EntryPages& p, int row, int64_t w, int off, int n, float* dst,
                                                int lane) {
  const int tf = int(p.token_bytes / 4);
  int64_t t = w * p.rate + off / tf;
  int o = off % tf;
  uint8_t* const* pages = p.rows[row];
  for (int c = 0; c < n; ++t) {
    const int len = min(tf - o, n - c);
    const float* src =
        reinterpret_cast<const float*>(pages[t / p.page_tokens] + size_t(t % p.page_tokens) * p.token_bytes) + o;
    for (int i = lane; i < len; i += 32) dst[c + i] = src[i];
    c += len, o = 0;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One channel of a pool (cpu/compress.h): running max, sum and weighted sum; sum 0: empty.
struct Pool {
  float mx, sum, acc;
};

// cpu::pool_push for one channel.
__device__ __forceinline__ void pool_push(Pool& p, float v, float g) {
  if (p.sum == 0) {
    p.mx = g, p.sum = 1, p.acc = v;
  } else if (g > p.mx) {
    const float r = float(exp(double(p.mx) - g));
    p.sum = p.sum * r + 1, p.acc = p.acc * r + v, p.mx = g;
  } else {
    const float e = float(exp(double(g) - p.mx));
    p.sum += e, p.acc += e * v;
  }
}

constexpr int kCompressThreads = 256, kCompressCh = 4;  // channels a thread: dim <= 1024

// One compressor's pools over one segment of a pass, each thread its
// channels' (in registers). Tokens are pushed in the order the serial
// definition pushes them, so every entry and state is the same whichever
// pieces and passes a sequence arrives in. At the pass's first position
// `start`, W0 = start / rate is the open window: the state holds entry W0's
// pool (u = 0: Ca of window W0 - 1, then Cb of W0's earlier tokens) and, with
// overlap, entry W0 + 1's (u = 1: Ca of W0's earlier tokens).
struct SegmentPools {
  const Compressor& c;
  int rf, D, S;
  int64_t start, rate, W0;
  const float* st;

  __device__ void load(Pool (&p)[kCompressCh], int u) const {
#pragma unroll
    for (int j = 0; j < kCompressCh; ++j) {
      const int ch = threadIdx.x + j * kCompressThreads;
      p[j] = ch < D ? Pool{st[u * 3 * D + ch], st[u * 3 * D + D + ch], st[u * 3 * D + 2 * D + ch]} : Pool{0, 0, 0};
    }
  }
  // Positions [t0, t1] of this pass, part 0 (Ca, or the only one) or 1 (Cb).
  __device__ void push(Pool (&p)[kCompressCh], int64_t t0, int64_t t1, int part) const {
    for (int64_t t = max(t0, start); t <= t1; ++t) {
      const size_t r = size_t(rf + (t - start));
      const float* __restrict__ kv = c.kv + r * c.ld + part * D;
      const float* __restrict__ g = c.gate + r * c.ld + part * D;
      const float* __restrict__ b = c.bias + size_t(t % rate) * S * D + part * D;
#pragma unroll
      for (int j = 0; j < kCompressCh; ++j) {
        const int ch = threadIdx.x + j * kCompressThreads;
        if (ch < D) pool_push(p[j], kv[ch], g[ch] + b[ch]);
      }
    }
  }
  // Entry w's pool over the tokens up to position `last`.
  __device__ void entry(Pool (&p)[kCompressCh], int64_t w, int64_t last) const {
    const int cb = c.overlap ? 1 : 0;
    const int64_t open = w * rate, close = min(last, (w + 1) * rate - 1);
    if (w == W0) {
      load(p, 0);
    } else if (c.overlap && w == W0 + 1) {
      load(p, 1);
      push(p, start, min(last, open - 1), 0);
    } else {
#pragma unroll
      for (int j = 0; j < kCompressCh; ++j) p[j] = Pool{0, 0, 0};
      if (c.overlap) push(p, open - rate, min(last, open - 1), 0);
    }
    push(p, open, close, cb);
  }
};

// Block (segment, j, compressor): entry W0 + j, if the pass closes it, pooled,
// normalised (RMSNorm), its rotary channels turned (RoPE at the window's first
// position: the closing row's tables) and written to the pages. Entries are
// independent, so a long prefill's spread over the GPU.
__global__ void __launch_bounds__(kCompressThreads) compress_entries_kernel(CompressPass a) {
  const Compressor& c = a.c[blockIdx.z];
  const int seg = blockIdx.x, rf = a.seg_first[seg], rl = a.seg_first[seg + 1] - 1, D = c.dim;
  const int64_t rate = a.pages.rate, start = a.pos[rf], end = a.pos[rl], W0 = start / rate;
  const int64_t w = W0 + blockIdx.y;
  if (w >= (end + 1) / rate) return;
  const SegmentPools sp{c, rf, D, c.overlap ? 2 : 1, start, rate, W0, a.state[seg] + c.state_off};
  Pool p[kCompressCh];
  sp.entry(p, w, (w + 1) * rate - 1);
  extern __shared__ float out[];  // [D], then the block's partial sums
  float* red = out + D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss = 0;
#pragma unroll
  for (int j = 0; j < kCompressCh; ++j) {
    const int ch = threadIdx.x + j * kCompressThreads;
    if (ch >= D) continue;
    const float v = p[j].sum == 0 ? 0.f : p[j].acc / p[j].sum;
    out[ch] = v;
    ss += v * v;
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float tot = 0;
  for (int k = 0; k < kCompressThreads / 32; ++k) tot += red[k];
  const float inv = rsqrtf(tot / float(D) + a.eps);
  for (int ch = threadIdx.x; ch < D; ch += kCompressThreads) out[ch] = c.norm[ch] * (out[ch] * inv);
  __syncthreads();
  const size_t r = size_t(rf + ((w + 1) * rate - 1 - start));  // the closing row
  for (int i = threadIdx.x; i < a.rope_half; i += kCompressThreads) {
    float* v = out + D - 2 * a.rope_half + 2 * i;
    const float cs = a.cos[r * a.rope_half + i], sn = a.sin[r * a.rope_half + i];
    const float x0 = v[0], x1 = v[1];
    v[0] = x0 * cs - x1 * sn;
    v[1] = x1 * cs + x0 * sn;
  }
  __syncthreads();
  for (int ch = threadIdx.x; ch < D; ch += kCompressThreads) *entry_at(a.pages, int(r), w, c.entry_off + ch) = out[ch];
}

// Block (segment, compressor), after compress_entries_kernel (which reads the
// state this writes): the pools open at the pass's end, W1 = (end + 1) / rate:
// entry W1's over the tokens so far, and with overlap entry W1 + 1's (Ca of
// window W1's tokens so far).
__global__ void __launch_bounds__(kCompressThreads) compress_state_kernel(CompressPass a) {
  const Compressor& c = a.c[blockIdx.y];
  const int seg = blockIdx.x, rf = a.seg_first[seg], rl = a.seg_first[seg + 1] - 1, D = c.dim;
  const int64_t rate = a.pages.rate, start = a.pos[rf], end = a.pos[rl], W0 = start / rate, W1 = (end + 1) / rate;
  float* st = a.state[seg] + c.state_off;
  const SegmentPools sp{c, rf, D, c.overlap ? 2 : 1, start, rate, W0, st};
  Pool p0[kCompressCh], p1[kCompressCh];
  sp.entry(p0, W1, end);
  if (c.overlap) {
    if (W1 == W0) {
      sp.load(p1, 1);
    } else {
#pragma unroll
      for (int j = 0; j < kCompressCh; ++j) p1[j] = Pool{0, 0, 0};
    }
    sp.push(p1, W1 * rate, end, 0);
  }
#pragma unroll
  for (int j = 0; j < kCompressCh; ++j) {
    const int ch = threadIdx.x + j * kCompressThreads;
    if (ch >= D) continue;
    st[ch] = p0[j].mx, st[D + ch] = p0[j].sum, st[2 * D + ch] = p0[j].acc;
    if (c.overlap) st[3 * D + ch] = p1[j].mx, st[4 * D + ch] = p1[j].sum, st[5 * D + ch] = p1[j].acc;
  }
}

constexpr int kScoreWarps = 8, kScoreEntries = 64;

__global__ void __launch_bounds__(kScoreWarps * 32) entry_scores_kernel(EntryScores a) {
  const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nv = a.n_visible[r], w0 = int64_t(blockIdx.y) * kScoreEntries;
  if (w0 >= nv) return;
  const int H = a.heads, D = a.dim, QD = D + 1;  // q rows padded against bank conflicts
  extern __shared__ float sh[];
  float* q = sh;
  float* wh = q + H * QD;
  float* keys = wh + H;
  for (int i = threadIdx.x; i < H * D; i += blockDim.x) q[(i / D) * QD + i % D] = a.q[size_t(r) * H * D + i];
  for (int h = threadIdx.x; h < H; h += blockDim.x) wh[h] = a.w[size_t(r) * H + h] * a.wscale;
  __syncthreads();
  float* key = keys + warp * D;
  const int64_t w1 = min(nv, w0 + kScoreEntries);
  for (int64_t w = w0 + warp; w < w1; w += kScoreWarps) {
    warp_load_entry(a.pages, r, w, a.key_off, D, key, lane);
    __syncwarp();
    float s = 0;
    for (int h = lane; h < H; h += 32) {
      const float* qh = q + h * QD;
      float d = 0;
      for (int c = 0; c < D; ++c) d += qh[c] * key[c];
      if (d > 0) s += wh[h] * (d * a.scale);
    }
    s = warp_sum(s);
    if (lane == 0) a.scores[size_t(r) * a.ld + w] = s;
    __syncwarp();
  }
}

// A block a row and kAttnHeads heads, a warp a head: the keys (K = V, one head
// shared by all) are staged kKeyTile at a time in shared memory (a warp a key,
// one page lookup a token slot), so each is read from memory once for the
// block's heads, not once a head; a warp scores a tile's keys together and
// takes one online-softmax step a tile.
constexpr int kAttnHeads = 8, kKeyTile = 16;

__global__ void __launch_bounds__(kAttnHeads * 32) sink_attention_kernel(SinkAttention a) {
  __shared__ float keys[kKeyTile][kMaxHeadDim];
  __shared__ bool valid[kKeyTile];
  const int r = blockIdx.x, lane = threadIdx.x & 31, h = blockIdx.y * kAttnHeads + (threadIdx.x >> 5);
  const bool active = h < a.n_heads;  // every warp stages keys; only these attend
  const int D = a.head_dim, nper = D / 32;
  float q[kPer], acc[kPer];
  const float* qr = a.q + (size_t(r) * a.n_heads + (active ? h : 0)) * D;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    q[i] = active && i < nper ? qr[lane + 32 * i] : 0.f;
    acc[i] = 0;
  }
  float m = active ? a.sinks[h] : 0.f, l = 1;  // the sink: exp(sink - m) in the denominator, no value
  const int64_t pos = a.pos[r];
  const int seg = a.row_seg[r], rf = a.seg_first[seg];
  const int64_t start = a.pos[rf], p0 = max(int64_t(0), pos - a.window + 1), n_win = pos - p0 + 1;
  const float* ring = a.state[seg] + a.ring_off;
  const int64_t n_ent = a.entries == SinkAttention::kNone      ? 0
                        : a.entries == SinkAttention::kVisible ? a.n_visible[r]
                                                               : a.k;
  // Key j: the window's positions p0 .. pos (this pass's rows, older ones from the ring), then the entries
  // (picks are -1 padded: skipped).
  auto entry = [&](int64_t j) {
    return a.entries == SinkAttention::kVisible ? j : int64_t(a.sel[size_t(r) * a.k + j]);
  };
  const int64_t n = n_win + n_ent;
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int nt = int(min(int64_t(kKeyTile), n - j0));
    for (int t = threadIdx.x >> 5; t < nt; t += kAttnHeads) {  // a warp a key
      const int64_t j = j0 + t;
      bool ok = true;
      if (j < n_win) {
        const int64_t p = p0 + j;
        const float* src = p >= start ? a.kv + size_t(rf + (p - start)) * D : ring + size_t(p % a.window) * D;
        for (int c = lane; c < D; c += 32) keys[t][c] = src[c];
      } else if (const int64_t w = entry(j - n_win); w >= 0) {
        warp_load_entry(a.pages, r, w, 0, D, keys[t], lane);
      } else {
        ok = false;
      }
      if (lane == 0) valid[t] = ok;
    }
    __syncthreads();
    if (active) {  // the tile's scores at once (independent sums), then one online-softmax step
      float sc[kKeyTile];
#pragma unroll
      for (int t = 0; t < kKeyTile; ++t) {
        float d = 0;
        if (t < nt)
#pragma unroll
          for (int i = 0; i < kPer; ++i)
            if (i < nper) d += q[i] * keys[t][lane + 32 * i];
        sc[t] = d;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int t = 0; t < kKeyTile; ++t) sc[t] += __shfl_xor_sync(0xffffffffu, sc[t], o);
      float mn = m;
#pragma unroll
      for (int t = 0; t < kKeyTile; ++t)
        if (t < nt && valid[t]) mn = fmaxf(mn, sc[t] *= a.scale);
      const float corr = __expf(m - mn);
      l *= corr;
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[i] *= corr;
#pragma unroll
      for (int t = 0; t < kKeyTile; ++t) {
        if (t >= nt || !valid[t]) continue;
        const float p = __expf(sc[t] - mn);
        l += p;
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (i < nper) acc[i] += p * keys[t][lane + 32 * i];
      }
      m = mn;
    }
    __syncthreads();
  }
  if (!active) return;
  float* o = a.out + (size_t(r) * a.n_heads + h) * D;
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (i < nper) o[lane + 32 * i] = acc[i] * inv;
}

__global__ void window_store_kernel(const float* __restrict__ kv, int D, int W, const int32_t* __restrict__ seg_first,
                                    const int64_t* __restrict__ pos, float* const* state, int64_t ring_off) {
  const int seg = blockIdx.x, rf = seg_first[seg], rl = seg_first[seg + 1] - 1;
  const int64_t start = pos[rf], p = pos[rl] - int64_t(blockIdx.y);
  if (p < start) return;
  const float* src = kv + size_t(rf + (p - start)) * D;
  float* dst = state[seg] + ring_off + size_t(p % W) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = src[c];
}

__global__ void rope_rows_kernel(float* x, int n_vec, int64_t row_stride, int64_t vec_stride, int offset, int half,
                                 const float* __restrict__ cos, const float* __restrict__ sin, float sign) {
  const int r = blockIdx.x;
  for (int idx = blockIdx.y * blockDim.x + threadIdx.x; idx < n_vec * half; idx += gridDim.y * blockDim.x) {
    const int v = idx / half, i = idx % half;
    float* p = x + size_t(r) * row_stride + size_t(v) * vec_stride + offset + 2 * i;
    const float cs = cos[size_t(r) * half + i], sn = sign * sin[size_t(r) * half + i];
    const float x0 = p[0], x1 = p[1];
    p[0] = x0 * cs - x1 * sn;
    p[1] = x1 * cs + x0 * sn;
  }
}

__global__ void regroup_kernel(const float* __restrict__ src, int rows, int groups, int C, __nv_bfloat16* dst,
                               bool split) {
  const size_t n = size_t(rows) * groups * C;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    // i indexes the [r][g][c] order.
    const int c = int(i % C), g = int((i / C) % groups);
    const size_t r = i / (size_t(C) * groups), gi = (size_t(g) * rows + r) * C + c;
    if (split)
      dst[gi] = __float2bfloat16_rn(src[i]);
    else
      dst[i] = __float2bfloat16_rn(src[gi]);
  }
}

}  // namespace

void compress(const CompressPass& a, cudaStream_t s) {
  if (a.n_seg <= 0) return;
  int dmax = 0;
  for (int i = 0; i < a.n_comp; ++i) dmax = std::max(dmax, a.c[i].dim);
  check(dmax <= kCompressThreads * kCompressCh, DZ_ERR_UNSUPPORTED, "compress: entry width ", dmax, " (at most ",
        kCompressThreads * kCompressCh, ")");
  const size_t smem = (size_t(dmax) + kCompressThreads / 32) * sizeof(float);
  if (a.max_close > 0)
    compress_entries_kernel<<<dim3(unsigned(a.n_seg), unsigned(a.max_close), unsigned(a.n_comp)), kCompressThreads,
                              smem, s>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
  compress_state_kernel<<<dim3(unsigned(a.n_seg), unsigned(a.n_comp)), kCompressThreads, 0, s>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
}

void entry_scores(const EntryScores& a, cudaStream_t s) {
  if (a.n_rows <= 0 || a.max_visible <= 0) return;
  const size_t smem = (size_t(a.heads) * (a.dim + 1) + a.heads + size_t(kScoreWarps) * a.dim) * sizeof(float);
  check(smem <= 200 * 1024, DZ_ERR_UNSUPPORTED, "entry_scores: ", a.heads, " indexer heads of ", a.dim,
        " (too large for shared memory)");
  if (smem > 48 * 1024)
    DZ_CUDA_CHECK(cudaFuncSetAttribute(entry_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(a.n_rows), unsigned((a.max_visible + kScoreEntries - 1) / kScoreEntries));
  entry_scores_kernel<<<grid, kScoreWarps * 32, smem, s>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
}

void sink_attention(const SinkAttention& a, cudaStream_t s) {
  if (a.n_rows <= 0) return;
  check(a.head_dim % 32 == 0 && a.head_dim <= kMaxHeadDim, DZ_ERR_UNSUPPORTED, "sink_attention: head_dim ", a.head_dim,
        " (a multiple of 32 up to ", kMaxHeadDim, ")");
  const dim3 grid(unsigned(a.n_rows), unsigned((a.n_heads + kAttnHeads - 1) / kAttnHeads));
  sink_attention_kernel<<<grid, kAttnHeads * 32, 0, s>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
}

void window_store(const float* kv, int dim, int window, int n_seg, const int32_t* seg_first, const int64_t* pos,
                  float* const* state, int64_t ring_off, cudaStream_t s) {
  if (n_seg <= 0) return;
  window_store_kernel<<<dim3(unsigned(n_seg), unsigned(window)), 128, 0, s>>>(kv, dim, window, seg_first, pos, state,
                                                                              ring_off);
  DZ_CUDA_LAUNCH_CHECK();
}

void rope_interleaved_rows(float* x, int n_rows, int n_vec, int64_t row_stride, int64_t vec_stride, int offset,
                           int half, const float* cos, const float* sin, bool inverse, cudaStream_t s) {
  if (n_rows <= 0 || half <= 0) return;
  // A block a row and 128 of its pairs: a decode step has one row, whose pairs one block would load one
  // round trip after another (7 us a call on an H100).
  const dim3 grid(unsigned(n_rows), unsigned(std::min((int64_t(n_vec) * half + 127) / 128, int64_t(64))));
  rope_rows_kernel<<<grid, 128, 0, s>>>(x, n_vec, row_stride, vec_stride, offset, half, cos, sin, inverse ? -1.f : 1.f);
  DZ_CUDA_LAUNCH_CHECK();
}

void split_groups_bf16(const float* src, int rows, int groups, int C, uint16_t* dst, cudaStream_t s) {
  if (rows <= 0) return;
  regroup_kernel<<<512, 256, 0, s>>>(src, rows, groups, C, reinterpret_cast<__nv_bfloat16*>(dst), true);
  DZ_CUDA_LAUNCH_CHECK();
}

void join_groups_bf16(const float* src, int rows, int groups, int C, uint16_t* dst, cudaStream_t s) {
  if (rows <= 0) return;
  regroup_kernel<<<512, 256, 0, s>>>(src, rows, groups, C, reinterpret_cast<__nv_bfloat16*>(dst), false);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
