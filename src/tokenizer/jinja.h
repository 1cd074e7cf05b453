// A Jinja2 interpreter for chat templates: the subset Hugging Face templates
// use, with transformers' environment (trim_blocks, lstrip_blocks, loop
// controls, Python-style tojson, raise_exception, strftime_now) so a new
// model's chat_template renders byte for byte like apply_chat_template.
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace dz::jinja {

struct Stmt;

class Template {
 public:
  // Throws dz::Error(DZ_ERR_FORMAT) naming the line of a syntax error, or
  // DZ_ERR_UNSUPPORTED for statements outside the subset.
  explicit Template(std::string_view source);
  ~Template();
  // vars: the template's variables (a JSON object). Errors while rendering
  // (raise_exception, type errors, undefined attributes) throw dz::Error
  // with DZ_ERR_INVALID_ARGUMENT.
  std::string render(const nlohmann::ordered_json& vars, const std::tm* now = nullptr) const;

 private:
  std::vector<std::unique_ptr<Stmt>> body_;
};

}  // namespace dz::jinja
