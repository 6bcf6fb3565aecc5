// The two units of a sparse layer that later run on different machines: the router (on main and on the shadow)
// and the expert FFN (on the workers). Both are plain functions over device memory so that any process can
// call them on its own Device.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/engine/model_weights.h"

namespace odmoe {

// Scratch device memory for RunMlp: two [max_tokens, max_intermediate] fp32 tensors.
class MlpWorkspace {
 public:
  static absl::StatusOr<std::unique_ptr<MlpWorkspace>> Create(Device& device, int64_t max_tokens,
                                                              int64_t max_intermediate);
  float* gate() { return gate_->as<float>(); }
  float* up() { return up_->as<float>(); }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t max_intermediate() const { return max_intermediate_; }
  uint64_t bytes() const { return gate_->size() + up_->size(); }

 private:
  MlpWorkspace() = default;
  std::unique_ptr<Buffer> gate_, up_;
  int64_t max_tokens_ = 0, max_intermediate_ = 0;
};

// out[n, hidden] = down(silu(gate(x)) * up(x)) for x: [n, hidden]. out must not alias x.
// REQUIRES: n <= ws.max_tokens(), mlp.intermediate <= ws.max_intermediate().
void RunMlp(Device& device, const MlpWeights& mlp, const float* x, int64_t n, int64_t hidden, MlpWorkspace& ws,
            float* out, Stream* stream);

// Router of one sparse layer: logits = h * router^T, softmax, top-k. h: [n, hidden];
// logits_scratch: [n, num_experts]; ids, weights: [n, top_k] on the device (best first; weights renormalised
// when the config says so).
void RunRouter(Device& device, const ModelConfig& config, WeightRef router, const float* h, int64_t n,
               float* logits_scratch, int32_t* ids, float* weights, Stream* stream);

}  // namespace odmoe
