// Fuzzes main's request handling without a server: the input is a serialized GenerateRequest, handed to
// MainNode::RunRequest (what the gRPC handler calls) of a main node of the shared demo-mixtral-kjv model
// (fuzz_nodes.h; it has a tokenizer, so text prompts are tokenized too). RunRequest validates the request
// (prompt or ids, token limits, sampling options) before it runs anything; a request that passes runs on main
// until the first sparse layer, where its StopCheck stops it (no worker is running: nothing is dialed).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "fuzz/fuzz_nodes.h"
#include "odmoe/v1/main.pb.h"

namespace {
odmoe::MainNode* main_node = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  main_node = odmoe::fuzz::FuzzMain("generate_request_fuzzer");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  odmoe::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  int emitted = 0;
  const absl::Status status = main_node->RunRequest(
      request, [&](const odmoe::v1::GenerateResponse&) { return ++emitted, true; },
      [] { return absl::CancelledError("the fuzzer stops every request"); });
  // A request either fails validation (nothing emitted) or is stopped by its StopCheck before its first token.
  if (!status.ok() && emitted != 0) std::abort();
  return 0;
}
