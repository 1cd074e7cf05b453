#include "loader/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"

namespace dz {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
struct DTypeInfo {
  const char* name;
  DType type;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {"F32", DType::F32, 4},         {"F16", DType::F16, 2}, {"BF16", DType::BF16, 2}, {"F8_E4M3", DType::F8_E4M3, 1},
    {"F8_E5M2", DType::F8_E5M2, 1}, {"U8", DType::U8, 1},   {"I8", DType::I8, 1},     {"I16", DType::I16, 2},
    {"I32", DType::I32, 4},         {"I64", DType::I64, 8}, {"BOOL", DType::BOOL, 1}, {"F64", DType::F64, 8},
    {"F8_E8M0", DType::F8_E8M0, 1},
};
// A header larger than this is refused before it is read (real checkpoints
// have headers of a few MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
}  // namespace

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}
size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 0;
}
bool dtype_from_name(const std::string& s, DType* out) {
  for (const auto& d : kDTypes)
    if (s == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::string TensorView::describe() const {
  return cat("tensor '", name, "' ", shape_str(shape), " ", dtype_name(dtype), " in ", file ? *file : std::string("?"));
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(DZ_ERR_IO, path_, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(DZ_ERR_IO, path_, ": cannot stat: ", std::strerror(errno));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    fail(DZ_ERR_FORMAT, path_, ": truncated: ", size_, " bytes, a safetensors file has at least 8");
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail(DZ_ERR_IO, path_, ": mmap failed: ", std::strerror(errno));
  }
  try {
    const auto* base = static_cast<const uint8_t*>(map_);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; ++i) hlen |= uint64_t(base[i]) << (8 * i);
    check(hlen <= kMaxHeaderBytes, DZ_ERR_FORMAT, path_, ": header length ", hlen, " exceeds the ", kMaxHeaderBytes,
          "-byte limit");
    check(hlen <= size_ - 8, DZ_ERR_FORMAT, path_, ": header length ", hlen, " runs past the end of the ", size_,
          "-byte file (truncated?)");
    const char* hbeg = reinterpret_cast<const char*>(base + 8);
    json h = json::parse(hbeg, hbeg + hlen, nullptr, /*allow_exceptions=*/false);
    check(!h.is_discarded(), DZ_ERR_FORMAT, path_, ": header is not well-formed JSON (or not UTF-8)");
    check(h.is_object(), DZ_ERR_FORMAT, path_, ": header is not a JSON object");
    const uint64_t data_start = 8 + hlen;
    const uint64_t data_len = size_ - data_start;
    struct Range {
      uint64_t b, e;
      const std::string* name;
    };
    std::vector<Range> ranges;
    for (auto it = h.begin(); it != h.end(); ++it) {
      const std::string& name = it.key();
      if (name == "__metadata__") {
        check(it->is_object(), DZ_ERR_FORMAT, path_, ": __metadata__ is not an object");
        for (auto m = it->begin(); m != it->end(); ++m) {
          check(m->is_string(), DZ_ERR_FORMAT, path_, ": __metadata__ '", m.key(), "' is not a string");
          metadata_[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const json& e = *it;
      check(e.is_object(), DZ_ERR_FORMAT, path_, ": tensor '", name, "': entry is not an object");
      check(e.contains("dtype") && e["dtype"].is_string(), DZ_ERR_FORMAT, path_, ": tensor '", name,
            "': missing dtype");
      TensorView t;
      t.name = name;
      const std::string dt = e["dtype"].get<std::string>();
      check(dtype_from_name(dt, &t.dtype), DZ_ERR_FORMAT, path_, ": tensor '", name, "': unknown dtype '", dt, "'");
      check(e.contains("shape") && e["shape"].is_array(), DZ_ERR_FORMAT, path_, ": tensor '", name, "': missing shape");
      uint64_t numel = 1;
      bool overflow = false;
      for (const auto& d : e["shape"]) {
        check(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), DZ_ERR_FORMAT, path_,
              ": tensor '", name, "': shape entries must be non-negative integers");
        uint64_t v = d.get<uint64_t>();
        check(v < (1ull << 48), DZ_ERR_FORMAT, path_, ": tensor '", name, "': dimension ", v, " is implausible");
        if (v && numel > UINT64_MAX / v) overflow = true;
        numel *= v;
        t.shape.push_back(static_cast<int64_t>(v));
      }
      check(!overflow && numel <= UINT64_MAX / dtype_size(t.dtype), DZ_ERR_FORMAT, path_, ": tensor '", name,
            "': shape overflows");
      check(e.contains("data_offsets") && e["data_offsets"].is_array() && e["data_offsets"].size() == 2 &&
                e["data_offsets"][0].is_number_unsigned() && e["data_offsets"][1].is_number_unsigned(),
            DZ_ERR_FORMAT, path_, ": tensor '", name, "': data_offsets must be two non-negative integers");
      const uint64_t b = e["data_offsets"][0].get<uint64_t>(), en = e["data_offsets"][1].get<uint64_t>();
      check(b <= en, DZ_ERR_FORMAT, path_, ": tensor '", name, "': data_offsets [", b, ", ", en, "] are reversed");
      check(en <= data_len, DZ_ERR_FORMAT, path_, ": tensor '", name, "': data_offsets [", b, ", ", en,
            "] run past the end of the data (", data_len, " bytes; file truncated?)");
      const uint64_t want = numel * dtype_size(t.dtype);
      check(en - b == want, DZ_ERR_FORMAT, path_, ": tensor '", name, "': ", shape_str(t.shape), " ", dt, " needs ",
            want, " bytes but data_offsets give ", en - b);
      t.data = base + data_start + b;
      t.nbytes = static_cast<size_t>(want);
      t.file = &path_;
      auto [pos, inserted] = tensors_.emplace(name, std::move(t));
      check(inserted, DZ_ERR_FORMAT, path_, ": tensor '", name, "' appears twice");
      ranges.push_back({b, en, &pos->first});
    }
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.b < b.b; });
    for (size_t i = 1; i < ranges.size(); ++i) {
      if (ranges[i].b == ranges[i].e || ranges[i - 1].b == ranges[i - 1].e) continue;  // empty tensors
      check(ranges[i].b >= ranges[i - 1].e, DZ_ERR_FORMAT, path_, ": tensors '", *ranges[i - 1].name, "' and '",
            *ranges[i].name, "' overlap (bytes ", ranges[i].b, " < ", ranges[i - 1].e, ")");
    }
    // Writers pad the header so every tensor starts aligned to its element size; where one does not (an old or
    // hand-made file), reading its elements in place would be misaligned loads: copy those tensors instead.
    size_t copied = 0, copied_bytes = 0;
    for (auto& [name, t] : tensors_) {
      if (t.nbytes == 0 || reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) == 0) continue;
      auto& buf = copies_.emplace_back((t.nbytes + 7) / 8);
      std::memcpy(buf.data(), t.data, t.nbytes);
      t.data = reinterpret_cast<const uint8_t*>(buf.data());
      ++copied, copied_bytes += t.nbytes;
    }
    if (copied)
      log_warn(path_, ": ", copied, " tensors (", copied_bytes,
               " bytes) are not aligned to their element size in the file (header not padded to 8 bytes?); "
               "they were copied into memory");
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

WeightStore::WeightStore(const std::string& dir, const std::function<void(size_t, size_t)>& progress) : dir_(dir) {
  std::error_code ec;
  check(fs::is_directory(dir, ec), DZ_ERR_IO, dir, ": not a directory");
  const fs::path d(dir);
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;  // tensor -> shard file name
  const fs::path index = d / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    check(bool(in), DZ_ERR_IO, index.string(), ": cannot open");
    json j = json::parse(in, nullptr, false);
    check(!j.is_discarded() && j.is_object(), DZ_ERR_FORMAT, index.string(), ": not a JSON object");
    check(j.contains("weight_map") && j["weight_map"].is_object(), DZ_ERR_FORMAT, index.string(),
          ": missing \"weight_map\" object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      check(it->is_string(), DZ_ERR_FORMAT, index.string(), ": weight_map['", it.key(), "'] is not a string");
      const std::string f = it->get<std::string>();
      check(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", DZ_ERR_FORMAT, index.string(),
            ": weight_map['", it.key(), "'] names '", f, "', not a file in the model directory");
      weight_map[it.key()] = f;
      if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
    }
    for (const auto& f : files)
      check(fs::exists(d / f), DZ_ERR_IO, index.string(), ": shard '", f, "' (holding tensor '",
            std::find_if(weight_map.begin(), weight_map.end(), [&](auto& kv) { return kv.second == f; })->first,
            "') does not exist");
  } else if (fs::exists(d / "model.safetensors")) {
    files.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    check(!files.empty(), DZ_ERR_NOT_FOUND, dir,
          ": no model.safetensors, model.safetensors.index.json or *.safetensors");
  }
  for (size_t i = 0; i < files.size(); ++i) {
    shards_.push_back(std::make_unique<SafetensorsFile>((d / files[i]).string()));
    if (progress) progress(i + 1, files.size());
  }
  for (const auto& s : shards_) {
    const std::string fname = fs::path(s->path()).filename().string();
    for (const auto& [name, t] : s->tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(name);
        check(it != weight_map.end(), DZ_ERR_FORMAT, s->path(), ": tensor '", name,
              "' is not listed in model.safetensors.index.json");
        check(it->second == fname, DZ_ERR_FORMAT, s->path(), ": tensor '", name, "' is listed in shard '", it->second,
              "'");
      }
      check(index_.emplace(name, &t).second, DZ_ERR_FORMAT, s->path(), ": tensor '", name,
            "' also appears in another shard");
    }
  }
  for (const auto& [name, f] : weight_map)
    check(index_.count(name), DZ_ERR_FORMAT, index.string(), ": tensor '", name, "' is listed in shard '", f,
          "' but that shard does not contain it");
}

const TensorView* WeightStore::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorView& WeightStore::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail(DZ_ERR_NOT_FOUND, dir_, ": tensor '", name, "' not found in the checkpoint");
  return *t;
}

const TensorView& WeightStore::get(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
  const TensorView& t = get(name);
  check(t.dtype == dtype, DZ_ERR_FORMAT, t.describe(), ": expected dtype ", dtype_name(dtype));
  check(t.shape == shape, DZ_ERR_FORMAT, t.describe(), ": expected shape ", shape_str(shape));
  return t;
}

uint64_t WeightStore::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [_, t] : index_) n += t->nbytes;
  return n;
}

}  // namespace dz
