/* Greedy decoding's argmax on a CPU, float32: each row's first maximal index, or -1 when the
 * row's maximum is not a finite number.
 *
 * Built into the same library as decode_attention.c (see
 * servelab/attention/cpu_kernel_build.py) and called through ctypes from
 * servelab/samplers/cpu_argmax.py; torch.argmax is the reference and the
 * fallback.
 *
 * Why: torch's CPU argmax over a large vocabulary runs at a fraction of the
 * read rate: SmolLM2's 16 x 49,152 logits took ~1.2 ms on one core of a Zen 4
 * VM, where amax over the same tensor takes ~55 us and this pass ~85 us;
 * about 1.5% of a batch-16 decode step. One pass keeps, in each of 4 x ARGMAX_LANES lanes
 * (positions i % (4 x ARGMAX_LANES), four vectors side by side so that no single
 * compare-and-blend chain sets the pace: one chain ran at 150 us), the lane's
 * largest value and the first position holding it (a strict >, so a later
 * equal value never replaces it), and whether a NaN was seen; the lanes are
 * then combined: the largest value and, among lanes holding it, the smallest
 * position. That is the first position of the row's maximum, which is what
 * torch.argmax returns (+0.0 and -0.0 compare equal in both).
 *
 * -1 (not finite) when the row holds a NaN (torch would return the first
 * NaN's position) or its maximum is +inf or -inf (every entry -inf): the
 * greedy shortcut that calls this hands such rows to the sampler's full
 * path, which reports them, exactly as it did when it checked torch's pick.
 *
 * Layout: x [rows, n], rows x_row_stride elements apart, each row contiguous,
 * n < 2^31 (positions are int32 lanes); out [rows] int64. Rows split over
 * threads when there is enough work (one row's answer never depends on it).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* One vector register of lanes: 16 with AVX-512, 8 with AVX, else 4. A 16-lane vector on AVX2 is two
 * registers, and the four chains' values, positions and counters (24 ymm) no longer fit in
 * AVX2's 16: gcc kept them on the stack and the pass took 2.1-3.3 ms on a Zen 3 VM
 * (~15x its 130-150 us now); SSE2 alone, 3.9 ms where 4 lanes take 0.33. */
#if defined(__AVX512F__)
#define ARGMAX_LANES 16
#elif defined(__AVX__)
#define ARGMAX_LANES 8
#else
#define ARGMAX_LANES 4 /* SSE2's 16 registers of 4 */
#endif
#define CHAINS 4  /* independent lane sets: one compare-and-blend chain is latency-bound */
#define MIN_PARALLEL_ELEMENTS 65536  /* below this a team's wake-up costs more than the pass */

typedef float af __attribute__((vector_size(ARGMAX_LANES * 4)));   /* one register of floats */
typedef int32_t ai __attribute__((vector_size(ARGMAX_LANES * 4))); /* their positions (the caller keeps n < 2^31) */

/* A lane's value and first position replaced where `better` (all ones) holds: bitwise blends,
 * so the loop stays in vector registers (C has no ?: on vectors). */
static inline af blend_f(af old, af new, ai better) { return (af)(((ai)new & better) | ((ai)old & ~better)); }

static int64_t argmax_row(const float* x, int64_t n) {
    af best[CHAINS];
    ai where[CHAINS], position[CHAINS], nan = {0};
    for (int c = 0; c < CHAINS; ++c)
        for (int j = 0; j < ARGMAX_LANES; ++j)
            best[c][j] = -INFINITY, where[c][j] = -1, position[c][j] = c * ARGMAX_LANES + j;
    const ai step = position[0] - position[0] + CHAINS * ARGMAX_LANES;
    int64_t i = 0;
    for (; i + CHAINS * ARGMAX_LANES <= n; i += CHAINS * ARGMAX_LANES)
        for (int c = 0; c < CHAINS; ++c) {
            af v;
            memcpy(&v, x + i + c * ARGMAX_LANES, sizeof(v));
            const ai better = v > best[c];  /* strict: an equal later value keeps the earlier position */
            nan |= v != v;
            best[c] = blend_f(best[c], v, better);
            where[c] = (position[c] & better) | (where[c] & ~better);
            position[c] += step;
        }
    int any_nan = 0;
    for (int j = 0; j < ARGMAX_LANES; ++j) any_nan |= nan[j] != 0;
    float top = -INFINITY;
    int64_t first = -1;
    for (int c = 0; c < CHAINS; ++c)  /* the largest lane value; among equals, the first position */
        for (int j = 0; j < ARGMAX_LANES; ++j)
            if (where[c][j] >= 0 && (best[c][j] > top || (best[c][j] == top && where[c][j] < first)))
                top = best[c][j], first = where[c][j];
    for (; i < n; ++i) {  /* the tail, after every earlier position */
        const float v = x[i];
        any_nan |= v != v;
        if (v > top) top = v, first = i;
    }
    /* A row of -inf leaves no position set (first == -1): not finite, like +inf and NaN. */
    return any_nan || first < 0 || !isfinite(top) ? -1 : first;
}

void servelab_argmax_rows(const float* x, int64_t x_row_stride, int64_t rows, int64_t n, int64_t* out,
                          int64_t num_threads) {
    if (rows <= 0) return;
#ifdef _OPENMP
    const int team = (int)(num_threads < rows ? num_threads : rows);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1 && rows * n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * x_row_stride, n);
#else
    (void)num_threads;
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * x_row_stride, n);
#endif
}
