#include "src/engine/moe_units.h"

#include "src/common/status.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<MlpWorkspace>> MlpWorkspace::Create(Device& device, int64_t max_tokens,
                                                                   int64_t max_intermediate) {
  std::unique_ptr<MlpWorkspace> ws(new MlpWorkspace());
  const size_t bytes = static_cast<size_t>(max_tokens * max_intermediate) * sizeof(float);
  ODMOE_ASSIGN_OR_RETURN(ws->gate_, device.Allocate(bytes, "mlp workspace (gate)"));
  ODMOE_ASSIGN_OR_RETURN(ws->up_, device.Allocate(bytes, "mlp workspace (up)"));
  ws->max_tokens_ = max_tokens;
  ws->max_intermediate_ = max_intermediate;
  return ws;
}

void RunMlp(Device& device, const MlpWeights& mlp, const float* x, int64_t n, int64_t hidden, MlpWorkspace& ws,
            float* out, Stream* stream) {
  ODMOE_CHECK(mlp.present());
  ODMOE_CHECK(n <= ws.max_tokens() && mlp.intermediate <= ws.max_intermediate());
  const int64_t inter = mlp.intermediate;
  device.MatMul(x, mlp.gate, {}, n, hidden, inter, ws.gate(), stream);
  device.MatMul(x, mlp.up, {}, n, hidden, inter, ws.up(), stream);
  device.SwiGlu(ws.gate(), ws.up(), n * inter, ws.gate(), stream);
  device.MatMul(ws.gate(), mlp.down, {}, n, inter, hidden, out, stream);
}

void RunRouter(Device& device, const ModelConfig& config, WeightRef router, const float* h, int64_t n,
               float* logits_scratch, int32_t* ids, float* weights, Stream* stream) {
  device.MatMul(h, router, {}, n, config.hidden_size, config.num_experts, logits_scratch, stream);
  device.RouterTopK(logits_scratch, n, config.num_experts, config.top_k, config.norm_topk_prob, ids, weights,
                    stream);
}

}  // namespace odmoe
