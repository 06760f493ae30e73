/* y[m, n] = alpha * sum_k x[m, k] * w[n, k] + beta * y[m, n] for a handful of rows m: a decode step's Linears.
 *
 * Why: on MLX's CPU backend a Linear is one BLAS sgemm. With 1-12 rows (one per running sequence) sgemm packs the
 * whole weight matrix into its own buffers before multiplying, so every weight byte is read, written and read again;
 * a decode step is bound by reading weights, so that copy costs about as much as the multiply. This kernel streams
 * each weight row once from memory and multiplies it with all rows of x while it sits in registers and L1.
 *
 * Blocking: 4 weight rows x 2 rows of x per register block (8 accumulators + 4 weight vectors + 1 x vector fits
 * AVX2's 16 registers); an odd last row of x gets a 4 x 1 block. The weight rows are prefetched a few lines ahead
 * on the first pass only; later passes over the same 4 rows hit L1. Threads split the output columns (n).
 *
 * Every output element is one dot product summed in the same order whatever the number of rows, so a sequence's
 * result does not depend on which other sequences share its batch. Without AVX2+FMA (other CPUs, Apple arm64) the
 * portable loop below computes the same sums with the compiler's vectorisation.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

#define PREFETCH_FLOATS 256

typedef struct {
    const float *x, *w;
    float *y;
    int64_t ldx, ldw, ldy;
    float alpha, beta;
    int M, N, K;
} Gemm;

static inline void store(const Gemm *g, int m, int n, float dot) {
    float *out = g->y + (size_t)m * g->ldy + n;
    *out = g->beta == 0.0f ? g->alpha * dot : g->alpha * dot + g->beta * *out;  /* beta 0: y is not read (BLAS) */
}

/* rows_x (1 or 2) rows of x starting at m against nr (1..4) weight rows starting at n. */
static void block(const Gemm *g, int m, int rows_x, int n, int nr, int prefetch) {
    const int K = g->K;
    const float *wr[4];
    for (int i = 0; i < 4; i++) wr[i] = g->w + (size_t)(n + (i < nr ? i : 0)) * g->ldw;
    const float *x0 = g->x + (size_t)m * g->ldx, *x1 = rows_x > 1 ? x0 + g->ldx : x0;
    __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00, a01 = a00, a11 = a00, a21 = a00, a31 = a00;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = _mm256_loadu_ps(wr[0] + k), v1 = _mm256_loadu_ps(wr[1] + k);
        __m256 v2 = _mm256_loadu_ps(wr[2] + k), v3 = _mm256_loadu_ps(wr[3] + k);
        if (prefetch && (k & 15) == 0) {
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wr[i] + k + PREFETCH_FLOATS), _MM_HINT_T0);
        }
        __m256 u = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(v0, u, a00); a10 = _mm256_fmadd_ps(v1, u, a10);
        a20 = _mm256_fmadd_ps(v2, u, a20); a30 = _mm256_fmadd_ps(v3, u, a30);
        if (rows_x > 1) {
            u = _mm256_loadu_ps(x1 + k);
            a01 = _mm256_fmadd_ps(v0, u, a01); a11 = _mm256_fmadd_ps(v1, u, a11);
            a21 = _mm256_fmadd_ps(v2, u, a21); a31 = _mm256_fmadd_ps(v3, u, a31);
        }
    }
    float r[4][2] = {{hsum8(a00), hsum8(a01)}, {hsum8(a10), hsum8(a11)},
                     {hsum8(a20), hsum8(a21)}, {hsum8(a30), hsum8(a31)}};
    for (int i = 0; i < nr; i++) {
        for (int j = 0; j < rows_x; j++) {
            const float *xj = j ? x1 : x0;
            float s = r[i][j];
            for (int kk = k; kk < K; kk++) s += wr[i][kk] * xj[kk];
            store(g, m + j, n + i, s);
        }
    }
}

static void columns(const Gemm *g, int n0, int n1) {
    for (int n = n0; n < n1; n += 4) {
        int nr = n1 - n < 4 ? n1 - n : 4;
        for (int m = 0; m < g->M; m += 2) block(g, m, g->M - m < 2 ? g->M - m : 2, n, nr, m == 0);
    }
}

#else /* portable: one dot product per output, the inner loop left to the compiler */

static void columns(const Gemm *g, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const float *wn = g->w + (size_t)n * g->ldw;
        for (int m = 0; m < g->M; m++) {
            const float *xm = g->x + (size_t)m * g->ldx;
            float s = 0.0f;
            for (int k = 0; k < g->K; k++) s += wn[k] * xm[k];
            store(g, m, n, s);
        }
    }
}
#endif

static void run(const Gemm *g, int num_threads) {
#ifdef _OPENMP
    /* Columns split in multiples of 4 so register blocks never straddle two threads. */
    if (num_threads > 1 && (int64_t)g->N * g->K >= (1 << 16)) {  /* smaller: a thread start costs more */
#pragma omp parallel num_threads(num_threads)
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads();
            int per = ((g->N + T - 1) / T + 3) & ~3;
            int n0 = t * per, n1 = n0 + per > g->N ? g->N : n0 + per;
            if (n0 < n1) columns(g, n0, n1);
        }
        return;
    }
#endif
    (void)num_threads;
    columns(g, 0, g->N);
}

static int threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Direct entry (tests, benchmarks): y[M, N] = x[M, K] @ w[N, K]^T, all row-major and contiguous. Returns 0 on
 * success, 1 on arguments out of range (the Python side checks first; this is the last guard). */
int cs_small_gemm(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (!x || !w || !y || M < 1 || N < 1 || K < 1 || M > 4096 || N > (1 << 30) || K > (1 << 30)) return 1;
    Gemm g = {x, w, y, K, K, N, 1.0f, 0.0f, (int)M, (int)N, (int)K};
    run(&g, num_threads < 1 ? 1 : num_threads);
    return 0;
}

int cs_small_gemm_abi_version(void) { return 3; }

/* ---- the BLAS interposer --------------------------------------------------------------------------------------
 * Loaded in LD_PRELOAD ahead of the BLAS (backend/tuning.py), this library's cblas_sgemm is the one MLX's CPU matmul
 * calls. It takes the calls of an nn.Linear with at most cs_small_gemm_rows rows (row-major x [M, K] times a
 * transposed row-major weight [N, K], as MLX issues them) while that limit is above zero, and hands every other
 * call, unchanged, to the next cblas_sgemm in the search order (OpenBLAS or the reference BLAS).
 * The limit is 0 (off) while no engine holds the kernel (cs_small_gemm_acquire / cs_small_gemm_release below). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
/* Only weight products: their K is a model width (576 and up in real models). Attention's q @ k^T has the same
 * layout but K = head_dim (at most 256): thousands of tiny calls per step (one per sequence and KV head), which
 * BLAS handles and which would only pay this kernel's thread start-up. */
#define MIN_WEIGHT_K 320
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

_Atomic int cs_small_gemm_rows = 0;
_Atomic long long cs_small_gemm_calls = 0;  /* calls the kernel took: tests check the path is really used */

void cs_set_small_gemm_rows(int rows) { atomic_store(&cs_small_gemm_rows, rows < 0 ? 0 : rows); }
int cs_get_small_gemm_rows(void) { return atomic_load(&cs_small_gemm_rows); }
long long cs_small_gemm_call_count(void) { return atomic_load(&cs_small_gemm_calls); }
int cs_small_gemm_interposed(void) { return 1; }

/* Holds: the process has one row limit, so the engines that use it (any thread, any number) share one count here.
 * The first acquire also records OpenBLAS's own thread count (when OpenBLAS is in the process), the last release
 * restores it and sets the limit back to 0; each is one critical section, so a release racing an acquire never
 * leaves the limit off while held nor on while free. The Python side (kernels/small_gemm.py, backend/small_batch.py) keeps
 * no state of its own. */
typedef int (*get_threads_fn)(void);
typedef void (*set_threads_fn)(int);
static pthread_mutex_t hold_lock = PTHREAD_MUTEX_INITIALIZER;
static int holders = 0;
static int saved_blas_threads = 0;  /* OpenBLAS's count when the first hold began; 0 without OpenBLAS */

static get_threads_fn blas_get_threads(void) {
    return (get_threads_fn)dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
}

static void blas_set_threads(int threads) {
    set_threads_fn set = (set_threads_fn)dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
    get_threads_fn get = blas_get_threads();
    if (set && get && get() != threads) set(threads);
}

/* One more holder; the limit becomes `rows` (the latest holder's). Returns the number of holders. */
int cs_small_gemm_acquire(int rows) {
    pthread_mutex_lock(&hold_lock);
    if (holders++ == 0) {
        get_threads_fn get = blas_get_threads();
        saved_blas_threads = get ? get() : 0;
    }
    atomic_store(&cs_small_gemm_rows, rows < 0 ? 0 : rows);
    int n = holders;
    pthread_mutex_unlock(&hold_lock);
    return n;
}

/* One holder fewer (none: no-op); the last one turns the kernel off and gives OpenBLAS its thread count back. */
int cs_small_gemm_release(void) {
    pthread_mutex_lock(&hold_lock);
    if (holders > 0 && --holders == 0) {
        atomic_store(&cs_small_gemm_rows, 0);
        if (saved_blas_threads > 0) blas_set_threads(saved_blas_threads);
        saved_blas_threads = 0;
    }
    int n = holders;
    pthread_mutex_unlock(&hold_lock);
    return n;
}

/* Before a forward pass of `rows` token rows while held: one OpenBLAS thread when the kernel takes every Linear
 * product of the pass (the BLAS calls left are attention's small ones, and a second BLAS thread would only fight the
 * kernel's OpenMP worker for a core), else OpenBLAS's own count. Returns the count set; 0 when not held or without
 * OpenBLAS (nothing done). */
int cs_small_gemm_before_pass(int rows) {
    pthread_mutex_lock(&hold_lock);
    int threads = 0;
    if (holders > 0 && saved_blas_threads > 0) {
        threads = rows <= atomic_load(&cs_small_gemm_rows) ? 1 : saved_blas_threads;
        blas_set_threads(threads);
    }
    pthread_mutex_unlock(&hold_lock);
    return threads;
}

int cs_small_gemm_holders(void) {
    pthread_mutex_lock(&hold_lock);
    int n = holders;
    pthread_mutex_unlock(&hold_lock);
    return n;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    static sgemm_fn next = 0;
    int limit = atomic_load_explicit(&cs_small_gemm_rows, memory_order_relaxed);
    if (limit > 0 && order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && M >= 1 && M <= limit &&
        N >= 64 && K >= MIN_WEIGHT_K && lda >= K && ldb >= K && ldc >= N) {
        Gemm g = {A, B, C, lda, ldb, ldc, alpha, beta, M, N, K};
        run(&g, threads());
        atomic_fetch_add_explicit(&cs_small_gemm_calls, 1, memory_order_relaxed);
        return;
    }
    if (!next) next = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!next) {
        fputs("cortexstream small_gemm: no BLAS cblas_sgemm after the interposer in the search order\n", stderr);
        abort();
    }
    next(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
