/* Decode attention straight over quantized KV pages (int8, float8 e4m3fn / e5m2) on a CPU.
 *
 * Built into the one CPU-kernel library by servelab/attention/cpu_kernel_build.py and called
 * through ctypes by servelab/attention/cpu_decode_quant.py; the reference is
 * servelab/reference/paged_attention.py (dequantize, then attend). Why a kernel: a decode step
 * reads every sequence's whole context once per layer, and that read is the floor of the
 * step; over quantized pages it is 1 byte per element (plus one float32 scale per token and
 * head) instead of 4, provided nothing makes a dequantized copy first. Here each head reads
 * its positions straight from the pages through the block table, converts one row of D
 * bytes to float32 (int8 by a cast, float8 by integer field moves) into a small buffer, and
 * uses it for the G query heads of its group; the scale multiplies the dot product (K) and
 * the softmax weight (V), not every element.
 *
 * Layouts:
 *   q        float32, row r, query head j = h * G + g at q + r * q_row_stride + j * D
 *   k, v     the pages, bytes: position p of row r is block table[r * table_stride + p / B],
 *            offset p % B; its head h at block * s_b + offset * s_s + h * s_h (byte strides
 *            in cache_strides[0..2] for K, [3..5] for V; the D bytes are contiguous)
 *   k_scale, v_scale  float32, same addressing with scale_strides (in floats; 0 for a static
 *            per-layer scale)
 *   seq_lens int32 [rows] (>= 1): the row's context including its newest position
 *   scores   float32 workspace [rows * Hk, G, width], width >= the longest context
 *   out      float32 [rows, Hk * G, D]
 * window > 0 restricts row r to its last `window` positions.
 *
 * Order (deterministic): dot products in 16 lanes over d, lanes summed in increasing order; softmax max and sum over
 * positions in increasing order; each head computed by one thread, so every thread count
 * gives the same bits.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_SIZE 512
#define LANES 16

typedef float vf __attribute__((vector_size(64)));  /* 16 floats */

static inline vf vload(const float* p) { vf x; memcpy(&x, p, sizeof(x)); return x; }
static inline vf vsplat(float s) { return (vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* The 16 lanes summed as a fixed tree (halves added: 16 -> 8 -> 4 -> 1): deterministic, and a few
 * shuffles instead of 15 dependent scalar adds. */
static inline float hsum(vf x) {
    const vf8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
                  + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float bits_to_float(uint32_t bits) { float f; memcpy(&f, &bits, sizeof(f)); return f; }

/* One stored row of `d` values -> float32 (format 1 int8, 2 float8 e4m3fn, 3 float8 e5m2). Float8 is
 * decoded with integer ops the compiler vectorizes: a normal number moves its exponent and mantissa
 * into float32's fields (bias 127 - 7 = 120 for e4m3, 127 - 15 = 112 for e5m2); a subnormal is
 * mantissa * 2^-9 (e4m3) or 2^-16 (e5m2), exact in float32. NaN / infinity are never stored (the
 * writes clamp to the finite range), so they are not decoded. */
static inline void convert_row(const uint8_t* restrict src, float* restrict dst, int64_t d, int64_t format) {
    if (format == 1) {
        const int8_t* s = (const int8_t*)src;
        for (int64_t i = 0; i < d; ++i) dst[i] = (float)s[i];
    } else if (format == 2) {
        for (int64_t i = 0; i < d; ++i) {
            const uint32_t b = src[i], e = (b >> 3) & 0xF, m = b & 7, sign = (b & 0x80) << 24;
            const float normal = bits_to_float(sign | ((e + 120) << 23) | (m << 20));
            const float sub = bits_to_float(sign | 0x3F800000u) * (float)m * 0.001953125f;  /* 2^-9 */
            dst[i] = e ? normal : sub;
        }
    } else {
        for (int64_t i = 0; i < d; ++i) {
            const uint32_t b = src[i], e = (b >> 2) & 0x1F, m = b & 3, sign = (b & 0x80) << 24;
            const float normal = bits_to_float(sign | ((e + 112) << 23) | (m << 21));
            const float sub = bits_to_float(sign | 0x3F800000u) * (float)m * 1.52587890625e-05f;  /* 2^-16 */
            dst[i] = e ? normal : sub;
        }
    }
}

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

/* Position p's block and offset walked block by block (no division per position; the table entry
 * past the last position is never read). */
#define FOR_POSITIONS(begin, len, block_size, table, block, offset, p)                              \
    for (int64_t p = (begin), block_index_ = (begin) / (block_size), offset = (begin) % (block_size),  \
                 block = (table)[block_index_];                                                    \
         p < (len);                                                                                 \
         ++p, (++offset == (block_size) ? (offset = 0, ++block_index_,                                     \
                                           block = p < (len) ? (table)[block_index_] : 0) : 0))

static inline __attribute__((always_inline)) void attend_head(const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v,
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
    for (int64_t g = 0; g < group; ++g) {  /* softmax over [begin, len) */
        float* sg = s + g * width;
        float m = -INFINITY, total = 0.0f;
        for (int64_t p = begin; p < len; ++p) m = sg[p] > m ? sg[p] : m;
        /* weights under e^-69 (1e-30 of the largest) are 0: they change nothing a float32 sum keeps,
         * and their products with small scales would be denormals, which are slow on x86 */
        for (int64_t p = begin; p < len; ++p) sg[p] = sg[p] - m < -69.0f ? 0.0f : exp_nonpositive(sg[p] - m);
        for (int64_t p = begin; p < len; ++p) total += sg[p];
        const float inv = 1.0f / total;
        for (int64_t p = begin; p < len; ++p) sg[p] *= inv;
        memset(out + g * d, 0, sizeof(float) * (size_t)d);
    }
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

/* Returns 0, or -1 when the head size exceeds MAX_HEAD_SIZE or the format is unknown. */
int servelab_paged_decode_quant(const float* q, int64_t q_row_stride, const uint8_t* k_cache,
                                const uint8_t* v_cache, const int64_t* cache_strides, const float* k_scale,
                                const float* v_scale, const int64_t* scale_strides, const int32_t* block_table,
                                int64_t table_stride, const int32_t* seq_lens, int64_t rows, int64_t kv_heads,
                                int64_t group, int64_t head_size, int64_t block_size, int64_t window,
                                int64_t format, float scale, float* scores, int64_t width, float* out,
                                int64_t num_threads) {
    if (head_size > MAX_HEAD_SIZE || format < 1 || format > 3) return -1;
    const int64_t heads = rows * kv_heads;
    const int team = num_threads > 1 ? (int)num_threads : 1;
    (void)team;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1 && heads > 1)
    for (int64_t x = 0; x < heads; ++x) {
        const int64_t r = x / kv_heads, h = x % kv_heads;
        const int64_t len = seq_lens[r];
        const int64_t begin = window > 0 && len > window ? len - window : 0;
        const float* qh = q + r * q_row_stride + h * group * head_size;
        const int32_t* table = block_table + r * table_stride;
        float* sh = scores + x * group * width;
        float* oh = out + (r * kv_heads + h) * group * head_size;
        /* the common head sizes as compile-time constants: fully unrolled row conversions and dots */
        if (head_size == 64 && format == 1)
            attend_head(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, table, begin, len, h,
                        group, 64, block_size, 1, scale, sh, width, oh);
        else if (head_size == 128 && format == 1)
            attend_head(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, table, begin, len, h,
                        group, 128, block_size, 1, scale, sh, width, oh);
        else if (head_size == 64)
            attend_head(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, table, begin, len, h,
                        group, 64, block_size, format, scale, sh, width, oh);
        else
            attend_head(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, table, begin, len, h,
                        group, head_size, block_size, format, scale, sh, width, oh);
    }
    return 0;
}

/* The quantizing cache write for int8 pages: row i of key / value (float32, heads contiguous,
 * rows key_row_stride / value_row_stride apart) goes to slot slots[i] (block slot / B, offset
 * slot % B; cache and scale addressing as above). Each head's scale is its own amax / 127 (1 for
 * an all-zero head), stored, or with static_scales the layer's (block and token strides 0), read;
 * q = round-half-even(x / scale) clamped to +-127: the same float32 operations, in the same order,
 * as the torch write (servelab.blocks.kv_quant.quantize_rows), so the same bits. */
void servelab_write_kv_int8(const float* key, int64_t key_row_stride, const float* value, int64_t value_row_stride,
                            int8_t* k_cache, int8_t* v_cache, const int64_t* cs, float* k_scale, float* v_scale,
                            const int64_t* ss, int64_t static_scales, const int64_t* slots, int64_t n,
                            int64_t heads, int64_t d, int64_t block_size) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
        for (int t = 0; t < 2; ++t) {
            const float* src = t == 0 ? key + i * key_row_stride : value + i * value_row_stride;
            int8_t* cache = t == 0 ? k_cache : v_cache;
            float* scales = t == 0 ? k_scale : v_scale;
            const int64_t* c = cs + 3 * t;
            const int64_t* s = ss + 3 * t;
            for (int64_t h = 0; h < heads; ++h) {
                const float* x = src + h * d;
                float* scale_at = scales + block * s[0] + offset * s[1] + h * s[2];
                float scale;
                if (static_scales) {
                    scale = *scale_at;
                } else {
                    float amax = 0.0f;
                    for (int64_t j = 0; j < d; ++j) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
                    scale = amax > 0.0f ? amax / 127.0f : 1.0f;
                    *scale_at = scale;
                }
                int8_t* dst = cache + block * c[0] + offset * c[1] + h * c[2];
                for (int64_t j = 0; j < d; ++j) {
                    float y = x[j] / scale;
                    y = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y);
                    dst[j] = (int8_t)nearbyintf(y);
                }
            }
        }
    }
}
