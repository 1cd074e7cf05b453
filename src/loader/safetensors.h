// Hugging Face safetensors checkpoints: each shard is mmap'd once and every
// tensor is a view into the mapping (no copies). Every header field is
// validated before any tensor byte is touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dz {

// F8_E8M0: power-of-two scale bytes (2^(b - 127), 0xFF NaN).
enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, F8_E5M2, U8, I8, I16, I32, I64, BOOL, F64, F8_E8M0 };

const char* dtype_name(DType t);
size_t dtype_size(DType t);
bool dtype_from_name(const std::string& s, DType* out);

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the shard's mapping (a copy where the file misaligns it)
  size_t nbytes = 0;
  const std::string* file = nullptr;  // shard path, for messages

  int64_t numel() const;
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  std::string describe() const;  // "name [a, b] BF16 in file"
};

// One mmap'd .safetensors file.
class SafetensorsFile {
 public:
  // Throws dz::Error (DZ_ERR_IO / DZ_ERR_FORMAT) naming the file and tensor.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const { return size_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::vector<uint64_t>> copies_;  // tensors the file does not align (8-byte aligned storage)
};

// All tensors of a model directory: model.safetensors, or the shards named by
// model.safetensors.index.json (every entry must exist in its shard, and every
// shard tensor must be listed), or every *.safetensors when neither exists.
class WeightStore {
 public:
  // progress(done_shards, total_shards) may be null.
  explicit WeightStore(const std::string& dir, const std::function<void(size_t, size_t)>& progress = {});

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const TensorView* find(const std::string& name) const;
  // Throws DZ_ERR_NOT_FOUND naming the tensor and directory.
  const TensorView& get(const std::string& name) const;
  // get() plus dtype and shape checks with clear messages.
  const TensorView& get(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const;

  const std::map<std::string, const TensorView*>& all() const { return index_; }
  size_t n_shards() const { return shards_.size(); }
  const std::string& dir() const { return dir_; }
  uint64_t total_bytes() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace dz
