// Options shared by the commands that run a model (logits, generate, ...).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commands.h"
#include "dayzero.h"

namespace dz::cli {

// "1,2,3" -> ids; false (with a message in *err) on anything else.
bool parse_tokens(const std::string& s, std::vector<int32_t>* out, std::string* err);
// --device cpu|cuda|auto, --threads N, --activations auto|f32|bf16,
// --attention precise|bf16|auto and --pass-tokens N into params; false with
// *err. Absent --device / --attention take the given defaults (a benchmark's
// differ from the CLI's).
struct ModelOptionDefaults {
  const char* device = "cpu";
  const char* attention = "auto";
};
bool parse_model_options(const Args& a, dz_model_params* params, std::string* err,
                         const ModelOptionDefaults& defaults = {});
// own + the flags parse_model_options reads: the known list for reject_unknown.
std::vector<std::string> with_model_options(std::vector<std::string> own);
// precise|bf16|auto into params->attention; false with *err.
bool parse_attention(const std::string& v, dz_model_params* params, std::string* err);
// 0 or 256..65536 into params->pass_tokens; false with *err.
bool parse_pass_tokens(const std::string& v, dz_model_params* params, std::string* err);
// The model opened without --model: DZ_MODEL in the environment, else
// kDefaultModel relative to the dz executable's folder or its parent (build/dz
// in a source tree), else to the working folder. The repository ships it: a
// tiny DeepSeek-V3.2 (MLA + DSA + MXFP4 MoE) trained by tools/train/train_dsv32.py.
extern const char* const kDefaultModel;
std::string default_model();
// params->progress: a line on stderr for loads that take over a second
// (redrawn on a terminal, else every 5 s), silent for quick ones.
void show_load_progress(dz_model_params* params);
// "  --device D    ..." lines for --help texts.
extern const char* const kModelOptionsHelp;

}  // namespace dz::cli
