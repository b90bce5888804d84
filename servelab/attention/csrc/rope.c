/* Rotary position embedding on a CPU, float32: the same bits as servelab.models.llama.rotate.
 *
 * Built into the same library as decode_attention.c (see
 * servelab/attention/cpu_kernel_build.py) and called through ctypes from
 * servelab/models/cpu_rope.py; the torch form (llama.rotate: a roll, two
 * multiplies and an add, each allocating) is the reference and the fallback.
 *
 * For token t, head h, dimension d < D (D even, half = D / 2):
 *   out[t, h, d] = x[t, h, (d + half) % D] * signed_sin[t, d] + x[t, h, d] * cos[t, d]
 * Each product is rounded, then the sum (torch's order; a + b == b + a in IEEE
 * arithmetic). No product may be fused into the sum: contraction is off below.
 *
 * Layouts: x [T, heads, D] with heads and dimensions contiguous and tokens
 * x_token_stride elements apart (a slice of a fused QKV output); out [T, heads, D]
 * contiguous; cos, signed_sin [T, D] contiguous.
 * Threads: tokens split into contiguous ranges when T * heads * D >= 32768
 * (torch's grain for elementwise ops); every element is computed the same way
 * on any thread.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <stdint.h>
#include "calls.h"

#define MIN_PARALLEL_ELEMENTS 32768

static void rope_token(const float* x, float* out, const float* cos, const float* signed_sin, int64_t heads,
                       int64_t head_size) {
    const int64_t half = head_size / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x + h * head_size;
        float* oh = out + h * head_size;
        for (int64_t d = 0; d < head_size; ++d) {
            const float rotated = xh[d < half ? d + half : d - half] * signed_sin[d];
            const float straight = xh[d] * cos[d];
            oh[d] = rotated + straight;
        }
    }
}

void servelab_rope(const float* x, int64_t x_token_stride, float* out, const float* cos, const float* signed_sin,
                   int64_t tokens, int64_t heads, int64_t head_size, int64_t num_threads) {
#ifdef _OPENMP
    if (num_threads > 1 && tokens > 1 && tokens * heads * head_size >= MIN_PARALLEL_ELEMENTS) {
        const int team = (int)(num_threads < tokens ? num_threads : tokens);
#pragma omp parallel for num_threads(team) schedule(static)
        for (int64_t t = 0; t < tokens; ++t)
            rope_token(x + t * x_token_stride, out + t * heads * head_size, cos + t * head_size,
                       signed_sin + t * head_size, heads, head_size);
        return;
    }
#else
    (void)num_threads;
#endif
    for (int64_t t = 0; t < tokens; ++t)
        rope_token(x + t * x_token_stride, out + t * heads * head_size, cos + t * head_size,
                   signed_sin + t * head_size, heads, head_size);
}
