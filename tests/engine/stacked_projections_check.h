// The check of stacked projections (AttentionWeights::qkv, MlpWeights::gate_up) that the CPU device's test
// (engine_test.cc) and the emulated CUDA device's (stacked_projections_cuda_test.cc) share.
#pragma once

#include <string>

namespace odmoe::testing {

// Loads the shared model `model` onto CreateDevice(device) at each precision of the shadow's replica (none, FP16,
// INT8, NF4) and checks, with gtest failures, that every layer's q, k and v (with biases where the model has them)
// and every shared expert's or dense MLP's gate and up are stacked, and that one token through a stack gives the
// same bits (memcmp) as through its matrices' views, one by one.
void ExpectStackedProjectionsBitwise(const std::string& model, const std::string& device);

}  // namespace odmoe::testing
