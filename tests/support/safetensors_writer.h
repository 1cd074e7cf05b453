// Writes safetensors files (and sharded checkpoints) for tests, including
// deliberately corrupted ones.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace dz::test {

struct RawTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline double bf16_to_double(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline RawTensor random_f32(const std::string& name, std::vector<int64_t> shape, std::mt19937& rng) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::normal_distribution<float> nd(0.f, 1.f);
  RawTensor t{name, "F32", shape, std::vector<uint8_t>(n * 4)};
  for (int64_t i = 0; i < n; ++i) {
    float v = nd(rng);
    std::memcpy(&t.bytes[i * 4], &v, 4);
  }
  return t;
}

inline RawTensor random_bf16(const std::string& name, std::vector<int64_t> shape, std::mt19937& rng) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::normal_distribution<float> nd(0.f, 1.f);
  RawTensor t{name, "BF16", shape, std::vector<uint8_t>(n * 2)};
  for (int64_t i = 0; i < n; ++i) {
    uint16_t v = f32_to_bf16(nd(rng));
    std::memcpy(&t.bytes[i * 2], &v, 2);
  }
  return t;
}

// Header JSON in the standard layout (tensors packed in order).
inline nlohmann::json header_for(const std::vector<RawTensor>& ts) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  h["__metadata__"] = {{"format", "pt"}};
  return h;
}

// Write a file from an explicit header string and data bytes (for corruption tests).
inline void write_raw(const std::filesystem::path& p, const std::string& header, const std::vector<uint8_t>& data,
                      uint64_t header_len_override = 0) {
  std::ofstream f(p, std::ios::binary);
  uint64_t n = header_len_override ? header_len_override : header.size();
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xFF));
  f << header;
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

inline void write_safetensors(const std::filesystem::path& p, const std::vector<RawTensor>& ts) {
  std::vector<uint8_t> data;
  for (const auto& t : ts) data.insert(data.end(), t.bytes.begin(), t.bytes.end());
  write_raw(p, header_for(ts).dump(), data);
}

// Write ts into n_shards files plus model.safetensors.index.json.
inline void write_sharded(const std::filesystem::path& dir, const std::vector<RawTensor>& ts, int n_shards) {
  std::filesystem::create_directories(dir);
  nlohmann::json wm = nlohmann::json::object();
  std::vector<std::vector<RawTensor>> parts(n_shards);
  for (size_t i = 0; i < ts.size(); ++i) parts[i % n_shards].push_back(ts[i]);
  for (int s = 0; s < n_shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
    write_safetensors(dir / name, parts[s]);
    for (const auto& t : parts[s]) wm[t.name] = name;
  }
  std::ofstream(dir / "model.safetensors.index.json")
      << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", wm}}.dump(2);
}

// A fresh empty directory under the system temp dir, removed when the test
// process exits (also after a failed REQUIRE skipped the test's own cleanup).
inline std::filesystem::path temp_dir(const std::string& tag) {
  struct Made {
    std::vector<std::filesystem::path> dirs;
    ~Made() {
      for (const auto& d : dirs) {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    }
  };
  static Made made;
  static std::mt19937_64 rng{std::random_device{}()};
  auto p = std::filesystem::temp_directory_path() / ("dz-test-" + tag + "-" + std::to_string(rng()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  made.dirs.push_back(p);
  return p;
}

// A random checkpoint's tensors, drawn for tests: matrices ~N(0, 1 / cols)
// rounded to BF16 (activations keep their scale through the layers), fp32
// vectors base + sd N(0, 1), and MXFP4 blocks with E8M0 scales near 2^-7.
struct RandomTensors {
  std::mt19937& rng;
  std::vector<RawTensor> ts;
  void mat(const std::string& name, int64_t rows, int64_t cols) {
    RawTensor t = random_bf16(name, {rows, cols}, rng);
    const float sd = 1.f / std::sqrt(float(cols));
    for (size_t i = 0; i < t.bytes.size(); i += 2) {
      uint16_t b;
      std::memcpy(&b, &t.bytes[i], 2);
      b = f32_to_bf16(float(bf16_to_double(b)) * sd);
      std::memcpy(&t.bytes[i], &b, 2);
    }
    ts.push_back(std::move(t));
  }
  void vec(const std::string& name, std::vector<int64_t> shape, float base, float sd) {
    RawTensor t = random_f32(name, std::move(shape), rng);
    for (size_t i = 0; i < t.bytes.size(); i += 4) {
      float f;
      std::memcpy(&f, &t.bytes[i], 4);
      f = base + sd * f;
      std::memcpy(&t.bytes[i], &f, 4);
    }
    ts.push_back(std::move(t));
  }
  void vec(const std::string& name, int64_t len, float base, float sd) {
    vec(name, std::vector<int64_t>{len}, base, sd);
  }
  void fp4(const std::string& base_name, int64_t rows, int64_t cols) {  // ~N(0, 1 / cols) in scale
    std::uniform_int_distribution<int> byte(0, 255), sc(119, 121);
    RawTensor b{
        base_name + ".weight_blocks", "U8", {rows, cols / 32, 16}, std::vector<uint8_t>(size_t(rows * cols / 2))};
    RawTensor s{base_name + ".weight_scales", "U8", {rows, cols / 32}, std::vector<uint8_t>(size_t(rows * cols / 32))};
    for (auto& x : b.bytes) x = uint8_t(byte(rng));
    for (auto& x : s.bytes) x = uint8_t(sc(rng));
    ts.push_back(std::move(b));
    ts.push_back(std::move(s));
  }
};

}  // namespace dz::test
