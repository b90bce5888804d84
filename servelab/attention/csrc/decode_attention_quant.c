/* Decode attention straight over quantized KV pages (int8, float8 e4m3fn / e5m2) on a CPU.
 *
 * Built into the one CPU-kernel library by servelab/attention/cpu_kernel_build.py and called
 * through ctypes by servelab/attention/cpu_decode_quant.py; the reference is
 * servelab/reference/paged_attention.py (dequantize, then attend). Why a kernel: a decode step
 * reads every sequence's whole context once per layer, and that read is the floor of the
 * step; over quantized pages it is 1 byte per element (plus one float32 scale per token and
 * head) instead of 4, provided nothing makes a dequantized copy first. Here each head reads
 * its positions straight from the pages through the block table, converts one row of D
 * bytes to float32 (int8 by a cast, float8 by a 256-entry table) into a small buffer, and
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
 * Order (deterministic): dot products over d in increasing order; softmax max and sum over
 * positions in increasing order; each head computed by one thread, so every thread count
 * gives the same bits.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_SIZE 512

static float E4M3[256], E5M2[256];
static int tables_ready = 0;

static float ldexp_int(float m, int e) { return ldexpf(m, e); }

/* The float8 -> float32 tables (OCP e4m3fn: no infinities, S.1111.111 is NaN; e5m2: IEEE-like). */
static void build_tables(void) {
    for (int b = 0; b < 256; ++b) {
        const float sign = (b & 0x80) ? -1.0f : 1.0f;
        int e = (b >> 3) & 0xF, m = b & 7;
        float x;
        if (e == 0) x = ldexp_int((float)m / 8.0f, -6);
        else if (e == 15 && m == 7) x = NAN;
        else x = ldexp_int(1.0f + (float)m / 8.0f, e - 7);
        E4M3[b] = sign * x;
        e = (b >> 2) & 0x1F, m = b & 3;
        if (e == 0) x = ldexp_int((float)m / 4.0f, -14);
        else if (e == 31) x = m == 0 ? INFINITY : NAN;
        else x = ldexp_int(1.0f + (float)m / 4.0f, e - 15);
        E5M2[b] = sign * x;
    }
    tables_ready = 1;
}

/* One stored row of `d` values -> float32 (format 1 int8, 2 e4m3fn, 3 e5m2). */
static inline void convert_row(const uint8_t* src, float* dst, int64_t d, int64_t format) {
    if (format == 1) {
        const int8_t* s = (const int8_t*)src;
        for (int64_t i = 0; i < d; ++i) dst[i] = (float)s[i];
    } else {
        const float* table = format == 2 ? E4M3 : E5M2;
        for (int64_t i = 0; i < d; ++i) dst[i] = table[src[i]];
    }
}

static void attend_head(const float* q, const uint8_t* k, const uint8_t* v, const int64_t* cs,
                        const float* ks, const float* vs, const int64_t* ss, const int32_t* table,
                        int64_t begin, int64_t len, int64_t h, int64_t group, int64_t d, int64_t block_size,
                        int64_t format, float scale, float* s, int64_t width, float* out) {
    float row[MAX_HEAD_SIZE];
    for (int64_t p = begin; p < len; ++p) {  /* scores: scale * k_scale * (q . stored row) */
        const int64_t block = table[p / block_size], offset = p % block_size;
        convert_row(k + block * cs[0] + offset * cs[1] + h * cs[2], row, d, format);
        const float factor = scale * ks[block * ss[0] + offset * ss[1] + h * ss[2]];
        for (int64_t g = 0; g < group; ++g) {
            const float* qg = q + g * d;
            float acc = 0.0f;
            for (int64_t i = 0; i < d; ++i) acc += qg[i] * row[i];
            s[g * width + p] = acc * factor;
        }
    }
    for (int64_t g = 0; g < group; ++g) {  /* softmax over [begin, len) */
        float* sg = s + g * width;
        float m = -INFINITY, total = 0.0f;
        for (int64_t p = begin; p < len; ++p) m = sg[p] > m ? sg[p] : m;
        for (int64_t p = begin; p < len; ++p) total += (sg[p] = expf(sg[p] - m));
        const float inv = 1.0f / total;
        for (int64_t p = begin; p < len; ++p) sg[p] *= inv;
        memset(out + g * d, 0, sizeof(float) * (size_t)d);
    }
    for (int64_t p = begin; p < len; ++p) {  /* values: (p * v_scale) * stored row */
        const int64_t block = table[p / block_size], offset = p % block_size;
        convert_row(v + block * cs[3] + offset * cs[4] + h * cs[5], row, d, format);
        const float v_scale = vs[block * ss[3] + offset * ss[4] + h * ss[5]];
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
    if (!tables_ready) build_tables();  /* before any thread reads them */
    const int64_t heads = rows * kv_heads;
    const int team = num_threads > 1 ? (int)num_threads : 1;
    (void)team;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1 && heads > 1)
    for (int64_t x = 0; x < heads; ++x) {
        const int64_t r = x / kv_heads, h = x % kv_heads;
        const int64_t len = seq_lens[r];
        const int64_t begin = window > 0 && len > window ? len - window : 0;
        attend_head(q + r * q_row_stride + h * group * head_size, k_cache, v_cache, cache_strides, k_scale,
                    v_scale, scale_strides, block_table + r * table_stride, begin, len, h, group, head_size,
                    block_size, format, scale, scores + x * group * width, width,
                    out + (r * kv_heads + h) * group * head_size);
    }
    return 0;
}
