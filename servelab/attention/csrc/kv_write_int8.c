/* The quantizing cache write for int8 pages.
 *
 * Built into the one CPU-kernel library by servelab/attention/cpu_kernel_build.py and called
 * through ctypes by servelab/attention/ops.py, and fused with the decode kernel by
 * servelab_write_decode_int8 (decode_attention_quant.c); the reference is the torch write,
 * servelab/blocks/kv_quant.py (quantize_rows). Addressing as in decode_attention_quant.c.
 */
#include "quant_pages.h"

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
