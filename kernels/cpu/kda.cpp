#include "cpu/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace dz::cpu {

namespace {

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

void l2_normalise(float* x, int n, double scale) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const double s = scale / std::sqrt(ss + 1e-6);
  for (int i = 0; i < n; ++i) x[i] = float(x[i] * s);
}

}  // namespace

void short_conv_silu(const float* x, int64_t n, int64_t channels, int64_t ld, const float* w, int K, float* hist,
                     float* y) {
  const int64_t H = K - 1;  // history rows
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < channels; ++c) {
      double acc = 0;
      for (int i = 0; i < K; ++i) {
        const int64_t src = t - H + i;  // input row; negative rows come from the history
        const float u = src >= 0 ? x[src * ld + c] : hist[(H + src) * channels + c];
        acc += double(w[c * K + i]) * u;
      }
      y[t * ld + c] = float(silu(acc));
    }
  // The history becomes the last H rows of [hist; x].
  std::vector<float> last(size_t(H * channels));
  for (int64_t r = 0; r < H; ++r) {
    const int64_t src = n - H + r;
    for (int64_t c = 0; c < channels; ++c)
      last[size_t(r * channels + c)] = src >= 0 ? x[src * ld + c] : hist[(H + src) * channels + c];
  }
  std::copy(last.begin(), last.end(), hist);
}

void kda_prepare(const KdaDims& d, int64_t n, float* q, float* k, int64_t ld, float* g, int64_t ld_g,
                 const float* a_log, const float* dt_bias, float* beta) {
  const int D = d.head_dim;
  const double qscale = 1.0 / std::sqrt(double(D));
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < d.n_heads; ++h) {
      l2_normalise(q + t * ld + h * D, D, qscale);
      l2_normalise(k + t * ld + h * D, D, 1.0);
      const double a = std::exp(double(a_log[h]));
      float* gh = g + t * ld_g + h * D;
      for (int c = 0; c < D; ++c) gh[c] = float(-a * softplus(double(gh[c]) + dt_bias[h * D + c]));
      beta[t * d.n_heads + h] = float(sigmoid(beta[t * d.n_heads + h]));
    }
}

void kda_recurrent(const KdaDims& d, const float* q, const float* k, const float* v, int64_t ld, const float* g,
                   int64_t ld_g, const float* beta, int64_t n, float* state, float* out, ThreadPool* pool) {
  const int D = d.head_dim, NH = d.n_heads;
  parallel_for(pool, size_t(NH), 1, [&](size_t h0, size_t h1) {
    std::vector<double> mem(static_cast<size_t>(D)), o(static_cast<size_t>(D));
    for (size_t h = h0; h < h1; ++h) {
      float* S = state + h * D * D;
      for (int64_t t = 0; t < n; ++t) {
        const float *qt = q + t * ld + h * D, *kt = k + t * ld + h * D, *vt = v + t * ld + h * D;
        const float* gt = g + t * ld_g + h * D;
        std::fill(mem.begin(), mem.end(), 0.0);
        for (int r = 0; r < D; ++r) {  // decay key channel r, then read S'^T k
          const float decay = float(std::exp(double(gt[r])));
          float* row = S + r * D;
          for (int c = 0; c < D; ++c) {
            row[c] *= decay;
            mem[size_t(c)] += double(row[c]) * kt[r];
          }
        }
        const double b = beta[t * NH + int64_t(h)];
        for (int c = 0; c < D; ++c) mem[size_t(c)] = b * (vt[c] - mem[size_t(c)]);  // the delta
        float* ot = out + t * int64_t(NH) * D + int64_t(h) * D;
        std::fill(o.begin(), o.end(), 0.0);
        for (int r = 0; r < D; ++r) {
          float* row = S + r * D;
          for (int c = 0; c < D; ++c) {
            row[c] = float(row[c] + double(kt[r]) * mem[size_t(c)]);
            o[size_t(c)] += double(row[c]) * qt[r];
          }
        }
        for (int c = 0; c < D; ++c) ot[c] = float(o[size_t(c)]);
      }
    }
  });
}

void kda_chunked(const KdaDims& d, const float* q, const float* k, const float* v, int64_t ld, const float* g,
                 int64_t ld_g, const float* beta, int64_t n, float* state, float* out, ThreadPool* pool, int chunk) {
  const int D = d.head_dim, NH = d.n_heads;
  const size_t C = size_t(std::max(1, chunk)), DD = size_t(D) * size_t(D);
  parallel_for(pool, size_t(NH), 1, [&](size_t h0, size_t h1) {
    std::vector<double> S(DD), G(C * size_t(D)), A(C * C), B(C * C), U(C * size_t(D)), Sn(DD),
        o(static_cast<size_t>(D));
    for (size_t h = h0; h < h1; ++h) {
      float* Sf = state + h * DD;
      for (size_t i = 0; i < DD; ++i) S[i] = Sf[i];
      for (int64_t c0 = 0; c0 < n; c0 += int64_t(C)) {
        const size_t m = size_t(std::min<int64_t>(int64_t(C), n - c0));
        auto row = [&](const float* base, int64_t stride, size_t i) {
          return base + (c0 + int64_t(i)) * stride + h * D;
        };
        // G: the in-chunk cumulative log-decay per key channel.
        for (size_t i = 0; i < m; ++i)
          for (int r = 0; r < D; ++r)
            G[i * D + size_t(r)] = (i ? G[(i - 1) * D + size_t(r)] : 0.0) + row(g, ld_g, i)[r];
        // A[i][j] = sum_r k_i k_j e^(G_i - G_j) (j < i), B[i][j] the same with q_i (j <= i).
        for (size_t i = 0; i < m; ++i) {
          const float *qi = row(q, ld, i), *ki = row(k, ld, i);
          for (size_t j = 0; j <= i; ++j) {
            const float* kj = row(k, ld, j);
            double a = 0, b = 0;
            for (int r = 0; r < D; ++r) {
              const double w = double(kj[r]) * std::exp(G[i * D + size_t(r)] - G[j * D + size_t(r)]);
              a += ki[r] * w;
              b += qi[r] * w;
            }
            A[i * C + j] = a;
            B[i * C + j] = b;
          }
        }
        // New values: u_i = beta_i (v_i - (e^G_i o k_i)^T S0 - sum_{j<i} A_ij u_j).
        for (size_t i = 0; i < m; ++i) {
          const float *ki = row(k, ld, i), *vi = row(v, ld, i);
          const double bi = beta[(c0 + int64_t(i)) * NH + int64_t(h)];
          double* ui = U.data() + i * D;
          for (int c = 0; c < D; ++c) ui[c] = vi[c];
          for (int r = 0; r < D; ++r) {
            const double kr = std::exp(G[i * D + size_t(r)]) * ki[r];
            const double* Sr = S.data() + size_t(r) * D;
            for (int c = 0; c < D; ++c) ui[c] -= kr * Sr[c];
          }
          for (size_t j = 0; j < i; ++j) {
            const double aij = A[i * C + j];
            const double* uj = U.data() + j * D;
            for (int c = 0; c < D; ++c) ui[c] -= aij * uj[c];
          }
          for (int c = 0; c < D; ++c) ui[c] *= bi;
        }
        // Outputs: o_i = (e^G_i o q_i)^T S0 + sum_{j<=i} B_ij u_j.
        for (size_t i = 0; i < m; ++i) {
          const float* qi = row(q, ld, i);
          std::fill(o.begin(), o.end(), 0.0);
          for (int r = 0; r < D; ++r) {
            const double qr = std::exp(G[i * D + size_t(r)]) * qi[r];
            const double* Sr = S.data() + size_t(r) * D;
            for (int c = 0; c < D; ++c) o[size_t(c)] += qr * Sr[c];
          }
          for (size_t j = 0; j <= i; ++j) {
            const double bij = B[i * C + j];
            const double* uj = U.data() + j * D;
            for (int c = 0; c < D; ++c) o[size_t(c)] += bij * uj[c];
          }
          float* oi = out + (c0 + int64_t(i)) * int64_t(NH) * D + int64_t(h) * D;
          for (int c = 0; c < D; ++c) oi[c] = float(o[size_t(c)]);
        }
        // State: S = Diag(e^G_last) S0 + sum_j Diag(e^(G_last - G_j)) k_j u_j^T.
        const double* Gl = G.data() + (m - 1) * D;
        for (int r = 0; r < D; ++r) {
          double* Sr = Sn.data() + size_t(r) * D;
          const double e = std::exp(Gl[r]);
          for (int c = 0; c < D; ++c) Sr[c] = e * S[size_t(r) * D + size_t(c)];
          for (size_t j = 0; j < m; ++j) {
            const double kr = std::exp(Gl[r] - G[j * D + size_t(r)]) * row(k, ld, j)[r];
            const double* uj = U.data() + j * D;
            for (int c = 0; c < D; ++c) Sr[c] += kr * uj[c];
          }
        }
        // The state is fp32 between chunks, as between tokens in the recurrent form.
        for (size_t i = 0; i < DD; ++i) S[i] = double(float(Sn[i]));
      }
      for (size_t i = 0; i < DD; ++i) Sf[i] = float(S[i]);
    }
  });
}

void kda_output_gate(const KdaDims& d, int64_t n, float* o, const float* gate, const float* w, float eps) {
  const int D = d.head_dim;
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < d.n_heads; ++h) {
      float* x = o + (t * d.n_heads + h) * D;
      const float* gt = gate + (t * d.n_heads + h) * D;
      double ss = 0;
      for (int c = 0; c < D; ++c) ss += double(x[c]) * x[c];
      const double inv = 1.0 / std::sqrt(ss / D + eps);
      for (int c = 0; c < D; ++c) x[c] = float(double(w[c]) * float(x[c] * inv) * sigmoid(gt[c]));
    }
}

}  // namespace dz::cpu
