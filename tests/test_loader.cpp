// Safetensors loader: valid single-file and sharded checkpoints, and every
// corruption the loader must refuse with a clear message (run under ASan too).
#include <catch2/catch.hpp>
#include <fstream>

#include "common/error.h"
#include "dayzero.h"
#include "loader/safetensors.h"
#include "support/safetensors_writer.h"

using namespace dz;
using namespace dz::test;
namespace fs = std::filesystem;

namespace {
// Expect constructing a SafetensorsFile on p to fail with status and a message
// containing every needle.
void expect_refused(const fs::path& p, dz_status status, std::vector<std::string> needles) {
  try {
    SafetensorsFile f(p.string());
    FAIL("loaded a corrupted file: " << p);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.status() == status);
    for (const auto& n : needles) CHECK_THAT(e.what(), Catch::Contains(n));
  }
}
std::vector<uint8_t> bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(seed + 31 * i);
  return v;
}
}  // namespace

TEST_CASE("loader reads a valid file through mmap without copying", "[loader]") {
  std::mt19937 rng(1234);
  auto dir = temp_dir("valid");
  std::vector<RawTensor> ts = {random_f32("a.weight", {3, 5}, rng), random_bf16("b.weight", {7}, rng),
                               RawTensor{"c.blocks", "U8", {2, 4, 16}, bytes(128, 7)},
                               RawTensor{"empty", "I64", {0, 4}, {}}};
  write_safetensors(dir / "model.safetensors", ts);
  SafetensorsFile f((dir / "model.safetensors").string());
  REQUIRE(f.tensors().size() == 4);
  for (const auto& t : ts) {
    const TensorView& v = f.tensors().at(t.name);
    CHECK(v.shape == t.shape);
    CHECK(v.nbytes == t.bytes.size());
    if (!t.bytes.empty()) CHECK(std::memcmp(v.data, t.bytes.data(), t.bytes.size()) == 0);
  }
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.tensors().at("b.weight").dtype == DType::BF16);
}

TEST_CASE("loader reads every supported dtype", "[loader]") {
  auto dir = temp_dir("dtypes");
  std::vector<RawTensor> ts;
  const char* names[] = {"F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "U8", "I8", "I16", "I32", "I64", "BOOL"};
  for (const char* n : names) {
    DType d;
    REQUIRE(dtype_from_name(n, &d));
    ts.push_back({std::string("t_") + n, n, {3, 2}, bytes(6 * dtype_size(d), 3)});
  }
  write_safetensors(dir / "model.safetensors", ts);
  SafetensorsFile f((dir / "model.safetensors").string());
  for (const auto& t : ts) CHECK(dtype_name(f.tensors().at(t.name).dtype) == t.dtype);
}

TEST_CASE("loader refuses corrupted files with a clear error", "[loader]") {
  std::mt19937 rng(99);
  auto dir = temp_dir("corrupt");
  std::vector<RawTensor> good = {random_f32("x.weight", {4, 4}, rng), random_f32("y.weight", {8}, rng)};
  std::vector<uint8_t> data;
  for (auto& t : good) data.insert(data.end(), t.bytes.begin(), t.bytes.end());

  SECTION("missing file") { expect_refused(dir / "nope.safetensors", DZ_ERR_IO, {"nope.safetensors", "cannot open"}); }
  SECTION("shorter than the length prefix") {
    std::ofstream(dir / "m.safetensors") << "abc";
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"m.safetensors", "truncated"});
  }
  SECTION("truncated data") {
    write_safetensors(dir / "m.safetensors", good);
    fs::resize_file(dir / "m.safetensors", fs::file_size(dir / "m.safetensors") - 5);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"y.weight", "run past the end"});
  }
  SECTION("huge header length") {
    write_raw(dir / "m.safetensors", header_for(good).dump(), data, 1ull << 60);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"header length", "exceeds"});
  }
  SECTION("header length past the end of the file") {
    write_raw(dir / "m.safetensors", header_for(good).dump(), data, 1000000);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"runs past the end"});
  }
  SECTION("malformed JSON") {
    write_raw(dir / "m.safetensors", "{\"x.weight\": {\"dtype\": ", data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"not well-formed JSON"});
  }
  SECTION("non-UTF-8 tensor name") {
    write_raw(dir / "m.safetensors",
              "{\"bad\xff\xfename\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"UTF-8"});
  }
  SECTION("unknown dtype") {
    auto h = header_for(good);
    h["x.weight"]["dtype"] = "F4_WHAT";
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"x.weight", "unknown dtype 'F4_WHAT'"});
  }
  SECTION("shape and byte range disagree") {
    auto h = header_for(good);
    h["x.weight"]["shape"] = {4, 5};
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"x.weight", "needs 80 bytes", "give 64"});
  }
  SECTION("overlapping tensors") {
    auto h = header_for(good);
    h["y.weight"]["data_offsets"] = {32, 64};
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"overlap", "x.weight", "y.weight"});
  }
  SECTION("reversed offsets") {
    auto h = header_for(good);
    h["y.weight"]["data_offsets"] = {96, 64};
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"y.weight", "reversed"});
  }
  SECTION("negative dimension") {
    auto h = header_for(good);
    h["y.weight"]["shape"] = {-8};
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"y.weight", "non-negative"});
  }
  SECTION("shape overflow") {
    auto h = header_for(good);
    h["y.weight"]["shape"] = {1ull << 40, 1ull << 40};
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"y.weight"});
  }
  SECTION("entry is not an object") {
    write_raw(dir / "m.safetensors", "{\"x.weight\": 5}", data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"x.weight", "not an object"});
  }
  SECTION("missing data_offsets") {
    auto h = header_for(good);
    h["x.weight"].erase("data_offsets");
    write_raw(dir / "m.safetensors", h.dump(), data);
    expect_refused(dir / "m.safetensors", DZ_ERR_FORMAT, {"x.weight", "data_offsets"});
  }
  fs::remove_all(dir);
}

TEST_CASE("sharded checkpoints load through the index and are validated", "[loader]") {
  std::mt19937 rng(7);
  auto dir = temp_dir("sharded");
  std::vector<RawTensor> ts;
  for (int i = 0; i < 10; ++i) ts.push_back(random_bf16("layers." + std::to_string(i) + ".w", {16, 8}, rng));
  write_sharded(dir, ts, 3);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";

  SECTION("valid") {
    size_t calls = 0;
    WeightStore ws(dir.string(), [&](size_t, size_t total) {
      calls++;
      CHECK(total == 3);
    });
    CHECK(calls == 3);
    CHECK(ws.n_shards() == 3);
    CHECK(ws.all().size() == 10);
    const TensorView& t = ws.get("layers.4.w", DType::BF16, {16, 8});
    CHECK(std::memcmp(t.data, ts[4].bytes.data(), t.nbytes) == 0);
    CHECK_THROWS_WITH(ws.get("layers.4.w", DType::F32, {16, 8}), Catch::Contains("expected dtype F32"));
    CHECK_THROWS_WITH(ws.get("nope"), Catch::Contains("'nope' not found"));
  }
  SECTION("missing shard") {
    fs::remove(dir / "model-00002-of-00003.safetensors");
    try {
      WeightStore ws(dir.string());
      FAIL("missing shard accepted");
    } catch (const Error& e) {
      CHECK(e.status() == DZ_ERR_IO);
      CHECK_THAT(e.what(), Catch::Contains("model-00002-of-00003.safetensors") && Catch::Contains("does not exist"));
    }
  }
  SECTION("index names a tensor its shard lacks") {
    auto idx = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors";
    std::ofstream(dir / "model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(WeightStore(dir.string()),
                      Catch::Contains("ghost.weight") && Catch::Contains("does not contain"));
  }
  SECTION("index points outside the directory") {
    auto idx = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
    idx["weight_map"]["layers.0.w"] = "../../etc/passwd";
    std::ofstream(dir / "model.safetensors.index.json") << idx.dump();
    CHECK_THROWS_WITH(WeightStore(dir.string()), Catch::Contains("not a file in the model directory"));
  }
  SECTION("malformed index") {
    std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": [1,2";
    CHECK_THROWS_WITH(WeightStore(dir.string()), Catch::Contains("model.safetensors.index.json"));
  }
  fs::remove_all(dir);
}

TEST_CASE("dz_model_open reports errors through the C API", "[loader][api]") {
  dz_model* m = reinterpret_cast<dz_model*>(0x1);
  CHECK(dz_model_open("/nonexistent/dz", nullptr, &m) == DZ_ERR_IO);
  CHECK(m == nullptr);
  CHECK_THAT(dz_last_error(), Catch::Contains("/nonexistent/dz"));
  CHECK(dz_model_open(nullptr, nullptr, &m) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(dz_last_error(), Catch::Contains("dir is NULL"));

  std::mt19937 rng(3);
  auto dir = temp_dir("api");
  write_safetensors(dir / "model.safetensors", {random_f32("w", {2, 2}, rng)});
  std::ofstream(dir / "config.json") << R"({"model_type": "no_such_family"})";
  CHECK(dz_model_open(dir.c_str(), nullptr, &m) == DZ_ERR_UNSUPPORTED);
  CHECK_THAT(dz_last_error(), Catch::Contains("no_such_family"));

  dz_model_params p;
  dz_model_params_init(&p);
  p.struct_size = 3;
  CHECK(dz_model_open(dir.c_str(), &p, &m) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(dz_last_error(), Catch::Contains("struct_size"));
  fs::remove_all(dir);
}

TEST_CASE("a header not padded to 8 bytes: misaligned tensors are copied, values intact", "[loader]") {
  const fs::path dir = temp_dir("unpadded");
  const float want[3] = {1.5f, -2.25f, 3.0e-8f};
  std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  while ((8 + header.size()) % 4 != 1) header += ' ';  // the data starts 1 byte past a 4-byte boundary
  const uint64_t n = header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  bytes += header + std::string(reinterpret_cast<const char*>(want), 12);
  std::ofstream(dir / "m.safetensors", std::ios::binary) << bytes;
  SafetensorsFile f((dir / "m.safetensors").string());
  const TensorView& t = f.tensors().at("x");
  CHECK(reinterpret_cast<uintptr_t>(t.data) % 4 == 0);
  float got[3];
  std::memcpy(got, t.data, 12);
  CHECK(std::memcmp(got, want, 12) == 0);
}
