// Checkpoint tensors as operator inputs, with the checks and messages every
// family needs: linear weights in any stored precision (F32/BF16/F16 in
// place, FP8 E4M3 with 128x128 `weight_scale_inv` blocks, MXFP4
// `weight_blocks` + `weight_scales`), small vectors decoded to fp32.
#pragma once

#include <string>
#include <vector>

#include "cpu/matmul.h"
#include "loader/safetensors.h"

namespace dz {

std::string shape_str(const std::vector<int64_t>& s);
void check_shape(const TensorView& t, const std::vector<int64_t>& shape);

// The [rows x cols] linear weight `base` + ".weight" (F32, BF16, F16, or F8_E4M3
// with base + ".weight_scale_inv"), or MXFP4 base + ".weight_blocks" /
// ".weight_scales", or DeepSeek's own layout: F8_E4M3 or packed FP4 (I8/U8
// [rows, cols / 2]) with E8M0 scales base + ".scale" (per 128x128 block /
// per 32 columns). Scales are validated (finite and positive FP8 scales, no
// 0xFF E8M0 scale byte).
cpu::WeightRef linear_weight(const WeightStore& ws, const std::string& base, int64_t rows, int64_t cols);

// The F32/BF16/F16 tensor `name` (exact name) of the given shape, viewed as
// [product of the leading dims x last dim]: stacked expert weights
// ([experts, rows, cols], sliced with row_slice) or a bare parameter matrix.
cpu::WeightRef float_matrix(const WeightStore& ws, const std::string& name, const std::vector<int64_t>& shape);

// A float vector (F32/BF16/F16) of the given shape, decoded to fp32.
std::vector<float> vector_f32(const WeightStore& ws, const std::string& name, const std::vector<int64_t>& shape);

// An optional vector's data, or null when it is empty (an absent bias).
inline const float* or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace dz
