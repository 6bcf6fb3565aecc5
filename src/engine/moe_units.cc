#include "src/engine/moe_units.h"

#include <algorithm>
#include <cstring>

#include "src/common/status.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<MlpWorkspace>> MlpWorkspace::Create(Device& device, int64_t max_tokens,
                                                                   int64_t max_intermediate) {
  std::unique_ptr<MlpWorkspace> ws(new MlpWorkspace());
  const size_t bytes = static_cast<size_t>(2 * max_tokens * max_intermediate) * sizeof(float);
  ODMOE_ASSIGN_OR_RETURN(ws->buffer_, device.Allocate(bytes, "mlp workspace (gate, up)"));
  ws->max_tokens_ = max_tokens;
  ws->max_intermediate_ = max_intermediate;
  return ws;
}

void RunMlp(Device& device, const MlpWeights& mlp, const float* x, int64_t n, int64_t hidden, MlpWorkspace& ws,
            float* out, Stream* stream) {
  ODMOE_CHECK(mlp.present());
  ODMOE_CHECK(n <= ws.max_tokens() && mlp.intermediate <= ws.max_intermediate());
  const int64_t inter = mlp.intermediate;
  if (n == 1 && !mlp.gate_up.empty()) {  // [gate | up] is one row of the stacked projection
    float* gate_up = ws.gate();
    device.MatMul(x, mlp.gate_up, {}, 1, hidden, 2 * inter, gate_up, stream);
    device.SwiGlu(gate_up, gate_up + inter, inter, gate_up, stream);
    device.MatMul(gate_up, mlp.down, {}, 1, inter, hidden, out, stream);
    return;
  }
  device.MatMul(x, mlp.gate, {}, n, hidden, inter, ws.gate(), stream);
  device.MatMul(x, mlp.up, {}, n, hidden, inter, ws.up(), stream);
  device.SwiGlu(ws.gate(), ws.up(), n * inter, ws.gate(), stream);
  device.MatMul(ws.gate(), mlp.down, {}, n, inter, hidden, out, stream);
}

std::vector<ExpertBatch> GroupByExpert(std::span<const int32_t> ids, std::span<const float> weights, int64_t n,
                                       int64_t k) {
  std::vector<ExpertBatch> batches;
  std::vector<int32_t> experts(ids.begin(), ids.begin() + n * k);
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  batches.reserve(experts.size());
  for (int32_t e : experts) {
    ExpertBatch b;
    b.expert = e;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        if (ids[static_cast<size_t>(i * k + j)] == e) {
          b.rows.push_back(static_cast<int32_t>(i));
          b.weights.push_back(weights[static_cast<size_t>(i * k + j)]);
        }
      }
    }
    batches.push_back(std::move(b));
  }
  return batches;
}

void PackRowsAndScales(std::span<const ExpertBatch> batches, int64_t n, int64_t k, PackedRouting* packed) {
  const size_t pairs = static_cast<size_t>(n * k);
  packed->pairs = pairs;
  packed->host.assign(2 * pairs, 0);
  packed->offsets.resize(batches.size());
  size_t at = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    packed->offsets[b] = at;
    for (size_t i = 0; i < batches[b].rows.size(); ++i, ++at) {
      packed->host[at] = batches[b].rows[i];
      std::memcpy(&packed->host[pairs + at], &batches[b].weights[i], sizeof(float));
    }
  }
  ODMOE_CHECK(at == pairs);
}

void ComputeExpertRows(Device& device, const MlpWeights& mlp, const float* hidden, int64_t n,
                       const int32_t* device_rows, int64_t m, int64_t h, float* gathered, MlpWorkspace& ws,
                       float* out, Stream* stream) {
  const float* x = hidden;
  if (!(m == n && n == 1)) {
    device.GatherRows(hidden, device_rows, m, h, gathered, stream);
    x = gathered;
  }
  RunMlp(device, mlp, x, m, h, ws, out, stream);
}

absl::Status CombineExpertOutputs(Device& device, std::span<const ExpertBatch> batches, const PackedRouting& routing,
                                  const int32_t* dev_index, int64_t h,
                                  const std::function<absl::StatusOr<const float*>(size_t b)>& expert_output,
                                  float* out, Stream* stream) {
  for (size_t b = 0; b < batches.size(); ++b) {
    ODMOE_ASSIGN_OR_RETURN(const float* y, expert_output(b));
    const int64_t m = static_cast<int64_t>(batches[b].rows.size());
    device.ScatterAddScaled(y, routing.rows(dev_index, b), routing.scales(dev_index, b), m, h,
                            /*sigmoid_scale=*/false, out, stream);
  }
  return absl::OkStatus();
}

}  // namespace odmoe
