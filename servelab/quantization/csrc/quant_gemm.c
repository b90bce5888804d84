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
#ifdef _OPENMP
#include <omp.h>
#endif

#define QG_MAX_ROWS 32

enum { FMT_INT8 = 0, FMT_W4A16 = 1, FMT_Q8_0 = 2, FMT_Q4_0 = 3, FMT_Q4_1 = 4, FMT_Q5_0 = 5, FMT_Q4_K = 6,
       FMT_Q6_K = 7 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
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

/* One output row n: acc[r] = sum_k x[r, k] * W[n, k]. */
static void one_row(int64_t fmt, const float *x, int64_t x_stride, int64_t rows, int64_t K, const uint8_t *w,
                    const float *scales, const uint8_t *zeros, int64_t group, float *acc) {
    float buf[256];
    const int64_t E = block_elems(fmt, group), B = block_bytes(fmt, group);
    for (int64_t r = 0; r < rows; r++) acc[r] = 0.0f;
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += E, b++) {
        const int64_t len = K - k0 < E ? K - k0 : E;
        const uint8_t *blk = w + b * B;
        if (fmt == FMT_INT8) {
            const int8_t *q = (const int8_t *)blk;
            for (int64_t j = 0; j < len; j++) buf[j] = (float)q[j];
        } else if (fmt == FMT_W4A16) {
            const float s = scales[b], z = (float)zeros[b], o = -z * s;
            for (int64_t j = 0; j < len / 2; j++) {
                buf[2 * j] = (float)(blk[j] & 0xF) * s + o;
                buf[2 * j + 1] = (float)(blk[j] >> 4) * s + o;
            }
        } else {
            gguf_block(fmt, blk, buf);
        }
        for (int64_t r = 0; r < rows; r++) acc[r] += dot(buf, x + r * x_stride + k0, len);
    }
    if (fmt == FMT_INT8)
        for (int64_t r = 0; r < rows; r++) acc[r] *= scales[0];
}

/* x [rows, K] (row stride x_stride floats), W [N] rows of w_row_bytes bytes; scales / zeros:
 * int8 [N], w4a16 [N, K / group] (else unused); bias [N] or NULL; out [rows, N] contiguous. */
void servelab_quant_gemm(int64_t fmt, const float *x, int64_t x_stride, int64_t rows, int64_t K, int64_t N,
                         const uint8_t *w, int64_t w_row_bytes, const float *scales, const uint8_t *zeros,
                         int64_t group, const float *bias, float *out, int64_t threads) {
    if (rows <= 0 || rows > QG_MAX_ROWS) return;
    const int64_t groups = fmt == FMT_W4A16 ? K / group : (fmt == FMT_INT8 ? 1 : 0);
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
