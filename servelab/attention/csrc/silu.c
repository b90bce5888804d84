/* SiLU in place on a decode step's gate rows, with torch's bits on the same CPU.
 *
 * Why: on SmolLM2's batch-16 decode step torch's in-place SiLU on the [16, 1536] gate
 * took ~24 us a layer on one thread (24,576 elements: under torch's parallel grain, so
 * never split), ~0.7 ms of a ~50 ms two-thread step. Here the glue runs it on its own
 * threads, fused with the gate * up product before the down GEMM (csrc/decode_glue.c).
 *
 * Same bits: torch's CPU SiLU (float32) is x / (1 + exp(-x)), computed
 *   - on vectors of 2 * V lanes at a time from each row's start (V = 8 with AVX2, 16 with
 *     AVX-512), its exp the SLEEF library's expf at 1.0-ulp accuracy, fused multiply-adds;
 *   - on the row's last (n mod 2V) elements one by one, its exp the C library's expf.
 * This file does the same: servelab_silu_exp below is SLEEF's algorithm (Cody-Waite
 * reduction by ln 2 in two parts, a degree-5 polynomial, 2^q applied in two halves),
 * the tail calls expf. Division and addition are correctly rounded everywhere, so the
 * result is torch's when the exp is. That holds for one torch build on one CPU kind,
 * so servelab.models.cpu_silu compares the two once per process (a probe over every
 * range of the exp and a row tail) and keeps torch's SiLU when a bit differs; the
 * tests compare them on 2^32 / 4099 evenly spaced bit patterns and the edges.
 * Without AVX2 and FMA the whole row goes through expf, which is what torch's
 * default (non-vector) kernel does.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include "calls.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

static inline float silu_scalar(float x) { return x / (1.0f + expf(-x)); }

/* One vector's operations, named once for each instruction set the exp below is written for. */
#if defined(__AVX512F__)
#define SILU_LANES 16
typedef __m512 silu_vec;
typedef __m512i silu_int;
#define V_SET1 _mm512_set1_ps
#define V_SET1_INT _mm512_set1_epi32
#define V_FMA _mm512_fmadd_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_DIV _mm512_div_ps
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ROUND_TO_INT _mm512_cvtps_epi32
#define V_TO_FLOAT _mm512_cvtepi32_ps
#define V_SHIFT_RIGHT _mm512_srai_epi32
#define V_SHIFT_LEFT _mm512_slli_epi32
#define V_ADD_INT _mm512_add_epi32
#define V_SUB_INT _mm512_sub_epi32
#define V_AS_FLOAT _mm512_castsi512_ps
#define V_NEG(x) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000)))
/* u where d is not below c (NaN keeps u), else 0; infinity where d is above c, else u */
#define V_ZERO_WHERE_BELOW(u, d, c) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, V_SET1(c), _CMP_NLT_UQ), u)
#define V_INFINITY_WHERE_ABOVE(u, d, c) \
    _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(V_SET1(c), d, _CMP_LT_OQ), V_SET1(INFINITY))
#elif defined(__AVX2__) && defined(__FMA__)
#define SILU_LANES 8
typedef __m256 silu_vec;
typedef __m256i silu_int;
#define V_SET1 _mm256_set1_ps
#define V_SET1_INT _mm256_set1_epi32
#define V_FMA _mm256_fmadd_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_DIV _mm256_div_ps
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ROUND_TO_INT _mm256_cvtps_epi32
#define V_TO_FLOAT _mm256_cvtepi32_ps
#define V_SHIFT_RIGHT _mm256_srai_epi32
#define V_SHIFT_LEFT _mm256_slli_epi32
#define V_ADD_INT _mm256_add_epi32
#define V_SUB_INT _mm256_sub_epi32
#define V_AS_FLOAT _mm256_castsi256_ps
#define V_NEG(x) _mm256_xor_ps(x, _mm256_set1_ps(-0.0f))
#define V_ZERO_WHERE_BELOW(u, d, c) _mm256_andnot_ps(_mm256_cmp_ps(d, V_SET1(c), _CMP_LT_OQ), u)
#define V_INFINITY_WHERE_ABOVE(u, d, c) \
    _mm256_blendv_ps(u, V_SET1(INFINITY), _mm256_cmp_ps(V_SET1(c), d, _CMP_LT_OQ))
#endif

#ifdef SILU_LANES
/* exp(d), SLEEF's single-precision 1.0-ulp algorithm: q = round(d / ln 2); s = d - q ln 2 with ln 2 in
 * two parts (fused); a degree-5 polynomial in s; times 2^q in two halves (2^(q>>1) * 2^(q - q>>1),
 * so no exponent overflows); 0 below -104, infinity above 100. */
static inline silu_vec silu_exp(silu_vec d) {
    const silu_int q = V_ROUND_TO_INT(V_MUL(d, V_SET1(1.442695040888963407359924681001892137f)));
    const silu_vec qf = V_TO_FLOAT(q);
    silu_vec s = V_FMA(qf, V_SET1(-0.693145751953125f), d);
    s = V_FMA(qf, V_SET1(-1.428606765330187045e-06f), s);
    silu_vec u = V_SET1(0.000198527617612853646278381f);
    u = V_FMA(u, s, V_SET1(0.00139304355252534151077271f));
    u = V_FMA(u, s, V_SET1(0.00833336077630519866943359f));
    u = V_FMA(u, s, V_SET1(0.0416664853692054748535156f));
    u = V_FMA(u, s, V_SET1(0.166666671633720397949219f));
    u = V_FMA(u, s, V_SET1(0.5f));
    u = V_ADD(V_SET1(1.0f), V_FMA(V_MUL(s, s), u, s));
    const silu_int half = V_SHIFT_RIGHT(q, 1), bias = V_SET1_INT(0x7f);
    u = V_MUL(u, V_AS_FLOAT(V_SHIFT_LEFT(V_ADD_INT(half, bias), 23)));
    u = V_MUL(u, V_AS_FLOAT(V_SHIFT_LEFT(V_ADD_INT(V_SUB_INT(q, half), bias), 23)));
    u = V_ZERO_WHERE_BELOW(u, d, -104.0f);
    return V_INFINITY_WHERE_ABOVE(u, d, 100.0f);
}
#endif

/* The vector width torch's kernel steps by on this build (2 vectors), 0 without vectors: the
 * probe's row lengths reach its tail. */
int64_t servelab_silu_step(void) {
#ifdef SILU_LANES
    return 2 * SILU_LANES;
#else
    return 0;
#endif
}

/* One row of n floats in place, as torch's kernel walks it from the row's start. */
void servelab_silu_row(float* x, int64_t n) {
    int64_t i = 0;
#ifdef SILU_LANES
    const silu_vec one = V_SET1(1.0f);
    for (; i + 2 * SILU_LANES <= n; i += 2 * SILU_LANES) {
        silu_vec a = V_LOAD(x + i), b = V_LOAD(x + i + SILU_LANES);
        V_STORE(x + i, V_DIV(a, V_ADD(one, silu_exp(V_NEG(a)))));
        V_STORE(x + i + SILU_LANES, V_DIV(b, V_ADD(one, silu_exp(V_NEG(b)))));
    }
#endif
    for (; i < n; ++i) x[i] = silu_scalar(x[i]);
}

/* x[r * row_stride + i] = silu(x[...]) for r < rows, i < n: float32, rows split over up to
 * num_threads OpenMP threads (each row is one unit of torch's walk, so the split changes no bits). */
void servelab_silu_rows(float* x, int64_t rows, int64_t n, int64_t row_stride, int64_t num_threads) {
#ifdef _OPENMP
    const int team = (num_threads > 1 && rows > 1) ? (int)(num_threads < rows ? num_threads : rows) : 1;
    if (team > 1) {
#pragma omp parallel for num_threads(team) schedule(static)
        for (int64_t r = 0; r < rows; ++r) servelab_silu_row(x + r * row_stride, n);
        return;
    }
#else
    (void)num_threads;
#endif
    for (int64_t r = 0; r < rows; ++r) servelab_silu_row(x + r * row_stride, n);
}
