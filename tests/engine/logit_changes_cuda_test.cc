// Logit bias and penalties on the (emulated) CUDA backend: added to the logits on the device (ScatterAddScaled over
// the logits as one column) before SelectTokens, each token picked as the host rule picks it. Built only against
// the SIMT emulator (tools/simt/tests/CMakeLists.txt), label cuda-emulated; needs ../shared/models.
#include "gtest/gtest.h"
#include "tests/engine/logit_changes_check.h"

namespace odmoe {
namespace {

// Fewer tokens than the CPU's test (24): the emulator runs a forward pass some 100 times slower.
TEST(LogitChangesCudaTest, PickAsTheHostRule) { testing::ExpectLogitChangesPickAsTheHostRule("cuda", 8); }

}  // namespace
}  // namespace odmoe
