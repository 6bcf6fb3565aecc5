// Fuzzes the decoding of tensors received over RPC: the input is a serialized odmoe.v1.Tensor (as it arrives
// inside every request) and rpc::DecodeF32 checks it against the shapes the daemons ask for. Every tensor it
// accepts must have the asked rank, matching dims, positive sizes and exactly product(dims) values.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "odmoe/v1/common.pb.h"
#include "src/rpc/rpc_util.h"

namespace {

void Decode(const odmoe::v1::Tensor& tensor, const std::vector<int64_t>& shape) {
  std::vector<int64_t> dims;
  absl::StatusOr<std::vector<float>> values = odmoe::rpc::DecodeF32(tensor, shape, "fuzz", &dims);
  if (!values.ok()) return;
  if (dims.size() != shape.size()) std::abort();
  int64_t numel = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] <= 0 || (shape[i] != -1 && dims[i] != shape[i])) std::abort();
    numel *= dims[i];
  }
  if (static_cast<int64_t>(values->size()) != numel) std::abort();
}

}  // namespace

// Invalid UTF-8 in string fields makes protobuf log an error per input; the fuzzer only needs the result.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  odmoe::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  Decode(tensor, {-1});
  Decode(tensor, {-1, -1});
  Decode(tensor, {-1, 4});  // the daemons' [rows, hidden]
  Decode(tensor, {2, -1, 3});
  // The tensor's own dims as the expected shape (rank capped: a shape with thousands of dims is refused anyway).
  if (tensor.shape_size() <= 8) Decode(tensor, std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()));
  // And the round trip: what EncodeF32 writes, DecodeF32 reads back unchanged.
  const std::vector<float> v = {1.0f, -2.5f, 3.0f, 0.0f, 7.0f, 8.0f};
  const int64_t dims[] = {2, 3};
  odmoe::v1::Tensor encoded;
  odmoe::rpc::EncodeF32(v, dims, &encoded);
  absl::StatusOr<std::vector<float>> back = odmoe::rpc::DecodeF32(encoded, dims, "round trip");
  if (!back.ok() || *back != v) std::abort();
  return 0;
}
