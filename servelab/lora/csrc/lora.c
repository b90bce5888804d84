/* Per-row LoRA on a CPU, float32: each row does only its own adapter's products.
 *
 *   shrink: h[t, c] = scale * sum_k A[slot[t], c, k] * x[t, k]
 *   expand: out[t, n] (+)= sum_r B(slot[t], n, r) * y[t, r]
 *
 * (servelab/reference/lora.py is the spec; servelab/lora/cpu_kernels.py calls this through ctypes.)
 * A row of slot -1 (or below) has no adapter: its h is zero and its output is left alone.
 *
 * Why grouped by slot here: a step's rows use a few slots, each slot by a few rows. Computing
 * per row streams the slot's A and B once per row; one GEMM against every slot does slots x
 * the needed products; one torch GEMM pair per slot costs ~10 us of fixed cost each. Here the
 * rows are sorted by slot (a counting sort, O(rows + slots)) and each slot's A / B is streamed
 * once per call while its rows (a tile of them in registers) are in cache.
 *
 * servelab_lora_layer does a whole wrapped layer in one call: the shrink of every slice (a fused
 * qkv's q, k, v) and every slice's expand at its output offset, skipping the (slot, slice) pairs
 * an adapter leaves alone and the rank padding past each adapter's rank.
 * servelab_lora_shrink / servelab_lora_expand are the Punica-style kernels, any strides.
 *
 * The expand's inner loop is a broadcast multiply-add over 16 contiguous output columns, so B
 * ([slot, n, r], r contiguous) is transposed a [rank, 16] block at a time onto the stack, once
 * per block for all the slot's rows (a second, transposed copy of every B would cost memory
 * for ~1% of a decode step).
 *
 * Threads: each slot's columns are split evenly between threads (shrink over A's rows, expand
 * over 16-column output blocks), one barrier between the two phases. Every output value is
 * computed by the same arithmetic whatever the thread count or the batch it is in.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef SERVELAB_LORA_BUILD_KEY
#define SERVELAB_LORA_BUILD_KEY "unkeyed"
#endif

#define LANES 16      /* one AVX-512 vector of floats: the unit of every inner loop */
#define SHRINK_ROWS 4 /* x rows whose dot products share each load of A */
#define EXPAND_ROWS 4 /* rows x 64 columns of accumulators (16 vectors) stay in registers together */
#define EXPAND_VECS 4 /* (the AVX-512 tile below is written out for exactly 4 x 4) */
#define EXPAND_COLS (EXPAND_VECS * LANES)
#define RANK_CHUNK 64 /* B rows transposed onto the stack at once */
#ifndef MIN_PARALLEL_MACS
#define MIN_PARALLEL_MACS (1 << 20) /* ~25 us of work: below, a second thread (a fork, a barrier) costs more than it saves */
#endif

int servelab_lora_abi(void) { return 1; }
const char *servelab_lora_build_key(void) { return SERVELAB_LORA_BUILD_KEY; }
int servelab_lora_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Rows grouped by slot: slot s's rows are rows[start[s] .. start[s + 1]), ascending. */
typedef struct {
    int64_t num_slots;
    int64_t *start;
    int64_t *rows;
    int64_t *slot_of;  /* [T] each row's slot, -1 for none */
} Groups;

static void groups_free(Groups *g) {
    free(g->start);
    free(g->rows);
    free(g->slot_of);
}

/* Each row's slot from `indices` [T], or (indices NULL) from segments: rows seg_starts[i] ..
 * + seg_lens[i] use seg_slots[i], later segments win, rows outside every segment have none
 * (clipped to [0, T), as the reference's slice assignment). Returns 0, -1 when out of memory,
 * or 1 when some slot is >= num_slots. */
static int groups_build(Groups *g, int64_t T, int64_t num_slots, const int64_t *indices, const int64_t *seg_starts,
                        const int64_t *seg_lens, const int64_t *seg_slots, int64_t num_segs) {
    g->num_slots = num_slots;
    g->start = calloc((size_t)num_slots + 1, sizeof(int64_t));
    g->rows = malloc(((size_t)T + 1) * sizeof(int64_t));
    g->slot_of = malloc(((size_t)T + 1) * sizeof(int64_t));
    if (!g->start || !g->rows || !g->slot_of) return -1;
    if (indices) {
        for (int64_t t = 0; t < T; t++) g->slot_of[t] = indices[t] < 0 ? -1 : indices[t];
    } else {
        for (int64_t t = 0; t < T; t++) g->slot_of[t] = -1;
        for (int64_t i = 0; i < num_segs; i++) {
            int64_t a = seg_starts[i] < 0 ? 0 : seg_starts[i], b = seg_starts[i] + seg_lens[i];
            if (b > T) b = T;
            for (int64_t t = a; t < b; t++) g->slot_of[t] = seg_slots[i] < 0 ? -1 : seg_slots[i];
        }
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = g->slot_of[t];
        if (s >= num_slots) return 1;
        if (s >= 0) g->start[s + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) g->start[s + 1] += g->start[s];
    /* place each row at its slot's cursor (start[s + 1] runs from s's start to its end) */
    for (int64_t s = num_slots; s > 0; s--) g->start[s] = g->start[s - 1];
    for (int64_t t = 0; t < T; t++)
        if (g->slot_of[t] >= 0) g->rows[g->start[g->slot_of[t] + 1]++] = t;
    return 0;
}

#ifdef __AVX512F__
#include <immintrin.h>
#define SHRINK_COLS 4 /* A rows per tile: 4 x 4 dot products share 8 loads per 16 k */

/* sums[j][c] = xr[j] . ar[c] over K, each in 16 float32 lanes (the tail masked in), then the lanes */
static inline void dots_4x4(const float *const xr[SHRINK_ROWS], const float *const ar[SHRINK_COLS], int64_t K,
                            float sums[SHRINK_ROWS][SHRINK_COLS]) {
    __m512 acc[SHRINK_ROWS][SHRINK_COLS];
    for (int j = 0; j < SHRINK_ROWS; j++)
        for (int c = 0; c < SHRINK_COLS; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = K - k >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 va[SHRINK_COLS];
        for (int c = 0; c < SHRINK_COLS; c++) va[c] = _mm512_maskz_loadu_ps(mask, ar[c] + k);
        for (int j = 0; j < SHRINK_ROWS; j++) {
            const __m512 vx = _mm512_maskz_loadu_ps(mask, xr[j] + k);
            for (int c = 0; c < SHRINK_COLS; c++) acc[j][c] = _mm512_fmadd_ps(vx, va[c], acc[j][c]);
        }
    }
    for (int j = 0; j < SHRINK_ROWS; j++)
        for (int c = 0; c < SHRINK_COLS; c++) sums[j][c] = _mm512_reduce_add_ps(acc[j][c]);
}
#else
#define SHRINK_COLS 1

static inline void dots_4x4(const float *const xr[SHRINK_ROWS], const float *const ar[SHRINK_COLS], int64_t K,
                            float sums[SHRINK_ROWS][SHRINK_COLS]) {
    float acc[SHRINK_ROWS][LANES] = {{0}}, tail[SHRINK_ROWS] = {0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES)
        for (int j = 0; j < SHRINK_ROWS; j++)
            for (int l = 0; l < LANES; l++) acc[j][l] += ar[0][k + l] * xr[j][k + l];
    for (; k < K; k++)
        for (int j = 0; j < SHRINK_ROWS; j++) tail[j] += ar[0][k] * xr[j][k];
    for (int j = 0; j < SHRINK_ROWS; j++) {
        float s = tail[j];
        for (int l = 0; l < LANES; l++) s += acc[j][l];
        sums[j][0] = s;
    }
}
#endif

/* h[row, c] = scale * A[c, :] . x[row, :] for c in [c0, c1) and the rows `rows` (count n).
 * Tiles of rows and of A rows; a partial tile repeats its last row (computed, not written). */
static void shrink_block(const float *x, int64_t x_rs, const int64_t *rows, int64_t n, int64_t K,
                         const float *a, int64_t a_cs, int64_t c0, int64_t c1, float scale, float *h,
                         int64_t h_rs) {
    for (int64_t i = 0; i < n; i += SHRINK_ROWS) {
        const int64_t m = n - i < SHRINK_ROWS ? n - i : SHRINK_ROWS;
        const float *xr[SHRINK_ROWS];
        for (int j = 0; j < SHRINK_ROWS; j++) xr[j] = x + rows[i + (j < m ? j : m - 1)] * x_rs;
        for (int64_t c = c0; c < c1; c += SHRINK_COLS) {
            const int64_t mc = c1 - c < SHRINK_COLS ? c1 - c : SHRINK_COLS;
            const float *ar[SHRINK_COLS];
            for (int q = 0; q < SHRINK_COLS; q++) ar[q] = a + (c + (q < mc ? q : mc - 1)) * a_cs;
            float sums[SHRINK_ROWS][SHRINK_COLS];
            dots_4x4(xr, ar, K, sums);
            for (int j = 0; j < m; j++)
                for (int q = 0; q < mc; q++) h[rows[i + j] * h_rs + c + q] = scale * sums[j][q];
        }
    }
}

#ifdef __AVX512F__
/* v[i] (rows i, 16 floats each) -> v[c] = column c. Three rounds: 32-bit pairs, 64-bit pairs, then
 * 128-bit lanes (u[k]'s lane q holds column 4q + k of 4 rows). */
static inline void transpose16(__m512 v[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {  /* rows g..g+3 */
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
        u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 lo_ab = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 hi_ab = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512 lo_cd = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 hi_cd = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
        v[k] = _mm512_shuffle_f32x4(lo_ab, lo_cd, _MM_SHUFFLE(2, 0, 2, 0));
        v[k + 8] = _mm512_shuffle_f32x4(lo_ab, lo_cd, _MM_SHUFFLE(3, 1, 3, 1));
        v[k + 4] = _mm512_shuffle_f32x4(hi_ab, hi_cd, _MM_SHUFFLE(2, 0, 2, 0));
        v[k + 12] = _mm512_shuffle_f32x4(hi_ab, hi_cd, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

/* dst[r * dst_rs + l] = B(r, n0 + l) for r < rc, l < w (<= 16), zeros for l >= w: B(r, n) = b[r * b_rs + n * b_ns].
 * With r contiguous (b_rs == 1, a [slot, n, r] buffer) 16 x 16 blocks are transposed in registers
 * (gathers are slow on CPUs with the gather-data-sampling mitigation). */
static void stage_block(const float *b, int64_t b_rs, int64_t b_ns, int64_t n0, int64_t w, int64_t rc, float *dst,
                        int64_t dst_rs) {
#ifdef __AVX512F__
    if (b_rs == 1) {
        for (int64_t r0 = 0; r0 < rc; r0 += LANES) {
            const int64_t rn = rc - r0 < LANES ? rc - r0 : LANES;
            const __mmask16 rmask = (__mmask16)(rn >= LANES ? 0xFFFF : (1u << rn) - 1);
            __m512 v[16];
            for (int l = 0; l < LANES; l++)
                v[l] = l < w ? _mm512_maskz_loadu_ps(rmask, b + (n0 + l) * b_ns + r0) : _mm512_setzero_ps();
            transpose16(v);
            for (int64_t r = 0; r < rn; r++) _mm512_storeu_ps(dst + (r0 + r) * dst_rs, v[r]);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < rc; r++)
        for (int l = 0; l < LANES; l++) dst[r * dst_rs + l] = l < w ? b[r * b_rs + (n0 + l) * b_ns] : 0.0f;
}

/* orow[j][col + l] (+)= sum_{r < rc} yr[j][r] * bt[r * bt_rs + l] for l < w (<= EXPAND_COLS), rows
 * j < m (the tile's other rows repeat row m - 1: computed, not written). Past w nothing is read. */
static inline void expand_tile(const float *const yr[EXPAND_ROWS], int64_t m, const float *bt, int64_t bt_rs,
                               int64_t rc, float *const orow[EXPAND_ROWS], int64_t col, int64_t w, int overwrite) {
#ifdef __AVX512F__
    /* named accumulators (4 rows x 4 vectors): gcc keeps an indexed array of them in memory */
    __mmask16 k[EXPAND_VECS];
    for (int v = 0; v < EXPAND_VECS; v++) {
        const int64_t left = w - v * LANES;
        k[v] = left >= LANES ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const float *y0 = yr[0], *y1 = yr[1], *y2 = yr[2], *y3 = yr[3];
    for (int64_t r = 0; r < rc; r++) {
        const float *row = bt + r * bt_rs;
        const __m512 b0 = _mm512_maskz_loadu_ps(k[0], row), b1 = _mm512_maskz_loadu_ps(k[1], row + LANES),
                     b2 = _mm512_maskz_loadu_ps(k[2], row + 2 * LANES),
                     b3 = _mm512_maskz_loadu_ps(k[3], row + 3 * LANES);
#define LORA_FMA_ROW(Y, A0, A1, A2, A3)                                                                 \
        do {                                                                                            \
            const __m512 yv = _mm512_set1_ps(Y[r]);                                                     \
            A0 = _mm512_fmadd_ps(yv, b0, A0); A1 = _mm512_fmadd_ps(yv, b1, A1);                         \
            A2 = _mm512_fmadd_ps(yv, b2, A2); A3 = _mm512_fmadd_ps(yv, b3, A3);                         \
        } while (0)
        LORA_FMA_ROW(y0, a00, a01, a02, a03);
        LORA_FMA_ROW(y1, a10, a11, a12, a13);
        LORA_FMA_ROW(y2, a20, a21, a22, a23);
        LORA_FMA_ROW(y3, a30, a31, a32, a33);
#undef LORA_FMA_ROW
    }
#define LORA_STORE_ROW(J, A0, A1, A2, A3)                                                                \
    if (J < m) {                                                                                         \
        float *o = orow[J] + col;                                                                        \
        if (!overwrite) {                                                                                \
            A0 = _mm512_add_ps(_mm512_maskz_loadu_ps(k[0], o), A0);                                      \
            A1 = _mm512_add_ps(_mm512_maskz_loadu_ps(k[1], o + LANES), A1);                              \
            A2 = _mm512_add_ps(_mm512_maskz_loadu_ps(k[2], o + 2 * LANES), A2);                          \
            A3 = _mm512_add_ps(_mm512_maskz_loadu_ps(k[3], o + 3 * LANES), A3);                          \
        }                                                                                                \
        _mm512_mask_storeu_ps(o, k[0], A0);                                                              \
        _mm512_mask_storeu_ps(o + LANES, k[1], A1);                                                      \
        _mm512_mask_storeu_ps(o + 2 * LANES, k[2], A2);                                                  \
        _mm512_mask_storeu_ps(o + 3 * LANES, k[3], A3);                                                  \
    }
    LORA_STORE_ROW(0, a00, a01, a02, a03)
    LORA_STORE_ROW(1, a10, a11, a12, a13)
    LORA_STORE_ROW(2, a20, a21, a22, a23)
    LORA_STORE_ROW(3, a30, a31, a32, a33)
#undef LORA_STORE_ROW
#else
    float acc[EXPAND_ROWS][EXPAND_COLS] = {{0}};
    for (int64_t r = 0; r < rc; r++) {
        const float *bv = bt + r * bt_rs;
        for (int j = 0; j < EXPAND_ROWS; j++) {
            const float yv = yr[j][r];
            for (int64_t l = 0; l < w; l++) acc[j][l] += yv * bv[l];
        }
    }
    for (int j = 0; j < m; j++)
        for (int64_t l = 0; l < w; l++) orow[j][col + l] = overwrite ? acc[j][l] : orow[j][col + l] + acc[j][l];
#endif
}

/* This thread's share [lo, hi) of `units` units split evenly between `nt` threads. */
static void share(int64_t units, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = units * tid / nt;
    *hi = units * (tid + 1) / nt;
}

/* Floats of the panel one thread needs for slices of up to N columns and rank R (nt threads). */
static int64_t panel_floats(int64_t N, int64_t R, int nt) {
    const int64_t blocks = ((N + LANES - 1) / LANES + nt - 1) / nt + 1;
    return (R < RANK_CHUNK ? R : RANK_CHUNK) * blocks * LANES + LANES;
}

/* out[row, 0:N] (+)= sum_{r < R} y[row, r] * B(r, n) for the slot's rows `rows` (count n), over
 * this thread's 16-column blocks. B(r, n) = b[r * b_rs + n * b_ns]. B's [rank chunk, columns]
 * panel is transposed once into `panel` (read in place when it is [r, n] already), then tiles of
 * rows outer and 16-column blocks inner: each output row is streamed in order. `add`: add to
 * out, else overwrite. */
static void expand_slot(const float *y, int64_t y_rs, const int64_t *rows, int64_t n, int64_t R, const float *b,
                        int64_t b_rs, int64_t b_ns, int64_t N, int add, float *out, int64_t out_rs, int tid,
                        int nt, float *panel) {
    int64_t lo, hi;
    share((N + LANES - 1) / LANES, tid, nt, &lo, &hi);
    if (lo >= hi) return;
    const int64_t n0 = lo * LANES, n1 = hi * LANES < N ? hi * LANES : N, width = (hi - lo) * LANES;
    for (int64_t r0 = 0; r0 < R || r0 == 0; r0 += RANK_CHUNK) {  /* rank 0: one pass writes zero deltas */
        const int64_t rc = R - r0 < RANK_CHUNK ? R - r0 : RANK_CHUNK;
        const float *bt = panel;
        int64_t bt_rs = width;
        if (b_ns == 1) {  /* [r, n] in memory: read in place (masked: nothing past n1) */
            bt = b + r0 * b_rs + n0;
            bt_rs = b_rs;
        } else {
            for (int64_t c = n0; c < n1; c += LANES)
                stage_block(b + r0 * b_rs, b_rs, b_ns, c, n1 - c < LANES ? n1 - c : LANES, rc, panel + (c - n0),
                            width);
        }
        for (int64_t i = 0; i < n; i += EXPAND_ROWS) {
            const int64_t m = n - i < EXPAND_ROWS ? n - i : EXPAND_ROWS;
            const float *yr[EXPAND_ROWS];
            float *orow[EXPAND_ROWS];
            for (int j = 0; j < EXPAND_ROWS; j++) {  /* a partial tile repeats its last row (not written) */
                const int64_t row = rows[i + (j < m ? j : m - 1)];
                yr[j] = y + row * y_rs + r0;
                orow[j] = out + row * out_rs;
            }
            for (int64_t c = n0; c < n1; c += EXPAND_COLS)
                expand_tile(yr, m, bt + (c - n0), bt_rs, rc, orow, c, n1 - c < EXPAND_COLS ? n1 - c : EXPAND_COLS,
                            r0 == 0 && !add);
        }
    }
}

static int team_size(int64_t threads, int64_t macs) {
    if (threads <= 1 || macs < MIN_PARALLEL_MACS) return 1;
    return (int)(threads < 64 ? threads : 64);
}

/* Rows of no slot get h = 0 (the generic shrink's contract). */
static void zero_unmapped(const Groups *g, int64_t T, int64_t W, float *h, int64_t h_rs) {
    for (int64_t t = 0; t < T; t++)
        if (g->slot_of[t] < 0) memset(h + t * h_rs, 0, (size_t)W * sizeof(float));
}

/* h [T, W] (row stride h_rs) = scale * A[slot[t]] @ x[t] (zeros for rows of no slot).
 * x [T, K] row stride x_rs; A: element (s, c, k) at a[s * a_ss + c * a_cs + k]. Row slots from
 * `indices` [T] or, when it is NULL, from the segments. Returns 0, 1 (a slot >= num_slots,
 * nothing written) or -1 (out of memory). */
int servelab_lora_shrink(const float *x, int64_t x_rs, int64_t T, int64_t K, const float *a, int64_t a_ss,
                         int64_t a_cs, int64_t W, int64_t num_slots, const int64_t *indices,
                         const int64_t *seg_starts, const int64_t *seg_lens, const int64_t *seg_slots,
                         int64_t num_segs, float scale, float *h, int64_t h_rs, int64_t threads) {
    Groups g;
    int rc = groups_build(&g, T, num_slots, indices, seg_starts, seg_lens, seg_slots, num_segs);
    if (rc == 0) {
        zero_unmapped(&g, T, W, h, h_rs);
        const int team = team_size(threads, g.start[num_slots] * W * K);
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
        {
#ifdef _OPENMP
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int tid = 0, nt = 1;
#endif
            for (int64_t s = 0; s < num_slots; s++) {
                const int64_t n = g.start[s + 1] - g.start[s];
                int64_t lo, hi;
                share(W, tid, nt, &lo, &hi);
                if (n && lo < hi) shrink_block(x, x_rs, g.rows + g.start[s], n, K, a + s * a_ss, a_cs, lo, hi, scale,
                                               h, h_rs);
            }
        }
        (void)team;
    }
    groups_free(&g);
    return rc;
}

/* out[t, 0:N] (+)= B[slot[t]] @ y[t] for rows of a slot (others untouched). y [T, R] row stride
 * y_rs; B: element (s, n, r) at b[s * b_ss + n * b_ns + r * b_rs]; out row stride out_rs (its
 * pointer already at the slice's first column). Returns as servelab_lora_shrink. */
int servelab_lora_expand(const float *y, int64_t y_rs, int64_t T, int64_t R, const float *b, int64_t b_ss,
                         int64_t b_ns, int64_t b_rs, int64_t N, int64_t num_slots, const int64_t *indices,
                         const int64_t *seg_starts, const int64_t *seg_lens, const int64_t *seg_slots,
                         int64_t num_segs, int64_t add, float *out, int64_t out_rs, int64_t threads) {
    Groups g;
    int rc = groups_build(&g, T, num_slots, indices, seg_starts, seg_lens, seg_slots, num_segs), failed = 0;
    if (rc == 0) {
        const int team = team_size(threads, g.start[num_slots] * N * R);
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
        {
#ifdef _OPENMP
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int tid = 0, nt = 1;
#endif
            float *panel = malloc((size_t)panel_floats(N, R, nt) * sizeof(float));
            if (!panel) failed = 1;  /* a benign race: every writer writes 1 */
            for (int64_t s = 0; panel && s < num_slots; s++) {
                const int64_t n = g.start[s + 1] - g.start[s];
                if (n) expand_slot(y, y_rs, g.rows + g.start[s], n, R, b + s * b_ss, b_rs, b_ns, N, (int)add, out,
                                   out_rs, tid, nt, panel);
            }
            free(panel);
        }
        (void)team;
    }
    groups_free(&g);
    return failed ? -1 : rc;
}

/* One wrapped layer: out[t, start_j + n] += sum_{r < rank} B[slot, start_j + n, r] * h[t, j * r_max + r]
 * for every slice j, where h[t, j * r_max + r] = A[slot, j * r_max + r, :] . x[t, :] and
 * rank = ranks[slot * num_slices + j] (0: the adapter leaves slice j alone, skipped).
 * x [T, K] row stride x_rs; A [S, num_slices * r_max, K]: element (s, c, k) at a[s * a_ss + c * K + k];
 * B [S, N_out, r_max]: element (s, n, r) at b[s * b_ss + n * b_ns + r * b_rs]; out [T, N_out] row
 * stride out_rs; slice_start / slice_size [num_slices]. Returns as servelab_lora_shrink. */
int servelab_lora_layer(const float *x, int64_t x_rs, int64_t T, int64_t K, const float *a, int64_t a_ss,
                        const float *b, int64_t b_ss, int64_t b_ns, int64_t b_rs, int64_t num_slots, int64_t r_max,
                        int64_t num_slices, const int64_t *slice_start, const int64_t *slice_size,
                        const int64_t *ranks, const int64_t *indices, float *out, int64_t out_rs, int64_t threads) {
    Groups g;
    const int64_t W = num_slices * r_max;
    int rc = groups_build(&g, T, num_slots, indices, 0, 0, 0, 0), failed = 0;
    float *h = rc == 0 ? malloc(((size_t)T * W + 1) * sizeof(float)) : 0;
    if (rc == 0 && !h) rc = -1;
    if (rc == 0) {
        int64_t macs = 0, widest = 0;
        for (int64_t j = 0; j < num_slices; j++) widest = slice_size[j] > widest ? slice_size[j] : widest;
        for (int64_t s = 0; s < num_slots; s++)
            for (int64_t j = 0; j < num_slices; j++)
                macs += (g.start[s + 1] - g.start[s]) * ranks[s * num_slices + j] * (K + slice_size[j]);
        const int team = team_size(threads, macs);
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
        {
#ifdef _OPENMP
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int tid = 0, nt = 1;
#endif
            for (int64_t s = 0; s < num_slots; s++) {
                const int64_t n = g.start[s + 1] - g.start[s];
                for (int64_t j = 0; n && j < num_slices; j++) {
                    int64_t lo, hi;
                    share(ranks[s * num_slices + j], tid, nt, &lo, &hi);
                    if (lo < hi) shrink_block(x, x_rs, g.rows + g.start[s], n, K, a + s * a_ss, K, j * r_max + lo,
                                              j * r_max + hi, 1.0f, h, W);
                }
            }
            float *panel = malloc((size_t)panel_floats(widest, r_max, nt) * sizeof(float));
            if (!panel) failed = 1;  /* a benign race: every writer writes 1 */
#ifdef _OPENMP
#pragma omp barrier
#endif
            for (int64_t s = 0; panel && s < num_slots; s++) {
                const int64_t n = g.start[s + 1] - g.start[s];
                for (int64_t j = 0; n && j < num_slices; j++) {
                    const int64_t rank = ranks[s * num_slices + j];
                    if (rank > 0)
                        expand_slot(h + j * r_max, W, g.rows + g.start[s], n, rank,
                                    b + s * b_ss + slice_start[j] * b_ns, b_rs, b_ns, slice_size[j], 1,
                                    out + slice_start[j], out_rs, tid, nt, panel);
                }
            }
            free(panel);
        }
        (void)team;
    }
    free(h);
    groups_free(&g);
    return failed ? -1 : rc;
}
