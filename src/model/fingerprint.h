// A short digest that identifies a model, so nodes can refuse peers serving another one: FNV-1a 64 over
// config.json's bytes and every tensor's name, dtype and shape (metadata only; no tensor data is read, so
// computing it opens no expert).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "src/model/checkpoint.h"

namespace odmoe {

// 16 hex digits.
absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir, const Checkpoint& checkpoint);

}  // namespace odmoe
