// A thin BLAS in front of OpenBLAS for MLX's CPU backend: `cblas_sgemm` with one row (M = 1,
// every decode step's matmuls and attention) goes to `cblas_sgemv`; every other call goes to
// OpenBLAS's own `cblas_sgemm` unchanged.
//
// Why: MLX calls sgemm for every f32 matmul, and OpenBLAS 0.3.21 (Debian 12's) packs both
// operands for a one-row product as for a big one; its gemv kernel does the same product
// several times faster (bench/results/cpu.md). Newer OpenBLAS releases forward such calls
// themselves; this does it for the one Debian ships.
//
// scripts/setup.sh compiles this into third_party/mlx-cpu/mlx_cpu.libs/libblas-sgemm-row.so,
// linked against OpenBLAS, and points the wheel's bundled libblas name at it. The loader puts
// it before OpenBLAS (it is libmlx's own dependency, OpenBLAS one level further), so MLX's
// `cblas_sgemm` binds here; everything else MLX calls (dgemm, cgemm, LAPACK) binds to OpenBLAS.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

// The CBLAS declarations used here (Debian's runtime package ships no headers); the values
// are the CBLAS standard's, `blasint` is the 32-bit int of OpenBLAS's LP64 build.
typedef int blasint;
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };
void cblas_sgemv(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, blasint, blasint, float, const float *, blasint,
                 const float *, blasint, float, float *, blasint);
typedef void (*sgemm_fn)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                         float, const float *, blasint, const float *, blasint, float, float *, blasint);

// OpenBLAS's cblas_sgemm: the next definition after this library's own.
static sgemm_fn openblas_sgemm;

__attribute__((constructor)) static void find_openblas_sgemm(void) {
    openblas_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
}

// Lets a program tell that MLX's sgemm calls come here (Ferrite's `engine::blas` looks for it).
int ferrite_sgemm_row_forwarding(void) { return 1; }

void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE trans_a, enum CBLAS_TRANSPOSE trans_b, blasint m,
                 blasint n, blasint k, float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
    if (order == CblasRowMajor && m == 1 && n > 0 && k > 0) {
        // C (1 x n) = alpha * a (1 x k) * op(B) (k x n) + beta * C, that is
        // c = alpha * op(B)^T a + beta * c. Stored row-major, op(B) = B^T means B is n x k:
        // c = B a (no transpose); op(B) = B means B is k x n: c = B^T a.
        enum CBLAS_TRANSPOSE gemv_trans = trans_b == CblasNoTrans ? CblasTrans : CblasNoTrans;
        blasint rows = trans_b == CblasNoTrans ? k : n;
        blasint cols = trans_b == CblasNoTrans ? n : k;
        // a's k values: contiguous when a is 1 x k, a column (stride lda) when it is stored k x 1.
        blasint inc_a = trans_a == CblasNoTrans ? 1 : lda;
        // MLX hands over uninitialised output with beta = 0; BLAS says y is then not read, but
        // zeroing it first keeps a NaN left in that memory out of the product in any version.
        if (beta == 0.0f) memset(c, 0, (size_t)n * sizeof(float));
        cblas_sgemv(CblasRowMajor, gemv_trans, rows, cols, alpha, b, ldb, a, inc_a, beta, c, 1);
        return;
    }
    openblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
