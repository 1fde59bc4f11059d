// Which cuBLASLt algorithms exist for the blockwise-FP8 GEMMs of an FP8 linear, and how fast each runs.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/cublaslt_algos bench/cublaslt_algos.cu -lcublasLt && /tmp/cublaslt_algos
//
// torch's F.scaled_mm asks cuBLASLt's heuristic for ONE algorithm and runs it. This asks for up to 64 for the
// same problem (TN, e4m3 x e4m3 -> BF16, FP32 compute, scale modes as torch sets them) and times each
// (CUDA events, median of 20 after 3 warm-ups), so a faster algorithm than the heuristic's first shows here.
// Problems are given in cuBLAS's column-major terms: D (m x n) = A^T (m x k) . B (k x n), A and B K-contiguous,
// as torch passes them for ops.py's fprop, dgrad and wgrad at 8,192 tokens. Timings run each algorithm in a short
// burst on a cool GPU: compare algorithms within one problem, not with the sustained timings of the other benches.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define BK(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS status %d at %d\n", (int)s, __LINE__); exit(1); } } while (0)

__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = (unsigned char)(h & 0xF7);  // e4m3 values with exponent <= 14: no NaN
  }
}
__global__ void fill_ones(float* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = 0.01f;
}

struct Problem { const char* name; int m, n, k; cublasLtMatmulMatrixScale_t sa, sb; };

static void run(cublasLtHandle_t lt, const Problem& p, void* ws, size_t ws_size) {
  unsigned char *A, *B; float *sA, *sB; __nv_bfloat16* D;
  size_t na = (size_t)p.m * p.k, nb = (size_t)p.k * p.n;
  CK(cudaMalloc(&A, na)); CK(cudaMalloc(&B, nb)); CK(cudaMalloc(&D, (size_t)p.m * p.n * 2));
  size_t nsa = p.sa == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ? (size_t)p.m * (p.k / 128) : (size_t)(p.m / 128) * ((p.k / 128 + 3) / 4 * 4);
  size_t nsb = p.sb == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ? (size_t)p.n * (p.k / 128) : (size_t)(p.n / 128) * ((p.k / 128 + 3) / 4 * 4);
  CK(cudaMalloc(&sA, nsa * 4)); CK(cudaMalloc(&sB, nsb * 4));
  fill_bytes<<<1024, 256>>>(A, na, 1); fill_bytes<<<1024, 256>>>(B, nb, 2);
  fill_ones<<<256, 256>>>(sA, nsa); fill_ones<<<256, 256>>>(sB, nsb);
  CK(cudaDeviceSynchronize());

  cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t la, lb, ld; cublasLtMatmulPreference_t pref;
  BK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &p.sa, sizeof p.sa));
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &p.sb, sizeof p.sb));
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sA, sizeof sA));
  BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sB, sizeof sB));
  BK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, p.k, p.m, p.k));
  BK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, p.k, p.n, p.k));
  BK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, p.m, p.n, p.m));
  BK(cublasLtMatmulPreferenceCreate(&pref));
  BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size, sizeof ws_size));
  const int want = 64; std::vector<cublasLtMatmulHeuristicResult_t> res(want); int got = 0;
  cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, want, res.data(), &got);
  double flops = 2.0 * p.m * p.n * p.k;
  printf("%s: m %d n %d k %d, %d algorithms (status %d)\n", p.name, p.m, p.n, p.k, got, (int)hs);
  float alpha = 1.f, beta = 0.f;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  float first = 0.f, best = 1e30f; int best_i = -1;
  for (int i = 0; i < got; ++i) {
    auto& algo = res[i].algo;
    bool ok = true;
    for (int w = 0; w < 3 && ok; ++w)
      ok = cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &algo, ws, ws_size, 0) == CUBLAS_STATUS_SUCCESS;
    if (!ok || cudaDeviceSynchronize() != cudaSuccess) { printf("  algo %2d: failed\n", i); cudaGetLastError(); continue; }
    std::vector<float> t;
    for (int r = 0; r < 20; ++r) {
      CK(cudaEventRecord(e0));
      cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &algo, ws, ws_size, 0);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    if (i == 0) first = t[10];
    if (t[10] < best) { best = t[10]; best_i = i; }
    int tile = -1, stages = -1, splitk = -1, swizzle = -1, custom = -1; size_t sz;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof swizzle, &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom, &sz);
    printf("  algo %2d: %.4f ms (%.0f TF/s)  tile %d stages %d splitk %d swizzle %d custom %d ws %zu\n", i, t[10],
           flops / t[10] / 1e9, tile, stages, splitk, swizzle, custom, res[i].workspaceSize);
  }
  if (got > 0) printf("  -> heuristic's first %.4f ms, fastest %.4f ms (algo %d)\n", first, best, best_i);
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  cudaFree(A); cudaFree(B); cudaFree(D); cudaFree(sA); cudaFree(sB);
  cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(op);
}

int main() {
  cublasLtHandle_t lt; BK(cublasLtCreate(&lt));
  size_t ws_size = 32u << 20; void* ws; CK(cudaMalloc(&ws, ws_size));
  const auto V = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, B = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int T = 8192;  // tokens
  // (name, N out features, K in features) of the Qwen2.5-1.5B and -7B linears (k/v: N = 256 / 512).
  struct Linear { const char* name; int n, k; };
  const Linear linears[] = {{"1.5B q/o", 1536, 1536}, {"1.5B gate/up", 8960, 1536}, {"1.5B down", 1536, 8960},
                            {"7B q/o", 3584, 3584},   {"7B gate/up", 18944, 3584}, {"7B down", 3584, 18944}};
  for (const auto& l : linears) {
    char name[3][64];
    snprintf(name[0], 64, "%s fprop", l.name);  // Y^T (N x T) = W (N x K) . X^T: A = W blocks, B = X tiles
    snprintf(name[1], 64, "%s dgrad", l.name);  // dX^T (K x T) = W^T (K x N) . dY^T: A = W^T blocks
    snprintf(name[2], 64, "%s wgrad", l.name);  // dW^T (K x N) = X^T (K x T) . dY: both tiles along tokens
    run(lt, {name[0], l.n, T, l.k, B, V}, ws, ws_size);
    run(lt, {name[1], l.k, T, l.n, B, V}, ws, ws_size);
    run(lt, {name[2], l.k, l.n, T, V, V}, ws, ws_size);
  }
  return 0;
}
