// Library-wide calls: version, errors, logging, model open/info.
#include <filesystem>

#include "api/api_util.h"
#include "api/handles.h"
#include "common/log.h"

namespace dz {
const char* last_error();
void set_log(dz_log_fn fn, void* user, dz_log_level level);
// Defined by the tokenizer (src/api/api_tokenizer.cpp): open dir/tokenizer.json
// (or tiktoken.model) when present, else nullptr.
dz_tokenizer* open_model_tokenizer(const std::string& dir);
}  // namespace dz

#define DZ_STR2(x) #x
#define DZ_STR(x) DZ_STR2(x)

extern "C" {

DZ_API const char* dz_version(void) {
  return DZ_STR(DZ_VERSION_MAJOR) "." DZ_STR(DZ_VERSION_MINOR) "." DZ_STR(DZ_VERSION_PATCH);
}

DZ_API int dz_abi_version(void) { return DZ_ABI_VERSION; }

DZ_API const char* dz_last_error(void) { return dz::last_error(); }

DZ_API const char* dz_status_name(dz_status s) {
  switch (s) {
    case DZ_OK:
      return "DZ_OK";
    case DZ_ERR_INVALID_ARGUMENT:
      return "DZ_ERR_INVALID_ARGUMENT";
    case DZ_ERR_IO:
      return "DZ_ERR_IO";
    case DZ_ERR_FORMAT:
      return "DZ_ERR_FORMAT";
    case DZ_ERR_UNSUPPORTED:
      return "DZ_ERR_UNSUPPORTED";
    case DZ_ERR_OUT_OF_MEMORY:
      return "DZ_ERR_OUT_OF_MEMORY";
    case DZ_ERR_KV_FULL:
      return "DZ_ERR_KV_FULL";
    case DZ_ERR_CANCELLED:
      return "DZ_ERR_CANCELLED";
    case DZ_ERR_DEVICE:
      return "DZ_ERR_DEVICE";
    case DZ_ERR_NOT_FOUND:
      return "DZ_ERR_NOT_FOUND";
    case DZ_ERR_BUFFER_TOO_SMALL:
      return "DZ_ERR_BUFFER_TOO_SMALL";
    case DZ_ERR_INTERNAL:
      return "DZ_ERR_INTERNAL";
  }
  return "DZ_ERR_UNKNOWN";
}

DZ_API dz_status dz_log_set(dz_log_fn fn, void* user, dz_log_level min_level) {
  return DZ_GUARD({
    dz::check(min_level >= DZ_LOG_DEBUG && min_level <= DZ_LOG_NONE, DZ_ERR_INVALID_ARGUMENT, "min_level ",
              int(min_level), " is not a dz_log_level");
    dz::set_log(fn, user, min_level);
  });
}

DZ_API void dz_model_params_init_sized(dz_model_params* p, size_t struct_size) {
  dz::init_sized(p, struct_size, [](dz_model_params& d) {
    d.device = DZ_DEVICE_CPU;
    d.experts = DZ_EXPERTS_AUTO;
    d.indexer = DZ_INDEXER_AUTO;
    d.bf16_sensitive = 1;
    d.activations = DZ_ACTIVATIONS_AUTO;
    d.attention = DZ_ATTENTION_AUTO;
  });
}

// The header makes dz_*_init a macro: the parentheses keep it from expanding here.
DZ_API void(dz_model_params_init)(dz_model_params* p) { dz_model_params_init_sized(p, sizeof(dz_model_params)); }

DZ_API void dz_model_info_init_sized(dz_model_info* info, size_t struct_size) {
  dz::init_sized(info, struct_size, [](dz_model_info&) {});
}

DZ_API void(dz_model_info_init)(dz_model_info* info) { dz_model_info_init_sized(info, sizeof(dz_model_info)); }

DZ_API dz_status dz_model_open(const char* dir, const dz_model_params* params, dz_model** out) {
  return DZ_GUARD({
    dz::need(dir, "dir");
    dz::need(out, "out");
    *out = nullptr;
    auto m = std::make_unique<dz_model>();
    m->params = dz::read_params(params, dz_model_params_init, offsetof(dz_model_params, progress), "params");
    dz::check(m->params.device >= DZ_DEVICE_CPU && m->params.device <= DZ_DEVICE_AUTO, DZ_ERR_INVALID_ARGUMENT,
              "params->device ", int(m->params.device), " is not a dz_device");
    dz::check(m->params.activations >= DZ_ACTIVATIONS_AUTO && m->params.activations <= DZ_ACTIVATIONS_BF16,
              DZ_ERR_INVALID_ARGUMENT, "params->activations ", int(m->params.activations),
              " is not a dz_activation_precision");
    dz::check(m->params.attention >= DZ_ATTENTION_AUTO && m->params.attention <= DZ_ATTENTION_BF16,
              DZ_ERR_INVALID_ARGUMENT, "params->attention ", int(m->params.attention),
              " is not a dz_attention_precision");
    dz::check(m->params.exact_moe_layers >= 0, DZ_ERR_INVALID_ARGUMENT, "params->exact_moe_layers ",
              m->params.exact_moe_layers, " is negative");
    dz::check(m->params.pass_tokens == 0 || (m->params.pass_tokens >= 256 && m->params.pass_tokens <= 65536),
              DZ_ERR_INVALID_ARGUMENT, "params->pass_tokens ", m->params.pass_tokens,
              " (0 for the default, or 256..65536)");
    m->config = dz::Config::load(dir);
    m->architecture = m->config.model_type();
    const dz_model_params& p = m->params;
    bool cancelled = false;
    m->weights = std::make_unique<dz::WeightStore>(dir, [&](size_t done, size_t total) {
      if (p.progress && p.progress("validate shards", done, total, p.progress_user)) cancelled = true;
    });
    dz::check(!cancelled, DZ_ERR_CANCELLED, dir, ": open cancelled by the progress callback");
    dz::FamilyFactory make = dz::find_family(m->architecture);
    if (!make) {
      std::string names;
      for (const auto& n : dz::family_names()) names += (names.empty() ? "" : ", ") + n;
      dz::fail(DZ_ERR_UNSUPPORTED, m->config.source(), ": model_type '", m->architecture,
               "' is not served by this build (served: ", names.empty() ? "none" : names, ")");
    }
    m->family = make(m->config, *m->weights, m->params);
    m->tokenizer = dz::open_model_tokenizer(dir);
    *out = m.release();
  });
}

DZ_API void dz_model_free(dz_model* model) { delete model; }

DZ_API dz_status dz_model_get_info(const dz_model* model, dz_model_info* info) {
  return DZ_GUARD({
    dz::need(model, "model");
    dz::need(info, "info");
    dz_model_info r;
    dz_model_info_init(&r);
    r.architecture = model->architecture.c_str();
    r.device = model->params.device;
    r.weight_bytes = model->weights->total_bytes();
    r.n_shards = static_cast<int32_t>(model->weights->n_shards());
    for (const auto& [_, t] : model->weights->all()) r.n_params += static_cast<uint64_t>(t->numel());
    r.device_bytes = r.weight_bytes;
    model->family->fill_info(r);
    dz::write_out(info, r, "info");
  });
}

}  // extern "C"
