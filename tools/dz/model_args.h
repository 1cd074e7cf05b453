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
// --device cpu|cuda|auto and --threads N into params; false with *err.
bool parse_model_options(const Args& a, dz_model_params* params, std::string* err);
// "  --device D    ..." lines for --help texts.
extern const char* const kModelOptionsHelp;

}  // namespace dz::cli
