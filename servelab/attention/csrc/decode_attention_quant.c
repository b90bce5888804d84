/* Decode attention straight over quantized KV pages (int8, float8 e4m3fn / e5m2) on a CPU.
 *
 * Built into the one CPU-kernel library by servelab/attention/cpu_kernel_build.py and called
 * through ctypes by servelab/attention/cpu_decode_quant.py; the reference is
 * servelab/reference/paged_attention.py (dequantize, then attend). Why a kernel: a decode step
 * reads every sequence's whole context once per layer, and that read is the floor of the
 * step; over quantized pages it is 1 byte per element (plus one float32 scale per token and
 * head) instead of 4, provided nothing makes a dequantized copy first. Each head reads its
 * positions straight from the pages through the block table, converts rows of D bytes to
 * float32 (int8 by a cast, float8 by integer field moves) into a small buffer, and uses them for
 * the G query heads of its group; the scale multiplies the dot product (K) and the softmax
 * weight (V), not every element. Head sizes that are multiples of 16 take the tiled path
 * (attend_head_tiled: 16 rows converted at once, AVX-512 widening loads, one transposing lane sum
 * per 16 dot products, output chunks in registers, rows prefetched ahead); others the row path
 * (attend_head_rows: one row at a time).
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
 * Order (deterministic): dot products in 16 lanes over d (tiled path: two chains of alternate
 * chunks), lanes summed by a fixed tree; softmax max and sum in 16 lanes, then the lanes by a fixed
 * tree; values accumulated over positions in increasing order (tiled path: even and odd positions
 * of a tile in two chains, added at the tile's end); each head computed by one thread, so every
 * thread count gives the same bits.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

typedef uint32_t vu32 __attribute__((vector_size(64)));

static inline vf bits_to_vf(vu32 x) { vf f; memcpy(&f, &x, sizeof(f)); return f; }
static inline vu32 vf_to_bits(vf x) { vu32 u; memcpy(&u, &x, sizeof(u)); return u; }

#ifdef __AVX512F__
/* exp_nonpositive on 16 lanes: the same operations in the same order (rounding to nearest even, the
 * same polynomial, the exponent built from the integer n). */
static inline vf exp_nonpositive16(vf x) {
    const vu32 low = (vu32)(x < vsplat(-87.0f));
    x = bits_to_vf((vf_to_bits(vsplat(-87.0f)) & low) | (vf_to_bits(x) & ~low));
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * vsplat(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf r = (x - n * vsplat(0.693359375f)) - n * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + vsplat(1.3981999507e-3f);
    p = p * r + vsplat(8.3334519073e-3f);
    p = p * r + vsplat(4.1665795894e-2f);
    p = p * r + vsplat(1.6666665459e-1f);
    p = p * r + vsplat(5.0000001201e-1f);
    p = p * r * r + r + vsplat(1.0f);
    return p * bits_to_vf((vu32)(((__v16si)_mm512_cvtps_epi32((__m512)n) + 127) << 23));
}
#endif

/* The largest of n floats and their sum, in 16 lanes (a scalar max / sum is a chain of dependent
 * operations the compiler may not reorder: it was 11% of the kernel). Fixed order: deterministic. */
static inline float lanes_max(const float* x, int64_t n) {
    vf m = vsplat(-INFINITY);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf y = vload(x + i);
        const vu32 take = (vu32)(y > m);  /* lanes of all ones where y is larger (C has no vector ?:) */
        m = bits_to_vf((vf_to_bits(y) & take) | (vf_to_bits(m) & ~take));
    }
    float r = -INFINITY;
    for (int j = 0; j < LANES; ++j) r = m[j] > r ? m[j] : r;
    for (; i < n; ++i) r = x[i] > r ? x[i] : r;
    return r;
}

static inline float lanes_sum(const float* x, int64_t n) {
    vf a = vsplat(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) a += vload(x + i);
    float r = hsum(a);
    for (; i < n; ++i) r += x[i];
    return r;
}

/* Softmax over s[g * width + begin .. len) in place, for every query head g; out zeroed. */
static inline void softmax_rows(float* restrict s, int64_t width, int64_t begin, int64_t len, int64_t group,
                                int64_t d, float* restrict out) {
    for (int64_t g = 0; g < group; ++g) {
        float* sg = s + g * width;
        const float m = lanes_max(sg + begin, len - begin);
        /* weights under e^-69 (1e-30 of the largest) are 0: they change nothing a float32 sum keeps,
         * and their products with small scales would be denormals, which are slow on x86 */
        int64_t p = begin;
#ifdef __AVX512F__
        for (; p + LANES <= len; p += LANES) { /* 16 at once (gcc vectorized the loop below 8 wide) */
            const vf x = vload(sg + p) - vsplat(m);
            const vf e = bits_to_vf(vf_to_bits(exp_nonpositive16(x)) & (vu32)(x >= vsplat(-69.0f)));
            memcpy(sg + p, &e, sizeof(e));
        }
#endif
        for (; p < len; ++p) sg[p] = sg[p] - m < -69.0f ? 0.0f : exp_nonpositive(sg[p] - m);
        const float inv = 1.0f / lanes_sum(sg + begin, len - begin);
        for (int64_t p = begin; p < len; ++p) sg[p] *= inv;
        memset(out + g * d, 0, sizeof(float) * (size_t)d);
    }
}

/* One KV head over positions [begin, len), one row at a time (any head size). */
static inline __attribute__((always_inline)) void attend_head_rows(
                        const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v,
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
    softmax_rows(s, width, begin, len, group, d, out);
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


/* ---- The tiled path (head sizes that are multiples of 16): TILE positions at a time. ----
 * Per position the row path above pays a lane sum per query head and a load / store of the
 * output per query head; it measured ~190 cycles per position and KV head on int8 pages (SmolLM2
 * shapes), slower than the float32 kernel reading 4x the bytes. Here a tile of TILE rows is
 * converted once into a float32 buffer (in L1), each query head's TILE dot products are summed
 * by one transposing tree (15 shuffle-add steps for 16 positions instead of 16 separate lane
 * sums), and the value rows are accumulated into output chunks held in registers across the
 * tile. Same float32 products; only the summation order differs (fixed, so still deterministic). */
#define TILE 16
#define VCHUNKS 8 /* output chunks of 16 floats held in registers while a tile's values accumulate */

typedef struct { int64_t index, offset, block; } walk_t; /* a position's table index, offset and block */

static inline walk_t walk_start(const int32_t* table, int64_t p, int64_t block_size) {
    walk_t w = {p / block_size, p % block_size, 0};
    w.block = table[w.index];
    return w;
}

/* Advance to position p + 1 (the table entry past `len` is never read). */
static inline void walk_next(walk_t* w, const int32_t* table, int64_t p, int64_t len, int64_t block_size) {
    if (++w->offset == block_size) {
        w->offset = 0;
        ++w->index;
        w->block = p + 1 < len ? table[w->index] : 0;
    }
}

/* Advance by n positions that stay within the block (or end exactly at its end) to position p. */
static inline void walk_skip(walk_t* w, const int32_t* table, int64_t p, int64_t len, int64_t n, int64_t block_size) {
    w->offset += n;
    if (w->offset == block_size) {
        w->offset = 0;
        ++w->index;
        w->block = p < len ? table[w->index] : 0;
    }
}

/* r[t] = the sum of x[t]'s 16 lanes, for 16 vectors at once: halves of pairs added, 16 -> 8 -> 4 -> 2
 * -> 1 partial sums per vector, every step two shuffles and one add over two vectors. */
static inline vf reduce_tile(const vf* x) {
    vf b[8], c[4], e[2];
    for (int i = 0; i < 8; ++i)
        b[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                         30, 31);
    for (int i = 0; i < 2; ++i)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                         30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* convert_row over 16 values at a time (d % 16 == 0) with AVX-512 widening loads: int8 is one
 * sign extension and one int -> float conversion per 16 values; float8 the same field moves as
 * convert_row, the subnormal chosen by a lane mask. (Auto-vectorized, convert_row took half-width
 * vectors and a two-step sign extension; gcc 12 lowers __builtin_convertvector from 16 bytes to 16
 * ints element by element, hence the intrinsics.) Without AVX-512: convert_row. */
static inline __attribute__((always_inline)) void convert_row16(const uint8_t* restrict src, float* restrict dst,
                                                                int64_t d, int64_t format) {
#ifdef __AVX512F__
    for (int64_t c = 0; c < d; c += LANES) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(src + c));
        vf x;
        if (format == 1) {
            x = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
        } else {
            const vu32 b = (vu32)_mm512_cvtepu8_epi32(raw), sign = (b & 0x80) << 24;
            const int e4 = format == 2;
            const vu32 e = e4 ? (b >> 3) & 0xF : (b >> 2) & 0x1F, m = e4 ? b & 7 : b & 3;
            const vu32 normal = e4 ? sign | ((e + 120) << 23) | (m << 20) : sign | ((e + 112) << 23) | (m << 21);
            const vf sub = bits_to_vf(sign | 0x3F800000u) * (vf)_mm512_cvtepi32_ps((__m512i)m)
                           * vsplat(e4 ? 0.001953125f : 1.52587890625e-05f); /* 2^-9, 2^-16 */
            const vu32 is_normal = (vu32)(e != 0);
            x = bits_to_vf((normal & is_normal) | (vf_to_bits(sub) & ~is_normal));
        }
        memcpy(dst + c, &x, sizeof(x));
    }
#else
    convert_row(src, dst, d, format);
#endif
}

/* Convert the n (<= TILE) rows of positions [p, p + n) to float32 rows of `d` in `rows`, and their
 * scales to `scales`; w walks on to position p + n. `ahead` walks PREFETCH positions in front and
 * asks for their rows: a head's rows are d bytes every s_s (the other heads between them) and one
 * block's rows are not next to the next block's, a pattern the hardware prefetcher left mostly
 * unfetched (the first load of a row was a quarter of the kernel's samples). */
#define PREFETCH (2 * TILE)
static inline __attribute__((always_inline)) void load_tile(const uint8_t* restrict base, int64_t s_b, int64_t s_s,
                                                            const float* restrict sbase, int64_t t_b, int64_t t_s,
                                                            walk_t* w, walk_t* ahead, const int32_t* table, int64_t p,
                                                            int64_t n, int64_t len, int64_t d, int64_t block_size,
                                                            int64_t format, float* restrict rows,
                                                            float* restrict scales) {
    if (w->offset + n <= block_size && ahead->offset + n <= block_size && p + n + PREFETCH <= len) {
        /* the tile and the one PREFETCH ahead each within one block (the common case): rows s_s
         * apart, no table walk per position */
        const uint8_t* row = base + w->block * s_b + w->offset * s_s;
        const uint8_t* next = base + ahead->block * s_b + ahead->offset * s_s;
        const float* scale = sbase + w->block * t_b + w->offset * t_s;
        /* and their scales (16 positions' scales of this head span up to four lines, t_s floats apart;
         * not prefetched, each tile began with demand misses on them: 2-3% of the kernel from DRAM) */
        const float* next_scale = sbase + ahead->block * t_b + ahead->offset * t_s;
        for (int64_t t = 0; t < n; t += 4) __builtin_prefetch(next_scale + t * t_s);
        __builtin_prefetch(next_scale + (n - 1) * t_s);
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t i = 0; i < d; i += 64) __builtin_prefetch(next + t * s_s + i);
            convert_row16(row + t * s_s, rows + t * d, d, format);
            scales[t] = scale[t * t_s];
        }
        walk_skip(w, table, p + n, len, n, block_size);
        walk_skip(ahead, table, p + n + PREFETCH, len, n, block_size);
        return;
    }
    for (int64_t t = 0; t < n; ++t) {
        if (p + t + PREFETCH < len) {
            const uint8_t* next = base + ahead->block * s_b + ahead->offset * s_s;
            __builtin_prefetch(sbase + ahead->block * t_b + ahead->offset * t_s);
            for (int64_t i = 0; i < d; i += 64) __builtin_prefetch(next + i);
            walk_next(ahead, table, p + t + PREFETCH, len, block_size);
        }
        convert_row16(base + w->block * s_b + w->offset * s_s, rows + t * d, d, format);
        scales[t] = sbase[w->block * t_b + w->offset * t_s];
        walk_next(w, table, p + t, len, block_size);
    }
}

/* s[g * width + p + t] = factor * k_scale[t] * (q_g . row_t) for the n (<= TILE) rows of a tile. */
static inline __attribute__((always_inline)) void score_tile(const float* restrict q, const float* restrict rows,
                                                             const float* restrict k_scales, int64_t n, int64_t p,
                                                             int64_t group, int64_t d, float factor,
                                                             float* restrict s, int64_t width) {
    const int64_t chunks = d / LANES;
    for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        vf acc[TILE];
        for (int64_t t = 0; t < TILE; ++t) {
            vf a = vsplat(0.0f), b = vsplat(0.0f); /* two chains: half the FMA latency in a row */
            if (t < n) {
                int64_t c = 0;
                for (; c + 1 < chunks; c += 2) {
                    a += vload(qg + c * LANES) * vload(rows + t * d + c * LANES);
                    b += vload(qg + (c + 1) * LANES) * vload(rows + t * d + (c + 1) * LANES);
                }
                if (c < chunks) a += vload(qg + c * LANES) * vload(rows + t * d + c * LANES);
            }
            acc[t] = a + b;
        }
        const vf dots = reduce_tile(acc);
        for (int64_t t = 0; t < n; ++t) s[g * width + p + t] = dots[t] * (factor * k_scales[t]);
    }
}

/* out_g += sum_t (s[g * width + p + t] * v_scale[t]) * row_t over the n (<= TILE) rows of a tile, the
 * output held in registers VCHUNKS chunks at a time. */
static inline __attribute__((always_inline)) void accumulate_tile(const float* restrict rows,
                                                                  const float* restrict v_scales, int64_t n,
                                                                  int64_t p, int64_t group, int64_t d,
                                                                  const float* restrict s, int64_t width,
                                                                  float* restrict out) {
    const int64_t chunks = d / LANES;
    for (int64_t g = 0; g < group; ++g) {
        float w[TILE];
        for (int64_t t = 0; t < n; ++t) w[t] = s[g * width + p + t] * v_scales[t];
        for (int64_t c0 = 0; c0 < chunks; c0 += VCHUNKS) {
            const int64_t m = chunks - c0 < VCHUNKS ? chunks - c0 : VCHUNKS;
            float* og = out + g * d + c0 * LANES;
            /* even and odd positions in separate accumulators: twice the independent FMA chains (one
             * chain per chunk was bound by the FMA latency) */
            vf acc[VCHUNKS], odd[VCHUNKS];
            for (int64_t j = 0; j < m; ++j) acc[j] = vload(og + j * LANES), odd[j] = vsplat(0.0f);
            int64_t t = 0;
            for (; t + 1 < n; t += 2) {
                const vf w0 = vsplat(w[t]), w1 = vsplat(w[t + 1]);
                for (int64_t j = 0; j < m; ++j) {
                    acc[j] += w0 * vload(rows + t * d + (c0 + j) * LANES);
                    odd[j] += w1 * vload(rows + (t + 1) * d + (c0 + j) * LANES);
                }
            }
            if (t < n)
                for (int64_t j = 0; j < m; ++j) acc[j] += vsplat(w[t]) * vload(rows + t * d + (c0 + j) * LANES);
            for (int64_t j = 0; j < m; ++j) {
                const vf sum = acc[j] + odd[j];
                memcpy(og + j * LANES, &sum, sizeof(vf));
            }
        }
    }
}

/* One KV head over positions [begin, len) by tiles: scores, softmax, values (d % LANES == 0). */
static inline __attribute__((always_inline)) void attend_head_tiled(
    const float* restrict q, const uint8_t* restrict k, const uint8_t* restrict v, const int64_t* restrict cs,
    const float* restrict ks, const float* restrict vs, const int64_t* restrict ss, const int32_t* restrict table,
    int64_t begin, int64_t len, int64_t h, int64_t group, int64_t d, int64_t block_size, int64_t format,
    float scale, float* restrict s, int64_t width, float* restrict out) {
    float rows[TILE * MAX_HEAD_SIZE] __attribute__((aligned(64)));
    float scales[TILE];
    const int64_t lookahead = begin + PREFETCH < len ? begin + PREFETCH : begin;
    walk_t w = walk_start(table, begin, block_size), ahead = walk_start(table, lookahead, block_size);
    for (int64_t p = begin; p < len; p += TILE) {
        const int64_t n = len - p < TILE ? len - p : TILE;
        load_tile(k + h * cs[2], cs[0], cs[1], ks + h * ss[2], ss[0], ss[1], &w, &ahead, table, p, n, len, d,
                  block_size, format, rows, scales);
        score_tile(q, rows, scales, n, p, group, d, scale, s, width);
    }
    softmax_rows(s, width, begin, len, group, d, out);
    w = walk_start(table, begin, block_size);
    ahead = walk_start(table, lookahead, block_size);
    for (int64_t p = begin; p < len; p += TILE) {
        const int64_t n = len - p < TILE ? len - p : TILE;
        load_tile(v + h * cs[5], cs[3], cs[4], vs + h * ss[5], ss[3], ss[4], &w, &ahead, table, p, n, len, d,
                  block_size, format, rows, scales);
        accumulate_tile(rows, scales, n, p, group, d, s, width, out);
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
        /* the common head sizes as compile-time constants: fully unrolled conversions and dots */
#define SERVELAB_ATTEND(fn, D, F) fn(qh, k_cache, v_cache, cache_strides, k_scale, v_scale, scale_strides, \
                                     table, begin, len, h, group, D, block_size, F, scale, sh, width, oh)
        /* int8 (format 1) as a constant too: its conversion without the float8 branches */
        if (head_size == 64 && format == 1) SERVELAB_ATTEND(attend_head_tiled, 64, 1);
        else if (head_size == 128 && format == 1) SERVELAB_ATTEND(attend_head_tiled, 128, 1);
        else if (head_size == 64) SERVELAB_ATTEND(attend_head_tiled, 64, format);
        else if (head_size == 128) SERVELAB_ATTEND(attend_head_tiled, 128, format);
        else if (head_size == 256) SERVELAB_ATTEND(attend_head_tiled, 256, format);
        else if (head_size % LANES == 0) SERVELAB_ATTEND(attend_head_tiled, head_size, format);
        else SERVELAB_ATTEND(attend_head_rows, head_size, format);
#undef SERVELAB_ATTEND
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

/* One layer of a pure decode step over int8 pages in one call: this step's rows written
 * (servelab_write_kv_int8), then attended (servelab_paged_decode_quant), the same operations in the
 * same order as the two calls, so the same bits. The model's direct path
 * (servelab.attention.cpu_decode_quant.DecodeStep) calls it for every layer after the first; one
 * foreign call instead of two, from Python whose objects the layer's weights have just evicted. */
int servelab_write_decode_int8(const float* key, int64_t key_row_stride, const float* value, int64_t value_row_stride,
                               const int64_t* slots, int64_t static_scales, const float* q, int64_t q_row_stride,
                               int8_t* k_cache, int8_t* v_cache, const int64_t* cache_strides, float* k_scale,
                               float* v_scale, const int64_t* scale_strides, const int32_t* block_table,
                               int64_t table_stride, const int32_t* seq_lens, int64_t rows, int64_t kv_heads,
                               int64_t group, int64_t head_size, int64_t block_size, int64_t window, float scale,
                               float* scores, int64_t width, float* out, int64_t num_threads) {
    if (head_size > MAX_HEAD_SIZE) return -1;
    servelab_write_kv_int8(key, key_row_stride, value, value_row_stride, k_cache, v_cache, cache_strides, k_scale,
                           v_scale, scale_strides, static_scales, slots, rows, kv_heads, head_size, block_size);
    return servelab_paged_decode_quant(q, q_row_stride, (const uint8_t*)k_cache, (const uint8_t*)v_cache,
                                       cache_strides, k_scale, v_scale, scale_strides, block_table, table_stride,
                                       seq_lens, rows, kv_heads, group, head_size, block_size, window, 1, scale,
                                       scores, width, out, num_threads);
}
