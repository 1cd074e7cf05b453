// dz info --fold-check: the load-time spread check of MXFP4 experts for the
// FP4 -> FP8 1x128 folding, on the gpt-oss fixture and on crafted tensors.
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>

#include "support/run_cmd.h"
#include "support/safetensors_writer.h"

using namespace dz::test;

TEST_CASE("dz info --fold-check reports lossy 1x128 groups and refuses NaN scales", "[cli][mxfp4]") {
  {
    auto [rc, out] = run_cmd(std::string(DZ_TOOL) + " info --model " + DZ_TEST_DATA + "/gpt_oss_tiny --fold-check");
    INFO(out);
    CHECK(rc == 0);
    CHECK_THAT(out, Catch::Contains("fold check:") && Catch::Contains("MXFP4 tensors"));
  }
  // Two rows of K = 256 (two groups each): row 0 group 0 spans scales 100 and 115 (lossy),
  // everything else within 14 binades.
  std::vector<uint8_t> blocks(2 * 8 * 16, 0x11), scales(2 * 8, 110);
  scales[0] = 115;
  scales[1] = 100;
  auto dir = temp_dir("foldcheck");
  write_sharded(dir,
                {RawTensor{"model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", {1, 2, 8, 16}, blocks},
                 RawTensor{"model.layers.0.mlp.experts.gate_up_proj_scales", "U8", {1, 2, 8}, scales}},
                1);
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt_oss"})";
  auto [rc, out] = run_cmd(std::string(DZ_TOOL) + " info --model " + dir.string() + " --fold-check");
  INFO(out);
  CHECK(rc == 0);
  CHECK_THAT(out, Catch::Contains("4 groups of 1x128, 1 lossy") && Catch::Contains("max spread 15"));
  CHECK_THAT(out, Catch::Contains("gate_up_proj_blocks: 1 of 4 groups"));
  CHECK_THAT(out, Catch::Contains("0 of 1 tensors fold by 64-row groups"));  // 2 rows: no 64-row groups

  scales[5] = 0xFF;
  auto dir2 = temp_dir("foldcheck-nan");
  write_sharded(dir2,
                {RawTensor{"model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", {1, 2, 8, 16}, blocks},
                 RawTensor{"model.layers.0.mlp.experts.gate_up_proj_scales", "U8", {1, 2, 8}, scales}},
                1);
  std::ofstream(dir2 / "config.json") << R"({"model_type": "gpt_oss"})";
  auto [rc2, out2] = run_cmd(std::string(DZ_TOOL) + " info --model " + dir2.string() + " --fold-check");
  INFO(out2);
  CHECK(rc2 == 1);
  CHECK_THAT(out2, Catch::Contains("0xFF") && Catch::Contains("gate_up_proj_blocks"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir2);
}
