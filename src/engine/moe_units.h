// The units of a sparse layer that later run on different machines: the expert FFN (on the workers) and the
// steps that keep the cluster exact wherever the experts run (prepare / experts / finalize): GroupByExpert +
// PackRowsAndScales, ComputeExpertRows, CombineExpertOutputs. (The router, on main and on the shadow, is one
// Device op: Device::AddRmsNormRoute, with the norm before it.) The local executor, main's remote executor and the
// worker call these same functions, so the summation order and the ops applied to each row are one definition, not
// copies kept in step by hand. All are plain functions over device memory so that any process can call them on
// its own Device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
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
  // [max_tokens, max_intermediate] each, gate then up in one allocation (so 2 x max_intermediate floats from
  // gate() hold one token's [gate | up]).
  float* gate() { return buffer_->as<float>(); }
  float* up() { return gate() + max_tokens_ * max_intermediate_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t max_intermediate() const { return max_intermediate_; }
  uint64_t bytes() const { return buffer_->size(); }

 private:
  MlpWorkspace() = default;
  std::unique_ptr<Buffer> buffer_;
  int64_t max_tokens_ = 0, max_intermediate_ = 0;
};

// out[n, hidden] = down(silu(gate(x)) * up(x)) for x: [n, hidden]; one token through mlp.gate_up when it is set
// (the same bits). out must not alias x.
// REQUIRES: n <= ws.max_tokens(), mlp.intermediate <= ws.max_intermediate().
void RunMlp(Device& device, const MlpWeights& mlp, const float* x, int64_t n, int64_t hidden, MlpWorkspace& ws,
            float* out, Stream* stream);

// Groups a layer's routing by expert: for each expert id in ascending order, the token rows that chose it and
// their weights. Every executor (local or remote) uses this one grouping so the summation order is the same.
// ids, weights: [n, k] (host).
struct ExpertBatch {
  int32_t expert = 0;
  std::vector<int32_t> rows;   // token indices, ascending
  std::vector<float> weights;  // same length as rows
};
std::vector<ExpertBatch> GroupByExpert(std::span<const int32_t> ids, std::span<const float> weights, int64_t n,
                                       int64_t k);

// The rows and router scales of every (token, expert) pair of a layer, batch after batch, packed for one
// host-to-device copy: host = [rows (pairs int32) | scales (pairs float, as bits)]; offsets[b] is where batch
// b's pairs start.
struct PackedRouting {
  std::vector<int32_t> host;    // [2, pairs]
  std::vector<size_t> offsets;  // [batches]
  size_t pairs = 0;
  // The rows / scales of batch b inside a device copy of `host` (dev_index: its first element).
  const int32_t* rows(const int32_t* dev_index, size_t b) const { return dev_index + offsets[b]; }
  const float* scales(const int32_t* dev_index, size_t b) const {
    return reinterpret_cast<const float*>(dev_index + pairs) + offsets[b];
  }
};
// Packs `batches` (from GroupByExpert over n tokens with k experts each: n * k pairs in all) into `packed`,
// reusing its storage. REQUIRES: the batches hold n * k rows in all.
void PackRowsAndScales(std::span<const ExpertBatch> batches, int64_t n, int64_t k, PackedRouting* packed);

// One expert over some rows of a layer's input: out[m, h] = mlp(hidden[device_rows[0..m)]). The rows are
// gathered into `gathered` ([m, h] scratch) first, except when the input and the request both have one row
// (m == n == 1): the MLP then reads `hidden` directly. hidden: [n, h]; device_rows: [m] device int32 indices
// into hidden. These are the exact ops of the single-process engine, so a worker computing an expert with
// this function returns the same bits. REQUIRES: m <= ws.max_tokens(); out aliases neither hidden nor gathered.
void ComputeExpertRows(Device& device, const MlpWeights& mlp, const float* hidden, int64_t n,
                       const int32_t* device_rows, int64_t m, int64_t h, float* gathered, MlpWorkspace& ws,
                       float* out, Stream* stream);

// The sum of a layer's experts: for each batch b in order (ascending expert id), out[rows] += scale *
// y_b with ScatterAddScaled, where y_b ([m_b, h] device memory) is what `expert_output(b)` returns (it may
// compute it or upload it; the pointer must stay valid until the next call). `dev_index`: the device copy of
// routing.host. Stops at the first error of `expert_output`. Enqueued on `stream`; the caller synchronizes.
absl::Status CombineExpertOutputs(Device& device, std::span<const ExpertBatch> batches, const PackedRouting& routing,
                                  const int32_t* dev_index, int64_t h,
                                  const std::function<absl::StatusOr<const float*>(size_t b)>& expert_output,
                                  float* out, Stream* stream);

}  // namespace odmoe
