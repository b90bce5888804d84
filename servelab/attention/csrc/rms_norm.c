/* RMSNorm on a CPU, float32, bit-identical to torch.rms_norm there.
 *
 * Built into the same library as decode_attention.c (see
 * servelab/attention/cpu_kernel_build.py) and called through ctypes from
 * servelab/models/cpu_norm.py; torch.rms_norm is the reference and the
 * fallback. Why a kernel: on a CPU torch.rms_norm is a composite of about ten
 * small ops (pow, sum, div, add, rsqrt, two multiplies, their allocations),
 * ~20-50 us per call on a decode step's [rows, hidden] whatever its size;
 * here one call does the arithmetic in a few microseconds.
 *
 * Same bits. torch evaluates, per row of n elements:
 *   ms  = sum(x * x) / n          the squares rounded to float first, then summed
 *   inv = 1 / sqrt(ms + eps)      (float arithmetic throughout)
 *   y   = (x * inv) * weight
 * Every step but the sum is one correctly rounded float operation, the same
 * in any implementation. The sum is torch's CPU cascade sum (SumKernel.cpp,
 * dispatched at its AVX2 width of 8 float lanes also on AVX-512 CPUs): the row
 * is read as n/8 vectors, the vectors as 4 interleaved streams summed in
 * levels of 16 (multi_row_sum), the streams then added in order, the n % 8
 * tail elements summed from 0 first, and the 8 lanes added to that one by one.
 * sum_of_squares below is that order written out. The compiler must not fuse a
 * square into its addition (an FMA rounds once, torch rounds twice): this file
 * is compiled with contraction off (the pragmas below), and every square is a
 * statement of its own.
 *
 * Python checks the bits against torch.rms_norm once per process before the
 * first use (servelab.models.cpu_norm.probe) and stays on torch if they differ
 * (another torch version or CPU architecture may sum in another order).
 *
 * Layouts: x, out [rows, n] contiguous; weight [n]. Requirement (checked by
 * Python): n >= 8.
 * Threads: rows split into contiguous ranges when rows * n >= 32768 (torch's
 * grain); a row is computed by one thread, so results do not depend on it.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include "calls.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define SUM_LANES 8   /* torch's Vectorized<float> width in its sum kernel */
#define SUM_ILP 4     /* interleaved vector streams (row_sum's ilp_factor) */
#define SUM_LEVELS 4  /* cascade levels (multi_row_sum's num_levels) */
#define MIN_PARALLEL_ELEMENTS 32768

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* acc += the squares of SUM_ILP consecutive vectors starting at vector (i * SUM_ILP). */
static inline void add_squares(float acc[SUM_ILP][SUM_LANES], const float* x, int64_t i) {
    for (int k = 0; k < SUM_ILP; ++k)
        for (int l = 0; l < SUM_LANES; ++l) {
            const float v = x[(i * SUM_ILP + k) * SUM_LANES + l];
            const float square = v * v;
            acc[k][l] += square;
        }
}

/* sum(x[e]^2 for e < n) in torch's cascade order (see the top of the file); n >= 8. */
static float sum_of_squares(const float* x, int64_t n) {
    const int64_t vectors = n / SUM_LANES, groups = vectors / SUM_ILP;
    int64_t power = ceil_log2(groups) / SUM_LEVELS;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[SUM_LEVELS][SUM_ILP][SUM_LANES] = {{{0.0f}}};
    int64_t i = 0;
    while (i + step <= groups) {
        for (int64_t j = 0; j < step; ++j, ++i) add_squares(acc[0], x, i);
        for (int j = 1; j < SUM_LEVELS; ++j) {  /* carry a finished chunk up one level */
            for (int k = 0; k < SUM_ILP; ++k)
                for (int l = 0; l < SUM_LANES; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < groups; ++i) add_squares(acc[0], x, i);
    for (int j = 1; j < SUM_LEVELS; ++j)
        for (int k = 0; k < SUM_ILP; ++k)
            for (int l = 0; l < SUM_LANES; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = groups * SUM_ILP; v < vectors; ++v)  /* vectors past the last full group */
        for (int l = 0; l < SUM_LANES; ++l) {
            const float e = x[v * SUM_LANES + l];
            const float square = e * e;
            acc[0][0][l] += square;
        }
    for (int k = 1; k < SUM_ILP; ++k)
        for (int l = 0; l < SUM_LANES; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * SUM_LANES; e < n; ++e) {
        const float square = x[e] * x[e];
        total += square;
    }
    for (int l = 0; l < SUM_LANES; ++l) total += acc[0][0][l];
    return total;
}

static void norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
    float mean_square = sum_of_squares(x, n) / (float)n;
    mean_square += eps;
    const float inverse = 1.0f / sqrtf(mean_square);
    for (int64_t e = 0; e < n; ++e) {
        const float normalized = x[e] * inverse;
        out[e] = normalized * weight[e];
    }
}

void servelab_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps,
                       int64_t num_threads) {
#ifdef _OPENMP
    const int team = (num_threads > 1 && rows > 1 && rows * n >= MIN_PARALLEL_ELEMENTS)
                         ? (int)(num_threads < rows ? num_threads : rows) : 1;
    if (team > 1) {
#pragma omp parallel for num_threads(team) schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            norm_row(x + r * n, weight, out + r * n, n, eps);
        return;
    }
#else
    (void)num_threads;
#endif
    for (int64_t r = 0; r < rows; ++r)
        norm_row(x + r * n, weight, out + r * n, n, eps);
}
