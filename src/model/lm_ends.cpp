#include "model/lm_ends.h"

#include "cpu/norm.h"
#include "model/weights.h"

namespace dz {

void LmEnds::load(const WeightStore& ws, int64_t vocab, int64_t hidden, bool tied, const std::string& embed_base,
                  const std::string& head_base, const std::string& norm_name) {
  embed = linear_weight(ws, embed_base, vocab, hidden);
  check(embed.kind != cpu::WeightKind::MXFP4, DZ_ERR_UNSUPPORTED, embed_base, ": MXFP4 embeddings");
  lm_head = tied ? embed : linear_weight(ws, head_base, vocab, hidden);
  final_norm = vector_f32(ws, norm_name, {hidden});
}

void LmEnds::embed_rows(std::span<const ForwardItem> batch, const BatchRows& flat, int64_t hidden, float* x) const {
  for (size_t r = 0; r < flat.rows.size(); ++r) {
    const ForwardItem& it = batch[flat.rows[r].item];
    embed.decode_row(it.tokens[size_t(flat.rows[r].pos - int64_t(it.seq->length()))], x + int64_t(r) * hidden);
  }
}

void LmEnds::logits(std::span<ForwardItem> batch, const BatchRows& flat, const float* x, int64_t hidden, float eps,
                    float* xn, ThreadPool* pool) const {
  for (size_t b = 0; b < batch.size(); ++b) {
    const auto [r0, nr] = flat.logit_rows(batch, b);
    cpu::rms_norm(x + r0 * hidden, nr, hidden, final_norm.data(), eps, xn);
    cpu::matmul(xn, nr, lm_head, nullptr, batch[b].logits, pool);
  }
}

}  // namespace dz
