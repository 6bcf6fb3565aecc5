// Fuzzes the worker's ComputeExperts handling without a server: the input is a serialized
// ComputeExpertsRequest, handed to WorkerNode::Compute (what the gRPC handler calls) of a worker of the shared
// mixtral-tiny model (fuzz_nodes.h). Compute validates the whole request (header, layer, hidden's shape, tasks,
// rows) before it loads and computes anything; requests that pass are computed. A request whose header leaves
// the fingerprint (or the epoch) unset gets the worker's own, so that the fuzzer gets past the header check;
// any other value is kept and must be refused.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "fuzz/fuzz_nodes.h"
#include "odmoe/v1/worker.pb.h"

namespace {
odmoe::WorkerNode* worker = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  worker = odmoe::fuzz::FuzzWorker("worker_request_fuzzer");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  odmoe::v1::ComputeExpertsRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (request.header().model_fingerprint().empty())
    request.mutable_header()->set_model_fingerprint(worker->fingerprint());
  if (request.header().epoch() == 0) request.mutable_header()->set_epoch(worker->epoch());
  odmoe::v1::ComputeExpertsResponse response;
  const absl::Status status = worker->Compute(request, &response);
  if (status.ok()) {
    if (response.outputs_size() != request.tasks_size()) std::abort();
  } else if (response.outputs_size() != 0) {
    std::abort();  // on error the response is cleared
  }
  // Whatever happened, no expert stays loaded by a ComputeExperts call.
  if (worker->ResidentExperts() != 0) std::abort();
  return 0;
}
