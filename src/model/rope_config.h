// RoPE settings from a Hugging Face config.json: `rope_parameters`
// (transformers 5) or the older `rope_scaling` + `rope_theta`.
#pragma once

#include "cpu/rope.h"
#include "loader/config.h"

namespace dz {

// head_dim: the attention head size the rotation applies to;
// default_theta: the family's rope_theta when the config names none.
cpu::RopeParams rope_params_from_config(const Config& cfg, int head_dim, double default_theta);

// The same from one rope-parameters object `rp` (named `where` in messages),
// for configs with several (deepseek_v4's rope_parameters.main / .compress);
// fields it lacks fall back to the config's top level.
cpu::RopeParams rope_params_from_object(const Config& cfg, const nlohmann::json& rp, const std::string& where,
                                        int head_dim, double default_theta);

}  // namespace dz
