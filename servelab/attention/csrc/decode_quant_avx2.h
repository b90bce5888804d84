/* The decode kernel's tiled parts for AVX2 without AVX-512 (decode_attention_quant.c includes it).
 *
 * The kernel's portable code works on 16-lane vectors; with AVX2 each is two registers, and gcc kept
 * arrays of them (the accumulators of a tile) on the stack: the first AVX2 build of the transposed
 * keys took 1.9x the float32 kernel. These are the same operations, in the same order, on 8-lane
 * vectors with the loops fixed so the accumulators stay in the 16 registers: the key columns' dot
 * products (column_dots8), the values (accumulate_heads8), the exponentials (exp_nonpositive8).
 * (The build hashes this file with the sources.)
 */
#ifndef SERVELAB_DECODE_QUANT_AVX2_H
#define SERVELAB_DECODE_QUANT_AVX2_H

#include "quant_pages.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
/* exp_nonpositive on 8 lanes (AVX2): the same operations in the same order. */
static inline vf8 exp_nonpositive8(vf8 x) {
    x = (vf8)_mm256_max_ps((__m256)x, _mm256_set1_ps(-87.0f));
    const vf8 n = (vf8)_mm256_round_ps((__m256)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vf8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf8)_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32((__m256)n), _mm256_set1_epi32(127)), 23);
}

#ifdef TRANSPOSED_KEYS
/* column_dots with AVX2 (d % 32 == 0): 8-lane vectors throughout (gcc kept 16-lane accumulators on the
 * stack: the kernel took 3x longer), each column of 16 positions converted as two halves; GB (1..3)
 * query heads in 2 chains each (chain c: columns col + 16 c + k), added 0 + 1. */
static inline __attribute__((always_inline)) void column_dots8(const uint8_t* restrict columns, const float* restrict q,
                                                              int64_t gb, int64_t d, int64_t format, vf* restrict dots) {
    vf8 acc[3][2][2]; /* [query head][chain][positions 0-7, 8-15] */
    for (int g = 0; g < 3; ++g)
        for (int c = 0; c < 2; ++c) acc[g][c][0] = acc[g][c][1] = (vf8){0};
    for (int64_t col = 0; col < d; col += 32)
        for (int64_t k = 0; k < 16; ++k) {
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                const __m128i raw = _mm_load_si128((const __m128i*)(columns + col * 16 + k * 32 + c * 16));
                const vf8 lo = convert8(raw, format), hi = convert8(_mm_unpackhi_epi64(raw, raw), format);
#pragma GCC unroll 3
                for (int g = 0; g < 3; ++g)
                    if (g < gb) {
                        const float qd = q[g * d + col + 16 * c + k];
                        const vf8 b = {qd, qd, qd, qd, qd, qd, qd, qd};
                        acc[g][c][0] += b * lo;
                        acc[g][c][1] += b * hi;
                    }
            }
        }
    for (int g = 0; g < 3; ++g)
        if (g < gb) {
            const vf8 lo = acc[g][0][0] + acc[g][1][0], hi = acc[g][0][1] + acc[g][1][1];
            store8((float*)&dots[g], lo);
            store8((float*)&dots[g] + 8, hi);
        }
}
#endif

/* accumulate_heads with AVX2 for d % 32 == 0: the same operations on 8-lane vectors (16-lane ones went
 * through the stack), the output 32 values at a time in registers (3 heads x 4 vectors: 12 of the 16
 * registers; a fixed 4, so gcc unrolls the loops and keeps them there). */
static inline __attribute__((always_inline)) void accumulate_heads8(const float* restrict rows,
                                                                    const float* restrict v_scales, int64_t n,
                                                                    int64_t p, int64_t gb, int64_t d,
                                                                    const float* restrict s, int64_t width,
                                                                    float* restrict out) {
    float w[3 * TILE] __attribute__((aligned(64)));
    tile_weights(s, width, p, v_scales, n, gb, w);
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
        vf8 acc[3][4];
        for (int g = 0; g < 3; ++g)
            if (g < gb)
                for (int j = 0; j < 4; ++j) acc[g][j] = load8(out + g * d + c0 + 8 * j);
#pragma GCC unroll 16
        for (int64_t t = 0; t < TILE; ++t) {
            vf8 x[4];
            for (int j = 0; j < 4; ++j) x[j] = load8(rows + t * d + c0 + 8 * j);
            for (int g = 0; g < 3; ++g)
                if (g < gb) {
                    const float wt = w[g * TILE + t];
                    const vf8 wg = {wt, wt, wt, wt, wt, wt, wt, wt};
                    for (int j = 0; j < 4; ++j) acc[g][j] += wg * x[j];
                }
        }
        for (int g = 0; g < 3; ++g)
            if (g < gb)
                for (int j = 0; j < 4; ++j) store8(out + g * d + c0 + 8 * j, acc[g][j]);
    }
}
#endif

#endif /* SERVELAB_DECODE_QUANT_AVX2_H */
