/* A Llama decoder layer's glue around its attention, on a CPU in float32, in three calls.
 *
 * Built into the same library as decode_attention.c (see
 * servelab/attention/cpu_kernel_build.py) and called through ctypes from
 * servelab/models/decode_glue.py; the layer's own modules (RMSNorm, Linear,
 * the SwiGLU MLP) are the reference and the fallback.
 *
 * Why: on a decode step a small model's layer is a dozen tiny operations
 * (two norms, four GEMMs, RoPE, two residual adds, the SwiGLU product), each
 * reached through a module call, its checks and an allocation: tens of
 * microseconds of Python per layer against a few of arithmetic. Here the
 * kernels the unfused layer already calls on that path (servelab_rms_norm,
 * servelab_panel_gemm, servelab_rope) run back to back from C.
 *
 * Same bits as the unfused layer on that path: the same functions on the same
 * inputs in the same order, and the glue between them is one rounded float
 * operation per element (h + x, g * u), as torch's add_ and mul_ compute them.
 * SiLU: csrc/silu.c's (torch's bits, checked once per process by servelab.models.cpu_silu)
 * when the caller passes silu_in_c, else torch's, called by the caller between
 * servelab_glue_out and servelab_glue_down.
 *
 * The three calls, for rows r < R (the decode batch), H = hidden size:
 *   servelab_glue_qkv:  normed = rms_norm(x; norm_weight)             [R, H]
 *                       qkv    = normed Wqkv^T + bqkv                  [R, Nqkv]
 *                       qk     = rope(qkv[:, :rotated_heads * D])      [R, rotated_heads, D]
 *   (attention: the layer's cache write and paged attention, in Python: backends swap there)
 *   servelab_glue_out:  h      = attn Wo^T + bo + x                    [R, H]
 *                       normed = rms_norm(h; norm_weight)              [R, H]
 *                       gu     = normed Wgu^T + bgu                    [R, 2I]
 *   (torch, unless silu_in_c: gu[:, :I] = silu(gu[:, :I]) in place)
 *   servelab_glue_down: gu[:, :I] = silu(gu[:, :I]) in place, if silu_in_c
 *                       gu[:, :I] *= gu[:, I:]
 *                       y      = gu[:, :I] Wd^T + bd + h               [R, H]
 * Weights are cpu_gemm.pack panels; a NULL bias is none. x, h, normed, y are
 * contiguous; attn's rows are attn_row_stride elements apart (K contiguous).
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "calls.h"

void servelab_glue_qkv(const float* x, const float* norm_weight, float eps, float* normed,
                       const float* qkv_panels, const float* qkv_bias, float* qkv, float* qk,
                       const float* cos, const float* signed_sin, int64_t rows, int64_t hidden, int64_t qkv_size,
                       int64_t rotated_heads, int64_t head_size, int64_t num_threads) {
    servelab_rms_norm(x, norm_weight, normed, rows, hidden, eps, num_threads);
    servelab_panel_gemm(normed, hidden, qkv_panels, qkv_bias, qkv, rows, hidden, qkv_size, num_threads);
    servelab_rope(qkv, qkv_size, qk, cos, signed_sin, rows, rotated_heads, head_size, num_threads);
}

void servelab_glue_out(const float* attn, int64_t attn_row_stride, const float* o_panels, const float* o_bias,
                       const float* x, float* h, const float* norm_weight, float eps, float* normed,
                       const float* gu_panels, const float* gu_bias, float* gu, int64_t rows, int64_t attn_size,
                       int64_t hidden, int64_t gu_size, int64_t num_threads) {
    servelab_panel_gemm(attn, attn_row_stride, o_panels, o_bias, h, rows, attn_size, hidden, num_threads);
    for (int64_t e = 0; e < rows * hidden; ++e) h[e] = h[e] + x[e];
    servelab_rms_norm(h, norm_weight, normed, rows, hidden, eps, num_threads);
    servelab_panel_gemm(normed, hidden, gu_panels, gu_bias, gu, rows, hidden, gu_size, num_threads);
}

void servelab_glue_down(float* gu, int64_t intermediate, int64_t silu_in_c, const float* down_panels,
                        const float* down_bias, const float* h, float* y, int64_t rows, int64_t hidden,
                        int64_t num_threads) {
    /* Rows split over the threads when SiLU runs here: its exp is most of this loop's time. */
#ifdef _OPENMP
    const int team = (silu_in_c && num_threads > 1 && rows > 1) ? (int)(num_threads < rows ? num_threads : rows) : 1;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
#endif
    for (int64_t r = 0; r < rows; ++r) {
        float* gate = gu + r * 2 * intermediate;
        const float* up = gate + intermediate;
        if (silu_in_c) servelab_silu_row(gate, intermediate);
        for (int64_t i = 0; i < intermediate; ++i) gate[i] = gate[i] * up[i];
    }
    servelab_panel_gemm(gu, 2 * intermediate, down_panels, down_bias, y, rows, intermediate, hidden, num_threads);
    for (int64_t e = 0; e < rows * hidden; ++e) y[e] = y[e] + h[e];
}
