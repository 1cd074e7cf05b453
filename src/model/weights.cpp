#include "model/weights.h"

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "cpu/fp8.h"
#include "cpu/mxfp4.h"

namespace dz {

namespace {
std::string where(const TensorView& t) { return t.file ? *t.file : std::string("?"); }

bool float_kind(DType d, cpu::WeightKind* k) {
  switch (d) {
    case DType::F32:
      *k = cpu::WeightKind::F32;
      return true;
    case DType::BF16:
      *k = cpu::WeightKind::BF16;
      return true;
    case DType::F16:
      *k = cpu::WeightKind::F16;
      return true;
    default:
      return false;
  }
}
// Refuses an E8M0 scale tensor (2-D, row-major) holding the NaN byte 0xFF, naming its position.
void check_e8m0_scales(const TensorView& s) {
  const size_t bad = cpu::find_e8m0_nan(s.data, s.nbytes);
  const int64_t cols = s.dim(1);
  check(bad == SIZE_MAX, DZ_ERR_FORMAT, "tensor ", s.name, ": scale byte 0xFF (E8M0 NaN) at [", int64_t(bad) / cols,
        ", ", int64_t(bad) % cols, "] (in ", where(s), "); the checkpoint is corrupt");
}
}  // namespace

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void check_shape(const TensorView& t, const std::vector<int64_t>& shape) {
  check(t.shape == shape, DZ_ERR_FORMAT, "tensor ", t.name, ": expected shape ", shape_str(shape), ", found ",
        shape_str(t.shape), " (in ", where(t), ")");
}

cpu::WeightRef linear_weight(const WeightStore& ws, const std::string& base, int64_t rows, int64_t cols) {
  cpu::WeightRef w;
  w.rows = rows;
  w.cols = cols;
  const std::string wn = base + ".weight", bn = base + ".weight_blocks";
  if (!ws.has(wn) && ws.has(bn)) {
    const TensorView& b = ws.get(bn);
    const TensorView& s = ws.get(base + ".weight_scales");
    for (const TensorView* t : {&b, &s})
      check(t->dtype == DType::U8, DZ_ERR_FORMAT, "tensor ", t->name, ": dtype ", dtype_name(t->dtype),
            " (expected U8 for MXFP4; in ", where(*t), ")");
    check(cols % cpu::kMxfp4Group == 0, DZ_ERR_FORMAT, "tensor ", bn, ": ", cols,
          " input features are not a multiple of the MXFP4 group (32)");
    const int64_t groups = cols / cpu::kMxfp4Group;
    check_shape(b, {rows, groups, cpu::kMxfp4GroupBytes});
    check_shape(s, {rows, groups});
    check_e8m0_scales(s);
    w.kind = cpu::WeightKind::MXFP4;
    w.data = b.data;
    w.scales = s.data;
    return w;
  }
  const TensorView& t = ws.get(wn);
  // DeepSeek's own layout names a weight's scales base + ".scale": E8M0 bytes per 128x128 block of an FP8
  // weight, per 32 columns of an FP4 one (two E2M1 values a byte, the first in the low nibble, as MXFP4).
  const std::string sc = base + ".scale";
  if ((t.dtype == DType::I8 || t.dtype == DType::U8) && ws.has(sc)) {
    const TensorView& s = ws.get(sc);
    check(s.dtype == DType::F8_E8M0 || s.dtype == DType::U8, DZ_ERR_FORMAT, "tensor ", sc, ": dtype ",
          dtype_name(s.dtype), " (expected F8_E8M0 or U8 scales for the FP4 weight ", wn, "; in ", where(s), ")");
    check(cols % cpu::kMxfp4Group == 0, DZ_ERR_FORMAT, "tensor ", wn, ": ", cols,
          " input features are not a multiple of the FP4 group (32)");
    check_shape(t, {rows, cols / 2});
    check_shape(s, {rows, cols / cpu::kMxfp4Group});
    check_e8m0_scales(s);
    w.kind = cpu::WeightKind::MXFP4;
    w.data = t.data;
    w.scales = s.data;
    return w;
  }
  if (t.dtype == DType::F8_E4M3) {
    check_shape(t, {rows, cols});
    const std::string sn = ws.has(base + ".weight_scale_inv") || !ws.has(sc) ? base + ".weight_scale_inv" : sc;
    check(ws.has(sn), DZ_ERR_FORMAT, "tensor ", wn, " is F8_E4M3 but its block scales ", sn, " are missing (in ",
          where(t), ")");
    const TensorView& s = ws.get(sn);
    const int64_t B = cpu::kFp8WeightBlock;
    check_shape(s, {(rows + B - 1) / B, (cols + B - 1) / B});
    w.data = t.data;
    w.scales = s.data;
    if (s.dtype == DType::F8_E8M0 || (s.dtype == DType::U8 && sn == sc)) {
      check_e8m0_scales(s);
      w.kind = cpu::WeightKind::FP8_BLOCK_E8M0;
      return w;
    }
    check(s.dtype == DType::F32, DZ_ERR_UNSUPPORTED, "tensor ", sn, ": dtype ", dtype_name(s.dtype),
          " (F32 or E8M0 128x128 block scales are supported; in ", where(s), ")");
    for (int64_t i = 0; i < s.numel(); ++i) {
      float v;
      std::memcpy(&v, s.data + 4 * i, 4);
      check(std::isfinite(v) && v > 0, DZ_ERR_FORMAT, "tensor ", sn, ": scale ", v, " at [", i / s.dim(1), ", ",
            i % s.dim(1), "] is not a positive finite number (in ", where(s), ")");
    }
    w.kind = cpu::WeightKind::FP8_BLOCK;
    return w;
  }
  check(float_kind(t.dtype, &w.kind), DZ_ERR_FORMAT, "tensor ", wn, ": dtype ", dtype_name(t.dtype),
        " is not supported for a linear weight (BF16, F16, F32, F8_E4M3 with block scales; in ", where(t), ")");
  check_shape(t, {rows, cols});
  w.data = t.data;
  return w;
}

cpu::WeightRef float_matrix(const WeightStore& ws, const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& t = ws.get(name);
  cpu::WeightRef w;
  check(float_kind(t.dtype, &w.kind), DZ_ERR_FORMAT, "tensor ", name, ": dtype ", dtype_name(t.dtype),
        " is not supported here (expected BF16, F16 or F32; in ", where(t), ")");
  check(!shape.empty(), DZ_ERR_INTERNAL, "float_matrix: empty shape for ", name);
  check_shape(t, shape);
  w.cols = shape.back();
  w.rows = t.numel() / w.cols;
  w.data = t.data;
  return w;
}

std::vector<float> vector_f32(const WeightStore& ws, const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& t = ws.get(name);
  cpu::WeightKind k;
  check(float_kind(t.dtype, &k), DZ_ERR_FORMAT, "tensor ", name, ": dtype ", dtype_name(t.dtype),
        " is not supported here (expected BF16, F16 or F32; in ", where(t), ")");
  check_shape(t, shape);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  cpu::to_f32(k, t.data, t.numel(), v.data());
  return v;
}

}  // namespace dz
