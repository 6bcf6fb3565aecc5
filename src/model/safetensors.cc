#include "src/model/safetensors.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

struct KnownDType {
  std::string_view name;
  uint32_t bits;
};
// Every dtype the safetensors format defines; only F32/F16/BF16 (and the integer types) map to ours.
constexpr KnownDType kKnownDTypes[] = {
    {"BOOL", 8}, {"U8", 8},   {"I8", 8},    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
    {"U16", 16}, {"F16", 16}, {"BF16", 16}, {"I32", 32},    {"U32", 32},    {"F32", 32},    {"F64", 64},
    {"I64", 64}, {"U64", 64}, {"C64", 64},  {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6},
};

const KnownDType* FindKnown(std::string_view name) {
  for (const auto& k : kKnownDTypes) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

constexpr int64_t kMaxDim = int64_t{1} << 40;

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::ShapeString() const { return StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* data, size_t size, const std::string& where) {
  if (size < 8) {
    return CorruptError(StrCat(where, ": file is ", size, " bytes, too short for a safetensors header"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return CorruptError(StrCat(where, ": header length ", header_len, " exceeds the limit of ",
                               kMaxSafetensorsHeaderBytes, " bytes (corrupt or not a safetensors file)"));
  }
  if (header_len > size - 8) {
    return CorruptError(
        StrCat(where, ": header length ", header_len, " runs past the end of the file (", size, " bytes): truncated?"));
  }
  if (header_len < 2 || data[8] != '{') {
    return CorruptError(StrCat(where, ": header does not start with a JSON object"));
  }
  const std::string_view text(reinterpret_cast<const char*>(data + 8), header_len);
  ODMOE_ASSIGN_OR_RETURN(Json header, ParseJson(text, StrCat(where, ": header")));
  if (!header.is_object()) return CorruptError(StrCat(where, ": header is not a JSON object"));

  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = size - out.data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return CorruptError(StrCat(where, ": __metadata__ is not an object"));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) {
          return CorruptError(StrCat(where, ": __metadata__ value for '", k, "' is not a string"));
        }
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string ctx = StrCat(where, ": tensor '", name, "'");
    if (name.empty()) return CorruptError(StrCat(where, ": a tensor has an empty name"));
    if (!entry.is_object()) return CorruptError(StrCat(ctx, ": entry is not an object"));
    auto dt = entry.find("dtype");
    auto sh = entry.find("shape");
    auto off = entry.find("data_offsets");
    if (dt == entry.end() || !dt->is_string()) return CorruptError(StrCat(ctx, ": missing or non-string dtype"));
    if (sh == entry.end() || !sh->is_array()) return CorruptError(StrCat(ctx, ": missing or non-list shape"));
    if (off == entry.end() || !off->is_array() || off->size() != 2) {
      return CorruptError(StrCat(ctx, ": data_offsets must be a list of two integers"));
    }
    TensorInfo t;
    t.name = name;
    t.dtype_name = dt->get<std::string>();
    const KnownDType* known = FindKnown(t.dtype_name);
    if (known == nullptr) return CorruptError(StrCat(ctx, ": unknown dtype '", t.dtype_name, "'"));
    t.dtype = ParseDType(t.dtype_name);
    // Element count, guarding against overflow: every dim below 2^40 and the running product below 2^62.
    __int128 numel = 1;
    for (const Json& d : *sh) {
      if (!d.is_number_integer() || (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0)) {
        return CorruptError(StrCat(ctx, ": shape entries must be non-negative integers, got ", sh->dump()));
      }
      const uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(kMaxDim)) return CorruptError(StrCat(ctx, ": dimension ", v, " too large"));
      t.shape.push_back(static_cast<int64_t>(v));
      numel *= static_cast<int64_t>(v);
      if (numel > (__int128{1} << 62)) return CorruptError(StrCat(ctx, ": shape ", sh->dump(), " too large"));
    }
    uint64_t begin = 0, end = 0;
    for (int i = 0; i < 2; ++i) {
      const Json& o = (*off)[i];
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0)) {
        return CorruptError(StrCat(ctx, ": data_offsets must be non-negative integers, got ", off->dump()));
      }
      (i == 0 ? begin : end) = o.get<uint64_t>();
    }
    if (begin > end) return CorruptError(StrCat(ctx, ": data_offsets [", begin, ", ", end, "] are reversed"));
    if (end > data_size) {
      return CorruptError(StrCat(ctx, ": data_offsets [", begin, ", ", end, "] lie outside the data section (",
                                 data_size, " bytes): truncated file?"));
    }
    const __int128 bits = numel * known->bits;
    const __int128 need = (bits + 7) / 8;
    if (need != static_cast<__int128>(end - begin)) {
      return CorruptError(StrCat(ctx, ": data_offsets span ", end - begin, " bytes but shape ", t.ShapeString(), " of ",
                                 t.dtype_name, " needs ", static_cast<uint64_t>(need)));
    }
    t.offset = out.data_start + begin;
    t.nbytes = end - begin;
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  // Sorted by offset, a tensor overlaps an earlier one iff it starts before the end of the previous non-empty
  // one. Empty tensors occupy no bytes and overlap nothing, but must not hide an overlap between neighbours.
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& cur : out.tensors) {
    if (cur.nbytes == 0) continue;
    if (prev != nullptr && prev->offset + prev->nbytes > cur.offset) {
      return CorruptError(
          StrCat(where, ": tensors '", prev->name, "' and '", cur.name, "' overlap in the data section"));
    }
    prev = &cur;
  }
  return out;
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<MappedFile> file, SafetensorsHeader header)
    : file_(std::move(file)), header_(std::move(header)) {
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  ODMOE_ASSIGN_OR_RETURN(SafetensorsHeader header, ParseSafetensors(file->data(), file->size(), path));
  return std::unique_ptr<SafetensorsFile>(new SafetensorsFile(std::move(file), std::move(header)));
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

}  // namespace odmoe
