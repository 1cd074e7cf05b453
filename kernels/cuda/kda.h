// Kimi Delta Attention on the GPU: the functions of cpu/kda.h for a batch of
// sequences (decode steps, or runs of tokens of any lengths).
//  - kda_recurrent: the recurrence, the fp32 state [head][key channel][value
//    channel] read from each sequence's state slot and written back (or to
//    another slot). One block a (head, sequence), two threads a value channel
//    holding its column of S in registers across the tokens: a decode step
//    moves each state once in and once out of HBM.
//  - kda_short_conv_silu, kda_prepare, kda_output_gate: the elementwise and
//    per-head steps around it (cpu::short_conv_silu, kda_prepare,
//    kda_output_gate).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

struct KdaRecurrent {
  int n_heads = 0;
  int head_dim = 0;  // 16, 32, 64 or 128 (d_k = d_v)
  int batch = 0;
  int64_t n = 0;  // tokens each sequence (ignored where seq_first is set)
  // Prepared inputs (cpu::kda_prepare's): q, k L2-normalised (q also times
  // d_k^-0.5), g the per-channel log-decay, beta in (0, 1). q, k, v: rows of
  // stride ld, g of stride ld_g, each H*D wide; beta [rows, H]. Device pointers.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  int64_t ld = 0;
  int64_t ld_g = 0;  // g's row stride (0: ld)
  const float* beta = nullptr;
  // [batch + 1] device row offsets: sequence b's token t is row seq_first[b] + t,
  // its token count seq_first[b + 1] - seq_first[b] (ragged). Null: row b n + t,
  // n tokens each.
  const int32_t* seq_first = nullptr;
  float* const* state = nullptr;  // [batch] device array: where each sequence's [H, D, D] state is written
  // [batch] device array: where each sequence's state is read from (null:
  // state; state_in[b] may equal state[b], not another sequence's). Lets a
  // forward pass read a committed state and write a new one; a sequence of no
  // tokens copies it across.
  const float* const* state_in = nullptr;
  int64_t state_offset = 0;  // floats added to every state / state_in pointer (a layer's part of a state slot)
  float* out = nullptr;      // [rows, H*D], row numbered as the inputs'
};

// Throws naming what the kernel cannot take. Stream-ordered.
void kda_recurrent(const KdaRecurrent& a, cudaStream_t s);

// Causal depthwise convolution (width K) + SiLU over ragged sequences,
// continuing each sequence's history, as cpu::short_conv_silu per sequence.
struct KdaConv {
  int64_t channels = 0;  // 3 H D ([q | k | v] channels)
  int kernel = 4;        // K (2..8)
  int batch = 0;
  const int32_t* seq_first = nullptr;  // [batch + 1] device row offsets (required)
  const float* x = nullptr;            // [rows, ld] inputs (device)
  int64_t ld = 0;
  const float* w = nullptr;  // [channels, K] fp32 (device)
  // [batch] device arrays of per-sequence state bases; the history, at
  // + hist_offset, is [(K - 1) x channels] oldest first. hist_in[b] may equal
  // hist_out[b] (in place), not another sequence's.
  const float* const* hist_in = nullptr;
  float* const* hist_out = nullptr;
  int64_t hist_offset = 0;  // floats
  float* y = nullptr;       // [rows, ld] outputs (device), must not alias x
  // The longest sequence's token count, or more (0: unknown). The tokens are
  // independent given their K - 1 predecessors, so with it they are split in
  // chunks across threads; without, one thread runs a sequence's channel.
  int64_t max_tokens = 0;
};
void kda_short_conv_silu(const KdaConv& a, cudaStream_t s);

// cpu::kda_prepare over n_rows rows, in place: q, k per head L2-normalised
// (x / sqrt(sum x^2 + 1e-6)), q also times head_dim^-0.5; g = -exp(a_log[h])
// softplus(g + dt_bias[h D + c]); beta = sigmoid(beta). q, k: row stride ld;
// g: row stride ld_g; beta [n_rows, n_heads]. Device pointers; head_dim 1..256.
void kda_prepare(int n_heads, int head_dim, int64_t n_rows, float* q, float* k, int64_t ld, float* g, int64_t ld_g,
                 const float* a_log, const float* dt_bias, float* beta, cudaStream_t s);

// cpu::kda_output_gate, written as bf16 (round to nearest even) for the o
// projection: out[r, h D + c] = bf16(w[c] (o[r, h, c] rsqrt(mean_c o^2 + eps))
// sigmoid(gate[r, h D + c])). o: [n_rows, H*D] contiguous, gate row stride
// ld_gate, out [n_rows, H*D]. Device pointers; head_dim 1..256.
void kda_output_gate(int n_heads, int head_dim, int64_t n_rows, const float* o, const float* gate, int64_t ld_gate,
                     const float* w, float eps, uint16_t* out_bf16, cudaStream_t s);

}  // namespace dz::cuda
