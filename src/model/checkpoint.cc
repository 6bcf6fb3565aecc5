#include "src/model/checkpoint.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

// A shard name from the index must stay inside the model folder: relative, no "..", no empty components.
absl::Status CheckShardName(const std::string& index_path, const std::string& name) {
  bool ok = !name.empty() && name.front() != '/' && name.find('\0') == std::string::npos &&
            name.find('\\') == std::string::npos;
  if (ok) {
    for (absl::string_view part : absl::StrSplit(name, '/')) {
      if (part.empty() || part == "." || part == "..") ok = false;
    }
  }
  if (!ok) {
    return CorruptError(StrCat(index_path, ": shard name '", name, "' leaves the model folder"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  ck->dir_ = dir;
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  // Like Transformers, a single model.safetensors wins over an index.
  if (FileExists(single_path)) {
    ck->source_ = single_path;
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
    for (const TensorInfo& t : file->tensors()) ck->where_[t.name] = file.get();
    ck->shards_.push_back(std::move(file));
  } else if (FileExists(index_path)) {
    ck->source_ = index_path;
    ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
    ODMOE_ASSIGN_OR_RETURN(Json index, ParseJson(text, index_path));
    if (!index.is_object()) return CorruptError(StrCat(index_path, ": expected a JSON object"));
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) {
      return CorruptError(StrCat(index_path, ": field 'weight_map' missing or not an object"));
    }
    std::unordered_map<std::string, const SafetensorsFile*> shard_by_name;
    for (const auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string()) {
        return CorruptError(StrCat(index_path, ": weight_map entry for '", tensor, "' is not a string"));
      }
      const std::string shard_name = shard.get<std::string>();
      ODMOE_RETURN_IF_ERROR(CheckShardName(index_path, shard_name));
      auto it = shard_by_name.find(shard_name);
      if (it == shard_by_name.end()) {
        const std::string shard_path = StrCat(dir, "/", shard_name);
        auto file = SafetensorsFile::Open(shard_path);
        if (absl::IsNotFound(file.status())) {
          return absl::NotFoundError(
              StrCat(shard_path, ": no such file (shard listed in ", index_path, " for tensor '", tensor, "')"));
        }
        if (!file.ok()) return file.status();
        it = shard_by_name.emplace(shard_name, file->get()).first;
        ck->shards_.push_back(std::move(file).value());
      }
      if (it->second->Find(tensor) == nullptr) {
        return CorruptError(StrCat(index_path, ": tensor '", tensor, "' is listed in shard '", shard_name,
                                   "' but that file does not contain it"));
      }
      ck->where_[tensor] = it->second;
    }
  } else {
    return absl::NotFoundError(
        StrCat(dir, ": no model.safetensors or model.safetensors.index.json (is this a model folder?)"));
  }
  return ck;
}

const SafetensorsFile* Checkpoint::ShardOf(std::string_view name) const {
  auto it = where_.find(std::string(name));
  return it == where_.end() ? nullptr : it->second;
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  const SafetensorsFile* f = ShardOf(name);
  return f == nullptr ? nullptr : f->Find(name);
}

absl::StatusOr<TensorData> Checkpoint::Check(std::string_view name, std::span<const int64_t> expected) const {
  const SafetensorsFile* file = ShardOf(name);
  if (file == nullptr) {
    return absl::NotFoundError(StrCat(source_, ": tensor '", name, "' is missing from the checkpoint"));
  }
  const TensorInfo* info = file->Find(name);
  if (!info->dtype || (*info->dtype != DType::kF32 && *info->dtype != DType::kF16 && *info->dtype != DType::kBF16)) {
    return absl::UnimplementedError(StrCat(file->path(), ": tensor '", name, "' has dtype ", info->dtype_name,
                                           ", which odmoe does not support (supported: F32, F16, BF16)"));
  }
  if (!std::equal(info->shape.begin(), info->shape.end(), expected.begin(), expected.end())) {
    return InvalidModelError(StrCat(file->path(), ": tensor '", name, "' has shape ", info->ShapeString(),
                                    " but the config needs [", absl::StrJoin(expected, ", "), "]"));
  }
  return TensorData{info, file->DataOf(*info), *info->dtype, &file->path()};
}

absl::StatusOr<TensorData> Checkpoint::Read(std::string_view name, std::span<const int64_t> expected) {
  ODMOE_ASSIGN_OR_RETURN(TensorData data, Check(name, expected));
  std::lock_guard<std::mutex> lock(mu_);
  read_.insert(std::string(name));
  return data;
}

absl::Status Checkpoint::Validate(const std::vector<TensorSpec>& specs) const {
  for (const TensorSpec& s : specs) {
    ODMOE_RETURN_IF_ERROR(Check(s.name, s.shape).status());
  }
  return absl::OkStatus();
}

std::vector<std::string> Checkpoint::ReadNames() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {read_.begin(), read_.end()};
}

int64_t Checkpoint::ExpertTensorsRead() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::count_if(read_.begin(), read_.end(), [](const std::string& n) { return IsExpertTensorName(n); });
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, _] : where_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t Checkpoint::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& s : shards_) total += s->mapped().size();
  return total;
}

}  // namespace odmoe
