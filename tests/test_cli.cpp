// The dz tool as a user runs it: --help everywhere, info on a sharded checkpoint.
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "support/run_cmd.h"
#include "support/safetensors_writer.h"

using namespace dz::test;

TEST_CASE("dz --help lists commands and every command has --help", "[cli]") {
  auto [rc, out] = run_cmd(std::string(DZ_TOOL) + " --help");
  REQUIRE(rc == 0);
  CHECK_THAT(out, Catch::Contains("info"));
  std::istringstream lines(out.substr(out.find("commands:")));
  std::string line;
  std::getline(lines, line);
  int n = 0;
  while (std::getline(lines, line) && line.rfind("  ", 0) == 0) {
    std::string cmd = line.substr(2, line.find(' ', 2) - 2);
    auto [crc, cout] = run_cmd(std::string(DZ_TOOL) + " " + cmd + " --help");
    INFO(cmd << ": " << cout);
    CHECK(crc == 0);
    CHECK_THAT(cout, Catch::Contains("usage: dz " + cmd));
    ++n;
  }
  CHECK(n >= 1);
  CHECK(run_cmd(std::string(DZ_TOOL) + " frobnicate").first == 2);
  // A number option given something else ends with a message and status 2, not an abort.
  auto [brc, bout] = run_cmd(std::string(DZ_TOOL) + " bench kv --tokens many");
  CHECK(brc == 2);
  CHECK_THAT(bout, Catch::Contains("takes a number"));
  auto [orc, oout] = run_cmd(std::string(DZ_TOOL) + " bench kv --tokens 99999999999999999999999");
  CHECK(orc == 2);
  CHECK_THAT(oout, Catch::Contains("out of range"));
  // So does a precision no enum has.
  auto [arc, aout] = run_cmd(std::string(DZ_TOOL) + " logits --model m --tokens 1 --out o --attention fast");
  CHECK(arc == 2);
  CHECK_THAT(aout, Catch::Contains("--attention 'fast'"));
  // And a pass size out of range.
  for (const char* cmd : {" logits --model m --tokens 1 --out o", " bench model --model m"}) {
    auto [prc, pout] = run_cmd(std::string(DZ_TOOL) + cmd + " --pass-tokens 100");
    INFO(cmd << ": " << pout);
    CHECK(prc == 2);
    CHECK_THAT(pout, Catch::Contains("--pass-tokens '100'"));
    // A device no backend has (bench model once took any word for cuda).
    auto [drc, dout] = run_cmd(std::string(DZ_TOOL) + cmd + " --device gpu");
    CHECK(drc == 2);
    CHECK_THAT(dout, Catch::Contains("--device 'gpu'"));
  }
  // A checkpoint that is not there: the library's message once, the command's name once.
  auto [mrc, mout] = run_cmd(std::string(DZ_TOOL) + " bench model --model /nonexistent/dz-model --device cpu");
  CHECK(mrc != 0);
  CHECK_THAT(mout, Catch::Contains("dz bench model: dz_model_open: /nonexistent/dz-model"));
  CHECK(mout.find("dz_model_open: dz_model_open") == std::string::npos);
}

TEST_CASE("dz bench kda: the recurrent and chunked forms agree, JSON with a time a token", "[cli][kimi]") {
  auto [rc, out] = run_cmd(std::string(DZ_TOOL) +
                           " bench kda --heads 2 --head-dim 16 --tokens 150 --chunks 0,7,16,64 --reps 1 2>/dev/null");
  INFO(out);
  REQUIRE(rc == 0);
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  CHECK(j["bench"] == "kda");
  CHECK(j.contains("commit"));
  REQUIRE(j["results"].size() == 4);
  for (const auto& r : j["results"]) {
    CHECK(r["us_per_token"].get<double>() > 0);
    CHECK(r["max_abs_diff_vs_first"].get<double>() < 1e-5);
  }
  CHECK(run_cmd(std::string(DZ_TOOL) + " bench kda --heads 0").first != 0);
}

TEST_CASE("dz info describes a sharded checkpoint and flags corruption", "[cli]") {
  std::mt19937 rng(11);
  auto dir = temp_dir("cli");
  std::vector<RawTensor> ts = {
      random_bf16("model.embed_tokens.weight", {32, 8}, rng), random_f32("model.norm.weight", {8}, rng),
      RawTensor{"model.layers.0.mlp.experts.down_proj_blocks", "U8", {2, 8, 1, 16}, std::vector<uint8_t>(256, 0x21)}};
  write_sharded(dir, ts, 2);
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt_oss", "num_hidden_layers": 1, "hidden_size": 8,
    "layer_types": ["sliding_attention"], "quantization_config": {"quant_method": "mxfp4"}})";
  auto [rc, out] = run_cmd(std::string(DZ_TOOL) + " info --model " + dir.string());
  INFO(out);
  CHECK(rc == 0);
  CHECK_THAT(out, Catch::Contains("architecture: gpt_oss"));
  CHECK_THAT(out, Catch::Contains("3 in 2 shards"));
  // 256 + 8 params, plus 512 MXFP4 elements (2 per byte).
  CHECK_THAT(out, Catch::Contains("(776)"));
  CHECK_THAT(out, Catch::Contains("sliding_attention x1"));
  CHECK_THAT(out, Catch::Contains("mxfp4"));
  CHECK_THAT(out, Catch::Contains("validation:   OK"));

  std::filesystem::resize_file(dir / "model-00002-of-00002.safetensors", 40);
  auto [rc2, out2] = run_cmd(std::string(DZ_TOOL) + " info --model " + dir.string());
  INFO(out2);
  CHECK(rc2 == 1);
  CHECK_THAT(out2, Catch::Contains("FAILED"));
  CHECK_THAT(out2, Catch::Contains("model-00002-of-00002.safetensors"));
  CHECK(run_cmd(std::string(DZ_TOOL) + " info --model " + dir.string() + " --bogus").first == 2);
  std::filesystem::remove_all(dir);
}
