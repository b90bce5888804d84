/* Few-row GEMM over quantized weights, the weight never materialized in float.
 *
 * out[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) for rows <= 32, where W is stored in one of
 * servelab's packed formats (servelab/quantization/formats.py): int8 per output channel, w4a16
 * groups with zeros, or a GGUF block type (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K). Each thread
 * takes a range of output rows n; for each block of W's row n it dequantizes that block alone
 * (at most 256 floats: AVX-512 registers for int8, w4a16, Q8_0, Q4_0, Q4_1 (see "The vector
 * path" below), the stack for the others), then adds its dot product with each x row. So the
 * weight streams from memory once per call in its packed size, whatever the row count.
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QG_AVX512 1
/* The vector path, per 32-weight block of a weight row: the block's weights as two float vectors
 * w = q * d + m (one rounding: fma), then one fma per x row and vector, lane l of a row's
 * accumulator summing the products at k = l mod 16 in increasing k.
 *
 * Why it is shaped this way (measured on SmolLM2's layers, one thread: a warm layer is bound by
 * the decode's instruction count; inside a step, where each layer's weight comes cold from L3 or
 * memory, one x row also waited on the stream):
 * - 4-bit formats look w up in a 16-entry table fma(0..15, d, m) (one vpermps per 16 weights,
 *   which reads only an index's low 4 bits, so the low nibble needs no mask) instead of
 *   converting every nibble to float and scaling it: the same value, fma(q, d, m), in fewer
 *   instructions.
 * - The float16 scales of 16 blocks are gathered and converted together into float arrays
 *   (QG_SEG blocks a segment), so a block's scale is a broadcast load, not a scalar conversion.
 * - Up to QG_XT x rows: the decoded vectors feed the rows' fmas from registers. More rows: a
 *   segment of QG_NB weight rows is decoded once into an L1 buffer and every tile of x rows
 *   reads it, so a block is decoded once per call, not once per tile.
 * - One to four x rows also prefetch the weight rows QG_PF chunks ahead (a decode step at batch
 *   1 streams its whole weight once; 1.3x on the step's layers cold).
 * Either way an output's operations are the same (the same w, the same fmas in the same order),
 * so its bits do not depend on the batch. */
#define QG_NB 4   /* weight rows decoded together: each x load feeds QG_NB x 2 FMAs */
#define QG_XT 4   /* x rows per register tile */
#define QG_SEG 16 /* blocks per segment (one gather of their scales) */
#ifndef QG_PF
#define QG_PF 4   /* chunks of QG_NB weight rows prefetched ahead */
#endif

static inline int avx512_format(int64_t fmt, int64_t K, int64_t group) {
    return K % 32 == 0 && (fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q5_0 || fmt == FMT_Q8_0
                           || fmt == FMT_INT8 || (fmt == FMT_W4A16 && group % 32 == 0)
                           || ((fmt == FMT_Q4_K || fmt == FMT_Q6_K) && K % 256 == 0));
}

/* d[j], m[j] (w = q * d + m) of blocks b0 .. b0 + nb - 1 (nb <= QG_SEG) of one weight row. */
static inline void seg_scales(int64_t fmt, const uint8_t *row, int64_t b0, int64_t nb, const float *scales,
                              const uint8_t *zeros, int64_t group, float *d, float *m) {
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q5_0 || fmt == FMT_Q8_0) {
        const int stride = fmt == FMT_Q4_0 ? 18 : (fmt == FMT_Q4_1 ? 20 : (fmt == FMT_Q5_0 ? 22 : 34));
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                 15), _mm512_set1_epi32(stride));
        const __mmask16 live = (__mmask16)((1u << nb) - 1u);
        /* 4 bytes at each block's start: d, then m (Q4_1) or the first quants (unused); in the row */
        const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, row + b0 * stride, 1);
        const __m512 vd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        __m512 vm;
        if (fmt == FMT_Q4_1)
            vm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        else if (fmt == FMT_Q4_0)
            vm = _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));  /* exact: a power of two */
        else if (fmt == FMT_Q5_0)
            vm = _mm512_mul_ps(vd, _mm512_set1_ps(-16.0f));
        else
            vm = _mm512_setzero_ps();
        _mm512_storeu_ps(d, vd);
        _mm512_storeu_ps(m, vm);
    } else if (fmt == FMT_Q4_K) {  /* 32-weight sub-block b % 8 of super-block b / 8: its 6-bit scale and min */
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *blk = row + (b0 + j) / 8 * 144;
            int sc, mn;
            q4_k_scale_min((int)((b0 + j) % 8), blk + 4, &sc, &mn);
            d[j] = half_to_float(blk) * (float)sc;
            m[j] = -(half_to_float(blk + 2) * (float)mn);
        }
    } else if (fmt == FMT_Q6_K) {  /* two scales per 32 weights (one per 16): carried in d and m */
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *blk = row + (b0 + j) / 8 * 210;
            const int64_t k = (b0 + j) % 8;
            const int8_t *s = (const int8_t *)(blk + 192 + 8 * (k / 4));
            const float dd = half_to_float(blk + 208);
            d[j] = dd * (float)s[2 * (k % 4)];
            m[j] = dd * (float)s[2 * (k % 4) + 1];
        }
    } else if (fmt == FMT_W4A16) {  /* 32-weight chunk b lies in group b * 32 / group */
        for (int64_t j = 0; j < nb; j++) {
            const int64_t g = (b0 + j) * 32 / group;
            d[j] = scales[g];
            m[j] = -(float)zeros[g] * scales[g];
        }
    } else {  /* int8: the channel scale is applied to the sum */
        for (int64_t j = 0; j < nb; j++) {
            d[j] = 1.0f;
            m[j] = 0.0f;
        }
    }
}

/* Weights [32 b, 32 b + 32) of one row as two float vectors, from its scale d and offset m. */
static inline __attribute__((always_inline)) void decode32(int64_t fmt, const uint8_t *row, int64_t b, float d,
                                                           float m, __m512 *w0, __m512 *w1) {
    if (fmt == FMT_Q8_0 || fmt == FMT_INT8) {
        const int8_t *q = (const int8_t *)(fmt == FMT_Q8_0 ? row + b * 34 + 2 : row + b * 32);
        const __m512 vd = _mm512_set1_ps(d);
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), vd);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), vd);
        return;
    }
    if (fmt == FMT_Q6_K) {  /* q = 4 bits of ql | 2 bits of qh << 4, minus 32; w = (d * scale) * q */
        const uint8_t *blk = row + b / 8 * 210;
        const int64_t k = b % 8, r = k % 4;
        const uint8_t *ql = blk + 64 * (k / 4) + 32 * (r & 1), *qh = blk + 128 + 32 * (k / 4);
        const __m512i low4 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
        __m512i q[2];
        for (int half = 0; half < 2; half++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * half)));
            const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * half)));
            v = _mm512_and_si512(r >= 2 ? _mm512_srli_epi32(v, 4) : v, low4);
            const __m512i high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128((int)(2 * r))),
                                                                    three), 4);
            q[half] = _mm512_sub_epi32(_mm512_or_si512(v, high), bias);
        }
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q[0]), _mm512_set1_ps(d));
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q[1]), _mm512_set1_ps(m));
        return;
    }
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(d), _mm512_set1_ps(m));
    if (fmt == FMT_Q4_K) {  /* sub-blocks 2c and 2c + 1 share 32 bytes: low nibbles, then high */
        const uint8_t *q = row + b / 8 * 144 + 16 + 32 * ((b % 8) / 2);
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        if (b & 1) {
            v0 = _mm512_srli_epi32(v0, 4);
            v1 = _mm512_srli_epi32(v1, 4);
        }
        *w0 = _mm512_permutexvar_ps(v0, table);  /* vpermps reads an index's low 4 bits */
        *w1 = _mm512_permutexvar_ps(v1, table);
        return;
    }
    if (fmt == FMT_Q5_0) {  /* 5-bit: the nibble plus bit j (weight j) or j + 16 (weight j + 16) of qh */
        const uint8_t *blk = row + b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, sizeof(qh));
        const __m512 upper = _mm512_fmadd_ps(_mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                                            30, 31), _mm512_set1_ps(d), _mm512_set1_ps(m));
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 6)));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
        const __m512i bit4 = _mm512_set1_epi32(16);
        *w0 = _mm512_permutex2var_ps(table, _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, bit4), upper);
        *w1 = _mm512_permutex2var_ps(table, _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, bit4), upper);
        return;
    }
    if (fmt == FMT_W4A16) {  /* byte j holds weights 2j (low nibble) and 2j + 1 */
        const __m128i q = _mm_loadu_si128((const __m128i *)(row + b * 16)), m8 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(q, m8), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m8);
        *w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
        *w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table);
        return;
    }
    /* Q4_0 / Q4_1: byte j holds weights j (low nibble) and j + 16 */
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * (fmt == FMT_Q4_1 ? 20 : 18)
                                                                             + (fmt == FMT_Q4_1 ? 4 : 2))));
    *w0 = _mm512_permutexvar_ps(v, table);  /* vpermps reads an index's low 4 bits: the low nibble */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  /* a byte >> 4: the high nibble */
}

/* r[j] = the sum of x[j]'s 16 lanes for 16 vectors at once, every vector by the same fixed tree
 * (lanes l and l + 8 first, then l and l + 4, l + 2, l + 1): two shuffles and one add over two
 * vectors a step, 15 steps for 16 sums. Adding each accumulator's lanes one by one (16 dependent
 * scalar adds, a store and 16 loads an output) was ~20% of a 16-row call. */
static inline __m512 reduce16(const __m512 *x) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) {
        const __m512 lo = _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44);  /* lanes 0-7 of both */
        const __m512 hi = _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE);  /* lanes 8-15 of both */
        b[i] = _mm512_add_ps(lo, hi);  /* [x0: 8 partials, x1: 8 partials] */
    }
    for (int i = 0; i < 4; i++) {
        const __m512 lo = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88);  /* 128-bit lanes 0, 2 */
        const __m512 hi = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD);  /* 128-bit lanes 1, 3 */
        c[i] = _mm512_add_ps(lo, hi);  /* four vectors' 4 partials each, one per 128-bit lane */
    }
    for (int i = 0; i < 2; i++) {
        const __m512 lo = _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44);  /* elements 0, 1 of both */
        const __m512 hi = _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE);  /* elements 2, 3 of both */
        e[i] = _mm512_add_ps(lo, hi);
    }
    const __m512 lo = _mm512_shuffle_ps(e[0], e[1], 0x88), hi = _mm512_shuffle_ps(e[0], e[1], 0xDD);
    return _mm512_add_ps(lo, hi);  /* one sum per vector, in a fixed but permuted lane order */
}

/* out[t, n0 + i] for t < tile, i < nn (<= QG_NB) from the lane accumulators acc[t * QG_NB + i]
 * (n accumulators, n <= 16): lanes summed by reduce16, then int8's channel scale, then the bias. */
static inline void finish(int64_t fmt, const __m512 *acc, int64_t n, int64_t tile, int64_t n0, int64_t nn,
                          const float *scales, const float *bias, float *out, int64_t N) {
    __m512 v[16];
    float sums[16];
    for (int j = 0; j < 16; j++) v[j] = j < n ? acc[j] : _mm512_setzero_ps();
    _mm512_storeu_ps(sums, reduce16(v));
    static const int where[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};  /* vector j's lane */
    for (int64_t t = 0; t < tile; t++)
        for (int64_t i = 0; i < nn; i++) {
            const int64_t n_out = n0 + i;
            float sum = sums[where[t * QG_NB + i]];
            if (fmt == FMT_INT8) sum *= scales[n_out];
            out[t * N + n_out] = sum + (bias ? bias[n_out] : 0.0f);
        }
}

typedef struct {
    int64_t fmt, K, row_bytes, group, groups, N;
    const uint8_t *w, *zeros;
    const float *scales, *bias;
} qg_args;

static inline void row_pointers(const qg_args *g, int64_t n0, int64_t nn, const uint8_t **wr, const float **sr,
                                const uint8_t **zr) {
    for (int i = 0; i < QG_NB; i++) {  /* past N: the last row again, computed and not written */
        const int64_t n = n0 + (i < nn ? i : nn - 1);
        wr[i] = g->w + n * g->row_bytes;
        sr[i] = g->scales ? g->scales + n * g->groups : 0;
        zr[i] = g->zeros ? g->zeros + n * g->groups : 0;
    }
}

/* Up to QG_XT x rows (XT a compile-time 1, 2 or 4; rows past tile repeat its last) against weight
 * rows n0 .. n0 + nn - 1, every block decoded into registers. */
static inline __attribute__((always_inline)) void tile_regs(const qg_args *g, const float *xr, int64_t xs,
                                                            int64_t tile, int64_t n0, int64_t nn, float *out,
                                                            const int XT, const int64_t fmt) {
    const int64_t nblocks = g->K / 32;
    const uint8_t *wr[QG_NB], *zr[QG_NB];
    const float *sr[QG_NB], *xp[QG_XT];
    float d[QG_NB][QG_SEG], m[QG_NB][QG_SEG];
    __m512 a[QG_XT * QG_NB];
    row_pointers(g, n0, nn, wr, sr, zr);
    for (int t = 0; t < XT; t++) xp[t] = xr + (t < tile ? t : tile - 1) * xs;
    for (int j = 0; j < XT * QG_NB; j++) a[j] = _mm512_setzero_ps();
    /* The weight rows QG_PF chunks ahead, a few lines a block: at one x row a step streams the
     * whole weight once, faster than the hardware prefetcher alone fetches it. */
    const char *pf = 0, *pf_end = 0;
    if (n0 + (QG_PF + 1) * QG_NB <= g->N) {
        pf = (const char *)(g->w + (n0 + QG_PF * QG_NB) * g->row_bytes);
        pf_end = pf + QG_NB * g->row_bytes;
    }
    for (int64_t b0 = 0; b0 < nblocks; b0 += QG_SEG) {
        const int64_t nb = nblocks - b0 < QG_SEG ? nblocks - b0 : QG_SEG;
        for (int i = 0; i < QG_NB; i++) seg_scales(fmt, wr[i], b0, nb, sr[i], zr[i], g->group, d[i], m[i]);
        for (int64_t j = 0; j < nb; j++) {
            const int64_t b = b0 + j;
            for (int l = 0; l < 3 && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
            __m512 w0[QG_NB], w1[QG_NB];
            for (int i = 0; i < QG_NB; i++) decode32(fmt, wr[i], b, d[i][j], m[i][j], &w0[i], &w1[i]);
            for (int t = 0; t < XT; t++) {
                const __m512 x0 = _mm512_loadu_ps(xp[t] + 32 * b), x1 = _mm512_loadu_ps(xp[t] + 32 * b + 16);
                for (int i = 0; i < QG_NB; i++) {
                    a[t * QG_NB + i] = _mm512_fmadd_ps(w0[i], x0, a[t * QG_NB + i]);
                    a[t * QG_NB + i] = _mm512_fmadd_ps(w1[i], x1, a[t * QG_NB + i]);
                }
            }
        }
    }
    finish(fmt, a, XT * QG_NB, tile, n0, nn, g->scales, g->bias, out, g->N);
}

/* tile_regs with the tile height and the format compile-time constants: no format branch per block */
static inline __attribute__((always_inline)) void tile_regs_fmt(const qg_args *g, const float *xr, int64_t xs,
                                                                int64_t tile, int64_t n0, int64_t nn, float *out,
                                                                const int64_t fmt) {
    if (tile == 1) tile_regs(g, xr, xs, tile, n0, nn, out, 1, fmt);
    else if (tile == 2) tile_regs(g, xr, xs, tile, n0, nn, out, 2, fmt);
    else tile_regs(g, xr, xs, tile, n0, nn, out, 4, fmt);
}

static void tile_regs_any(const qg_args *g, const float *xr, int64_t xs, int64_t tile, int64_t n0, int64_t nn,
                          float *out) {
    switch (g->fmt) {
    case FMT_Q4_1: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q4_1); break;
    case FMT_Q4_0: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q4_0); break;
    case FMT_Q5_0: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q5_0); break;
    case FMT_Q4_K: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q4_K); break;
    case FMT_Q6_K: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q6_K); break;
    case FMT_Q8_0: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_Q8_0); break;
    case FMT_INT8: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_INT8); break;
    default: tile_regs_fmt(g, xr, xs, tile, n0, nn, out, FMT_W4A16); break;
    }
}

/* One segment of decoded weights buf [QG_NB][QG_SEG * 32] (blocks b0 .. b0 + nb - 1) into the
 * accumulators acc [QG_XT * QG_NB] of up to QG_XT x rows, in registers for the segment. */
static inline __attribute__((always_inline)) void tile_buf(const float *buf, int64_t nb, const float *xr,
                                                           int64_t xs, int64_t tile, int64_t k0, __m512 *acc,
                                                           const int XT) {
    const float *xp[QG_XT];
    __m512 a[QG_XT * QG_NB];
    for (int t = 0; t < XT; t++) xp[t] = xr + (t < tile ? t : tile - 1) * xs + k0;
    for (int j = 0; j < XT * QG_NB; j++) a[j] = acc[j];
    for (int64_t k = 0; k < 32 * nb; k += 16) {
        __m512 w[QG_NB];  /* each weight vector loaded once for the tile's rows */
        for (int i = 0; i < QG_NB; i++) w[i] = _mm512_load_ps(buf + i * QG_SEG * 32 + k);
        for (int t = 0; t < XT; t++) {
            const __m512 x = _mm512_loadu_ps(xp[t] + k);
            for (int i = 0; i < QG_NB; i++) a[t * QG_NB + i] = _mm512_fmadd_ps(w[i], x, a[t * QG_NB + i]);
        }
    }
    for (int j = 0; j < XT * QG_NB; j++) acc[j] = a[j];
}

/* All `rows` x rows (> QG_XT) against weight rows n0 .. n0 + nn - 1: each segment of the weight
 * rows is decoded once into buf, then every x tile accumulates from it. */
static void rows_buffered(const qg_args *g, const float *x, int64_t xs, int64_t rows, int64_t n0, int64_t nn,
                          float *out) {
    const int64_t fmt = g->fmt, nblocks = g->K / 32;
    const uint8_t *wr[QG_NB], *zr[QG_NB];
    const float *sr[QG_NB];
    float d[QG_SEG], m[QG_SEG];
    float buf[QG_NB * QG_SEG * 32] __attribute__((aligned(64)));
    __m512 acc[QG_MAX_ROWS / QG_XT][QG_XT * QG_NB];
    row_pointers(g, n0, nn, wr, sr, zr);
    for (int64_t r0 = 0; r0 < rows; r0 += QG_XT)
        for (int j = 0; j < QG_XT * QG_NB; j++) acc[r0 / QG_XT][j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nblocks; b0 += QG_SEG) {
        const int64_t nb = nblocks - b0 < QG_SEG ? nblocks - b0 : QG_SEG;
        for (int i = 0; i < QG_NB; i++) {
            seg_scales(fmt, wr[i], b0, nb, sr[i], zr[i], g->group, d, m);
            for (int64_t j = 0; j < nb; j++) {
                __m512 w0, w1;
                decode32(fmt, wr[i], b0 + j, d[j], m[j], &w0, &w1);
                _mm512_store_ps(buf + i * QG_SEG * 32 + 32 * j, w0);
                _mm512_store_ps(buf + i * QG_SEG * 32 + 32 * j + 16, w1);
            }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += QG_XT) {
            const int64_t tile = rows - r0 < QG_XT ? rows - r0 : QG_XT;
            const float *xr = x + r0 * xs;
            if (tile == 1) tile_buf(buf, nb, xr, xs, tile, 32 * b0, acc[r0 / QG_XT], 1);
            else if (tile == 2) tile_buf(buf, nb, xr, xs, tile, 32 * b0, acc[r0 / QG_XT], 2);
            else tile_buf(buf, nb, xr, xs, tile, 32 * b0, acc[r0 / QG_XT], 4);
        }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += QG_XT)
        finish(fmt, acc[r0 / QG_XT], QG_XT * QG_NB, rows - r0 < QG_XT ? rows - r0 : QG_XT, n0, nn, g->scales, g->bias,
               out + r0 * g->N, g->N);
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
        const qg_args g = {fmt, K, w_row_bytes, group, groups, N, w, zeros, scales, bias};
        const int64_t chunks = (N + QG_NB - 1) / QG_NB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads((int)(threads > 0 ? threads : 1)) if (threads > 1 && N >= 64)
#endif
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * QG_NB, nn = N - n0 < QG_NB ? N - n0 : QG_NB;
            if (rows <= QG_XT)
                tile_regs_any(&g, x, x_stride, rows, n0, nn, out);
            else
                rows_buffered(&g, x, x_stride, rows, n0, nn, out);
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
