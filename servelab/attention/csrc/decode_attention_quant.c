/* Decode attention straight over quantized KV pages (int8, float8 e4m3fn / e5m2) on a CPU.
 *
 * Built into the one CPU-kernel library by servelab/attention/cpu_kernel_build.py and called
 * through ctypes by servelab/attention/cpu_decode_quant.py; the reference is
 * servelab/reference/paged_attention.py (dequantize, then attend). Why a kernel: a decode step
 * reads every sequence's whole context once per layer, and that read is the floor of the
 * step; over quantized pages it is 1 byte per element (plus one float32 scale per token and
 * head) instead of 4, provided nothing makes a dequantized copy first. Each head reads its
 * positions straight from the pages through the block table (quant_pages.h: the conversions, the
 * walk, a tile's rows), converts them to float32 (int8 by a cast, float8 by integer field moves)
 * in registers or a small buffer, and uses them for the G query heads of its group; the scale
 * multiplies the dot product (K) and the softmax weight (V), not every element. Head sizes that
 * are multiples of 16 take the tiled path (attend_heads_tiled: a row's KV heads tile by tile, 16
 * positions at a time; with AVX-512 BW the K rows transposed as bytes so a register holds one
 * column of 16 positions, else converted rows and one transposing lane sum per 16 dot products;
 * output chunks in registers, with AVX2 the value rows' bytes converted where they are used; rows
 * prefetched ahead); others the row path (attend_head_rows: one row at a time).
 *
 * Layouts:
 *   q        float32, row r, query head j = h * G + g at q + r * q_row_stride + j * D
 *   k, v     the pages, bytes: position p of row r is block table[r * table_stride + p / B],
 *            offset p % B; its head h at block * s_b + offset * s_s + h * s_h (byte strides
 *            in cache_strides[0..2] for K, [3..5] for V; the D bytes are contiguous)
 *   k_scale, v_scale  float32, same addressing with scale_strides (in floats; 0 for a static
 *            per-layer scale)
 *   seq_lens int32 [rows] (>= 1): the row's context including its newest position
 *   scores   float32 workspace [max(1, num_threads), Hk, G, width], width >= the longest context: one
 *            slot per thread, reused by each row (or head) the thread takes, so it stays in the core's
 *            caches (one slot per row was 2.4 MB at 16 x 4k for SmolLM2, streamed out and back)
 *   out      float32 [rows, Hk * G, D]
 * window > 0 restricts row r to its last `window` positions.
 *
 * Order (deterministic): dot products in fixed chains (row path: 16 lanes over d, summed by a
 * fixed tree; tiled path with AVX-512 BW: four chains, chain c over the columns 16 c + k of every
 * 64, then (0 + 1) + (2 + 3); without: two chains of alternate 16-lane chunks, lanes summed by a
 * fixed tree); softmax max and sum in 16 lanes, then the lanes by a fixed tree; values accumulated
 * over positions in increasing order (tiled path: one chain per query head and 16-value chunk); each
 * head computed by one thread, in the same operations whether its thread takes whole rows or single
 * heads, so every thread count gives the same bits. (A build with other instructions may differ in
 * the last bits: the oracle test holds every build to the float64 reference.)
 */
#include "quant_pages.h"
#include "decode_quant_avx2.h"
#include "calls.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* exp(x) for x <= 0 (softmax arguments, max subtracted): Cephes' single-precision polynomial, as
 * csrc/decode_attention.c's (within 2 ulp of expf on [-87, 0]); no libm call, so loops vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * bits_to_float((uint32_t)((int32_t)n + 127) << 23);
}

#ifdef __AVX512F__
/* exp_nonpositive on 16 lanes: the same operations in the same order (rounding to nearest even, the
 * same polynomial, the exponent built from the integer n). */
static inline vf exp_nonpositive16(vf x) {
    const vu32 low = (vu32)(x < vsplat(-87.0f));
    x = bits_to_vf((vf_to_bits(vsplat(-87.0f)) & low) | (vf_to_bits(x) & ~low));
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * vsplat(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf r = (x - n * vsplat(0.693359375f)) - n * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + vsplat(1.3981999507e-3f);
    p = p * r + vsplat(8.3334519073e-3f);
    p = p * r + vsplat(4.1665795894e-2f);
    p = p * r + vsplat(1.6666665459e-1f);
    p = p * r + vsplat(5.0000001201e-1f);
    p = p * r * r + r + vsplat(1.0f);
    return p * bits_to_vf((vu32)(((__v16si)_mm512_cvtps_epi32((__m512)n) + 127) << 23));
}
#endif

/* The largest of n floats in 16 lanes (a scalar max / sum is a chain of dependent operations the
 * compiler may not reorder: it was 11% of the kernel; the sum is made in softmax_rows the same way).
 * Fixed order: deterministic. */
static inline float lanes_max(const float* x, int64_t n) {
    int64_t i = 0;
    float r = -INFINITY;
#if defined(__AVX2__) && !defined(__AVX512F__) /* vmaxps on two halves (the compare-and-blend took 4 ops) */
    __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;
    for (; i + LANES <= n; i += LANES) {
        lo = _mm256_max_ps(lo, _mm256_loadu_ps(x + i));
        hi = _mm256_max_ps(hi, _mm256_loadu_ps(x + i + 8));
    }
    const vf8 m = (vf8)_mm256_max_ps(lo, hi);
    for (int j = 0; j < 8; ++j) r = m[j] > r ? m[j] : r;
#else
    vf m = vsplat(-INFINITY);
    for (; i + LANES <= n; i += LANES) {
        const vf y = vload(x + i);
        const vu32 take = (vu32)(y > m);  /* lanes of all ones where y is larger (C has no vector ?:) */
        m = bits_to_vf((vf_to_bits(y) & take) | (vf_to_bits(m) & ~take));
    }
    for (int j = 0; j < LANES; ++j) r = m[j] > r ? m[j] : r;
#endif
    for (; i < n; ++i) r = x[i] > r ? x[i] : r;
    return r;
}

/* Softmax over s[g * width + begin .. len) in place, for every query head g; out zeroed. */
static inline void softmax_rows(float* restrict s, int64_t width, int64_t begin, int64_t len, int64_t group,
                                int64_t d, float* restrict out) {
    for (int64_t g = 0; g < group; ++g) {
        float* sg = s + g * width;
        const float m = lanes_max(sg + begin, len - begin);
        /* weights under e^-69 (1e-30 of the largest) are 0: they change nothing a float32 sum keeps,
         * and their products with small scales would be denormals, which are slow on x86 */
        int64_t p = begin;
        vf sum = vsplat(0.0f); /* summed as they are made: 16 lanes, in order, then the fixed tree */
#if defined(__AVX2__) && !defined(__AVX512F__)
        /* two halves of 8, their sums in two registers (a 16-lane sum went through the stack every
         * 16 scores: the softmax took a third of the kernel's time outside its dot products) */
        vf8 sum_lo = {0}, sum_hi = {0};
        for (; p + LANES <= len; p += LANES) {
            const vf8 x_lo = load8(sg + p) - m, x_hi = load8(sg + p + 8) - m;
            const vf8 e_lo = (vf8)_mm256_and_ps((__m256)exp_nonpositive8(x_lo),
                                                _mm256_cmp_ps((__m256)x_lo, _mm256_set1_ps(-69.0f), _CMP_GE_OQ));
            const vf8 e_hi = (vf8)_mm256_and_ps((__m256)exp_nonpositive8(x_hi),
                                                _mm256_cmp_ps((__m256)x_hi, _mm256_set1_ps(-69.0f), _CMP_GE_OQ));
            store8(sg + p, e_lo);
            store8(sg + p + 8, e_hi);
            sum_lo += e_lo;
            sum_hi += e_hi;
        }
        sum = __builtin_shufflevector(sum_lo, sum_hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
        for (; p + LANES <= len; p += LANES) {
#ifdef __AVX512F__ /* 16 at once (gcc vectorized the scalar loop 8 wide) */
            const vf x = vload(sg + p) - vsplat(m);
            const vf e = bits_to_vf(vf_to_bits(exp_nonpositive16(x)) & (vu32)(x >= vsplat(-69.0f)));
            memcpy(sg + p, &e, sizeof(e));
#else
            for (int64_t i = p; i < p + LANES; ++i) sg[i] = sg[i] - m < -69.0f ? 0.0f : exp_nonpositive(sg[i] - m);
            const vf e = vload(sg + p);
#endif
            sum += e;
        }
        float total = hsum(sum);
        for (; p < len; ++p) {
            sg[p] = sg[p] - m < -69.0f ? 0.0f : exp_nonpositive(sg[p] - m);
            total += sg[p];
        }
        const float inv = 1.0f / total;
        for (int64_t p = begin; p < len; ++p) sg[p] *= inv;
        memset(out + g * d, 0, sizeof(float) * (size_t)d);
    }
}

/* One KV head over positions [begin, len), one row at a time (any head size). */
static inline __attribute__((always_inline)) void attend_head_rows(
                        const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v,
                        const int64_t* restrict cs, const float* restrict ks, const float* restrict vs,
                        const int64_t* restrict ss, const int32_t* restrict table, int64_t begin, int64_t len,
                        int64_t h, int64_t group, int64_t d, int64_t block_size, int64_t format, float scale,
                        float* restrict s, int64_t width, float* restrict out) {
    float row[MAX_HEAD_SIZE] __attribute__((aligned(64)));
    const int64_t chunks = d / LANES, tail = chunks * LANES;
    const uint8_t* kh = k + h * cs[2];
    const uint8_t* vh = v + h * cs[5];
    const float* ksh = ks + h * ss[2];
    const float* vsh = vs + h * ss[5];
    FOR_POSITIONS(begin, len, block_size, table, block, offset, p) {  /* scores: scale * k_scale * (q . row) */
        convert_row(kh + block * cs[0] + offset * cs[1], row, d, format);
        const float factor = scale * ksh[block * ss[0] + offset * ss[1]];
        for (int64_t g = 0; g < group; ++g) {
            const float* qg = q + g * d;
            vf acc = vsplat(0.0f);
            for (int64_t c = 0; c < chunks; ++c) acc += vload(qg + c * LANES) * vload(row + c * LANES);
            float dot = hsum(acc);
            for (int64_t i = tail; i < d; ++i) dot += qg[i] * row[i];
            s[g * width + p] = dot * factor;
        }
    }
    softmax_rows(s, width, begin, len, group, d, out);
    FOR_POSITIONS(begin, len, block_size, table, block, offset, p) {  /* values: (p * v_scale) * row */
        convert_row(vh + block * cs[3] + offset * cs[4], row, d, format);
        const float v_scale = vsh[block * ss[3] + offset * ss[4]];
        for (int64_t g = 0; g < group; ++g) {
            const float w = s[g * width + p] * v_scale;
            float* og = out + g * d;
            for (int64_t i = 0; i < d; ++i) og[i] += w * row[i];
        }
    }
}


/* ---- The tiled path (head sizes that are multiples of 16): TILE positions at a time. ----
 * Per position the row path above pays a lane sum per query head and a load / store of the
 * output per query head; it measured ~190 cycles per position and KV head on int8 pages (SmolLM2
 * shapes), slower than the float32 kernel reading 4x the bytes. Here a tile's K rows are
 * transposed as bytes and each query head's TILE dot products build up in one register
 * (score_tile_transposed; without AVX-512 BW: the rows converted once into a float32 buffer in L1
 * and each head's TILE dot products summed by one transposing tree, 15 shuffle-add steps for 16
 * positions instead of 16 separate lane sums), and the value rows are accumulated into output
 * chunks held in registers across the tile. Same float32 products; only the summation order
 * differs (fixed, so still deterministic). */

/* r[t] = the sum of x[t]'s 16 lanes, for 16 vectors at once: halves of pairs added, 16 -> 8 -> 4 -> 2
 * -> 1 partial sums per vector, every step two shuffles and one add over two vectors. */
static inline vf reduce_tile(const vf* x) {
    vf b[8], c[4], e[2];
    for (int i = 0; i < 8; ++i)
        b[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                         30, 31);
    for (int i = 0; i < 2; ++i)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                         30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* s[g * width + p + t] = factor * k_scale[t] * (q_g . row_t) for the n (<= TILE) rows of a tile. */
static inline __attribute__((always_inline)) void score_tile(const float* restrict q, const float* restrict rows,
                                                             const float* restrict k_scales, int64_t n, int64_t p,
                                                             int64_t group, int64_t d, float factor,
                                                             float* restrict s, int64_t width) {
    const int64_t chunks = d / LANES;
    for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        vf acc[TILE];
        /* a full tile (the common case) with no test per row: gcc then keeps the 16 sums in registers
         * (with the test they went through the stack: 7% of the kernel in L1) */
#pragma GCC unroll 16
        for (int64_t t = 0; t < TILE; ++t) {
            vf a = vsplat(0.0f), b = vsplat(0.0f); /* two chains: half the FMA latency in a row */
            if (n == TILE || t < n) {
                int64_t c = 0;
                for (; c + 1 < chunks; c += 2) {
                    a += vload(qg + c * LANES) * vload(rows + t * d + c * LANES);
                    b += vload(qg + (c + 1) * LANES) * vload(rows + t * d + (c + 1) * LANES);
                }
                if (c < chunks) a += vload(qg + c * LANES) * vload(rows + t * d + c * LANES);
            }
            acc[t] = a + b;
        }
        const vf dots = reduce_tile(acc);
        if (n == TILE) {
            const vf sums = dots * (vsplat(factor) * vload(k_scales));
            memcpy(s + g * width + p, &sums, sizeof(sums));
        } else {
            for (int64_t t = 0; t < n; ++t) s[g * width + p + t] = dots[t] * (factor * k_scales[t]);
        }
    }
}

/* Query heads a tiled function takes at once, and 16-lane chunks of a value row it holds in registers:
 * what fits the register file (32 vector registers with AVX-512, 16 with AVX2, where a 16-lane vector is
 * two registers). */
#ifdef __AVX512F__
#define QUERY_BLOCK 4
#define VALUE_CHUNKS 4
#else
#define QUERY_BLOCK 3
#define VALUE_CHUNKS 2
#endif

#ifdef __AVX512BW__
/* The transposing score path (AVX-512 BW; AVX2: column_dots8 in decode_quant_avx2.h): a tile's K rows transposed as bytes
 * (transpose_bytes), so each converted vector holds one column d of 16 positions, and a query head's
 * 16 dot products build up in one register as sum_d q[d] * column_d: no lane sums, q[d] broadcast from
 * memory. On SmolLM2 shapes (G = 3, D = 64) it made the kernel ~8% faster in cache than score_tile's
 * transposing tree. Dot products of GB (1..4) query heads in 4 chains each (chain c: columns col + 16 c
 * + k), added (0 + 1) + (2 + 3); dots[g]: query head g's 16 dot products. */
static inline __attribute__((always_inline)) void column_dots(const uint8_t* restrict columns, const float* restrict q,
                                                              int64_t gb, int64_t d, int64_t format, vf* restrict dots) {
    vf acc[4][4];
    for (int g = 0; g < 4; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = vsplat(0.0f);
    for (int64_t col = 0; col < d; col += 64) {
        const int64_t lanes = (d - col) / LANES < 4 ? (d - col) / LANES : 4;
        for (int64_t k = 0; k < 16; ++k) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                if (c >= lanes) break;
                const vf x = convert16(_mm_load_si128((const __m128i*)(columns + col * 16 + k * 64 + c * 16)), format);
                for (int g = 0; g < 4; ++g)
                    if (g < gb) acc[g][c] += vsplat(q[g * d + col + 16 * c + k]) * x;
            }
        }
    }
    for (int g = 0; g < 4; ++g)
        if (g < gb) dots[g] = (acc[g][0] + acc[g][1]) + (acc[g][2] + acc[g][3]);
}
#elif defined(TRANSPOSED_KEYS) /* AVX2 without AVX-512: decode_quant_avx2.h */
#define column_dots column_dots8
#endif

#ifdef TRANSPOSED_KEYS
/* Whether the transposing path takes head size d (AVX2 transposes 32 columns at a time). */
#define TRANSPOSABLE(d) (COLUMN_BYTES == 64 || (d) % COLUMN_BYTES == 0)

/* score_tile's result from the TILE rows at addresses and their k_scales (load_tile's: past n, zero_row
 * with scale 0). */
static inline __attribute__((always_inline)) void score_tile_transposed(const float* restrict q,
                                                                        const uint8_t* const* addresses,
                                                                        const float* restrict k_scales, int64_t n,
                                                                        int64_t p, int64_t group, int64_t d,
                                                                        int64_t format, float factor,
                                                                        float* restrict s, int64_t width) {
    uint8_t columns[TILE * MAX_HEAD_SIZE] __attribute__((aligned(64)));
    for (int64_t col = 0; col < d; col += COLUMN_BYTES) transpose_bytes(addresses, col, d - col, columns + col * 16);
    const vf factors = vsplat(factor) * vload(k_scales);
    for (int64_t g0 = 0; g0 < group; g0 += QUERY_BLOCK) { /* at most 16 accumulators (AVX-512; AVX2: 6) */
        vf dots[QUERY_BLOCK];
        const int64_t gb = group - g0 < QUERY_BLOCK ? group - g0 : QUERY_BLOCK;
        if (QUERY_BLOCK >= 4 && gb == 4) column_dots(columns, q + g0 * d, 4, d, format, dots);
        else if (gb == 3) column_dots(columns, q + g0 * d, 3, d, format, dots);
        else if (gb == 2) column_dots(columns, q + g0 * d, 2, d, format, dots);
        else column_dots(columns, q + g0 * d, 1, d, format, dots);
        for (int64_t g = 0; g < gb; ++g) {
            const vf sums = dots[g] * factors;
            if (n == TILE) memcpy(s + (g0 + g) * width + p, &sums, sizeof(sums));
            else
                for (int64_t t = 0; t < n; ++t) s[(g0 + g) * width + p + t] = sums[t];
        }
    }
}
#else
#define TRANSPOSABLE(d) 0
#endif

/* out_g += sum_t (s[g * width + p + t] * v_scale[t]) * row_t over the n (<= TILE) rows of a tile, for
 * GB (1..QUERY_BLOCK) query heads at once: each row chunk is loaded once for all GB heads, the output
 * VALUE_CHUNKS chunks at a time in registers, positions in increasing order (one chain per head and chunk). Loading the
 * rows once per head instead was 2-5% slower in the kernel on SmolLM2's shapes; the weights are
 * stored one by one (a vector store read back as broadcasts cost a store-forwarding stall: 9% of this
 * function in a micro-benchmark). Every tile runs all TILE positions (a fixed, unrolled loop: a
 * partial tile's loop over n was 5% slower at 190 positions): rows past n must be zeros, their
 * weights are. */
static inline __attribute__((always_inline)) void accumulate_heads(const float* restrict rows,
                                                                   const float* restrict v_scales, int64_t n,
                                                                   int64_t p, int64_t gb, int64_t d,
                                                                   const float* restrict s, int64_t width,
                                                                   float* restrict out) {
    float w[QUERY_BLOCK * TILE] __attribute__((aligned(64)));
    tile_weights(s, width, p, v_scales, n, gb, w);
    for (int64_t c0 = 0; c0 < d; c0 += VALUE_CHUNKS * LANES) {
        const int64_t m = (d - c0) / LANES < VALUE_CHUNKS ? (d - c0) / LANES : VALUE_CHUNKS;
        vf acc[QUERY_BLOCK][VALUE_CHUNKS];
        for (int64_t g = 0; g < gb; ++g)
            for (int64_t j = 0; j < m; ++j) acc[g][j] = vload(out + g * d + c0 + j * LANES);
#pragma GCC unroll 16
        for (int64_t t = 0; t < TILE; ++t) {
            vf x[VALUE_CHUNKS];
            for (int64_t j = 0; j < m; ++j) x[j] = vload(rows + t * d + c0 + j * LANES);
            for (int64_t g = 0; g < gb; ++g) {
                const vf wg = vsplat(w[g * TILE + t]);
                for (int64_t j = 0; j < m; ++j) acc[g][j] += wg * x[j];
            }
        }
        for (int64_t g = 0; g < gb; ++g)
            for (int64_t j = 0; j < m; ++j) memcpy(out + g * d + c0 + j * LANES, &acc[g][j], sizeof(vf));
    }
}

#ifndef VALUES_FROM_BYTES /* AVX2: values straight from the rows' bytes (decode_quant_avx2.h) */
#define VALUES_FROM_BYTES(d) 0
#define accumulate_tile_bytes8(...) ((void)0)
#endif

/* The values of a tile's n rows for all query heads, QUERY_BLOCK at a time (rows past n zeros). */
static inline __attribute__((always_inline)) void accumulate_tile(const float* restrict rows,
                                                                  const float* restrict v_scales, int64_t n,
                                                                  int64_t p, int64_t group, int64_t d,
                                                                  const float* restrict s, int64_t width,
                                                                  float* restrict out) {
    for (int64_t g0 = 0; g0 < group; g0 += QUERY_BLOCK) {
        const int64_t gb = group - g0 < QUERY_BLOCK ? group - g0 : QUERY_BLOCK;
        const float* sg = s + g0 * width;
        float* og = out + g0 * d;
        if (QUERY_BLOCK >= 4 && gb == 4) accumulate_heads(rows, v_scales, n, p, 4, d, sg, width, og);
        else if (gb == 3) accumulate_heads(rows, v_scales, n, p, 3, d, sg, width, og);
        else if (gb == 2) accumulate_heads(rows, v_scales, n, p, 2, d, sg, width, og);
        else accumulate_heads(rows, v_scales, n, p, 1, d, sg, width, og);
    }
}

/* KV heads [h, h + heads) of one row over positions [begin, len) by tiles: scores, softmax, values
 * (d % LANES == 0). q, s and out point at head h's query, scores and output; head h + j's are
 * j * group * d (q, out) and j * group * width (s) further. The heads go through each tile in turn,
 * so a block's rows of every head are read while its lines are in cache: one head at a time read
 * every third line of a block (three KV heads) and came back for the others after the whole
 * context, by when the prefetchers' copies were gone (a sweep from DRAM took 17% longer). */
static inline __attribute__((always_inline)) void attend_heads_tiled(
    const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v, const int64_t* restrict cs,
    const float* restrict ks, const float* restrict vs, const int64_t* restrict ss, const int32_t* restrict table,
    int64_t begin, int64_t len, int64_t h, int64_t heads, int64_t group, int64_t d, int64_t block_size,
    int64_t format, float scale, float* restrict s, int64_t width, float* restrict out) {
    float rows[TILE * MAX_HEAD_SIZE] __attribute__((aligned(64)));
    float scales[TILE];
    const int64_t lookahead = begin + PREFETCH < len ? begin + PREFETCH : begin;
    for (int pass = 0; pass < 2; ++pass) { /* 0: keys -> scores; 1: values -> out */
        const uint8_t* cache = pass == 0 ? k : v;
        const float* cache_scales = pass == 0 ? ks : vs;
        const int64_t* c = cs + 3 * pass;
        const int64_t* t = ss + 3 * pass;
        walk_t w = walk_start(table, begin, block_size), ahead = walk_start(table, lookahead, block_size);
        for (int64_t p = begin; p < len; p += TILE) {
            const int64_t n = len - p < TILE ? len - p : TILE;
            walk_t head_w = w, head_ahead = ahead;  /* every head walks the same positions */
            for (int64_t j = 0; j < heads; ++j) {
                head_w = w, head_ahead = ahead;
                /* the paths that read the rows' bytes in place take their addresses, the others the rows
                 * converted into `rows` */
                const uint8_t* addresses[TILE];
                const int in_place = pass == 0 ? TRANSPOSABLE(d) : VALUES_FROM_BYTES(d);
                load_tile(cache + (h + j) * c[2], c[0], c[1], cache_scales + (h + j) * t[2], t[0], t[1], &head_w,
                          &head_ahead, table, p, n, len, d, block_size, format, rows, scales,
                          in_place ? addresses : NULL);
#ifdef TRANSPOSED_KEYS
                if (pass == 0 && in_place) {
                    score_tile_transposed(q + j * group * d, addresses, scales, n, p, group, d, format, scale,
                                          s + j * group * width, width);
                    continue;
                }
#endif
                if (pass == 1 && in_place) {
                    accumulate_tile_bytes8(addresses, scales, n, p, group, d, format, s + j * group * width, width,
                                           out + j * group * d);
                    continue;
                }
                if (pass == 0)
                    score_tile(q + j * group * d, rows, scales, n, p, group, d, scale, s + j * group * width, width);
                else {
                    if (n < TILE) /* zero weights times zero rows: the missing positions add nothing */
                        memset(rows + n * d, 0, sizeof(float) * (size_t)((TILE - n) * d));
                    accumulate_tile(rows, scales, n, p, group, d, s + j * group * width, width, out + j * group * d);
                }
            }
            w = head_w, ahead = head_ahead;
        }
        if (pass == 0)
            for (int64_t j = 0; j < heads; ++j)
                softmax_rows(s + j * group * width, width, begin, len, group, d, out + j * group * d);
    }
}

/* attend_heads_tiled with the common head sizes as compile-time constants (fully unrolled conversions
 * and dots), and the format too for int8 at 64 and 128 and float8 at 64 (no format branches); each
 * instance its own function. Inlined all into the kernel's one OpenMP loop, they made one huge
 * function: gcc took 43 s to compile this file with -march=native on a Zen 3 (65 s with plain -O3,
 * 40 s for Sapphire Rapids; most of the test suite's kernel builds), against 13 s (37, 16) as
 * functions, and the code it made for the huge one was 5-8% slower on int8 pages (register allocation
 * over the whole; A/B in a C driver, the same bits). Float8 at 64 as a runtime format was then 6%
 * slower, hence its own constants. One indirect call per work unit is nothing beside a unit's hundreds
 * of positions. */
typedef void (*tiled_fn)(const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v,
                         const int64_t* restrict cs, const float* restrict ks, const float* restrict vs,
                         const int64_t* restrict ss, const int32_t* restrict table, int64_t begin, int64_t len,
                         int64_t h, int64_t heads, int64_t group, int64_t d, int64_t block_size, int64_t format,
                         float scale, float* restrict s, int64_t width, float* restrict out);

#define SERVELAB_TILED_FN(NAME, D, F)                                                                         \
    static __attribute__((noinline)) void NAME(                                                              \
        const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v, const int64_t* restrict cs, \
        const float* restrict ks, const float* restrict vs, const int64_t* restrict ss,                        \
        const int32_t* restrict table, int64_t begin, int64_t len, int64_t h, int64_t heads, int64_t group,    \
        int64_t d, int64_t block_size, int64_t format, float scale, float* restrict s, int64_t width,          \
        float* restrict out) {                                                                                \
        (void)d, (void)format;                                                                                \
        attend_heads_tiled(q, k, v, cs, ks, vs, ss, table, begin, len, h, heads, group, D, block_size, F, scale, s, \
                           width, out);                                                                       \
    }
SERVELAB_TILED_FN(tiled_64_int8, 64, 1)
SERVELAB_TILED_FN(tiled_128_int8, 128, 1)
SERVELAB_TILED_FN(tiled_64_e4m3, 64, 2)
SERVELAB_TILED_FN(tiled_64_e5m2, 64, 3)
SERVELAB_TILED_FN(tiled_128, 128, format)
SERVELAB_TILED_FN(tiled_256, 256, format)
SERVELAB_TILED_FN(tiled_any, d, format)
#undef SERVELAB_TILED_FN

/* Returns 0, or -1 when the head size exceeds MAX_HEAD_SIZE or the format is unknown. */
int servelab_paged_decode_quant(const float* q, int64_t q_row_stride, const uint8_t* k_cache,
                                const uint8_t* v_cache, const int64_t* cache_strides, const float* k_scale,
                                const float* v_scale, const int64_t* scale_strides, const int32_t* block_table,
                                int64_t table_stride, const int32_t* seq_lens, int64_t rows, int64_t kv_heads,
                                int64_t group, int64_t head_size, int64_t block_size, int64_t window,
                                int64_t format, float scale, float* scores, int64_t width, float* out,
                                int64_t num_threads) {
    if (head_size > MAX_HEAD_SIZE || format < 1 || format > 3) return -1;
    const int team = num_threads > 1 ? (int)num_threads : 1;
    /* work units: whole rows (all their KV heads tile by tile, see attend_heads_tiled) when there are
     * enough rows to share among the threads, else single (row, KV head) pairs. Each head's
     * operations are the same either way, so the unit changes no bit. */
    const int whole_rows = team == 1 || rows >= 2 * team;
    /* the tiled instance for this head size and format (NULL: the row path) */
    const tiled_fn tiled = head_size == 64 && format == 1 ? tiled_64_int8
                           : head_size == 128 && format == 1 ? tiled_128_int8
                           : head_size == 64 && format == 2 ? tiled_64_e4m3
                           : head_size == 64 && format == 3 ? tiled_64_e5m2
                           : head_size == 128 ? tiled_128
                           : head_size == 256 ? tiled_256 : head_size % LANES == 0 ? tiled_any : NULL;
    const int64_t units = whole_rows ? rows : rows * kv_heads, span = whole_rows ? kv_heads : 1;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1 && units > 1)
    for (int64_t x = 0; x < units; ++x) {
        const int64_t r = whole_rows ? x : x / kv_heads, h = whole_rows ? 0 : x % kv_heads;
        const int64_t len = seq_lens[r];
        const int64_t begin = window > 0 && len > window ? len - window : 0;
        const float* qh = q + r * q_row_stride + h * group * head_size;
        const int32_t* table = block_table + r * table_stride;
#ifdef _OPENMP
        const int64_t slot = omp_get_thread_num();
#else
        const int64_t slot = 0;
#endif
        float* sh = scores + (slot * kv_heads + h) * group * width;
        float* oh = out + (r * kv_heads + h) * group * head_size;
        if (tiled)
            tiled(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, table, begin, len, h, span,
                  group, head_size, block_size, format, scale, sh, width, oh);
        else
            for (int64_t j = 0; j < span; ++j)
                attend_head_rows(qh + j * group * head_size, k_cache, v_cache, cache_strides, k_scale, v_scale,
                                 scale_strides, table, begin, len, h + j, group, head_size, block_size, format, scale,
                                 sh + j * group * width, width, oh + j * group * head_size);
    }
    return 0;
}

/* One layer of a pure decode step over int8 pages in one call: this step's rows written
 * (servelab_write_kv_int8), then attended (servelab_paged_decode_quant), the same operations in the
 * same order as the two calls, so the same bits. The model's direct path
 * (servelab.attention.cpu_decode_quant.DecodeStep) calls it for every layer after the first; one
 * foreign call instead of two, from Python whose objects the layer's weights have just evicted. */
int servelab_write_decode_int8(const float* key, int64_t key_row_stride, const float* value, int64_t value_row_stride,
                               const int64_t* slots, int64_t static_scales, const float* q, int64_t q_row_stride,
                               int8_t* k_cache, int8_t* v_cache, const int64_t* cache_strides, float* k_scale,
                               float* v_scale, const int64_t* scale_strides, const int32_t* block_table,
                               int64_t table_stride, const int32_t* seq_lens, int64_t rows, int64_t kv_heads,
                               int64_t group, int64_t head_size, int64_t block_size, int64_t window, float scale,
                               float* scores, int64_t width, float* out, int64_t num_threads) {
    if (head_size > MAX_HEAD_SIZE) return -1; /* before the write: a refused call changes nothing */
    servelab_write_kv_int8(key, key_row_stride, value, value_row_stride, k_cache, v_cache, cache_strides, k_scale,
                           v_scale, scale_strides, static_scales, slots, rows, kv_heads, head_size, block_size);
    return servelab_paged_decode_quant(q, q_row_stride, (const uint8_t*)k_cache, (const uint8_t*)v_cache,
                                       cache_strides, k_scale, v_scale, scale_strides, block_table, table_stride,
                                       seq_lens, rows, kv_heads, group, head_size, block_size, window, 1, scale,
                                       scores, width, out, num_threads);
}
