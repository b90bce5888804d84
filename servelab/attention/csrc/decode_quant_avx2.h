/* The decode kernel's tiled parts for AVX2 without AVX-512 (decode_attention_quant.c includes it).
 *
 * The kernel's portable code works on 16-lane vectors; with AVX2 each is two registers, and gcc kept
 * arrays of them (the accumulators of a tile) on the stack: the first AVX2 build of the transposed
 * keys took 1.9x the float32 kernel. These are the same operations, in the same order, on 8-lane
 * vectors with the loops fixed so the accumulators stay in the 16 registers: the key columns' dot
 * products (column_dots8), the values (accumulate_bytes8), the exponentials (exp_nonpositive8).
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
        /* by 2 (not by 4, which was 6-9% slower): 1.5-4% faster in the kernel */
#pragma GCC unroll 2
        for (int64_t k = 0; k < 16; ++k) {
#pragma GCC unroll 2
            for (int c = 0; c < 2; ++c) {
                /* each half widened straight from memory (a 16-byte load and an unpack took one more
                 * shuffle per 8 values, on the pipes the widening uses) */
                /* transpose_bytes' AVX2 layout: rows 0-7 at 64 (k / 2) + 16 c + 8 (k % 2), rows 8-15 32 further */
                const uint8_t* column = columns + col * 16 + (k >> 1) * 64 + (k & 1) * 8 + c * 16;
                const vf8 lo = convert8(_mm_loadl_epi64((const __m128i*)column), format),
                          hi = convert8(_mm_loadl_epi64((const __m128i*)(column + 32)), format);
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

/* accumulate_heads with AVX2 for d % 32 == 0, straight from the rows' bytes: rows[t] is position
 * p + t's row of d stored values (rows past n point at zeros, their weights are 0). The same products
 * in the same order as accumulate_heads (so the same bits), on 8-lane vectors, the output 32 values at a
 * time in registers (3 heads x 4 vectors: 12 of the 16 registers), each 8 bytes widened and converted
 * where they are used. (Converted into a float32 tile first, the tile's stores took a third of the value
 * pass: a 256-bit store per 8 values, one per cycle.) */
static inline __attribute__((always_inline)) void accumulate_bytes8(const uint8_t* const* rows,
                                                                    const float* restrict v_scales, int64_t n,
                                                                    int64_t p, int64_t gb, int64_t d, int64_t format,
                                                                    const float* restrict s, int64_t width,
                                                                    float* restrict out) {
    float w[3 * TILE] __attribute__((aligned(64)));
    tile_weights(s, width, p, v_scales, n, gb, w);
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
        vf8 acc[3][4];
        for (int g = 0; g < 3; ++g)
            if (g < gb)
                for (int j = 0; j < 4; ++j) acc[g][j] = load8(out + g * d + c0 + 8 * j);
        /* unrolled by 4, not 16: fully unrolled, gcc kept the 48 weights' addresses on the stack (~20%
         * slower in a micro-benchmark) */
#pragma GCC unroll 4
        for (int64_t t = 0; t < TILE; ++t) {
            const uint8_t* row = rows[t] + c0;
            vf8 weight[3];
            for (int g = 0; g < 3; ++g)
                if (g < gb) weight[g] = (vf8)_mm256_broadcast_ss(w + g * TILE + t);
            for (int j = 0; j < 4; ++j) {
                const vf8 x = convert8(_mm_loadl_epi64((const __m128i*)(row + 8 * j)), format);
                for (int g = 0; g < 3; ++g)
                    if (g < gb) acc[g][j] += weight[g] * x;
            }
        }
        for (int g = 0; g < 3; ++g)
            if (g < gb)
                for (int j = 0; j < 4; ++j) store8(out + g * d + c0 + 8 * j, acc[g][j]);
    }
}

/* The values of a tile for all query heads, 3 at a time (accumulate_tile from the rows' bytes). */
static inline __attribute__((always_inline)) void accumulate_tile_bytes8(const uint8_t* const* rows,
                                                                         const float* restrict v_scales, int64_t n,
                                                                         int64_t p, int64_t group, int64_t d,
                                                                         int64_t format, const float* restrict s,
                                                                         int64_t width, float* restrict out) {
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const int64_t gb = group - g0 < 3 ? group - g0 : 3;
        if (gb == 3) accumulate_bytes8(rows, v_scales, n, p, 3, d, format, s + g0 * width, width, out + g0 * d);
        else if (gb == 2) accumulate_bytes8(rows, v_scales, n, p, 2, d, format, s + g0 * width, width, out + g0 * d);
        else accumulate_bytes8(rows, v_scales, n, p, 1, d, format, s + g0 * width, width, out + g0 * d);
    }
}
#define VALUES_FROM_BYTES(d) ((d) % 32 == 0)
#endif

#endif /* SERVELAB_DECODE_QUANT_AVX2_H */
