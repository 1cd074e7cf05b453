#include "model/rope_config.h"

namespace dz {

namespace {
double num_or(const nlohmann::json& o, const char* key, double fallback, const Config& cfg, const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return fallback;
  check(o[key].is_number(), DZ_ERR_FORMAT, cfg.source(), ": ", where, ".", key, " is not a number");
  return o[key].get<double>();
}
}  // namespace

cpu::RopeParams rope_params_from_config(const Config& cfg, int head_dim, double default_theta) {
  const auto& j = cfg.json();
  const char* where = "rope_parameters";
  nlohmann::json rp = nlohmann::json::object();
  for (const char* k : {"rope_parameters", "rope_scaling"})
    check(!j.contains(k) || j[k].is_null() || j[k].is_object(), DZ_ERR_FORMAT, cfg.source(), ": ", k,
          " is not an object");
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rp = j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    rp = j["rope_scaling"];
    where = "rope_scaling";
  }
  return rope_params_from_object(cfg, rp, where, head_dim, default_theta);
}

cpu::RopeParams rope_params_from_object(const Config& cfg, const nlohmann::json& rp, const std::string& where,
                                        int head_dim, double default_theta) {
  const auto& j = cfg.json();
  check(rp.is_object(), DZ_ERR_FORMAT, cfg.source(), ": ", where, " is not an object");
  cpu::RopeParams p;
  p.base = num_or(rp, "rope_theta", num_or(j, "rope_theta", default_theta, cfg, "config"), cfg, where);
  const double partial =
      num_or(rp, "partial_rotary_factor", num_or(j, "partial_rotary_factor", 1.0, cfg, "config"), cfg, where);
  p.dim = int(head_dim * partial);
  check(p.dim > 0 && p.dim % 2 == 0, DZ_ERR_FORMAT, cfg.source(), ": rotary dimension ", p.dim,
        " (head_dim x partial_rotary_factor) must be positive and even");
  check(p.base > 1, DZ_ERR_FORMAT, cfg.source(), ": rope_theta ", p.base, " must be > 1");
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (rp.contains(k) && !rp[k].is_null()) {
      check(rp[k].is_string(), DZ_ERR_FORMAT, cfg.source(), ": ", where, ".", k, " is not a string");
      type = rp[k].get<std::string>();
      break;
    }
  if (type == "default") return p;
  check(type == "yarn", DZ_ERR_UNSUPPORTED, cfg.source(), ": ", where, ".rope_type '", type,
        "' is not supported (default, yarn)");
  p.type = cpu::RopeParams::Type::Yarn;
  p.original_max_position = num_or(rp, "original_max_position_embeddings", 0, cfg, where);
  check(p.original_max_position > 0, DZ_ERR_FORMAT, cfg.source(), ": ", where,
        ".original_max_position_embeddings is required for yarn");
  p.factor = num_or(rp, "factor", 0, cfg, where);
  if (p.factor == 0) p.factor = num_or(j, "max_position_embeddings", 0, cfg, "config") / p.original_max_position;
  check(p.factor > 0, DZ_ERR_FORMAT, cfg.source(), ": ", where, ".factor must be positive");
  // transformers: `get("beta_fast") or 32` (a zero means the default too).
  p.beta_fast = num_or(rp, "beta_fast", 0, cfg, where);
  if (p.beta_fast == 0) p.beta_fast = 32;
  p.beta_slow = num_or(rp, "beta_slow", 0, cfg, where);
  if (p.beta_slow == 0) p.beta_slow = 1;
  check(p.beta_fast > 0 && p.beta_slow > 0, DZ_ERR_FORMAT, cfg.source(), ": ", where, ".beta_fast ", p.beta_fast,
        " and beta_slow ", p.beta_slow, " must be positive");
  p.attention_factor = num_or(rp, "attention_factor", 0, cfg, where);
  p.mscale = num_or(rp, "mscale", 0, cfg, where);
  p.mscale_all_dim = num_or(rp, "mscale_all_dim", 0, cfg, where);
  if (rp.contains("truncate") && !rp["truncate"].is_null()) {
    check(rp["truncate"].is_boolean(), DZ_ERR_FORMAT, cfg.source(), ": ", where, ".truncate is not a boolean");
    p.truncate = rp["truncate"].get<bool>();
  }
  return p;
}

}  // namespace dz
