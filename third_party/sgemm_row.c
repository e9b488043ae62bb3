// A thin BLAS in front of OpenBLAS for MLX's CPU backend: `cblas_sgemm` with one row (M = 1,
// every decode step's matmuls and attention) goes to `cblas_sgemv`, and so does each row of a
// product of a few rows (a verify pass's) where that measured faster; every other call goes
// to OpenBLAS's own `cblas_sgemm` unchanged.
//
// Why: MLX calls sgemm for every f32 matmul, and OpenBLAS 0.3.21 (Debian 12's) packs both
// operands for a one-row product as for a big one; its gemv kernel does the same product
// several times faster (bench/results/cpu.md). Newer OpenBLAS releases forward such calls
// themselves; this does it for the one Debian ships. A verify pass's rows through the same
// gemv also get the bits a decode step gives each of them.
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

// Whether m rows go to gemv one at a time: up to 3 rows always; up to 8 where the weights
// (n x k) stay within 2M floats, so the rows read them from the cache. Beyond that sgemm's
// packing pays (bench/results/cpu.md: a 8192 x 384 output projection, 4 rows).
static int rows_by_gemv(blasint m, blasint n, blasint k) {
    return m >= 1 && (m <= 3 || (m <= 8 && (long long)n * k <= (1LL << 21)));
}

void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE trans_a, enum CBLAS_TRANSPOSE trans_b, blasint m,
                 blasint n, blasint k, float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
    if (order == CblasRowMajor && n > 0 && k > 0 && rows_by_gemv(m, n, k)) {
        // Each row: c (1 x n) = alpha * a (1 x k) * op(B) (k x n) + beta * c, that is
        // c = alpha * op(B)^T a + beta * c. Stored row-major, op(B) = B^T means B is n x k:
        // c = B a (no transpose); op(B) = B means B is k x n: c = B^T a.
        enum CBLAS_TRANSPOSE gemv_trans = trans_b == CblasNoTrans ? CblasTrans : CblasNoTrans;
        blasint rows = trans_b == CblasNoTrans ? k : n;
        blasint cols = trans_b == CblasNoTrans ? n : k;
        // Row i of op(A): a row of a (stride 1) when a is m x k, a column (stride lda) when it
        // is stored k x m; row i of C starts ldc further each.
        blasint inc_a = trans_a == CblasNoTrans ? 1 : lda;
        for (blasint i = 0; i < m; ++i) {
            const float *row = trans_a == CblasNoTrans ? a + (size_t)i * lda : a + i;
            float *out = c + (size_t)i * ldc;
            // MLX hands over uninitialised output with beta = 0; BLAS says y is then not read,
            // but zeroing it first keeps a NaN left in that memory out of the product in any
            // version.
            if (beta == 0.0f) memset(out, 0, (size_t)n * sizeof(float));
            cblas_sgemv(CblasRowMajor, gemv_trans, rows, cols, alpha, b, ldb, row, inc_a, beta, out, 1);
        }
        return;
    }
    openblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
