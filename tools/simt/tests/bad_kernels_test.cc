// The checker flags every known-bad kernel (bad_kernels.cu), with the kernel's name and the bug's file:line.
#include "tools/simt/tests/bad_kernels.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "simt/simt.h"

namespace {

struct Case {
  const char* name;
  cudaError_t (*run)();
  simt::ErrorKind kind;
  const char* kernel;
};

class BadKernelTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    previous_ = simt::SetReportHandler([this](const simt::Report& r) { reports_.push_back(r); });
  }
  void TearDown() override {
    simt::SetReportHandler(previous_);
    (void)cudaDeviceReset();
  }
  std::vector<simt::Report> reports_;
  simt::ReportHandler previous_;
};

TEST_P(BadKernelTest, IsFlagged) {
  const Case& c = GetParam();
  (void)c.run();
  std::string all;
  bool found = false;
  for (const simt::Report& r : reports_) {
    all += std::string(simt::ErrorKindName(r.kind)) + " in " + r.kernel + ": " + r.message + "\n";
    if (r.kind == c.kind && r.kernel == c.kernel) {
      found = true;
      // The report points at the bug in this file (a checker report names both accesses' file:line; a
      // scheduler report names where threads wait).
      EXPECT_NE(r.message.find("bad_kernels.cu:"), std::string::npos) << r.message;
    }
  }
  EXPECT_TRUE(found) << "expected a '" << simt::ErrorKindName(c.kind) << "' report in " << c.kernel << "; got:\n"
                     << all;
  std::printf("%s", all.c_str());
}

using simt::ErrorKind;
INSTANTIATE_TEST_SUITE_P(
    Checker, BadKernelTest,
    ::testing::Values(
        Case{"MissingSyncThreads", simt_bad::MissingSyncThreads, ErrorKind::kRace, "MissingSyncThreadsKernel"},
        Case{"MissingSyncWarp", simt_bad::MissingSyncWarp, ErrorKind::kRace, "MissingSyncWarpKernel"},
        Case{"OffByOne", simt_bad::OffByOne, ErrorKind::kOutOfBounds, "OffByOneKernel"},
        Case{"MisalignedVectorLoad", simt_bad::MisalignedVectorLoad, ErrorKind::kMisaligned,
             "MisalignedVectorLoadKernel"},
        Case{"LanesExitBeforeShuffle", simt_bad::LanesExitBeforeShuffle, ErrorKind::kWarpCollective,
             "LanesExitBeforeShuffleKernel"},
        Case{"WrongShuffleMask", simt_bad::WrongShuffleMask, ErrorKind::kWarpCollective, "WrongShuffleMaskKernel"},
        Case{"BarrierInDivergentCode", simt_bad::BarrierInDivergentCode, ErrorKind::kBarrierDivergence,
             "BarrierInDivergentCodeKernel"},
        Case{"PlainMinInsteadOfAtomic", simt_bad::PlainMinInsteadOfAtomic, ErrorKind::kRace,
             "PlainMinInsteadOfAtomicKernel"},
        Case{"UndersizedDynamicShared", simt_bad::UndersizedDynamicShared, ErrorKind::kOutOfBounds,
             "UndersizedDynamicSharedKernel"},
        Case{"UninitializedSharedRead", simt_bad::UninitializedSharedRead, ErrorKind::kUninitShared,
             "UninitializedSharedReadKernel"},
        Case{"UseAfterFree", simt_bad::UseAfterFree, ErrorKind::kUseAfterFree, "UseAfterFreeKernel"},
        Case{"GraphReplayAfterFree", simt_bad::GraphReplayAfterFree, ErrorKind::kUseAfterFree,
             "GraphReplayAfterFreeKernel"},
        Case{"BlocksRaceOnGlobal", simt_bad::BlocksRaceOnGlobal, ErrorKind::kRace, "BlocksRaceOnGlobalKernel"},
        Case{"TwoThreadsWriteOneByte", simt_bad::TwoThreadsWriteOneByte, ErrorKind::kRace,
             "TwoThreadsWriteOneByteKernel"},
        Case{"WriteAfterManyReaders", simt_bad::WriteAfterManyReaders, ErrorKind::kRace,
             "WriteAfterManyReadersKernel"}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

}  // namespace
