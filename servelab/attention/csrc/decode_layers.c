/* A pure decode step's later layers over int8 pages, from arguments prepared once.
 *
 * Built into the one CPU-kernel library (servelab/attention/cpu_kernel_build.py) and driven by
 * servelab/models/quantized_decode_layers.py, which mirrors these two structs in ctypes and checks
 * their sizes against servelab_decode_layers_sizes() when it binds them.
 *
 * Why: each layer of that step is four C calls (decode_glue.c's three and the int8 write with the
 * attention kernel, servelab_write_decode_int8) whose arguments are the same from step to step but
 * for a handful (the step's rows, slots, block table, lengths, RoPE tables). Made from Python, the
 * calls cost ~100 ctypes conversions a layer, and the tuples holding their arguments were rebuilt
 * every step: ~1 ms of SmolLM2's batch-16 step at two threads, all of it on objects the weights'
 * stream had evicted. Here the per-layer arguments live in an array of servelab_layer_args made
 * once, the per-step ones in one servelab_step_args the caller refreshes, and a layer is
 * exactly the calls the glue makes, in the same order, on the same values: the same bits
 * (tests/kv_quant/test_kv_quant_direct_path.py).
 *
 * Layer i reads its input rows from step->x (i == 0) or step->between, and writes its output over
 * step->between (the last layer: into step->out, a fresh tensor each step): a layer reads its input
 * only in its first two calls (the input norm, then the residual into h) and writes its output in the
 * last, from h.
 */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "calls.h"

/* One layer's own arguments: its weights (cpu_gemm panels; NULL bias: none), norms and pages. */
typedef struct {
    const float *input_norm, *post_norm;             /* [hidden] */
    const float *qkv_panels, *qkv_bias, *o_panels, *o_bias, *gate_up_panels, *gate_up_bias, *down_panels, *down_bias;
    int8_t *k_cache, *v_cache;                       /* [blocks, block_size, kv_heads, head_dim] */
    float *k_scale, *v_scale;                        /* per token and head, or one static scale */
    float input_eps, post_eps, scale;                /* the norms' eps, the attention's softmax scale */
} servelab_layer_args;

/* What every layer shares: the step's inputs (refreshed each step) and the buffers and sizes. */
typedef struct {
    /* the step's */
    const float* x;                                  /* [rows, hidden]: the first of these layers' input */
    const float *cos, *signed_sin;                   /* [rows, head_dim]: the step's RoPE tables */
    const int64_t* slots;                            /* [rows]: where each row's K/V is written */
    const int32_t* block_table;                      /* [rows, table_stride] */
    const int32_t* seq_lens;                         /* [rows] */
    float* scores;                                   /* the kernel's workspace, one slot per thread */
    const int64_t *cache_strides, *scale_strides;    /* the pages' byte strides, the scales' strides */
    int64_t table_stride, width, static_scales, num_threads;
    /* the buffers, float32: normed, h, between [rows, hidden]; qkv [rows, qkv_size];
     * qk [rows, heads + kv_heads, head_dim]; attn [rows, heads, head_dim]; gate_up [rows, 2 intermediate] */
    float *normed, *qkv, *qk, *attn, *h, *gate_up, *between;
    float* out;                                      /* [rows, hidden]: the last layer's output (the step's) */
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, block_size, window, silu_in_c;
    /* an instrument for benchmarks: when time_attention, the seconds inside the int8 write and
     * attention calls are added to attention_seconds (two clock reads a layer) */
    int64_t time_attention;
    double attention_seconds;
} servelab_step_args;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The sizes the Python mirror must match (a layout drift between the two is refused at bind time). */
int64_t servelab_decode_layers_sizes(int64_t which) {
    return which == 0 ? (int64_t)sizeof(servelab_layer_args) : (int64_t)sizeof(servelab_step_args);
}

/* The layer's first part: input norm, QKV and RoPE; the int8 write and attention; O, the residual,
 * the post norm and gate_up. Nonzero: the attention kernel refused (nothing written: it refuses
 * before the write). */
int servelab_decode_layer_attend(servelab_step_args* s, const servelab_layer_args* l, const float* in) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, qk_row = (s->heads + s->kv_heads) * s->head_dim;
    servelab_glue_qkv(in, l->input_norm, l->input_eps, s->normed, l->qkv_panels, l->qkv_bias, s->qkv, s->qk,
                      s->cos, s->signed_sin, s->rows, s->hidden, qkv_size, s->heads + s->kv_heads, s->head_dim,
                      s->num_threads);
    /* k: the rotated keys after the query heads in qk; v: the unrotated values at the end of qkv */
    const double start = s->time_attention ? seconds_now() : 0.0;
    const int rc = servelab_write_decode_int8(
        s->qk + q_size, qk_row, s->qkv + q_size + kv_size, qkv_size, s->slots, s->static_scales, s->qk, qk_row,
        l->k_cache, l->v_cache, s->cache_strides, l->k_scale, l->v_scale, s->scale_strides, s->block_table,
        s->table_stride, s->seq_lens, s->rows, s->kv_heads, s->heads / s->kv_heads, s->head_dim, s->block_size,
        s->window, l->scale, s->scores, s->width, s->attn, s->num_threads);
    if (s->time_attention) s->attention_seconds += seconds_now() - start;
    if (rc != 0) return rc;
    servelab_glue_out(s->attn, q_size, l->o_panels, l->o_bias, in, s->h, l->post_norm, l->post_eps, s->normed,
                      l->gate_up_panels, l->gate_up_bias, s->gate_up, s->rows, q_size, s->hidden,
                      2 * s->intermediate, s->num_threads);
    return 0;
}

/* The layer's last part: (SiLU, when silu_in_c,) the gate times up, down and the residual, into y
 * [rows, hidden]. Without silu_in_c the caller has run torch's SiLU on gate_up[:, :intermediate]. */
void servelab_decode_layer_down(const servelab_step_args* s, const servelab_layer_args* l, float* y) {
    servelab_glue_down(s->gate_up, s->intermediate, s->silu_in_c, l->down_panels, l->down_bias, s->h, y, s->rows,
                       s->hidden, s->num_threads);
}

/* Every layer, when SiLU is C's (silu_in_c): -1 - i when layer i's attention refused (the layers
 * before it are done), -(n + 1) without silu_in_c (nothing done), else 0. */
int servelab_decode_layers(servelab_step_args* s, const servelab_layer_args* layers, int64_t n) {
    if (!s->silu_in_c) return (int)(-(n + 1));
    for (int64_t i = 0; i < n; ++i) {
        if (servelab_decode_layer_attend(s, layers + i, i == 0 ? s->x : s->between) != 0) return (int)(-1 - i);
        servelab_decode_layer_down(s, layers + i, i == n - 1 ? s->out : s->between);
    }
    return 0;
}
