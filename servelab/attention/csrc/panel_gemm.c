/* A float32 GEMM for a few rows on a CPU: y = x w^T + bias, w read once in column panels.
 *
 * Built into the same library as decode_attention.c (see
 * servelab/attention/cpu_kernel_build.py) and called through ctypes from
 * servelab/models/cpu_gemm.py; F.linear is the reference and the fallback.
 *
 * Why: a decode step multiplies a few rows (its sequences) by every weight
 * of the model, so the step streams the weights from memory once per layer.
 * Library GEMMs read them at a fraction of the copy bandwidth on such shapes
 * and pay a fixed cost per call (oneDNN: ~15-25 us) that a small model's
 * weights never win back. Here the weight is pre-arranged in panels of PANEL
 * output columns, each panel one sequential stream [K, PANEL], and every
 * element loaded is used by up to 6 rows from registers (6 rows measured
 * 20-30% faster than 4 from 8 rows on).
 *
 * Width per target: the 6 rows' accumulators for one panel must stay in
 * registers, or every multiply-add goes through memory. With AVX-512 (32 zmm)
 * a panel is 64 columns = 4 vectors of 16 floats: 6 x 4 = 24 accumulators.
 * Elsewhere it is 16 columns = 2 vectors of 8 floats (one ymm each; AVX2 has
 * 16): 12 accumulators + 2 weight vectors + 1 broadcast = 15. (The 64-column
 * panel compiled for AVX2 spilled: ~13x slower than oneDNN at 16 rows; the
 * 16-column panel kept in 16-float vectors, 2 ymm each, still went through
 * the stack: 259 vs 31 us for a 576x576 weight at one row.) NEON's 32 q
 * registers hold the 16-column form too. cpu_gemm.pack reads the width from
 * servelab_panel_gemm_width().
 *
 * Where it is preferred (servelab_panel_gemm_preferred): AVX-512, and AVX2
 * with FMA. The AVX2 build was measured on an AVX-512 Zen 4 (2-core EPYC VM,
 * one thread pinned, weights cold: 4 MiB written before each call,
 * interleaved medians) against what servelab.models.linear runs without it,
 * oneDNN's packed GEMM (weights of 2^18 elements or more) or F.linear, both
 * capped to AVX2 as on a CPU without AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2,
 * MKL_ENABLE_INSTRUCTIONS=AVX2). A whole decoder's GEMMs per forward, ms:
 *
 *   rows                     1      4      8     16     32
 *   tiny (hidden 256)  AVX2  0.27   0.39   1.41   1.45   3.04
 *                  without  0.47   0.86   1.94   1.93   3.60
 *   SmolLM2-135M       AVX2  19.0   28.5   57.1   60.7  101.6
 *                  without  36.7   43.9   67.2   73.9  116.7
 *
 * and per weight it was as fast or faster at every shape tried (576x576,
 * 960x576, 1536x576, 3072x576, 576x1536, 1536x256, 256x768, 128x256, 256x64)
 * and row count (1-64): up to 2x at 4 rows, 1.1-1.5x at 8-24, ties at one
 * row on the smallest weights and at 32 rows on the largest (3072x576: 1.20
 * vs 1.22 ms). So the AVX2 build keeps the same MAX_ROWS as AVX-512. Against
 * oneDNN's own AVX-512 code on that machine the AVX2 build loses from 8 rows
 * on (3072x576, 16 rows: 0.99 vs 0.73 ms), which is why the AVX-512 build
 * keeps its 64-column panels. Other targets (no
 * AVX2/FMA, NEON) compute correctly but are not measured, so not preferred.
 *
 * Layouts:
 *   x       [rows, K]  rows x_row_stride elements apart, K contiguous
 *   panels  [P, K, W]  W = PANEL, P = ceil(N / W): panels[p, k, j] = w[p * W + j, k],
 *                      zero past column N (packed by cpu_gemm.pack)
 *   bias    [N] or NULL
 *   y       [rows, N]  contiguous
 *
 * Summation order (deterministic): every output accumulates its K products
 * in increasing k in one float32 lane (a fused multiply-add where the target
 * has one), then adds the bias. An output's bits therefore depend only on its
 * own row of x and column of w: the same in any batch, at any thread count.
 *
 * Threads: the panels split into contiguous ranges, one per thread, when the
 * weight is large enough to pay for the team (MIN_PARALLEL_WEIGHT elements);
 * the caller passes torch.get_num_threads() (OpenMP shared with torch).
 */
#include <stdint.h>
#include <string.h>
#include "calls.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
typedef float pvf __attribute__((vector_size(64)));  /* 16 floats, one zmm */
#define PANEL_LANES 16
#define PANEL 64  /* output columns per panel: 4 zmm per k, 6 rows x 4 = 24 accumulators of 32 zmm */
#define PSPLAT(s) {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}
#else
typedef float pvf __attribute__((vector_size(32)));  /* 8 floats: one ymm, two NEON q */
#define PANEL_LANES 8
#define PANEL 16  /* 2 ymm per k, 6 rows x 2 = 12 accumulators + 2 loads + 1 broadcast of 16 ymm */
#define PSPLAT(s) {s, s, s, s, s, s, s, s}
#endif
#define PANEL_VECTORS (PANEL / PANEL_LANES)
#define ROW_BLOCK 6                                   /* rows sharing each loaded panel vector */
#define MIN_PARALLEL_WEIGHT 65536

static inline pvf pload(const float* p) { pvf v; memcpy(&v, p, sizeof(v)); return v; }
static inline void pstore(float* p, pvf v) { memcpy(p, &v, sizeof(v)); }
static inline pvf psplat(float s) { return (pvf)PSPLAT(s); }

/* rows [m, m + n_rows) of one panel; n_rows is a constant after inlining, so the
 * accumulators stay in registers (n_rows * PANEL_VECTORS: at most 24 of the 32 zmm, 12 of the 16 ymm). */
static inline __attribute__((always_inline)) void panel_rows(
        const float* x, int64_t x_row_stride, const float* panel, int64_t k_size, int n_rows,
        pvf acc[ROW_BLOCK][PANEL_VECTORS]) {
    for (int i = 0; i < n_rows; ++i)
        for (int v = 0; v < PANEL_VECTORS; ++v) acc[i][v] = (pvf){0};
    for (int64_t k = 0; k < k_size; ++k) {
        pvf w[PANEL_VECTORS];
        for (int v = 0; v < PANEL_VECTORS; ++v) w[v] = pload(panel + k * PANEL + v * PANEL_LANES);
        for (int i = 0; i < n_rows; ++i) {
            const pvf xs = psplat(x[i * x_row_stride + k]);
            for (int v = 0; v < PANEL_VECTORS; ++v) acc[i][v] += xs * w[v];
        }
    }
}

static void store_rows(pvf acc[ROW_BLOCK][PANEL_VECTORS], int n_rows, const float* bias, float* y, int64_t n_size,
                       int64_t column, int64_t columns) {
    for (int i = 0; i < n_rows; ++i) {
        float row[PANEL];
        for (int v = 0; v < PANEL_VECTORS; ++v) pstore(row + v * PANEL_LANES, acc[i][v]);
        float* out = y + i * n_size + column;
        if (bias != NULL)
            for (int64_t j = 0; j < columns; ++j) out[j] = row[j] + bias[column + j];
        else
            memcpy(out, row, (size_t)columns * sizeof(float));
    }
}

static void gemm_panels(const float* x, int64_t x_row_stride, const float* panels, const float* bias, float* y,
                        int64_t rows, int64_t k_size, int64_t n_size, int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
        const float* panel = panels + p * k_size * PANEL;
        const int64_t column = p * PANEL;
        const int64_t columns = n_size - column < PANEL ? n_size - column : PANEL;
        for (int64_t m = 0; m < rows; m += ROW_BLOCK) {
            const int64_t left = rows - m;
            const float* xm = x + m * x_row_stride;
            pvf acc[ROW_BLOCK][PANEL_VECTORS];
            int n_rows = ROW_BLOCK;
            switch (left < ROW_BLOCK ? left : ROW_BLOCK) {  /* one specialised loop per block height */
                case 1: n_rows = 1; panel_rows(xm, x_row_stride, panel, k_size, 1, acc); break;
                case 2: n_rows = 2; panel_rows(xm, x_row_stride, panel, k_size, 2, acc); break;
                case 3: n_rows = 3; panel_rows(xm, x_row_stride, panel, k_size, 3, acc); break;
                case 4: n_rows = 4; panel_rows(xm, x_row_stride, panel, k_size, 4, acc); break;
                case 5: n_rows = 5; panel_rows(xm, x_row_stride, panel, k_size, 5, acc); break;
                default: panel_rows(xm, x_row_stride, panel, k_size, ROW_BLOCK, acc); break;
            }
            store_rows(acc, n_rows, bias, y + m * n_size, n_size, column, columns);
        }
    }
}

void servelab_panel_gemm(const float* x, int64_t x_row_stride, const float* panels, const float* bias, float* y,
                         int64_t rows, int64_t k_size, int64_t n_size, int64_t num_threads) {
    const int64_t n_panels = (n_size + PANEL - 1) / PANEL;
#ifdef _OPENMP
    if (num_threads > 1 && n_panels > 1 && k_size * n_size >= MIN_PARALLEL_WEIGHT) {
        const int team = (int)(num_threads < n_panels ? num_threads : n_panels);
#pragma omp parallel num_threads(team)
        {
            const int64_t t = omp_get_thread_num(), size = omp_get_num_threads();
            gemm_panels(x, x_row_stride, panels, bias, y, rows, k_size, n_size, n_panels * t / size,
                        n_panels * (t + 1) / size);
        }
        return;
    }
#else
    (void)num_threads;
#endif
    gemm_panels(x, x_row_stride, panels, bias, y, rows, k_size, n_size, 0, n_panels);
}

/* PANEL: the column count cpu_gemm.pack must lay the panels out in for this build. */
int64_t servelab_panel_gemm_width(void) { return PANEL; }

/* 1 where the kernel measured faster than oneDNN / F.linear up to cpu_gemm.MAX_ROWS rows: AVX-512 builds
 * (64-column panels) and AVX2 + FMA builds (16-column panels; the numbers are in the header). Elsewhere it
 * still computes correctly (the tests run it), and servelab keeps oneDNN / F.linear. */
int servelab_panel_gemm_preferred(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}
