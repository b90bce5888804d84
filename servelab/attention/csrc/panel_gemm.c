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
 * weights never win back. Here the weight is pre-arranged in panels of 64
 * output columns, each panel one sequential stream [K, 64], and every
 * element loaded is used by up to 6 rows from registers (6 rows x 4 vectors
 * = 24 accumulators: 6 rows measured 20-30% faster than 4 from 8 rows on).
 *
 * Layouts:
 *   x       [rows, K]  rows x_row_stride elements apart, K contiguous
 *   panels  [P, K, 64] P = ceil(N / 64): panels[p, k, j] = w[p * 64 + j, k],
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
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float pvf __attribute__((vector_size(64)));  /* 16 floats */
#define PANEL_LANES 16
#define PANEL 64                                      /* output columns per panel */
#define PANEL_VECTORS (PANEL / PANEL_LANES)
#define ROW_BLOCK 6                                   /* rows sharing each loaded panel vector */
#define MIN_PARALLEL_WEIGHT 65536

static inline pvf pload(const float* p) { pvf v; memcpy(&v, p, sizeof(v)); return v; }
static inline void pstore(float* p, pvf v) { memcpy(p, &v, sizeof(v)); }
static inline pvf psplat(float s) { return (pvf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* rows [m, m + n_rows) of one panel; n_rows is a constant after inlining, so the
 * accumulators stay in registers (n_rows * 4 vectors, at most 24 of the 32 zmm). */
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

/* 1 when this build's vectors are the kernel's 16-float registers (AVX-512). Elsewhere the 24
 * accumulators do not fit the register file and spill: compiled for AVX2 the kernel measured
 * ~13x slower than oneDNN at 16 rows, so servelab keeps oneDNN / F.linear there (it still computes
 * correctly, and the tests run it). */
int servelab_panel_gemm_preferred(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
