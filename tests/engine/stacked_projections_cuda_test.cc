// Stacked projections (AttentionWeights::qkv, MlpWeights::gate_up) on the (emulated) CUDA backend: one token's
// projection through a stack is bitwise the projections through its matrices' own views, for the checkpoint's
// dtype and for each precision of the shadow's replica. The GEMVs sum a row the same way whichever rows share a
// launch; this checks that the views keep what lets them (16-byte aligned rows). Built only against the SIMT
// emulator (tools/simt/tests/CMakeLists.txt), label cuda-emulated; needs ../shared/models.
#include "gtest/gtest.h"
#include "tests/engine/stacked_projections_check.h"

namespace odmoe {
namespace {

TEST(StackedProjectionsCudaTest, OneTokensRowsAreTheirMatricesBitwise) {
  testing::ExpectStackedProjectionsBitwise("tiny-mixtral-kjv", "cuda");  // bf16, Mixtral
  testing::ExpectStackedProjectionsBitwise("qwen2moe-tiny", "cuda");     // q, k, v biases and a shared expert
}

}  // namespace
}  // namespace odmoe
