/* The library's functions that one source calls in another, declared once. Each defining source
 * includes this too, so a definition that drifts from what its callers were compiled against is a
 * compile error, not a wrong call. (The build hashes this file with the sources.) */
#ifndef SERVELAB_CALLS_H
#define SERVELAB_CALLS_H

#include <stdint.h>

/* rms_norm.c, panel_gemm.c, silu.c, rope.c: called by decode_glue.c */
void servelab_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps,
                       int64_t num_threads);
void servelab_panel_gemm(const float* x, int64_t x_row_stride, const float* panels, const float* bias, float* y,
                         int64_t rows, int64_t k_size, int64_t n_size, int64_t num_threads);
void servelab_silu_row(float* x, int64_t n);
void servelab_rope(const float* x, int64_t x_token_stride, float* out, const float* cos, const float* signed_sin,
                   int64_t tokens, int64_t heads, int64_t head_size, int64_t num_threads);

/* decode_glue.c and decode_attention_quant.c: called by decode_layers.c */
void servelab_glue_qkv(const float* x, const float* norm_weight, float eps, float* normed,
                       const float* qkv_panels, const float* qkv_bias, float* qkv, float* qk,
                       const float* cos, const float* signed_sin, int64_t rows, int64_t hidden, int64_t qkv_size,
                       int64_t rotated_heads, int64_t head_size, int64_t num_threads);
void servelab_glue_out(const float* attn, int64_t attn_row_stride, const float* o_panels, const float* o_bias,
                       const float* x, float* h, const float* norm_weight, float eps, float* normed,
                       const float* gu_panels, const float* gu_bias, float* gu, int64_t rows, int64_t attn_size,
                       int64_t hidden, int64_t gu_size, int64_t num_threads);
void servelab_glue_down(float* gu, int64_t intermediate, int64_t silu_in_c, const float* down_panels,
                        const float* down_bias, const float* h, float* y, int64_t rows, int64_t hidden,
                        int64_t num_threads);
int servelab_write_decode_int8(const float* key, int64_t key_row_stride, const float* value, int64_t value_row_stride,
                               const int64_t* slots, int64_t static_scales, const float* q, int64_t q_row_stride,
                               int8_t* k_cache, int8_t* v_cache, const int64_t* cache_strides, float* k_scale,
                               float* v_scale, const int64_t* scale_strides, const int32_t* block_table,
                               int64_t table_stride, const int32_t* seq_lens, int64_t rows, int64_t kv_heads,
                               int64_t group, int64_t head_size, int64_t block_size, int64_t window, float scale,
                               float* scores, int64_t width, float* out, int64_t num_threads);

#endif /* SERVELAB_CALLS_H */
