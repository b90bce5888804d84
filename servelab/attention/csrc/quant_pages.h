/* Reading quantized KV pages on a CPU: the formats' conversions to float32, the walk through a
 * row's block table, and a tile's rows (converted to float32, or their addresses; and, for the
 * transposing score path, their bytes transposed).
 *
 * Included by decode_attention_quant.c only: static inline functions the compiler specializes per
 * head size and format inside the kernel. (The build hashes this file with the sources.)
 */
#ifndef SERVELAB_QUANT_PAGES_H
#define SERVELAB_QUANT_PAGES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
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

#define TILE 16 /* positions a tile holds */

/* A row of zeros: what the paths reading rows in place read past a partial tile's end. */
static const uint8_t zero_row[MAX_HEAD_SIZE] __attribute__((aligned(64)));

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

/* convert16: 16 stored values -> float32; convert_row16: convert_row over 16 values at a time (d % 16
 * == 0) with widening loads: int8 is one sign extension and one int -> float conversion per 16 (AVX-512)
 * or 8 (AVX2) values; float8 the same field moves as convert_row, the subnormal chosen by a lane mask.
 * (Auto-vectorized, convert_row took half-width vectors and a two-step sign extension; gcc 12 lowers
 * __builtin_convertvector from 16 bytes to 16 ints element by element, hence the intrinsics.) With
 * neither: convert_row. */
#if defined(__AVX512F__) || defined(__AVX2__)
#define HAVE_CONVERT16 1
#endif

#ifdef __AVX512F__
static inline __attribute__((always_inline)) vf convert16(__m128i raw, int64_t format) {
    if (format == 1) return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    const vu32 b = (vu32)_mm512_cvtepu8_epi32(raw), sign = (b & 0x80) << 24;
    const int e4 = format == 2;
    const vu32 e = e4 ? (b >> 3) & 0xF : (b >> 2) & 0x1F, m = e4 ? b & 7 : b & 3;
    const vu32 normal = e4 ? sign | ((e + 120) << 23) | (m << 20) : sign | ((e + 112) << 23) | (m << 21);
    const vf sub = bits_to_vf(sign | 0x3F800000u) * (vf)_mm512_cvtepi32_ps((__m512i)m)
                   * vsplat(e4 ? 0.001953125f : 1.52587890625e-05f); /* 2^-9, 2^-16 */
    const vu32 is_normal = (vu32)(e != 0);
    return bits_to_vf((normal & is_normal) | (vf_to_bits(sub) & ~is_normal));
}
#elif defined(__AVX2__)
typedef uint32_t vu32x8 __attribute__((vector_size(32)));

/* 8-float loads and stores as intrinsics: gcc turned a loop of memcpy's of vf8 into a byte-copy loop
 * through the stack. */
static inline __attribute__((always_inline)) vf8 load8(const float* p) { return (vf8)_mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) void store8(float* p, vf8 x) { _mm256_storeu_ps(p, (__m256)x); }

/* The low 8 bytes of raw -> 8 floats (convert16's operations on half the lanes). */
static inline __attribute__((always_inline)) vf8 convert8(__m128i raw, int64_t format) {
    if (format == 1) return (vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    const vu32x8 b = (vu32x8)_mm256_cvtepu8_epi32(raw), sign = (b & 0x80) << 24;
    const int e4 = format == 2;
    const vu32x8 e = e4 ? (b >> 3) & 0xF : (b >> 2) & 0x1F, m = e4 ? b & 7 : b & 3;
    const vu32x8 normal = e4 ? sign | ((e + 120) << 23) | (m << 20) : sign | ((e + 112) << 23) | (m << 21);
    /* a vector cast between vectors of one size keeps the bits (as bits_to_vf does for 16 lanes) */
    const vf8 sub = (vf8)(sign | 0x3F800000u) * (vf8)_mm256_cvtepi32_ps((__m256i)m)
                    * (e4 ? 0.001953125f : 1.52587890625e-05f); /* 2^-9, 2^-16 */
    const vu32x8 is_normal = (vu32x8)(e != 0);
    return (vf8)((normal & is_normal) | ((vu32x8)sub & ~is_normal));
}

static inline __attribute__((always_inline)) vf convert16(__m128i raw, int64_t format) {
    const vf8 lo = convert8(raw, format), hi = convert8(_mm_unpackhi_epi64(raw, raw), format);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

static inline __attribute__((always_inline)) void convert_row16(const uint8_t* restrict src, float* restrict dst,
                                                                int64_t d, int64_t format) {
#if defined(__AVX512F__)
    for (int64_t c = 0; c < d; c += LANES) {
        const vf x = convert16(_mm_loadu_si128((const __m128i*)(src + c)), format);
        memcpy(dst + c, &x, sizeof(x));
    }
#elif defined(__AVX2__) /* halves stored one by one: gcc builds a 16-lane vector of two halves on the stack */
    for (int64_t c = 0; c < d; c += LANES) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(src + c));
        const vf8 lo = convert8(raw, format), hi = convert8(_mm_unpackhi_epi64(raw, raw), format);
        store8(dst + c, lo);
        store8(dst + c + 8, hi);
    }
#else
    convert_row(src, dst, d, format);
#endif
}

/* Convert the n (<= TILE) rows of positions [p, p + n) to float32 rows of `d` in `rows` (or, with
 * `addresses`, store the rows' addresses there instead, zero_row and scale 0 past n up to TILE), and
 * their scales to `scales`; w walks on to
 * position p + n. `ahead` walks PREFETCH positions in front and
 * asks for their rows: a head's rows are d bytes every s_s (the other heads between them) and one
 * block's rows are not next to the next block's, a pattern the hardware prefetcher left mostly
 * unfetched (the first load of a row was a quarter of the kernel's samples). */
#define PREFETCH (2 * TILE)
static inline __attribute__((always_inline)) void load_tile(const uint8_t* restrict base, int64_t s_b, int64_t s_s,
                                                            const float* restrict sbase, int64_t t_b, int64_t t_s,
                                                            walk_t* w, walk_t* ahead, const int32_t* table, int64_t p,
                                                            int64_t n, int64_t len, int64_t d, int64_t block_size,
                                                            int64_t format, float* restrict rows,
                                                            float* restrict scales, const uint8_t** addresses) {
    if (addresses) /* the in-place paths read whole tiles: past n, rows of zeros with zero scales */
        for (int64_t t = n; t < TILE; ++t) addresses[t] = zero_row, scales[t] = 0.0f;
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
            if (addresses) addresses[t] = row + t * s_s;
            else convert_row16(row + t * s_s, rows + t * d, d, format);
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
        if (addresses) addresses[t] = base + w->block * s_b + w->offset * s_s;
        else convert_row16(base + w->block * s_b + w->offset * s_s, rows + t * d, d, format);
        scales[t] = sbase[w->block * t_b + w->offset * t_s];
        walk_next(w, table, p + t, len, block_size);
    }
}

/* The transposing score path's byte transpose: COLUMN_BYTES (64 with AVX-512 BW, 32 with AVX2) bytes
 * of 16 rows at a time. */
#if defined(__AVX512BW__) || (defined(__AVX2__) && !defined(__AVX512F__))
#define TRANSPOSED_KEYS 1
#ifdef __AVX512BW__
#define COLUMN_BYTES 64
typedef __m512i vbytes;
#define bytes_unpacklo8 _mm512_unpacklo_epi8
#define bytes_unpackhi8 _mm512_unpackhi_epi8
#define bytes_unpacklo16 _mm512_unpacklo_epi16
#define bytes_unpackhi16 _mm512_unpackhi_epi16
#define bytes_unpacklo32 _mm512_unpacklo_epi32
#define bytes_unpackhi32 _mm512_unpackhi_epi32
#define bytes_unpacklo64 _mm512_unpacklo_epi64
#define bytes_unpackhi64 _mm512_unpackhi_epi64
#define bytes_store(p, x) _mm512_store_si512((void*)(p), x)
#else
#define COLUMN_BYTES 32
typedef __m256i vbytes;
#define bytes_unpacklo8 _mm256_unpacklo_epi8
#define bytes_unpackhi8 _mm256_unpackhi_epi8
#define bytes_unpacklo16 _mm256_unpacklo_epi16
#define bytes_unpackhi16 _mm256_unpackhi_epi16
#define bytes_unpacklo32 _mm256_unpacklo_epi32
#define bytes_unpackhi32 _mm256_unpackhi_epi32
#define bytes_unpacklo64 _mm256_unpacklo_epi64
#define bytes_unpackhi64 _mm256_unpackhi_epi64
#define bytes_store(p, x) _mm256_store_si256((__m256i*)(p), x)
#endif

/* The transpose network's first two steps for 8 rows x[0..7] in place, within each 128-bit lane:
 * bytes of row pairs interleaved, then 16-bit pairs; after it x[4j + m] holds rows 4j .. 4j + 3,
 * bytes 4m .. 4m + 3. */
static inline __attribute__((always_inline)) void interleave_rows8(vbytes* x) {
    vbytes y[8];
    for (int i = 0; i < 4; ++i) { /* y[2i], y[2i + 1]: rows 2i, 2i + 1, bytes k < 8 / k >= 8 */
        y[2 * i] = bytes_unpacklo8(x[2 * i], x[2 * i + 1]);
        y[2 * i + 1] = bytes_unpackhi8(x[2 * i], x[2 * i + 1]);
    }
    for (int j = 0; j < 2; ++j) {
        x[4 * j] = bytes_unpacklo16(y[4 * j], y[4 * j + 2]);
        x[4 * j + 1] = bytes_unpackhi16(y[4 * j], y[4 * j + 2]);
        x[4 * j + 2] = bytes_unpacklo16(y[4 * j + 1], y[4 * j + 3]);
        x[4 * j + 3] = bytes_unpackhi16(y[4 * j + 1], y[4 * j + 3]);
    }
}

/* Bytes [col, col + cols) of 16 rows transposed (AVX-512 BW; AVX2's layout below): column col + 16 L + k,
 * its 16 rows' bytes in row order, to out + COLUMN_BYTES k + 16 L (out COLUMN_BYTES-aligned); cols a
 * multiple of 16, at most 64 (the rest read as 0). The classic network, within each 128-bit lane:
 * interleave_rows8 on each half, then 32-bit pairs, then 64-bit ones joining the halves; 64 shuffles
 * for 16 x 64 bytes. */
#ifdef __AVX512BW__
static inline __attribute__((always_inline)) void transpose_bytes(const uint8_t* const* rows, int64_t col,
                                                                  int64_t cols, uint8_t* restrict out) {
    vbytes x[16], y[16];
    const __mmask64 valid = cols >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << cols) - 1);
    for (int t = 0; t < 16; ++t) x[t] = _mm512_maskz_loadu_epi8(valid, rows[t] + col);
    interleave_rows8(x);
    interleave_rows8(x + 8);
    for (int u = 0; u < 2; ++u) /* y[8u + e]: rows 8u .. 8u + 7, bytes 2e, 2e + 1 */
        for (int m = 0; m < 4; ++m) {
            y[8 * u + 2 * m] = bytes_unpacklo32(x[8 * u + m], x[8 * u + 4 + m]);
            y[8 * u + 2 * m + 1] = bytes_unpackhi32(x[8 * u + m], x[8 * u + 4 + m]);
        }
    for (int e = 0; e < 8; ++e) { /* byte k of every row */
        bytes_store(out + 2 * e * COLUMN_BYTES, bytes_unpacklo64(y[e], y[8 + e]));
        bytes_store(out + (2 * e + 1) * COLUMN_BYTES, bytes_unpackhi64(y[e], y[8 + e]));
    }
}
#else
/* AVX2 (cols a multiple of 32: the caller's d % 32 == 0): bytes [col, col + 32) of 16 rows transposed,
 * each half of 8 rows on its own, without the network's last step (the 64-bit unpacks that join the
 * halves): column col + 16 L + k's rows 0-7 at out + 64 (k / 2) + 16 L + 8 (k % 2), its rows 8-15 32
 * bytes further (column_dots8 reads each half as 8 bytes anyway). One half's network lives in 16
 * registers; all 16 rows at once kept 32 vectors live and gcc spilled ~20 of them to the stack (with
 * the split in decode_attention_quant.c, 1-6% faster in the kernel, the same bits). */
static inline __attribute__((always_inline)) void transpose_bytes(const uint8_t* const* rows, int64_t col,
                                                                  int64_t cols, uint8_t* restrict out) {
    (void)cols;
    for (int u = 0; u < 2; ++u) { /* rows 8u .. 8u + 7 */
        vbytes x[8];
        for (int t = 0; t < 8; ++t) x[t] = _mm256_loadu_si256((const __m256i*)(rows[8 * u + t] + col));
        interleave_rows8(x);
        for (int m = 0; m < 4; ++m) { /* rows 8u .. 8u + 7 of bytes 2e, 2e + 1 (e = 2m, 2m + 1) in each lane */
            bytes_store(out + 64 * (2 * m) + 32 * u, bytes_unpacklo32(x[m], x[4 + m]));
            bytes_store(out + 64 * (2 * m + 1) + 32 * u, bytes_unpackhi32(x[m], x[4 + m]));
        }
    }
}
#endif
#endif

/* w[g * TILE + t] = s[g * width + p + t] * v_scales[t] for t < n, 0 past n: a tile's softmax weights
 * times its value scales, for GB query heads (a full tile 16 at once). */
static inline __attribute__((always_inline)) void tile_weights(const float* restrict s, int64_t width, int64_t p,
                                                               const float* restrict v_scales, int64_t n, int64_t gb,
                                                               float* restrict w) {
    if (n == TILE) {
        const vf scales = vload(v_scales);
        for (int64_t g = 0; g < gb; ++g) {
            const vf x = vload(s + g * width + p) * scales;
            memcpy(w + g * TILE, &x, sizeof(x));
        }
        return;
    }
    for (int64_t g = 0; g < gb; ++g)
        for (int64_t t = 0; t < TILE; ++t) w[g * TILE + t] = t < n ? s[g * width + p + t] * v_scales[t] : 0.0f;
}

/* The quantizing int8 cache write (kv_write_int8.c). */
void servelab_write_kv_int8(const float* key, int64_t key_row_stride, const float* value, int64_t value_row_stride,
                            int8_t* k_cache, int8_t* v_cache, const int64_t* cs, float* k_scale, float* v_scale,
                            const int64_t* ss, int64_t static_scales, const int64_t* slots, int64_t n,
                            int64_t heads, int64_t d, int64_t block_size);

#endif /* SERVELAB_QUANT_PAGES_H */
