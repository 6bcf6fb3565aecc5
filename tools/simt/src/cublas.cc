// cuBLAS over a reference GEMM: the handle functions odmoe calls and cublasGemmEx with F32/F16/BF16 inputs, F32
// output, compute 32F or 32F_PEDANTIC, either operand transposed or not. Column-major, as cuBLAS. The sum is in
// double and rounded once, so it is at least as accurate as the GPU's fp32 accumulation; tests compare the two
// with tolerances, never bit for bit. On a capturing stream (the handle's) a GEMM is recorded as a kernel node that
// runs the reference GEMM at every graph launch, with alpha and beta as they were when it was recorded.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <vector>

#include "src/internal.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace {

bool ReadAs(cudaDataType type, const void* p, size_t i, double* out) {
  switch (type) {
    case CUDA_R_32F:
      *out = static_cast<const float*>(p)[i];
      return true;
    case CUDA_R_16F:
      *out = __half2float(static_cast<const __half*>(p)[i]);
      return true;
    case CUDA_R_16BF:
      *out = __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
      return true;
    default:
      return false;
  }
}

bool Supported(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF; }

size_t ElementBytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

// A GEMM whose arguments were checked; alpha and beta by value.
struct Gemm {
  cublasOperation_t transa, transb;
  int m, n, k;
  float alpha;
  const void* A;
  cudaDataType Atype;
  int lda;
  const void* B;
  cudaDataType Btype;
  int ldb;
  float beta;
  float* C;
  int ldc;

  // Bytes of a column-major operand of `cols` columns of `rows` elements, `ld` apart (what the GEMM reads).
  static size_t Span(int rows, int cols, int ld, size_t element) {
    if (rows == 0 || cols == 0) return 0;
    return (static_cast<size_t>(cols - 1) * ld + rows) * element;
  }

  cudaError_t Run() const {
    // The reference GEMM is not instrumented: a freed operand is reported here, as the checker would for a kernel.
    const int a_rows = transa == CUBLAS_OP_N ? m : k, a_cols = transa == CUBLAS_OP_N ? k : m;
    const int b_rows = transb == CUBLAS_OP_N ? k : n, b_cols = transb == CUBLAS_OP_N ? n : k;
    const bool freed =
        simt::detail::ReportFreedAccess(A, std::max<size_t>(1, Span(a_rows, a_cols, lda, ElementBytes(Atype))),
                                        "cublasGemmEx's A") ||
        simt::detail::ReportFreedAccess(B, std::max<size_t>(1, Span(b_rows, b_cols, ldb, ElementBytes(Btype))),
                                        "cublasGemmEx's B") ||
        simt::detail::ReportFreedAccess(C, std::max<size_t>(1, Span(m, n, ldc, 4)), "cublasGemmEx's C");
    if (freed) return cudaErrorInvalidValue;
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double sum = 0;
        for (int p = 0; p < k; ++p) {
          double x, y;
          const size_t ai = transa == CUBLAS_OP_N ? static_cast<size_t>(p) * lda + i : static_cast<size_t>(i) * lda + p;
          const size_t bi = transb == CUBLAS_OP_N ? static_cast<size_t>(j) * ldb + p : static_cast<size_t>(p) * ldb + j;
          ReadAs(Atype, A, ai, &x);
          ReadAs(Btype, B, bi, &y);
          sum += x * y;
        }
        float& out = C[static_cast<size_t>(j) * ldc + i];
        // beta == 0 must not read C (it may hold NaN), as in BLAS.
        out = beta == 0.f ? static_cast<float>(alpha * sum)
                          : static_cast<float>(alpha * sum + static_cast<double>(beta) * out);
      }
    }
    return cudaSuccess;
  }
};

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->workspace = workspace;
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_UNKNOWN";
  }
}

// C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C, column-major; alpha and beta are host floats.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) || (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!Supported(Atype) || !Supported(Btype) || Ctype != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC) return CUBLAS_STATUS_NOT_SUPPORTED;
  const int a_rows = transa == CUBLAS_OP_N ? m : k;
  const int b_rows = transb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const Gemm gemm{transa, transb, m, n,     k,   *static_cast<const float*>(alpha), A,
                  Atype,  lda,    B, Btype, ldb, *static_cast<const float*>(beta),  static_cast<float*>(C),
                  ldc};
  // As a kernel on the handle's stream: refused where a launch would be (an invalidated capture, the legacy stream
  // beside a capture it would depend on), recorded on a capturing stream.
  bool capture = false;
  if (simt::detail::IssueWork(handle->stream, &capture) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (capture) {
    simt::detail::RecordNode(handle->stream, cudaGraphNodeTypeKernel, [gemm](cudaStream_t) {
      const cudaError_t e = gemm.Run();
      if (e != cudaSuccess) simt::detail::SetLastError(e);
      return e;
    });
    return CUBLAS_STATUS_SUCCESS;
  }
  if (gemm.Run() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
