// Known-bad kernels (bad_kernels.cu): each a few lines with one bug of a kind found by injecting bugs into copies
// of odmoe's kernels. The checked build must flag every one (bad_kernels_test.cc): the checker cannot silently
// stop working. Each launcher allocates what it needs and returns the launch's error.
#pragma once

#include <cuda_runtime.h>

namespace simt_bad {

cudaError_t MissingSyncThreads();       // a shared-memory tree without the barrier between levels: shared race
cudaError_t MissingSyncWarp();          // lanes exchange through shared memory without __syncwarp: shared race
cudaError_t OffByOne();                 // `i <= n`: a global write one past the allocation
cudaError_t MisalignedVectorLoad();     // __ldg of a uint4 at a float offset of 1
cudaError_t LanesExitBeforeShuffle();   // half the warp returns before a full-mask __shfl_xor_sync
cudaError_t WrongShuffleMask();         // lanes 0-15 read lanes 16-31, outside the 0xffff mask
cudaError_t BarrierInDivergentCode();   // __syncthreads inside `if (threadIdx.x < 32)`, then another
cudaError_t PlainMinInsteadOfAtomic();  // `if (v < best) best = v` on a shared variable by every thread
cudaError_t UndersizedDynamicShared();  // the launch gives 4 bytes less dynamic shared memory than used
cudaError_t UninitializedSharedRead();  // reads a shared element no thread of the block wrote
cudaError_t UseAfterFree();             // reads a buffer the host freed before the launch
cudaError_t GraphReplayAfterFree();     // a captured launch replayed after the host freed its input
cudaError_t BlocksRaceOnGlobal();       // every block writes the same global element
// Beyond the injected bugs, the checker's own limits: byte-granular races and one remembered reader of many.
cudaError_t TwoThreadsWriteOneByte();  // thread t writes byte t / 2: neighbours share a byte
cudaError_t WriteAfterManyReaders();   // 64 threads read a shared word, then one writes it without a barrier

}  // namespace simt_bad
