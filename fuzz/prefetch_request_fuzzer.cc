// Fuzzes the worker's Prefetch handling without a server: the input is a serialized PrefetchRequest, handed to
// WorkerNode::DoPrefetch of a worker of the shared mixtral-tiny model (fuzz_nodes.h); headers are completed as
// in worker_request_fuzzer. Every expert a prefetch accepted is then consumed by a one-row ComputeExperts call
// (which must find it resident), so each input starts from a worker with nothing resident. The worker remembers
// how far each request has got, so a prediction an earlier input already passed is late and loads nothing.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz/fuzz_nodes.h"
#include "odmoe/v1/worker.pb.h"
#include "src/rpc/rpc_util.h"

namespace {
odmoe::WorkerNode* worker = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  worker = odmoe::fuzz::FuzzWorker("prefetch_request_fuzzer");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  odmoe::v1::PrefetchRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (request.header().model_fingerprint().empty())
    request.mutable_header()->set_model_fingerprint(worker->fingerprint());
  if (request.header().epoch() == 0) request.mutable_header()->set_epoch(worker->epoch());
  bool late = false;
  const absl::StatusOr<int32_t> accepted = worker->DoPrefetch(request, &late);
  if (!accepted.ok()) {
    if (worker->ResidentExperts() != 0) std::abort();  // a refused prefetch loads nothing
    return 0;
  }
  if (*accepted < 0 || *accepted > request.experts_size() || worker->ResidentExperts() != *accepted) std::abort();
  // A prediction for a (request, position, layer) the worker has already computed (the same input run again:
  // libFuzzer does) is late: nothing is loaded.
  if (late) {
    if (*accepted != 0) std::abort();
    return 0;
  }
  // Consume them: one row of zeros through every prefetched expert.
  odmoe::v1::ComputeExpertsRequest compute;
  *compute.mutable_header() = request.header();
  compute.set_layer(request.layer());
  compute.set_position(request.position());  // the position the prediction was for: main's request for it
  const int64_t hidden = worker->config().hidden_size;
  const std::vector<float> row(static_cast<size_t>(hidden), 0.0f);
  const int64_t dims[] = {1, hidden};
  odmoe::rpc::EncodeF32(row, dims, compute.mutable_hidden());
  for (int32_t e : request.experts()) {
    odmoe::v1::ExpertTask* task = compute.add_tasks();
    task->set_expert(e);
    task->add_rows(0);
  }
  odmoe::v1::ComputeExpertsResponse response;
  const absl::Status status = worker->Compute(compute, &response);
  if (!status.ok()) {
    std::fprintf(stderr, "prefetch_request_fuzzer: computing prefetched experts failed: %s\n",
                 status.ToString().c_str());
    std::abort();
  }
  for (const odmoe::v1::ExpertOutput& out : response.outputs()) {
    if (out.loaded_on_demand()) std::abort();  // it was prefetched
  }
  if (worker->ResidentExperts() != 0) std::abort();
  return 0;
}
