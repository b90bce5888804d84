/* Few-row GEMM over quantized weights, the weight never materialized in float.
 *
 * out[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) for rows <= 32, where W is stored in one of
 * servelab's packed formats (servelab/quantization/formats.py): int8 per output channel, w4a16
 * groups with zeros, or a GGUF block type (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K). Each thread
 * takes a range of output rows n; for each block of W's row n it dequantizes that block alone
 * (at most 256 floats, on the stack), then adds its dot product with each x row. So the weight
 * streams from memory once per call in its packed size, whatever the row count.
 *
 * Numerics: every output sums its blocks in increasing k, each block's products in 16 float32
 * lanes (then the lanes in order), so a row's result does not depend on the batch it is in or
 * on the thread count. The float64 reference differs by float32 rounding of a K-term sum.
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QG_MAX_ROWS 32
#define QG_TILE 8  /* x rows whose accumulators stay in registers together */

enum { FMT_INT8 = 0, FMT_W4A16 = 1, FMT_Q8_0 = 2, FMT_Q4_0 = 3, FMT_Q4_1 = 4, FMT_Q5_0 = 5, FMT_Q4_K = 6,
       FMT_Q6_K = 7 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float lanes[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[j + l] * b[j + l];
    float s = 0.0f;
    for (; j < n; j++) s += a[j] * b[j];
    for (int l = 0; l < 16; l++) s += lanes[l];
    return s;
}

/* a full block: a compile-time length the compiler unrolls into vector FMAs */
static inline float dot_fixed(const float *restrict a, const float *restrict b, int64_t n) {
    float lanes[16] = {0};
    for (int64_t j = 0; j < n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[j + l] * b[j + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += lanes[l];
    return s;
}

static inline void nibbles32(const uint8_t *qs, float *buf, float d, float m) {
    for (int j = 0; j < 16; j++) {
        buf[j] = (float)(qs[j] & 0xF) * d + m;
        buf[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static inline void q4_k_scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Dequantize block b of a GGUF row into buf (32 or 256 floats). */
static inline void gguf_block(int64_t fmt, const uint8_t *blk, float *restrict buf) {
    switch (fmt) {
    case FMT_Q8_0: {
        float d = half_to_float(blk);
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < 32; j++) buf[j] = d * (float)q[j];
        break;
    }
    case FMT_Q4_0: {
        float d = half_to_float(blk);
        nibbles32(blk + 2, buf, d, -8.0f * d);
        break;
    }
    case FMT_Q4_1:
        nibbles32(blk + 4, buf, half_to_float(blk), half_to_float(blk + 2));
        break;
    case FMT_Q5_0: {
        float d = half_to_float(blk);
        uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) | ((uint32_t)blk[5] << 24);
        const uint8_t *qs = blk + 6;
        for (int j = 0; j < 16; j++) {
            int x0 = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
            int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
            buf[j] = (float)(x0 - 16) * d;
            buf[j + 16] = (float)(x1 - 16) * d;
        }
        break;
    }
    case FMT_Q4_K: {
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        const uint8_t *scales = blk + 4, *qs = blk + 16;
        for (int c = 0; c < 4; c++) {
            int sc1, m1, sc2, m2;
            q4_k_scale_min(2 * c, scales, &sc1, &m1);
            q4_k_scale_min(2 * c + 1, scales, &sc2, &m2);
            float d1 = d * (float)sc1, o1 = dmin * (float)m1, d2 = d * (float)sc2, o2 = dmin * (float)m2;
            const uint8_t *q = qs + 32 * c;
            float *y = buf + 64 * c;
            for (int l = 0; l < 32; l++) {
                y[l] = d1 * (float)(q[l] & 0xF) - o1;
                y[l + 32] = d2 * (float)(q[l] >> 4) - o2;
            }
        }
        break;
    }
    case FMT_Q6_K: {
        float d = half_to_float(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const int8_t *s = sc + 8 * h;
            float *y = buf + 128 * h;
            for (int l = 0; l < 32; l++) {
                int i = l / 16;
                int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)s[i] * (float)q1;
                y[l + 32] = d * (float)s[i + 2] * (float)q2;
                y[l + 64] = d * (float)s[i + 4] * (float)q3;
                y[l + 96] = d * (float)s[i + 6] * (float)q4;
            }
        }
        break;
    }
    default:
        break;
    }
}

static int64_t block_elems(int64_t fmt, int64_t group) {
    switch (fmt) {
    case FMT_INT8: return 32;
    case FMT_W4A16: return group;
    case FMT_Q4_K: case FMT_Q6_K: return 256;
    default: return 32;
    }
}

static int64_t block_bytes(int64_t fmt, int64_t group) {
    switch (fmt) {
    case FMT_INT8: return 32;
    case FMT_W4A16: return group / 2;
    case FMT_Q8_0: return 34;
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q5_0: return 22;
    case FMT_Q4_K: return 144;
    case FMT_Q6_K: return 210;
    default: return 0;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QG_AVX512 1
/* 32 weights from 16 bytes: fmt Q4_0 / Q4_1 nibbles (byte j: weights j, j + 16) or w4a16 nibbles
 * (byte j: weights 2j, 2j + 1), as two float vectors q * d + m. */
static inline void nib32_avx512(const uint8_t *qs, int interleaved, float d, float m, __m512 *w0, __m512 *w1) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    if (interleaved) {
        const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
        lo = a;
        hi = b;
    }
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm);
}

static inline void int8x32_avx512(const int8_t *q, float d, __m512 *w0, __m512 *w1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    const __m512 vd = _mm512_set1_ps(d);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), vd);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), vd);
}

static inline int avx512_format(int64_t fmt, int64_t K, int64_t group) {
    return K % 32 == 0 && (fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q8_0 || fmt == FMT_INT8
                           || (fmt == FMT_W4A16 && group % 32 == 0));
}

/* Weights [k0, k0 + 32) of one row (block b) as two float vectors. */
static inline void decode32_avx512(int64_t fmt, const uint8_t *w, int64_t k0, int64_t b, const float *scales,
                                   const uint8_t *zeros, int64_t group, __m512 *w0, __m512 *w1) {
    switch (fmt) {
    case FMT_Q4_0: {
        const uint8_t *blk = w + b * 18;
        const float d = half_to_float(blk);
        nib32_avx512(blk + 2, 0, d, -8.0f * d, w0, w1);
        break;
    }
    case FMT_Q4_1: {
        const uint8_t *blk = w + b * 20;
        nib32_avx512(blk + 4, 0, half_to_float(blk), half_to_float(blk + 2), w0, w1);
        break;
    }
    case FMT_Q8_0: {
        const uint8_t *blk = w + b * 34;
        int8x32_avx512((const int8_t *)(blk + 2), half_to_float(blk), w0, w1);
        break;
    }
    case FMT_INT8:
        int8x32_avx512((const int8_t *)(w + k0), 1.0f, w0, w1);
        break;
    default: {  /* w4a16: 32 weights in 16 bytes, in group k0 / group */
        const int64_t g = k0 / group;
        nib32_avx512(w + k0 / 2, 1, scales[g], -(float)zeros[g] * scales[g], w0, w1);
        break;
    }
    }
}

#define QG_NB 4  /* weight rows decoded together: each x load feeds QG_NB FMAs */
#define QG_XT 4  /* x rows per pass */
static inline __attribute__((always_inline)) void block_avx512_t(
        int64_t fmt, const float *xr, int64_t xs, int64_t tile, int64_t K, const uint8_t *w, int64_t row_bytes,
        int64_t n0, int64_t nn, const float *scales, const uint8_t *zeros, int64_t group, int64_t groups,
        const float *bias, float *out, int64_t N, const int XT) {
    __m512 a[QG_NB][QG_XT];
    const uint8_t *wr[QG_NB];
    const float *sr[QG_NB];
    const uint8_t *zr[QG_NB];
    const float *xp[QG_XT];
    for (int i = 0; i < QG_NB; i++) {  /* past N: the last row again, computed and not written */
        const int64_t n = n0 + (i < nn ? i : nn - 1);
        wr[i] = w + n * row_bytes;
        sr[i] = scales ? scales + n * groups : 0;
        zr[i] = zeros ? zeros + n * groups : 0;
    }
    for (int t = 0; t < XT; t++) xp[t] = xr + (t < tile ? t : tile - 1) * xs;
    for (int i = 0; i < QG_NB; i++)
        for (int t = 0; t < XT; t++) a[i][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += 32, b++) {
        __m512 w0[QG_NB], w1[QG_NB];
        for (int i = 0; i < QG_NB; i++) decode32_avx512(fmt, wr[i], k0, b, sr[i], zr[i], group, &w0[i], &w1[i]);
        for (int t = 0; t < XT; t++) {
            const __m512 x0 = _mm512_loadu_ps(xp[t] + k0), x1 = _mm512_loadu_ps(xp[t] + k0 + 16);
            for (int i = 0; i < QG_NB; i++) {
                a[i][t] = _mm512_fmadd_ps(w0[i], x0, a[i][t]);
                a[i][t] = _mm512_fmadd_ps(w1[i], x1, a[i][t]);
            }
        }
    }
    for (int64_t i = 0; i < nn; i++) {
        const int64_t n = n0 + i;
        for (int64_t t = 0; t < tile; t++) {
            float lanes[16], sum = 0.0f;
            _mm512_storeu_ps(lanes, a[i][t]);
            for (int l = 0; l < 16; l++) sum += lanes[l];
            if (fmt == FMT_INT8) sum *= scales[n];
            out[t * N + n] = sum + (bias ? bias[n] : 0.0f);
        }
    }
}

/* out[t * N + n0 + i] = sum_k x[t, k] * W[n0 + i, k] for t < tile (<= QG_XT), i < nn (<= QG_NB).
 * Lane l of each accumulator sums the products at k = l mod 16 in increasing k; lanes are added
 * in order at the end: the same operations for an output whatever the batch or the grouping. */
static void block_avx512(int64_t fmt, const float *xr, int64_t xs, int64_t tile, int64_t K, const uint8_t *w,
                         int64_t row_bytes, int64_t n0, int64_t nn, const float *scales, const uint8_t *zeros,
                         int64_t group, int64_t groups, const float *bias, float *out, int64_t N) {
    if (tile == 1)
        block_avx512_t(fmt, xr, xs, tile, K, w, row_bytes, n0, nn, scales, zeros, group, groups, bias, out, N, 1);
    else if (tile == 2)
        block_avx512_t(fmt, xr, xs, tile, K, w, row_bytes, n0, nn, scales, zeros, group, groups, bias, out, N, 2);
    else
        block_avx512_t(fmt, xr, xs, tile, K, w, row_bytes, n0, nn, scales, zeros, group, groups, bias, out, N, 4);
}
#endif

/* Decode block b of one weight row into buf (len weights). */
static inline void decode_block(int64_t fmt, const uint8_t *blk, int64_t len, const float *scales,
                                const uint8_t *zeros, int64_t b, float *restrict buf) {
    if (fmt == FMT_INT8) {
        const int8_t *q = (const int8_t *)blk;
        for (int64_t j = 0; j < len; j++) buf[j] = (float)q[j];
    } else if (fmt == FMT_W4A16) {
        const float s = scales[b], o = -(float)zeros[b] * s;
        for (int64_t j = 0; j < len / 2; j++) {
            buf[2 * j] = (float)(blk[j] & 0xF) * s + o;
            buf[2 * j + 1] = (float)(blk[j] >> 4) * s + o;
        }
    } else {
        gguf_block(fmt, blk, buf);
    }
}

/* One output row n: acc[r] = sum_k x[r, k] * W[n, k]. Each row keeps 16 float32 lanes across
 * all blocks (lane l sums the products at k = l mod 16, in increasing k), reduced once at the
 * end in lane order, then a partial last 16 (int8's odd widths) is added: the same operations
 * for a row whatever the batch. Rows go in tiles of QG_TILE so their lanes stay in registers. */
static void one_row(int64_t fmt, const float *x, int64_t x_stride, int64_t rows, int64_t K, const uint8_t *w,
                    const float *scales, const uint8_t *zeros, int64_t group, float *acc) {
    float buf[256];
    const int64_t E = block_elems(fmt, group), B = block_bytes(fmt, group), K16 = K / 16 * 16;
    for (int64_t r0 = 0; r0 < rows; r0 += QG_TILE) {
        const int64_t tile = rows - r0 < QG_TILE ? rows - r0 : QG_TILE;
        const float *xr = x + r0 * x_stride;
        float lanes[QG_TILE][16] = {{0}};
        float tail[QG_TILE] = {0};
        for (int64_t k0 = 0, b = 0; k0 < K; k0 += E, b++) {
            const int64_t len = K - k0 < E ? K - k0 : E;
            decode_block(fmt, w + b * B, len, scales, zeros, b, buf);
            const int64_t full = (k0 + len <= K16 ? len : K16 - k0) / 16 * 16;
            if (tile == 1) {
                for (int64_t j = 0; j < full; j += 16)
                    for (int l = 0; l < 16; l++) lanes[0][l] += buf[j + l] * xr[k0 + j + l];
            } else {
                for (int64_t t = 0; t < tile; t++)
                    for (int64_t j = 0; j < full; j += 16)
                        for (int l = 0; l < 16; l++) lanes[t][l] += buf[j + l] * xr[t * x_stride + k0 + j + l];
            }
            for (int64_t j = full; j < len; j++)
                for (int64_t t = 0; t < tile; t++) tail[t] += buf[j] * xr[t * x_stride + k0 + j];
        }
        for (int64_t t = 0; t < tile; t++) {
            float s = 0.0f;
            for (int l = 0; l < 16; l++) s += lanes[t][l];
            acc[r0 + t] = fmt == FMT_INT8 ? (s + tail[t]) * scales[0] : s + tail[t];
        }
    }
}

/* x [rows, K] (row stride x_stride floats), W [N] rows of w_row_bytes bytes; scales / zeros:
 * int8 [N], w4a16 [N, K / group] (else unused); bias [N] or NULL; out [rows, N] contiguous. */
void servelab_quant_gemm(int64_t fmt, const float *x, int64_t x_stride, int64_t rows, int64_t K, int64_t N,
                         const uint8_t *w, int64_t w_row_bytes, const float *scales, const uint8_t *zeros,
                         int64_t group, const float *bias, float *out, int64_t threads) {
    if (rows <= 0 || rows > QG_MAX_ROWS) return;
    const int64_t groups = fmt == FMT_W4A16 ? K / group : (fmt == FMT_INT8 ? 1 : 0);
#ifdef QG_AVX512
    if (avx512_format(fmt, K, group)) {
        const int64_t chunks = (N + QG_NB - 1) / QG_NB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads((int)(threads > 0 ? threads : 1)) if (threads > 1 && N >= 64)
#endif
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * QG_NB, nn = N - n0 < QG_NB ? N - n0 : QG_NB;
            for (int64_t r0 = 0; r0 < rows; r0 += QG_XT)
                block_avx512(fmt, x + r0 * x_stride, x_stride, rows - r0 < QG_XT ? rows - r0 : QG_XT, K, w,
                             w_row_bytes, n0, nn, scales, zeros, group, groups, bias, out + r0 * N, N);
        }
        return;
    }
#endif
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads((int)(threads > 0 ? threads : 1)) if (threads > 1 && N >= 64)
#endif
    for (int64_t n = 0; n < N; n++) {
        float acc[QG_MAX_ROWS];
        one_row(fmt, x, x_stride, rows, K, w + n * w_row_bytes, scales ? scales + n * groups : 0,
                zeros ? zeros + n * groups : 0, group, acc);
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t r = 0; r < rows; r++) out[r * N + n] = acc[r] + b;
    }
}

/* Rows `ids` of a GGUF-blocked table [V, K] dequantized into out [len(ids), K] (an embedding lookup). */
void servelab_quant_rows(int64_t fmt, const uint8_t *w, int64_t w_row_bytes, int64_t K, const int64_t *ids,
                         int64_t count, float *out) {
    const int64_t E = block_elems(fmt, 0), B = block_bytes(fmt, 0);
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * w_row_bytes;
        for (int64_t k0 = 0, b = 0; k0 < K; k0 += E, b++) gguf_block(fmt, row + b * B, out + i * K + k0);
    }
}

int servelab_quant_abi(void) { return 1; }

#ifndef SERVELAB_QUANT_BUILD_KEY
#define SERVELAB_QUANT_BUILD_KEY "unkeyed"
#endif
const char *servelab_quant_build_key(void) { return SERVELAB_QUANT_BUILD_KEY; }
