/* Decode attention over dense per-head K/V on a CPU, float32.
 *
 * Built by servelab/attention/cpu_kernel_build.py (the system C compiler,
 * -O3 -march=native -fopenmp, each flag dropped if the compiler refuses it)
 * and called through ctypes; the PyTorch
 * formulation in servelab/attention/decode_kv.py is the reference and the
 * fallback. Why a kernel: a decode step's attention is two skinny products
 * per KV head (the G query heads of a GQA group against one context),
 * [G, D] x [D, len] and [G, len] x [len, D]. Batched BLAS calls on such
 * shapes read a context from memory at a fraction of the copy bandwidth;
 * here each K and V element is loaded once, in address order, and used G
 * times from a register.
 *
 * Layouts (H = rows * kv_per_row heads, contiguous):
 *   q       [rows, Hk, G, D]  query heads of each KV head's group (rows may be strided)
 *   kt      [H, cap/16, D, 16]  K in tiles of 16 positions, each tile transposed:
 *                          position l, dimension d at ((l/16)*D + d)*16 + l%16,
 *                          so a head's context is one sequential stream and a
 *                          tile's 16 scores accumulate in one vector register
 *   v       [H, cap, D]    V in rows
 *   lens    [rows] int64   context length of each row (1 <= len <= cap)
 *   scores  [H, G, width]  scale * q.k for l < len, -inf for len <= l < width
 *   p       [H, G, width]  softmax of scores (read for l < len only)
 *   out     [H, G, D]
 *   key_rows, value_rows [slots, Hk, D]  a layer's paged cache, flattened
 *   slots   [rows] int64   the cache slot of each row's newest position, lens[r] - 1
 * Requirements (checked by the Python side): D % 16 == 0, cap % 16 == 0,
 * 1 <= G <= 8, len <= width <= cap.
 *
 * Summation order (deterministic): every dot product accumulates over d (or
 * over l) in increasing order in one float32 lane, with fused multiply-adds
 * where the target has them.
 *
 * Threads: scores and values split the H heads (sequences x KV heads) into
 * contiguous ranges of about equal work (context positions), one per thread,
 * up to num_threads (the caller passes torch.get_num_threads(): with OpenMP
 * the kernel shares torch's OpenMP runtime, so the two never oversubscribe).
 * A head is computed by one thread in the order above, so results are the
 * same bits for every thread count. Without OpenMP the loops run serially.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef SERVELAB_BUILD_KEY
#define SERVELAB_BUILD_KEY "unkeyed"
#endif

typedef float vf __attribute__((vector_size(64)));  /* 16 floats: zmm, 2 ymm or 4 q registers */
#define LANES 16

static inline vf load(const float* p) { vf x; memcpy(&x, p, sizeof(x)); return x; }
static inline void store(float* p, vf x) { memcpy(p, &x, sizeof(x)); }
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* Software prefetch, three kinds. Measured on SmolLM2-135M's batch-16 decode K/V (30 layers
 * of 48 heads, ~45 KB of K and ~45 KB of V each: 126 MB per step, read cold, 64 MiB written
 * between steps) through torch tensors and ctypes, on a 2-core Zen 4 VM whose one-thread read
 * of one long stream (torch.sum) is 22-25 GB/s, i.e. 5.0-5.7 ms for these bytes. The VM's
 * speed drifts up to 2x between minutes: figures are medians of 150-300 rounds alternating
 * the variants in one process, and only ratios within a run compare.
 * - kt_next / v_next: the same offsets in the next head of this thread's range (NULL for its
 *   last head), one prefetch per cache line loaded. A head's K (or V) is one short stream
 *   (11 pages), the hardware prefetchers stop at each 4 KiB page's end, and the kernel's
 *   arithmetic did not overlap the misses: without software prefetch a step takes 1.2-1.35x
 *   as long.
 * - The same line again, 4 KiB ahead in this head's own stream (PREFETCH_AGAIN): the next
 *   head's prefetches are issued at the rate the kernel consumes lines already in L2, faster
 *   than memory serves them, and some of those lines are still not in L2 when their head
 *   comes (dropped or late), each then a demand miss; the second chance costs an L2 hit
 *   where the line is there. 1.05-1.09x per step; 2 or 8 KiB ahead gained less, in the
 *   scores or the values alone ~1.02x.
 * - One prefetch into every 4 KiB page of the thread's heads before its first head
 *   (prefetch_pages in servelab_decode_attention): cold, a page's translation is a page walk
 *   whose page-table line is in DRAM too, and the prefetches and loads of the page wait for
 *   it. The ~1100 walks of a layer take ~35 us as one burst; the heads' loops then run ~20%
 *   faster: 1.05-1.09x per step.
 * All into L2 (locality 1): into L1 (locality 3 or 0) the next head's lines evict the current
 * one's (0.77x). With the direct stores of the scores, a step went from 8.75-9.16 to 8.08-8.14
 * ms at 1 thread (1.08-1.13x, 265 of 300 and 194 of 200 rounds faster), 10.15 to 9.15 ms with
 * 14 MB of other data read between layers (1.11x), and 5.24 to 4.70 ms at 2 threads (1.12x).
 * Tried and no better, or worse: prefetching only the own stream, 2-96 KB ahead (chained
 * from K to V to the next K), instead of the next head (0.78-1.04x of the next head alone);
 * two heads ahead (1.0x); the next head's pages at each head's start instead of all pages at
 * once (0.96-1.0x); the page-table lines first (one prefetch per 32 KiB: 1.0x); real loads
 * (0.58x: a missing load stalls retirement); ~2-8 KB of the next V before the softmax
 * (1.0-1.02x); each prefetch issued twice at once (1.02x). Prefetches change no result. */
#define PREFETCH(p) __builtin_prefetch((p), 0, 1)
#define PREFETCH_AGAIN 4096  /* bytes */

/* One prefetch into every 4 KiB page of [p, p + bytes): its translation into the TLB (and
 * its first line into L2). */
static void prefetch_pages(const void* p, int64_t bytes) {
    const uintptr_t start = (uintptr_t)p, end = start + (uintptr_t)bytes;
    for (uintptr_t page = start & ~(uintptr_t)4095; page < end; page += 4096)
        PREFETCH((const void*)(page < start ? start : page));
}

/* One KV head: scores of its G query heads over positions [0, len), 16 at a time,
 * the G accumulators in registers (G is a compile-time constant per instance). A whole
 * tile's scores are stored directly: through a buffer and a memcpy of a runtime length
 * (rep movs, tens of cycles per query head and tile) the kernel took 1.13-1.15x as long
 * warm (in L2 or L3), 1.01x cold. Not kept: two tiles per pass over d (2G accumulators,
 * each q broadcast serving two lines, GCC kept from folding a line's load into each of
 * its G FMAs) was 1.35x faster warm but 5-10% slower cold, where the next head's
 * prefetches then outran memory. */
#define DEFINE_SCORES(G)                                                                      \
static void scores_head_##G(const float* q, const float* kt, int64_t len, float* s,           \
                            int64_t D, int64_t width, float scale, const float* kt_next) {    \
    const int64_t bytes = (len + LANES - 1) / LANES * LANES * D * (int64_t)sizeof(float);     \
    for (int64_t l0 = 0; l0 < len; l0 += LANES) {                                             \
        vf acc[G];                                                                            \
        for (int g = 0; g < G; ++g) acc[g] = splat(0.0f);                                     \
        for (int64_t d = 0; d < D; ++d) {                                                     \
            const float* line = kt + l0 * D + d * LANES;                                      \
            const vf k = load(line); /* whole tiles: cap % 16 == 0 */                         \
            if (kt_next) PREFETCH(kt_next + l0 * D + d * LANES);                              \
            if ((l0 * D + d * LANES) * (int64_t)sizeof(float) + PREFETCH_AGAIN < bytes)       \
                PREFETCH((const char*)line + PREFETCH_AGAIN);                                 \
            for (int g = 0; g < G; ++g) acc[g] += splat(q[g * D + d]) * k;                    \
        }                                                                                     \
        if (l0 + LANES <= len) {                                                              \
            for (int g = 0; g < G; ++g) store(s + g * width + l0, acc[g] * splat(scale));     \
        } else {                                                                              \
            for (int g = 0; g < G; ++g) {                                                     \
                float tmp[LANES];                                                             \
                store(tmp, acc[g] * splat(scale));                                            \
                memcpy(s + g * width + l0, tmp, (size_t)(len - l0) * sizeof(float));          \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int g = 0; g < G; ++g)                                                               \
        for (int64_t l = len; l < width; ++l) s[g * width + l] = -INFINITY;                   \
}

/* One KV head: out[g] = sum_l p[g, l] * v[l], NV vectors of D at a time (G * NV
 * accumulators in registers), positions in increasing order. */
#define DEFINE_PV(G, NV)                                                                      \
static void pv_head_##G##_##NV(const float* p, const float* v, int64_t len, float* out,       \
                               int64_t D, int64_t width, const float* v_next) {               \
    const int64_t bytes = len * D * (int64_t)sizeof(float);                                   \
    for (int64_t d0 = 0; d0 < D; d0 += NV * LANES) {                                          \
        vf acc[G][NV];                                                                        \
        for (int g = 0; g < G; ++g)                                                           \
            for (int j = 0; j < NV; ++j) acc[g][j] = splat(0.0f);                             \
        for (int64_t l = 0; l < len; ++l) {                                                   \
            vf x[NV];                                                                         \
            for (int j = 0; j < NV; ++j) x[j] = load(v + l * D + d0 + j * LANES);             \
            if (v_next)                                                                       \
                for (int j = 0; j < NV; ++j) PREFETCH(v_next + l * D + d0 + j * LANES);       \
            for (int j = 0; j < NV; ++j)                                                      \
                if ((l * D + d0 + j * LANES) * (int64_t)sizeof(float) + PREFETCH_AGAIN < bytes) \
                    PREFETCH((const char*)(v + l * D + d0 + j * LANES) + PREFETCH_AGAIN);     \
            for (int g = 0; g < G; ++g) {                                                     \
                const vf w = splat(p[g * width + l]);                                         \
                for (int j = 0; j < NV; ++j) acc[g][j] += w * x[j];                           \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < G; ++g)                                                           \
            for (int j = 0; j < NV; ++j) store(out + g * D + d0 + j * LANES, acc[g][j]);      \
    }                                                                                         \
}

DEFINE_SCORES(1) DEFINE_SCORES(2) DEFINE_SCORES(3) DEFINE_SCORES(4)
DEFINE_SCORES(5) DEFINE_SCORES(6) DEFINE_SCORES(7) DEFINE_SCORES(8)
DEFINE_PV(1, 4) DEFINE_PV(2, 4) DEFINE_PV(3, 4) DEFINE_PV(4, 4)
DEFINE_PV(5, 2) DEFINE_PV(6, 2) DEFINE_PV(7, 2) DEFINE_PV(8, 2)
DEFINE_PV(1, 1) DEFINE_PV(2, 1) DEFINE_PV(3, 1) DEFINE_PV(4, 1)
DEFINE_PV(5, 1) DEFINE_PV(6, 1) DEFINE_PV(7, 1) DEFINE_PV(8, 1)

typedef void (*scores_fn)(const float*, const float*, int64_t, float*, int64_t, int64_t, float, const float*);
typedef void (*pv_fn)(const float*, const float*, int64_t, float*, int64_t, int64_t, const float*);

static const scores_fn SCORES[8] = {scores_head_1, scores_head_2, scores_head_3, scores_head_4,
                                    scores_head_5, scores_head_6, scores_head_7, scores_head_8};
static const pv_fn PV_WIDE[8] = {pv_head_1_4, pv_head_2_4, pv_head_3_4, pv_head_4_4,
                                 pv_head_5_2, pv_head_6_2, pv_head_7_2, pv_head_8_2};
static const pv_fn PV_NARROW[8] = {pv_head_1_1, pv_head_2_1, pv_head_3_1, pv_head_4_1,
                                   pv_head_5_1, pv_head_6_1, pv_head_7_1, pv_head_8_1};

int servelab_abi_version(void) { return 16; }

/* The cache key this library was built under (compiler, flags, resolved target
 * features, source): the loader refuses a file whose key is not its own. */
const char* servelab_build_key(void) { return SERVELAB_BUILD_KEY; }

int servelab_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Below this many multiply-adds a call stays on one thread (waking a team costs more). */
#define MIN_PARALLEL_WORK 32768

/* Threads worth using for H heads of the given lengths: at most num_threads and H. */
static int team_size(const int64_t* lens, int64_t heads, int64_t kv_per_row, int64_t per_position,
                     int64_t num_threads) {
    if (num_threads <= 1 || heads <= 1) return 1;
    int64_t work = 0;
    for (int64_t r = 0; r < heads / kv_per_row; ++r) work += lens[r];
    if (work * kv_per_row * per_position < MIN_PARALLEL_WORK) return 1;
    return (int)(num_threads < heads ? num_threads : heads);
}

static inline int64_t head_cost(const int64_t* lens, int64_t h, int64_t kv_per_row) {
    return lens[h / kv_per_row] + LANES;  /* context positions plus a tile of fixed overhead */
}

/* Heads [*lo, *hi) of thread t of n: contiguous ranges of about equal work; a head
 * goes to the thread whose share holds the middle of its work. */
static void head_range(const int64_t* lens, int64_t heads, int64_t kv_per_row, int t, int n,
                       int64_t* lo, int64_t* hi) {
    if (n == 1) { *lo = 0; *hi = heads; return; }
    int64_t total = 0;
    for (int64_t h = 0; h < heads; ++h) total += head_cost(lens, h, kv_per_row);
    const int64_t begin = total * t / n, end = total * (t + 1) / n;
    int64_t acc = 0, h = 0;
    while (h < heads && 2 * acc + head_cost(lens, h, kv_per_row) < 2 * begin) acc += head_cost(lens, h++, kv_per_row);
    *lo = h;
    while (h < heads && 2 * acc + head_cost(lens, h, kv_per_row) < 2 * end) acc += head_cost(lens, h++, kv_per_row);
    *hi = t == n - 1 ? heads : h;
}

/* Head h (row h / kv_per_row, KV head h % kv_per_row): copy its row's newest position,
 * lens[r] - 1, from the flattened paged cache [slots, kv_per_row, D] at slots[r] into the
 * tiled K (one float per tile row: D strided stores) and the V rows. A pure copy. */
static inline void append_head(const float* key_rows, const float* value_rows, const int64_t* slots,
                               const int64_t* lens, float* tiles, float* values, int64_t h, int64_t kv_per_row,
                               int64_t head_size, int64_t cap) {
    const int64_t r = h / kv_per_row, j = h % kv_per_row, pos = lens[r] - 1;
    const float* k = key_rows + (slots[r] * kv_per_row + j) * head_size;
    const float* v = value_rows + (slots[r] * kv_per_row + j) * head_size;
    float* tile = tiles + h * cap * head_size + (pos / LANES) * head_size * LANES + pos % LANES;
    for (int64_t d = 0; d < head_size; ++d) tile[d * LANES] = k[d];
    memcpy(values + (h * cap + pos) * head_size, v, (size_t)head_size * sizeof(float));
}

/* reshape_and_cache's write on a CPU: row i of k and v ([n, row_size] each, rows k_row_stride /
 * v_row_stride elements apart, a row contiguous) to row slots[i] of the flattened caches key_rows /
 * value_rows ([slots, row_size], contiguous). A pure copy, rows in order; the caller guarantees
 * 0 <= slots[i] < the caches' rows (servelab/attention/ops.py checks it once per step). Why: the
 * torch form is two index_copy_ calls per layer, ~20 us of dispatch for a decode step's few rows. */
void servelab_write_kv(const float* k, int64_t k_row_stride, const float* v, int64_t v_row_stride,
                       float* key_rows, float* value_rows, const int64_t* slots, int64_t n, int64_t row_size) {
    for (int64_t i = 0; i < n; ++i) {
        memcpy(key_rows + slots[i] * row_size, k + i * k_row_stride, (size_t)row_size * sizeof(float));
        memcpy(value_rows + slots[i] * row_size, v + i * v_row_stride, (size_t)row_size * sizeof(float));
    }
}

/* One team of `team` threads (a variable of that name in scope), each running the block
 * after it; serial without OpenMP. */
#ifdef _OPENMP
#define THREAD_ID omp_get_thread_num()
#define TEAM_SIZE omp_get_num_threads()
#define PARALLEL_TEAM _Pragma("omp parallel num_threads(team)")
#else
#define THREAD_ID 0
#define TEAM_SIZE 1
#define PARALLEL_TEAM (void)team;
#endif

/* q_row_stride: elements between the queries of consecutive rows (kv_per_row * group *
 * head_size when q is contiguous; more when q is a slice of a fused QKV output). */
void servelab_decode_scores(const float* q, int64_t q_row_stride, const float* kt, const int64_t* lens,
                            float* scores, int64_t heads, int64_t kv_per_row, int64_t group, int64_t head_size,
                            int64_t cap, int64_t width, float scale, int64_t num_threads) {
    const scores_fn f = SCORES[group - 1];
    const int team = team_size(lens, heads, kv_per_row, group * head_size, num_threads);
    PARALLEL_TEAM
    {
        int64_t lo, hi;
        head_range(lens, heads, kv_per_row, THREAD_ID, TEAM_SIZE, &lo, &hi);
        for (int64_t h = lo; h < hi; ++h)
            f(q + (h / kv_per_row) * q_row_stride + (h % kv_per_row) * group * head_size,
              kt + h * head_size * cap, lens[h / kv_per_row],
              scores + h * group * width, head_size, width, scale,
              h + 1 < hi ? kt + (h + 1) * head_size * cap : NULL);
    }
}

void servelab_decode_pv(const float* p, const float* v, const int64_t* lens, float* out,
                        int64_t heads, int64_t kv_per_row, int64_t group, int64_t head_size,
                        int64_t cap, int64_t width, int64_t num_threads) {
    const int wide = group <= 4 ? 4 : 2;
    const pv_fn f = head_size % (wide * LANES) == 0 ? PV_WIDE[group - 1] : PV_NARROW[group - 1];
    const int team = team_size(lens, heads, kv_per_row, group * head_size, num_threads);
    PARALLEL_TEAM
    {
        int64_t lo, hi;
        head_range(lens, heads, kv_per_row, THREAD_ID, TEAM_SIZE, &lo, &hi);
        for (int64_t h = lo; h < hi; ++h)
            f(p + h * group * width, v + h * cap * head_size, lens[h / kv_per_row],
              out + h * group * head_size, head_size, width,
              h + 1 < hi ? v + (h + 1) * cap * head_size : NULL);
    }
}

/* exp(x) for x <= 0 (softmax arguments, max already subtracted): Cephes' single-precision
 * polynomial on x - n ln2, scaled by 2^n through the exponent bits; within 2 ulp of expf
 * on [-87, 0], and below -87 (a weight under 1e-38 next to the maximum's 1) it returns
 * exp(-87). No libm call, so the loops below vectorize. */
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
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

/* In place over s[0, len): s = exp(s - max) / sum. Max and sum in 16 lanes (positions
 * l % 16), lanes combined in increasing order: deterministic. */
static void softmax_row(float* s, int64_t len) {
    float lane_max[LANES], lane_sum[LANES];
    for (int j = 0; j < LANES; ++j) lane_max[j] = -INFINITY, lane_sum[j] = 0.0f;
    int64_t l = 0;
    for (; l + LANES <= len; l += LANES)
        for (int j = 0; j < LANES; ++j) lane_max[j] = s[l + j] > lane_max[j] ? s[l + j] : lane_max[j];
    for (int j = 0; l + j < len; ++j) lane_max[j] = s[l + j] > lane_max[j] ? s[l + j] : lane_max[j];
    float m = lane_max[0];
    for (int j = 1; j < LANES; ++j) m = lane_max[j] > m ? lane_max[j] : m;
    for (l = 0; l < len; ++l) s[l] = exp_nonpositive(s[l] - m);
    for (l = 0; l + LANES <= len; l += LANES)
        for (int j = 0; j < LANES; ++j) lane_sum[j] += s[l + j];
    for (int j = 0; l + j < len; ++j) lane_sum[j] += s[l + j];
    float total = 0.0f;
    for (int j = 0; j < LANES; ++j) total += lane_sum[j];
    const float inv = 1.0f / total;
    for (l = 0; l < len; ++l) s[l] *= inv;
}

/* The whole decode attention of every head in one parallel region (one team wake-up
 * per layer, not one per product): per head, its scores into scores[h] (workspace
 * [H, G, width]), a softmax per query head, then the values into out[h] [G, D], while
 * the head's scores are still in the cache.
 *
 * With slots (not NULL), each head first appends its row's newest position (lens[r] - 1)
 * from the paged cache (key_rows / value_rows) into kt and v (append_head). The thread
 * that attends a head makes its copy, so the copies run on every thread, into the lines
 * the head's scores read right after (a K position spans D lines of the tiled layout).
 * As a call of its own before this one, the copy was serial and took ~1.2 ms of a
 * SmolLM2 batch-16 step (30 layers) at 1 and at 2 threads. Without slots, kt and v are
 * only read.
 *
 * Before its first head, each thread prefetches one line of every page its heads read
 * (see PREFETCH: the page walks of a cold layer). */
void servelab_decode_attention(const float* q, int64_t q_row_stride, float* kt, float* v,
                               const int64_t* lens, float* scores, float* out, int64_t heads, int64_t kv_per_row,
                               int64_t group, int64_t head_size, int64_t cap, int64_t width, float scale,
                               int64_t num_threads, const float* key_rows, const float* value_rows,
                               const int64_t* slots) {
    const scores_fn sf = SCORES[group - 1];
    const int wide = group <= 4 ? 4 : 2;
    const pv_fn pf = head_size % (wide * LANES) == 0 ? PV_WIDE[group - 1] : PV_NARROW[group - 1];
    const int team = team_size(lens, heads, kv_per_row, 2 * group * head_size, num_threads);
    PARALLEL_TEAM
    {
        int64_t lo, hi;
        head_range(lens, heads, kv_per_row, THREAD_ID, TEAM_SIZE, &lo, &hi);
        for (int64_t h = lo; h < hi; ++h) { /* the pages this thread reads (see PREFETCH) */
            const int64_t len = lens[h / kv_per_row];
            prefetch_pages(kt + h * head_size * cap, (len + LANES - 1) / LANES * LANES * head_size * 4);
            prefetch_pages(v + h * cap * head_size, len * head_size * 4);
        }
        for (int64_t h = lo; h < hi; ++h) {
            const int64_t len = lens[h / kv_per_row];
            float* s = scores + h * group * width;
            const int more = h + 1 < hi;
            if (slots) append_head(key_rows, value_rows, slots, lens, kt, v, h, kv_per_row, head_size, cap);
            sf(q + (h / kv_per_row) * q_row_stride + (h % kv_per_row) * group * head_size,
               kt + h * head_size * cap, len, s, head_size, width, scale,
               more ? kt + (h + 1) * head_size * cap : NULL);
            for (int64_t g = 0; g < group; ++g) softmax_row(s + g * width, len);
            pf(s, v + h * cap * head_size, len, out + h * group * head_size, head_size, width,
               more ? v + (h + 1) * cap * head_size : NULL);
        }
    }
}
