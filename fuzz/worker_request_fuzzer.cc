// Fuzzes the worker's ComputeExperts handling without a server: the input is a serialized
// ComputeExpertsRequest, handed to WorkerNode::Compute (what the gRPC handler calls) of a worker of the shared
// mixtral-tiny model (fuzz_nodes.h). Compute validates the whole request (header, layer, hidden's shape, tasks,
// rows) before it loads and computes anything; requests that pass are computed. A request whose header leaves
// the fingerprint (or the epoch) unset gets the worker's own, so that the fuzzer gets past the header check;
// any other value is kept and must be refused.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "fuzz/fuzz_nodes.h"
#include "odmoe/v1/worker.pb.h"
#include "src/rpc/rpc_util.h"

namespace {
odmoe::WorkerNode* worker = nullptr;

// A one-row request of another request id than `previous`: the worker then frees what earlier requests kept.
void FreeKeptExperts(uint64_t previous) {
  odmoe::v1::ComputeExpertsRequest next;
  const uint64_t id = previous + 1 == 0 ? 1 : previous + 1;  // never 0: an untracked request frees nothing
  odmoe::rpc::FillHeader(next.mutable_header(), worker->epoch(), worker->fingerprint(), "fuzz", id);
  next.set_layer(static_cast<int32_t>(worker->config().SparseLayers()[0]));
  const int64_t hidden = worker->config().hidden_size;
  const std::vector<float> row(static_cast<size_t>(hidden), 0.0f);
  const int64_t dims[] = {1, hidden};
  odmoe::rpc::EncodeF32(row, dims, next.mutable_hidden());
  odmoe::v1::ExpertTask* task = next.add_tasks();
  task->set_expert(0);
  task->add_rows(0);
  odmoe::v1::ComputeExpertsResponse response;
  if (!worker->Compute(next, &response).ok()) std::abort();
}

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
  // Whatever happened, no expert stays loaded by a ComputeExperts call, except those a request with an id keeps
  // for its other mini-batch calls (a task's expert_calls > 1). Main's next request frees those: send one, and
  // then nothing may be left.
  int64_t may_keep = 0;
  if (request.header().request_id() != 0) {
    for (const odmoe::v1::ExpertTask& task : request.tasks()) may_keep += task.expert_calls() > 1 ? 1 : 0;
  }
  if (worker->ResidentExperts() > may_keep) std::abort();
  if (worker->ResidentExperts() > 0) {
    FreeKeptExperts(request.header().request_id());
    if (worker->ResidentExperts() != 0) std::abort();
  }
  return 0;
}
