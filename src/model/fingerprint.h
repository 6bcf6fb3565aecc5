// A short digest that identifies a model, so nodes can refuse peers serving another one: FNV-1a 64 over
// config.json's bytes and every tensor's name, dtype and shape (metadata only; no tensor data is read, so
// computing it opens no expert).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "src/model/checkpoint.h"
#include "src/model/synthetic.h"

namespace odmoe {

// 16 hex digits.
absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir, const Checkpoint& checkpoint);

// The fingerprint of synthetic weights (SyntheticSpec: config, layers, seed): FNV-1a 64 over a tag, the config
// file's bytes, the effective layer count and the seed, so every node generating the same weights agrees and a
// node with another seed or layer count is refused. Errors of reading and parsing the config.
absl::StatusOr<std::string> SyntheticFingerprint(const SyntheticSpec& spec);

}  // namespace odmoe
