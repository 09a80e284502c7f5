/* k3convert's FP4 byte kernels: table gathers keyed by (group key, stored byte), and the
 * largest E2M1 magnitude code of each group. Plain C11 and pthreads, no allocation; the
 * Python side (k3convert/native/__init__.py) checks every size and key range before a
 * call, so these loops trust their arguments (the search's loss tables: shapes only, the
 * loop masks what it indexes with).
 *
 * Why C: one table load per stored byte is what the decode needs; torch's index_select
 * reaches about 1.3 GB/s of stored bytes on one core and needs an int32 index built per
 * byte first, against a 4 GB/s page-cache read of the same bytes.
 *
 * Threads: every exported kernel takes nthreads last. Its groups are split into nthreads
 * contiguous ranges (whole units: pairs where a loop takes two groups at a time), each
 * range is exactly the work the one-thread loop does on it, so the output does not
 * depend on the count; nthreads <= 1 (or fewer units than threads) runs on the calling
 * thread and creates none. The calling thread takes the first range. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define K3_MAX_THREADS 64

/* a range body: the kernel on groups [lo, hi); returns a count the caller sums */
typedef int64_t (*k3_body)(const void *ctx, int64_t lo, int64_t hi);
typedef struct {
    k3_body fn;
    const void *ctx;
    int64_t lo, hi, ret;
} k3_task;

static void *k3_run_task(void *p) {
    k3_task *t = (k3_task *)p;
    t->ret = t->fn(t->ctx, t->lo, t->hi);
    return NULL;
}

/* fn over [0, n) in min(nthreads, units) contiguous ranges of whole units of `unit`
 * groups (the last range ends at n); a thread that cannot be created runs its range on
 * the calling thread. The sum of the bodies' returns. */
static int64_t k3_parallel(k3_body fn, const void *ctx, int64_t n, int64_t unit,
                           int nthreads) {
    int64_t units = (n + unit - 1) / unit;
    if (nthreads > K3_MAX_THREADS) nthreads = K3_MAX_THREADS;
    if ((int64_t)nthreads > units) nthreads = (int)units;
    if (nthreads <= 1) return n > 0 ? fn(ctx, 0, n) : 0;
    k3_task task[K3_MAX_THREADS];
    pthread_t tid[K3_MAX_THREADS];
    int started[K3_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        int64_t a = units * t / nthreads * unit, b = units * (t + 1) / nthreads * unit;
        task[t] = (k3_task){fn, ctx, a, b < n ? b : n, 0};
    }
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&tid[t], NULL, k3_run_task, &task[t]) == 0;
    k3_run_task(&task[0]);
    int64_t sum = task[0].ret;
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            k3_run_task(&task[t]);
        sum += task[t].ret;
    }
    return sum;
}

#define K3_LOOP(T)                                                                      \
    for (int64_t g = 0; g < groups; g++) {                                              \
        const T *t = table + ((int64_t)key[g] << 8);                                    \
        const uint8_t *s = src + g * per;                                               \
        T *o = out + g * per;                                                           \
        for (int64_t j = 0; j < per; j++) o[j] = t[s[j]];                               \
    }

/* out[g * per + j] = table[(key[g] << 8) | src[g * per + j]] for every group g < groups */
static void k3_gather_u32_1(const uint8_t *src, const int32_t *key, int64_t groups, int64_t per,
                   const uint32_t *table, uint32_t *out) {
    K3_LOOP(uint32_t)
}

static void k3_gather_u64_1(const uint8_t *src, const int32_t *key, int64_t groups, int64_t per,
                   const uint64_t *table, uint64_t *out) {
    K3_LOOP(uint64_t)
}

/* bytes: eight loads assembled into one 64-bit store (measured faster than byte stores) */
static void k3_gather_u8_1(const uint8_t *src, const int32_t *key, int64_t groups, int64_t per,
                  const uint8_t *table, uint8_t *out) {
    if (per % 8) {
        K3_LOOP(uint8_t)
        return;
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *t = table + ((int64_t)key[g] << 8);
        const uint8_t *s = src + g * per;
        uint8_t *o = out + g * per;
        for (int64_t j = 0; j < per; j += 8) {
            uint64_t w = 0;
            for (int k = 0; k < 8; k++) w |= (uint64_t)t[s[j + k]] << (8 * k);
            memcpy(o + j, &w, 8); /* little-endian hosts only: the loader checks */
        }
    }
}

/* out[g] = the largest (nibble & 7) over the 2 * per nibbles of group g: E2M1 magnitude
 * codes are ordered like their values, so this is the code of the group's largest |x|.
 * per 8 or 16: sixteen lane maxima of the two nibbles at a time (a loop the compiler
 * vectorises), then each group's half or whole; measured 5-10x the plain loop at per 8. */
static void k3_max8_generic(const uint8_t *restrict src, int64_t blocks, uint8_t *restrict out) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *s = src + 16 * b;
        uint8_t v[16];
        for (int k = 0; k < 16; k++) {
            uint8_t lo = s[k] & 7, hi = (s[k] >> 4) & 7;
            v[k] = lo > hi ? lo : hi;
        }
        uint8_t m0 = 0, m1 = 0;
        for (int k = 0; k < 8; k++) {
            m0 = v[k] > m0 ? v[k] : m0;
            m1 = v[k + 8] > m1 ? v[k + 8] : m1;
        }
        out[2 * b] = m0;
        out[2 * b + 1] = m1;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_HAVE_MAX8_SIMD 1
/* AVX2: 32 bytes (four 8-byte groups) at a time: each byte's larger nibble code, each
 * 64-bit lane folded by 32, 16 and 8 bits (codes <= 7: whole bytes shift in as zeros) so
 * its byte 0 holds the lane's maximum, those four bytes picked out; measured ~2x the
 * vectorised portable loop */
__attribute__((target("avx2"))) static void k3_max8_avx2(const uint8_t *restrict src,
                                                         int64_t blocks,
                                                         uint8_t *restrict out) {
    const __m256i m7 = _mm256_set1_epi8(7);
    const __m256i pick = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(src + 16 * b));
        __m256i x = _mm256_max_epu8(_mm256_and_si256(v, m7),
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), m7));
        x = _mm256_max_epu8(x, _mm256_srli_epi64(x, 32));
        x = _mm256_max_epu8(x, _mm256_srli_epi64(x, 16));
        x = _mm256_max_epu8(x, _mm256_srli_epi64(x, 8));
        x = _mm256_shuffle_epi8(x, pick);
        uint16_t lo = (uint16_t)_mm256_extract_epi16(x, 0), hi = (uint16_t)_mm256_extract_epi16(x, 8);
        memcpy(out + 2 * b, &lo, 2);
        memcpy(out + 2 * b + 2, &hi, 2);
    }
    if (b < blocks) k3_max8_generic(src + 16 * b, blocks - b, out + 2 * b);
}
#endif

static void k3_max8(const uint8_t *restrict src, int64_t blocks, uint8_t *restrict out,
                    int simd) {
#ifdef K3_HAVE_MAX8_SIMD
    if (simd && __builtin_cpu_supports("avx2")) {
        k3_max8_avx2(src, blocks, out);
        return;
    }
#endif
    (void)simd;
    k3_max8_generic(src, blocks, out);
}

static void k3_max_codes_1(const uint8_t *restrict src, int64_t groups, int64_t per,
                           uint8_t *restrict out, int simd) {
    if (per == 8 && groups % 2 == 0) {
        k3_max8(src, groups / 2, out, simd);
        return;
    }
    if (per == 16) { /* the 8-byte maxima of 256 groups into a local buffer, then pairs */
        uint8_t tmp[512];
        for (int64_t g0 = 0; g0 < groups; g0 += 256) {
            int64_t n = groups - g0 < 256 ? groups - g0 : 256;
            k3_max8(src + 16 * g0, n, tmp, simd);
            for (int64_t g = 0; g < n; g++) {
                uint8_t a = tmp[2 * g], b = tmp[2 * g + 1];
                out[g0 + g] = a > b ? a : b;
            }
        }
        return;
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *s = src + g * per;
        uint8_t m = 0;
        for (int64_t j = 0; j < per; j++) {
            uint8_t lo = s[j] & 7, hi = (s[j] >> 4) & 7;
            uint8_t b = lo > hi ? lo : hi;
            m = b > m ? b : m;
        }
        out[g] = m;
    }
}

/* Requantization output through nibble maps: map[key * 16 + n] is the output nibble of
 * input nibble n under the key, so a byte b becomes map[b & 15] | map[b >> 4] << 4. */
static inline uint8_t k3_nib(const uint8_t *map, uint8_t b) {
    return (uint8_t)(map[b & 15] | (map[b >> 4] << 4));
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_HAVE_NIB_SIMD 1
/* 16 bytes through one map (or two: bytes 0..7 and 8..15), by two byte shuffles */
__attribute__((target("avx2"))) static inline __m128i k3_nib16(__m128i v, __m128i m0,
                                                               __m128i m1) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(v, m4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    __m128i a = _mm_blend_epi16(_mm_shuffle_epi8(m0, lo), _mm_shuffle_epi8(m1, lo), 0xF0);
    __m128i c = _mm_blend_epi16(_mm_shuffle_epi8(m0, hi), _mm_shuffle_epi8(m1, hi), 0xF0);
    return _mm_or_si128(a, _mm_slli_epi16(c, 4)); /* c's bytes are < 16: no carry */
}

__attribute__((target("avx2"))) static void k3_gather_nib_avx2(
    const uint8_t *restrict src, const int32_t *restrict key, int64_t groups,
    const uint8_t *restrict map, uint8_t *restrict out) {
    for (int64_t g = 0; g < groups; g++) {
        __m128i mm = _mm_loadu_si128((const __m128i *)(map + 16 * (int64_t)key[g]));
        __m128i v = _mm_loadu_si128((const __m128i *)(src + 16 * g));
        _mm_storeu_si128((__m128i *)(out + 16 * g), k3_nib16(v, mm, mm));
    }
}
#endif

/* out[16 g + j] = the byte src[16 g + j] through map[key[g]] (groups of 16 bytes: one MX
 * group); the caller bounds every key by the map's rows */
static void k3_gather_nib_1(const uint8_t *restrict src, const int32_t *restrict key, int64_t groups,
                   const uint8_t *restrict map, uint8_t *restrict out, int simd) {
#ifdef K3_HAVE_NIB_SIMD
    if (simd && __builtin_cpu_supports("avx2")) {
        k3_gather_nib_avx2(src, key, groups, map, out);
        return;
    }
#endif
    for (int64_t g = 0; g < groups; g++)
        for (int k = 0; k < 16; k++)
            out[16 * g + k] = k3_nib(map + 16 * (int64_t)key[g], src[16 * g + k]);
}

/* MXFP4 -> symmetric int4 in one pass per int group of `sub` MX groups (16 bytes each):
 * m_j, the largest magnitude code of MX group j; amax = max_j vals[e_j * 8 + m_j] (vals:
 * float32 [2048], the reference's value of magnitude code m under E8M0 code e - the
 * group's largest |value|, exactly); then MX group j's map row, cls * span + clamp(e_j -
 * exponent(amax), d_lo, d_hi) - d_lo with cls 0 / 1 for amax's significand 1 / 1.5 and 2
 * for amax 0, and its 16 bytes through that row. amax[g] is written for the caller's
 * scale; the return is the number of codes outside [lo, hi] (nonzero: the caller drops the
 * output; every row stays inside the map whatever the codes). */
typedef struct {
    const uint8_t *src, *codes, *map;
    const float *vals;
    uint8_t *out;
    float *amax;
    int64_t sub;
    int lo, hi, span, d_lo, d_hi, simd;
} k3_int4_args;

static inline int64_t k3_int4_row(const k3_int4_args *a, float amax, int e) {
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    int cls = bits == 0 ? 2 : (bits & 0x7FFFFFu) != 0;
    int d = e - (int)(bits >> 23);
    d = d < a->d_lo ? a->d_lo : d > a->d_hi ? a->d_hi : d;
    return (int64_t)cls * a->span + (d - a->d_lo);
}

static int64_t k3_mx_int4_generic(const k3_int4_args *a, int64_t lo, int64_t hi) {
    int64_t bad = 0, sub = a->sub;
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *s = a->src + 16 * sub * g, *e = a->codes + sub * g;
        float amax = 0.0f;
        for (int64_t j = 0; j < sub; j++) {
            uint8_t m = 0;
            for (int k = 0; k < 16; k++) {
                uint8_t l = s[16 * j + k] & 7, h = (s[16 * j + k] >> 4) & 7;
                uint8_t b = l > h ? l : h;
                m = b > m ? b : m;
            }
            float v = a->vals[(int64_t)e[j] * 8 + m];
            amax = v > amax ? v : amax;
            bad += (e[j] < a->lo) | (e[j] > a->hi);
        }
        a->amax[g] = amax;
        for (int64_t j = 0; j < sub; j++) {
            const uint8_t *map = a->map + 16 * k3_int4_row(a, amax, e[j]);
            for (int k = 0; k < 16; k++) a->out[16 * (sub * g + j) + k] = k3_nib(map, s[16 * j + k]);
        }
    }
    return bad;
}

#ifdef K3_HAVE_NIB_SIMD
/* the largest magnitude code of each of 4 MX groups (64 bytes) in bytes 0..3: each byte's
 * larger nibble code, then halves folded pairwise until one byte per group is left */
__attribute__((target("avx2"))) static inline uint32_t k3_max4x16(const uint8_t *s) {
    const __m128i m7 = _mm_set1_epi8(7);
    __m128i x[4];
    for (int j = 0; j < 4; j++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + 16 * j));
        x[j] = _mm_max_epu8(_mm_and_si128(v, m7), _mm_and_si128(_mm_srli_epi16(v, 4), m7));
    }
    /* 8 bytes per group: [x0 | x1], [x2 | x3] */
    __m128i a = _mm_max_epu8(_mm_unpacklo_epi64(x[0], x[1]), _mm_unpackhi_epi64(x[0], x[1]));
    __m128i b = _mm_max_epu8(_mm_unpacklo_epi64(x[2], x[3]), _mm_unpackhi_epi64(x[2], x[3]));
    /* 4 bytes per group: one dword each */
    __m128 af = _mm_castsi128_ps(a), bf = _mm_castsi128_ps(b);
    __m128i c = _mm_max_epu8(_mm_castps_si128(_mm_shuffle_ps(af, bf, _MM_SHUFFLE(2, 0, 2, 0))),
                             _mm_castps_si128(_mm_shuffle_ps(af, bf, _MM_SHUFFLE(3, 1, 3, 1))));
    c = _mm_max_epu8(c, _mm_srli_epi32(c, 16));
    c = _mm_max_epu8(c, _mm_srli_epi32(c, 8));
    const __m128i pick = _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                       -1);
    return (uint32_t)_mm_cvtsi128_si32(_mm_shuffle_epi8(c, pick));
}

__attribute__((target("avx2"))) static inline uint32_t k3_max1x16(const uint8_t *s) {
    const __m128i m7 = _mm_set1_epi8(7);
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    __m128i x = _mm_max_epu8(_mm_and_si128(v, m7), _mm_and_si128(_mm_srli_epi16(v, 4), m7));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 8));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 4));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 2));
    x = _mm_max_epu8(x, _mm_srli_si128(x, 1));
    return (uint32_t)_mm_cvtsi128_si32(x) & 0xFF;
}

/* the portable loop's arithmetic: group maxima compared as float32 bits (all values are
 * >= +0, where the bits order like the values), the row base and clamp once per group */
__attribute__((target("avx2"))) static int64_t k3_mx_int4_avx2(const k3_int4_args *a,
                                                              int64_t lo, int64_t hi) {
    int64_t sub = a->sub;
    const uint32_t *vb = (const uint32_t *)a->vals;
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *s = a->src + 16 * sub * g, *e = a->codes + sub * g;
        uint8_t *o = a->out + 16 * sub * g;
        uint32_t top = 0;
        int64_t j = 0;
        for (; j + 4 <= sub; j += 4) {
            uint32_t m = k3_max4x16(s + 16 * j);
            for (int k = 0; k < 4; k++) {
                uint32_t f = vb[(int64_t)e[j + k] * 8 + ((m >> (8 * k)) & 0xFF)];
                top = f > top ? f : top;
            }
        }
        for (; j < sub; j++) {
            uint32_t f = vb[(int64_t)e[j] * 8 + k3_max1x16(s + 16 * j)];
            top = f > top ? f : top;
        }
        memcpy(&a->amax[g], &top, 4);
        int cls = top == 0 ? 2 : (top & 0x7FFFFFu) != 0;
        int k = (int)(top >> 23);
        const uint8_t *base = a->map + 16 * ((int64_t)cls * a->span - a->d_lo);
        for (j = 0; j < sub; j++) {
            int d = (int)e[j] - k;
            d = d < a->d_lo ? a->d_lo : d;
            d = d > a->d_hi ? a->d_hi : d;
            __m128i mm = _mm_loadu_si128((const __m128i *)(base + 16 * d));
            __m128i v = _mm_loadu_si128((const __m128i *)(s + 16 * j));
            _mm_storeu_si128((__m128i *)(o + 16 * j), k3_nib16(v, mm, mm));
        }
    }
    /* the codes outside [lo, hi], counted apart (a loop the compiler vectorises) */
    int64_t bad = 0;
    const uint8_t *e = a->codes;
    for (int64_t i = sub * lo; i < sub * hi; i++) bad += (e[i] < a->lo) | (e[i] > a->hi);
    return bad;
}
#endif

static int64_t k3_mx_int4_body(const void *c, int64_t lo, int64_t hi) {
    const k3_int4_args *a = (const k3_int4_args *)c;
#ifdef K3_HAVE_NIB_SIMD
    if (a->simd && __builtin_cpu_supports("avx2")) return k3_mx_int4_avx2(a, lo, hi);
#endif
    return k3_mx_int4_generic(a, lo, hi);
}

/* groups int groups of sub MX groups; map: uint8 [3 * span x 16] nibble maps */
int64_t k3_mx_int4(const uint8_t *src, const uint8_t *codes, int64_t groups, int64_t sub,
                   const float *vals, int lo, int hi, int span, int d_lo, int d_hi,
                   const uint8_t *map, uint8_t *out, float *amax, int simd, int nthreads) {
    k3_int4_args a = {src, codes, map, vals, out, amax, sub, lo, hi, span, d_lo, d_hi, simd};
    return k3_parallel(k3_mx_int4_body, &a, groups, 1, nthreads);
}

/* MXFP4 -> symmetric int4 with each int group's scale searched (k3convert/quant/mx_int4.py
 * has the derivation). Per int group of `sub` (<= 4) MX groups of 16 bytes: m_j the
 * largest magnitude code of MX group j; e_ref the largest E8M0 code of a group with
 * m_j > 0 (none: a zero group, every byte `zero_byte`, scale `zero_scale`); d_j = e_ref -
 * e_j; the class k of max_j e2m1(m_j) * 2**-d_j over the kept groups (m_j > 0, d_j <=
 * depth): 0.5, 0.75, 1, 1.5, 2, 3, 4, 6 -> 0..7; the candidates' errors summed over the
 * kept groups' bytes from `err` (uint32 [8][depth + 1][256 bytes][16 lanes]; the caller
 * keeps every sum below 2**32), the first smallest of the `ncand` lanes wins (best);
 * every MX group's bytes go through nibble map [k][best][d_j] of `nibs` (uint8 [8]
 * [ncand][depth + 2][16]; row depth + 1 for the groups left out) and the scale is
 * rel[k * ncand + best] * 2**(e_ref - 127). The return: the number of codes of nonzero
 * MX groups outside [lo, hi] (nonzero: the caller drops the output). */
typedef struct {
    const uint8_t *src, *codes, *nibs, *ltab, *sq16;
    const uint32_t *err, *vbits;
    const float *rel, *lval;
    uint8_t *out;
    float *scale;
    double *loss;
    int64_t sub, chunk;
    int depth, ncand, lo, hi, simd;
    float zero_scale;
    uint8_t zero_byte;
} k3_search_args;

/* 2**p as a double, for p in double's normal range */
static inline double k3_pow2d(int p) {
    uint64_t b = (uint64_t)(p + 1023) << 52;
    double x;
    memcpy(&x, &b, 8);
    return x;
}

/* One MX group's share of the loss (16 bytes s under the nibble tables of its row):
 * *sq = sum of (2 e2m1(n))**2 over its 32 values (sq16: the release's squares, x4),
 * return value: values changed (chg: 0 / 1 per nibble) | the largest rank of a value's
 * |error| (rank: 0..15 per nibble, the row's |errors| ascending) << 8. */
static inline int k3_mx_stats(const uint8_t *s, const uint8_t *sq16, const uint8_t *chg,
                              const uint8_t *rank, int *sq) {
    int q2 = 0, c = 0, r = 0;
    for (int q = 0; q < 16; q++) {
        int lo = s[q] & 15, hi = s[q] >> 4;
        q2 += sq16[lo] + sq16[hi];
        c += chg[lo] + chg[hi];
        r = rank[lo] > r ? rank[lo] : r;
        r = rank[hi] > r ? rank[hi] : r;
    }
    *sq = q2;
    return c | r << 8;
}

#ifdef K3_HAVE_NIB_SIMD
/* k3_mx_stats by byte shuffles and sums of absolute differences */
__attribute__((target("avx2"))) static inline int k3_mx_stats_avx2(
    const uint8_t *s, const uint8_t *sq16, const uint8_t *chg, const uint8_t *rank, int *sq) {
    const __m128i m4 = _mm_set1_epi8(0x0F), z = _mm_setzero_si128();
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    __m128i tq = _mm_loadu_si128((const __m128i *)sq16);
    __m128i tc = _mm_loadu_si128((const __m128i *)chg);
    __m128i tr = _mm_loadu_si128((const __m128i *)rank);
    __m128i q = _mm_add_epi64(_mm_sad_epu8(_mm_shuffle_epi8(tq, lo), z),
                              _mm_sad_epu8(_mm_shuffle_epi8(tq, hi), z));
    __m128i c = _mm_sad_epu8(_mm_add_epi8(_mm_shuffle_epi8(tc, lo), _mm_shuffle_epi8(tc, hi)), z);
    __m128i r = _mm_max_epu8(_mm_shuffle_epi8(tr, lo), _mm_shuffle_epi8(tr, hi));
    r = _mm_max_epu8(r, _mm_srli_si128(r, 8));
    r = _mm_max_epu8(r, _mm_srli_si128(r, 4));
    r = _mm_max_epu8(r, _mm_srli_si128(r, 2));
    r = _mm_max_epu8(r, _mm_srli_si128(r, 1));
    *sq = _mm_cvtsi128_si32(q) + _mm_extract_epi32(q, 2);
    return (_mm_cvtsi128_si32(c) + _mm_extract_epi32(c, 2)) | (_mm_cvtsi128_si32(r) & 0xFF) << 8;
}
#endif

/* The loss of int group g against the release's decode, added to the totals of its chunk
 * (loss + 5 * (g / chunk): squared error, squared reference, largest |error|, values
 * changed, MX groups changed). The squared error of the kept MX groups is the winning
 * candidate's sum `acc_best` (units 2**-24 * U**2: exact); per MX group the release's
 * squares, the values changed and the largest |error| come from byte tables of its row
 * (k, best, d): ltab uint8 [8 * ncand * (depth + 1) + 1][2][16] (per row: changed 0 / 1,
 * rank of |error|; the last row: an MX group left out, more than depth binades down and
 * rounded to zero, whose nonzero values all change) and lval float32 [8][ncand][depth +
 * 1][16] (|error| / U by rank). A rank is read & 15, so any table bytes stay in bounds
 * (the caller checks the tables' shapes, not their values: figures from tables other
 * than mx_int4.loss_tables' are meaningless, never out of bounds). Every term is exact
 * in double; the sums run in group order within a chunk. */
static inline __attribute__((always_inline)) void k3_search_loss(
                           const k3_search_args *a, int64_t g, const uint8_t *s,
                           const uint8_t *e, const uint8_t *m, int k, int best, int e_ref,
                           uint32_t acc_best, int vec) {
    double *L = a->loss + 5 * (g / a->chunk);
    const float *v = (const float *)a->vbits;
    const int64_t row0 = (int64_t)(k * a->ncand + best) * (a->depth + 1);
    const uint8_t *nz = a->ltab + (int64_t)8 * a->ncand * (a->depth + 1) * 32; /* left out */
    double u = k3_pow2d(e_ref - 127), err2 = (double)acc_best * k3_pow2d(2 * (e_ref - 127) - 24);
    double ref2 = 0, top = L[2];
    int64_t chg = 0, gch = 0;
    for (int64_t j = 0; j < a->sub; j++) {
        if (!m[j]) continue; /* every value +-0: held */
        int d = e_ref - e[j], sq, st;
        int kept = d <= a->depth;
        const uint8_t *t = kept ? a->ltab + (row0 + d) * 32 : nz;
#ifdef K3_HAVE_NIB_SIMD
        if (vec)
            st = k3_mx_stats_avx2(s + 16 * j, a->sq16, t, t + 16, &sq);
        else
#endif
            st = k3_mx_stats(s + 16 * j, a->sq16, t, t + 16, &sq);
        double uj = k3_pow2d(e[j] - 127), r2 = 0.25 * (double)sq * uj * uj;
        double worst = kept ? (double)a->lval[(row0 + d) * 16 + ((st >> 8) & 15)] * u
                            : (double)v[m[j]] * uj;
        if (!kept) err2 += r2;
        top = worst > top ? worst : top;
        ref2 += r2;
        chg += st & 0xFF;
        gch += (st & 0xFF) != 0;
    }
    L[0] += err2;
    L[1] += ref2;
    L[2] = top;
    L[3] += (double)chg;
    L[4] += (double)gch;
}

/* the per-group steps both loops share: e_ref and the class from the maxima m; returns
 * e_ref (-1: a zero group) and sets *k, *bad */
static inline int k3_search_class(const k3_search_args *a, const uint8_t *e,
                                  const uint8_t *m, int64_t sub, int *k, int64_t *bad) {
    int e_ref = -1;
    for (int64_t j = 0; j < sub; j++) {
        *bad += m[j] && ((e[j] < a->lo) | (e[j] > a->hi));
        if (m[j] && e[j] > e_ref) e_ref = e[j];
    }
    uint32_t top = 0; /* float32 bits of the largest kept value / 2**(e_ref - 127) */
    for (int64_t j = 0; j < sub; j++) {
        int d = e_ref - e[j];
        if (m[j] && d <= a->depth) {
            uint32_t f = a->vbits[m[j]] - ((uint32_t)d << 23); /* e2m1(m) * 2**-d */
            top = f > top ? f : top;
        }
    }
    int c = 2 * ((int)(top >> 23) - 126) + ((top & 0x7FFFFFu) != 0);
    *k = c < 0 ? 0 : c > 7 ? 7 : c;
    return e_ref;
}

static inline int k3_search_best(const k3_search_args *a, const uint32_t *acc) {
    int best = 0;
    for (int l = 1; l < a->ncand; l++)
        if (acc[l] < acc[best]) best = l;
    return best;
}

static inline float k3_search_scale(const k3_search_args *a, int k, int best, int e_ref) {
    uint32_t ub = (uint32_t)e_ref << 23; /* 2**(e_ref - 127): e_ref in [lo, hi], normal */
    float unit;
    memcpy(&unit, &ub, 4);
    return a->rel[k * a->ncand + best] * unit;
}

static int64_t k3_search_generic(const k3_search_args *a, int64_t lo, int64_t hi) {
    int64_t bad = 0, sub = a->sub;
    uint8_t m[4];
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *s = a->src + 16 * sub * g, *e = a->codes + sub * g;
        uint8_t *o = a->out + 16 * sub * g;
        for (int64_t j = 0; j < sub; j++) {
            uint8_t mj = 0;
            for (int q = 0; q < 16; q++) {
                uint8_t l = s[16 * j + q] & 7, h = (s[16 * j + q] >> 4) & 7;
                uint8_t b = l > h ? l : h;
                mj = b > mj ? b : mj;
            }
            m[j] = mj;
        }
        int k, e_ref = k3_search_class(a, e, m, sub, &k, &bad);
        if (e_ref < 0) {
            memset(o, a->zero_byte, (size_t)(16 * sub));
            a->scale[g] = a->zero_scale;
            continue;
        }
        uint32_t acc[16] = {0};
        for (int64_t j = 0; j < sub; j++) {
            int d = e_ref - e[j];
            if (!m[j] || d > a->depth) continue;
            const uint32_t *t = a->err + ((int64_t)(k * (a->depth + 1) + d) << 12);
            for (int q = 0; q < 16; q++) {
                const uint32_t *r = t + 16 * (int)s[16 * j + q];
                for (int l = 0; l < 16; l++) acc[l] += r[l];
            }
        }
        int best = k3_search_best(a, acc);
        const uint8_t *nb = a->nibs + (int64_t)(k * a->ncand + best) * (a->depth + 2) * 16;
        for (int64_t j = 0; j < sub; j++) {
            int d = e_ref - e[j];
            const uint8_t *map = nb + 16 * (m[j] && d <= a->depth ? d : a->depth + 1);
            for (int q = 0; q < 16; q++) o[16 * j + q] = k3_nib(map, s[16 * j + q]);
        }
        a->scale[g] = k3_search_scale(a, k, best, e_ref);
        if (a->loss) k3_search_loss(a, g, s, e, m, k, best, e_ref, acc[best], 0);
    }
    return bad;
}

#ifdef K3_HAVE_NIB_SIMD
/* the first smallest of lanes v0 | v1 (lanes at or past ncand raised to all ones by pad) */
__attribute__((target("avx2"))) static inline int k3_first_min(__m256i v0, __m256i v1,
                                                               __m256i pad0, __m256i pad1) {
    v0 = _mm256_or_si256(v0, pad0);
    v1 = _mm256_or_si256(v1, pad1);
    __m256i mn = _mm256_min_epu32(v0, v1);
    mn = _mm256_min_epu32(mn, _mm256_permute2x128_si256(mn, mn, 1));
    mn = _mm256_min_epu32(mn, _mm256_shuffle_epi32(mn, _MM_SHUFFLE(1, 0, 3, 2)));
    mn = _mm256_min_epu32(mn, _mm256_shuffle_epi32(mn, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t e0 = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v0, mn)));
    uint32_t e1 = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v1, mn)));
    return __builtin_ctz(e0 | e1 << 8);
}

/* lane l of the 16 sums v0 | v1 */
__attribute__((target("avx2"))) static inline uint32_t k3_lane(__m256i v0, __m256i v1, int l) {
    uint32_t acc[16];
    _mm256_storeu_si256((__m256i *)acc, v0);
    _mm256_storeu_si256((__m256i *)(acc + 8), v1);
    return acc[l];
}

/* one MX group per int group (g = 32): d is 0, the class follows from m alone */
__attribute__((target("avx2"))) static int64_t k3_search1_avx2(const k3_search_args *a,
                                                              int64_t lo, int64_t hi,
                                                              __m256i pad0, __m256i pad1) {
    static const int8_t cls_of_m[8] = {0, 0, 2, 3, 4, 5, 6, 7}; /* e2m1(m): 0.5 .. 6 */
    int64_t bad = 0;
    const int nc = a->ncand, rows = a->depth + 2;
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *s = a->src + 16 * g;
        int e = a->codes[g], m = (int)k3_max1x16(s);
        if (!m) {
            memset(a->out + 16 * g, a->zero_byte, 16);
            a->scale[g] = a->zero_scale;
            continue;
        }
        bad += (e < a->lo) | (e > a->hi);
        int k = cls_of_m[m];
        const uint32_t *t = a->err + ((int64_t)k * (a->depth + 1) << 12);
        __m256i v0 = _mm256_setzero_si256(), v1 = _mm256_setzero_si256();
        for (int q = 0; q < 16; q++) {
            const __m256i *r = (const __m256i *)(t + 16 * (int)s[q]);
            v0 = _mm256_add_epi32(v0, _mm256_loadu_si256(r));
            v1 = _mm256_add_epi32(v1, _mm256_loadu_si256(r + 1));
        }
        int best = k3_first_min(v0, v1, pad0, pad1);
        __m128i mm = _mm_loadu_si128((const __m128i *)(a->nibs + (int64_t)(k * nc + best) * rows * 16));
        __m128i v = _mm_loadu_si128((const __m128i *)s);
        _mm_storeu_si128((__m128i *)(a->out + 16 * g), k3_nib16(v, mm, mm));
        a->scale[g] = k3_search_scale(a, k, best, e);
        if (a->loss) {
            uint8_t m1 = (uint8_t)m, e1 = (uint8_t)e;
            k3_search_loss(a, g, s, &e1, &m1, k, best, e, k3_lane(v0, v1, best), 1);
        }
    }
    return bad;
}

/* the same per group: maxima and output bytes by byte shuffles, the 16 candidate sums in
 * two 8-lane vectors */
__attribute__((target("avx2"))) static int64_t k3_search_avx2(const k3_search_args *a,
                                                             int64_t lo, int64_t hi) {
    int64_t bad = 0, sub = a->sub;
    uint8_t m[4];
    /* lanes at or past ncand: all ones, never below a real sum (every sum < 2**32 - 1) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i nc = _mm256_set1_epi32(a->ncand);
    const __m256i pad0 = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(1)), nc);
    const __m256i pad1 = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(9)), nc);
    if (sub == 1) return k3_search1_avx2(a, lo, hi, pad0, pad1);
    for (int64_t g = lo; g < hi; g++) {
        const uint8_t *s = a->src + 16 * sub * g, *e = a->codes + sub * g;
        uint8_t *o = a->out + 16 * sub * g;
        for (int64_t j = 0; j < sub; j++) m[j] = (uint8_t)k3_max1x16(s + 16 * j);
        int k, e_ref = k3_search_class(a, e, m, sub, &k, &bad);
        if (e_ref < 0) {
            memset(o, a->zero_byte, (size_t)(16 * sub));
            a->scale[g] = a->zero_scale;
            continue;
        }
        __m256i v0 = _mm256_setzero_si256(), v1 = _mm256_setzero_si256();
        for (int64_t j = 0; j < sub; j++) {
            int d = e_ref - e[j];
            if (!m[j] || d > a->depth) continue;
            const uint32_t *t = a->err + ((int64_t)(k * (a->depth + 1) + d) << 12);
            for (int q = 0; q < 16; q++) {
                const __m256i *r = (const __m256i *)(t + 16 * (int)s[16 * j + q]);
                v0 = _mm256_add_epi32(v0, _mm256_loadu_si256(r));
                v1 = _mm256_add_epi32(v1, _mm256_loadu_si256(r + 1));
            }
        }
        int best = k3_first_min(v0, v1, pad0, pad1);
        const uint8_t *nb = a->nibs + (int64_t)(k * a->ncand + best) * (a->depth + 2) * 16;
        for (int64_t j = 0; j < sub; j++) {
            int d = e_ref - e[j];
            __m128i mm = _mm_loadu_si128(
                (const __m128i *)(nb + 16 * (m[j] && d <= a->depth ? d : a->depth + 1)));
            __m128i v = _mm_loadu_si128((const __m128i *)(s + 16 * j));
            _mm_storeu_si128((__m128i *)(o + 16 * j), k3_nib16(v, mm, mm));
        }
        a->scale[g] = k3_search_scale(a, k, best, e_ref);
        if (a->loss) k3_search_loss(a, g, s, e, m, k, best, e_ref, k3_lane(v0, v1, best), 1);
    }
    return bad;
}
#endif

static int64_t k3_mx_int4_search_body(const void *c, int64_t lo, int64_t hi) {
    const k3_search_args *a = (const k3_search_args *)c;
#ifdef K3_HAVE_NIB_SIMD
    if (a->simd && __builtin_cpu_supports("avx2")) return k3_search_avx2(a, lo, hi);
#endif
    return k3_search_generic(a, lo, hi);
}

/* groups int groups of sub (1..4) MX groups; ncand <= 16; vals: float32 [8] e2m1 */
/* loss: NULL, or float64 [ceil(groups / chunk)][5] zeroed by the caller, filled by
 * k3_search_loss from ltab, sq16 (uint8 [16]) and lval; the threads' ranges are whole chunks, so the totals do not
 * depend on the thread count */
int64_t k3_mx_int4_search(const uint8_t *src, const uint8_t *codes, int64_t groups,
                          int64_t sub, int depth, const uint32_t *err, const uint8_t *nibs,
                          int ncand, const float *rel, const float *vals, float zero_scale,
                          int zero_byte, int lo, int hi, uint8_t *out, float *scale,
                          const uint8_t *ltab, const uint8_t *sq16, const float *lval,
                          double *loss, int64_t chunk, int simd, int nthreads) {
    k3_search_args a = {src, codes, nibs, ltab, sq16, err, (const uint32_t *)vals, rel, lval,
                        out, scale,
                        loss, sub < 1 ? 1 : sub > 4 ? 4 : sub, chunk < 1 ? 1 : chunk, depth,
                        ncand, lo, hi, simd, zero_scale, (uint8_t)zero_byte};
    return k3_parallel(k3_mx_int4_search_body, &a, groups, loss ? a.chunk : 1, nthreads);
}

/* -- FP4 -> bfloat16 / float32 through the tensor's nibble table ----------------------
 * MXFP4 (one E8M0 code per 16 bytes) and NVFP4 (one e4m3 code per 8 bytes): lut row c
 * holds the 16 outputs of the 16 E2M1 nibbles under scale byte c, the reference's own
 * values (computed by torch once per dtype, or per global scale), so every output is a
 * copy of a table entry: the reference's bits whatever the scale (NaN, overflow,
 * subnormal). bfloat16: per code 16 low bytes then 16 high bytes (byte shuffles give 32
 * values at a time); float32: per code 16 words (two 8-word permutes and a blend give 8).
 * per: the bytes under one code, 8 or 16. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_HAVE_AVX2_PATH 1
#endif

/* ``want`` (0 portable, 1 AVX2, 2 AVX-512 BW + VBMI) capped at what this CPU runs */
static int k3_level(int want) {
#ifdef K3_HAVE_AVX2_PATH
    if (want >= 2 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi"))
        return 2;
    return want >= 1 && __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    (void)want;
    return 0;
#endif
}

static inline void k3_lut_bf16_8(const uint8_t *s, const uint8_t *t, uint16_t *o) {
    for (int k = 0; k < 8; k++) {
        uint8_t lo = s[k] & 15, hi = s[k] >> 4;
        o[2 * k] = (uint16_t)(t[lo] | (t[16 + lo] << 8));
        o[2 * k + 1] = (uint16_t)(t[hi] | (t[16 + hi] << 8));
    }
}

static void k3_lut_bf16_generic_1(const uint8_t *restrict src, const uint8_t *restrict codes,
                                  int64_t groups, int64_t per, const uint8_t *restrict lut,
                                  uint16_t *restrict out) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t h = 0; h < per; h += 8)
            k3_lut_bf16_8(src + per * g + h, lut + 32 * (int64_t)codes[g], out + 2 * (per * g + h));
}

static void k3_lut_f32_generic_1(const uint8_t *restrict src, const uint8_t *restrict codes,
                                 int64_t groups, int64_t per, const uint32_t *restrict lut,
                                 uint32_t *restrict out) {
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *s = src + per * g;
        const uint32_t *t = lut + 16 * (int64_t)codes[g];
        uint32_t *o = out + 2 * per * g;
        for (int64_t k = 0; k < per; k++) {
            o[2 * k] = t[s[k] & 15];
            o[2 * k + 1] = t[s[k] >> 4];
        }
    }
}

#ifdef K3_HAVE_AVX2_PATH
/* the nibbles of 16 bytes as bytes, from 16-bit words each holding one source byte:
 * (w | w << 4) & 0x0F0F puts its low nibble in the word's low byte, its high in the high */
#define K3_NIBBLES(w) \
    _mm256_and_si256(_mm256_or_si256((w), _mm256_slli_epi16((w), 4)), _mm256_set1_epi16(0x0F0F))

__attribute__((target("avx2"))) static inline void k3_store2(__m256i *o, __m256i a, __m256i b,
                                                              int stream) {
    if (stream) { /* the output is 4x the stored bytes and larger than the caches: streaming
                   * stores skip reading every destination line first */
        _mm256_stream_si256(o, a);
        _mm256_stream_si256(o + 1, b);
    } else {
        _mm256_storeu_si256(o, a);
        _mm256_storeu_si256(o + 1, b);
    }
}

/* MXFP4: one code per 16 bytes (32 values, 64 output bytes) per step. The source bytes go
 * into the words of each lane in the order (0..3, 8..11 | 4..7, 12..15), so the low /
 * high byte shuffles and one unpack each give values 0..15 and 16..31 in place: five
 * shuffles and three logic ops per 32 values, no cross-lane fix-up */
__attribute__((target("avx2"))) static void k3_lut16_bf16_avx2_1(
    const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups,
    const uint8_t *restrict lut, uint16_t *restrict out) {
    const __m256i order = _mm256_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 8, -1, 9, -1, 10, -1, 11,
                                           -1, 4, -1, 5, -1, 6, -1, 7, -1, 12, -1, 13, -1, 14,
                                           -1, 15, -1);
    int stream = ((uintptr_t)out & 31) == 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *t = lut + 32 * (int64_t)codes[g];
        __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
        __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16)));
        __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(src + 16 * g)));
        __m256i n = K3_NIBBLES(_mm256_shuffle_epi8(x, order));
        __m256i l = _mm256_shuffle_epi8(tl, n), h = _mm256_shuffle_epi8(th, n);
        k3_store2((__m256i *)(out + 32 * g), _mm256_unpacklo_epi8(l, h),
                  _mm256_unpackhi_epi8(l, h), stream);
    }
    if (stream) _mm_sfence();
}

/* NVFP4: two codes (16 bytes, 32 values) per step, lane 0 under the first code's table and
 * lane 1 under the second's, then the lanes' halves put back in order */
__attribute__((target("avx2"))) static void k3_lut8_bf16_avx2_1(
    const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups,
    const uint8_t *restrict lut, uint16_t *restrict out) {
    int stream = ((uintptr_t)out & 31) == 0;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        const uint8_t *ta = lut + 32 * (int64_t)codes[g], *tb = lut + 32 * (int64_t)codes[g + 1];
        __m256i tl = _mm256_loadu2_m128i((const __m128i *)tb, (const __m128i *)ta);
        __m256i th = _mm256_loadu2_m128i((const __m128i *)(tb + 16), (const __m128i *)(ta + 16));
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + 8 * g)));
        __m256i n = K3_NIBBLES(w);
        __m256i l = _mm256_shuffle_epi8(tl, n), h = _mm256_shuffle_epi8(th, n);
        __m256i lo = _mm256_unpacklo_epi8(l, h), hi = _mm256_unpackhi_epi8(l, h);
        k3_store2((__m256i *)(out + 16 * g), _mm256_permute2x128_si256(lo, hi, 0x20),
                  _mm256_permute2x128_si256(lo, hi, 0x31), stream);
    }
    if (stream) _mm_sfence();
    if (g < groups) k3_lut_bf16_8(src + 8 * g, lut + 32 * (int64_t)codes[g], out + 16 * g);
}

/* float32: 8 bytes (16 values) through one code's table per step */
__attribute__((target("avx2"))) static void k3_lut_f32_avx2_1(
    const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups, int64_t per,
    const uint32_t *restrict lut, uint32_t *restrict out) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    int stream = ((uintptr_t)out & 31) == 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *t = lut + 16 * (int64_t)codes[g];
        __m256 tl = _mm256_loadu_ps((const float *)t), th = _mm256_loadu_ps((const float *)t + 8);
        for (int64_t q = 0; q < per; q += 8) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(src + per * g + q));
            __m128i n = _mm_unpacklo_epi8(_mm_and_si128(v, m4),
                                          _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            __m256i i0 = _mm256_cvtepu8_epi32(n), i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(n, 8));
            /* entries 0..7 or 8..15 by bit 3 of the nibble (moved to the sign bit) */
            __m256 r0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tl, i0),
                                         _mm256_permutevar8x32_ps(th, i0),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
            __m256 r1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tl, i1),
                                         _mm256_permutevar8x32_ps(th, i1),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)));
            float *o = (float *)(out + 2 * (per * g + q));
            if (stream) {
                _mm256_stream_ps(o, r0);
                _mm256_stream_ps(o + 8, r1);
            } else {
                _mm256_storeu_ps(o, r0);
                _mm256_storeu_ps(o + 8, r1);
            }
        }
    }
    if (stream) _mm_sfence();
}

/* AVX-512 (BW + VBMI): 32 values (16 stored bytes, 64 output bytes) per step through one
 * byte permute over a 64-byte table holding the step's two 32-byte tables (NVFP4: its two
 * groups' codes; MXFP4: its one code twice). Output byte p is table byte
 * (p >> 5) << 5 | (p & 1) << 4 | nibble(value p >> 1): a first permute puts each stored
 * byte under the four output bytes of its two values, a per-word shift brings the odd
 * value's (high) nibble down, and one ternary-logic op masks it and adds the table
 * offsets. Two permutes, a shift and a mask per 32 values, the output already in order
 * (the AVX2 NVFP4 loop needs two lane permutes more). */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void k3_lut_bf16_vbmi_1(
    const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups, int64_t per,
    const uint8_t *restrict lut, uint16_t *restrict out) {
    uint8_t rep[64], off[64];
    uint16_t shift[32];
    for (int p = 0; p < 64; p++) {
        rep[p] = (uint8_t)(p >> 2);
        off[p] = (uint8_t)(((p >> 5) << 5) | ((p & 1) << 4));
    }
    for (int w = 0; w < 32; w++) shift[w] = (uint16_t)(4 * (w & 1));
    const __m512i vrep = _mm512_loadu_si512(rep), voff = _mm512_loadu_si512(off);
    const __m512i vshift = _mm512_loadu_si512(shift), m4 = _mm512_set1_epi8(0x0F);
    int64_t steps = groups * per / 16; /* NVFP4: pairs of groups; MXFP4: groups */
    int stream = ((uintptr_t)out & 63) == 0; /* as k3_store2: streaming stores (measured
                                               * faster here than plain ones, 22 MB outputs) */
    for (int64_t k = 0; k < steps; k++) {
        const uint8_t *ta = lut + 32 * (int64_t)codes[per == 8 ? 2 * k : k];
        const uint8_t *tb = per == 8 ? lut + 32 * (int64_t)codes[2 * k + 1] : ta;
        __m512i tab = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)ta)),
            _mm256_loadu_si256((const __m256i *)tb), 1);
        __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + 16 * k)));
        __m512i n = _mm512_srlv_epi16(_mm512_permutexvar_epi8(vrep, x), vshift);
        __m512i v = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(n, m4, voff, 0xEA), tab);
        if (stream)
            _mm512_stream_si512((__m512i *)(out + 32 * k), v);
        else
            _mm512_storeu_si512((__m512i *)(out + 32 * k), v);
    }
    if (stream) _mm_sfence();
    if (steps * 16 < groups * per) /* an NVFP4 range's last group without its pair */
        k3_lut_bf16_8(src + 16 * steps, lut + 32 * (int64_t)codes[2 * steps], out + 32 * steps);
}
#endif

/* -- the exported kernels: the loops above over nthreads contiguous ranges ----------- */
typedef struct {
    const void *src, *key, *table; /* as each kernel names them */
    void *out;
    int64_t per;
    int flag;
} k3_args;

#define K3_GATHER(NAME, T)                                                              \
    static int64_t NAME##_body(const void *c, int64_t lo, int64_t hi) {                 \
        const k3_args *a = (const k3_args *)c;                                          \
        NAME##_1((const uint8_t *)a->src + lo * a->per, (const int32_t *)a->key + lo,   \
                 hi - lo, a->per, (const T *)a->table, (T *)a->out + lo * a->per);      \
        return 0;                                                                       \
    }                                                                                   \
    void NAME(const uint8_t *src, const int32_t *key, int64_t groups, int64_t per,      \
              const T *table, T *out, int nthreads) {                                   \
        k3_args a = {src, key, table, out, per, 0};                   \
        k3_parallel(NAME##_body, &a, groups, 1, nthreads);                              \
    }
K3_GATHER(k3_gather_u8, uint8_t)
K3_GATHER(k3_gather_u32, uint32_t)
K3_GATHER(k3_gather_u64, uint64_t)

/* ranges of whole 256-group blocks: the loop's own blocking (and pairs at per 8) */
static int64_t k3_max_codes_body(const void *c, int64_t lo, int64_t hi) {
    const k3_args *a = (const k3_args *)c;
    k3_max_codes_1((const uint8_t *)a->src + lo * a->per, hi - lo, a->per,
                   (uint8_t *)a->out + lo, a->flag);
    return 0;
}
void k3_max_codes(const uint8_t *restrict src, int64_t groups, int64_t per,
                  uint8_t *restrict out, int simd, int nthreads) {
    k3_args a = {src, NULL, NULL, out, per, simd};
    k3_parallel(k3_max_codes_body, &a, groups, 256, nthreads);
}

static int64_t k3_gather_nib_body(const void *c, int64_t lo, int64_t hi) {
    const k3_args *a = (const k3_args *)c;
    k3_gather_nib_1((const uint8_t *)a->src + 16 * lo, (const int32_t *)a->key + lo, hi - lo,
                    (const uint8_t *)a->table, (uint8_t *)a->out + 16 * lo, a->flag);
    return 0;
}
void k3_gather_nib(const uint8_t *restrict src, const int32_t *restrict key, int64_t groups,
                   const uint8_t *restrict map, uint8_t *restrict out, int simd,
                   int nthreads) {
    k3_args a = {src, key, map, out, 16, simd};
    k3_parallel(k3_gather_nib_body, &a, groups, 1, nthreads);
}

/* FP4 -> one byte per value through the low bytes of a bfloat16 decode table (the FP8
 * re-encode: each row's 16 low bytes are e4m3 bytes): [groups x per] -> [groups x 2 per] */
static void k3_lut_u8_generic_1(const uint8_t *restrict src, const uint8_t *restrict codes,
                                int64_t groups, int64_t per, const uint8_t *restrict lut,
                                uint8_t *restrict out) {
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *s = src + per * g, *t = lut + 32 * (int64_t)codes[g];
        uint8_t *o = out + 2 * per * g;
        for (int64_t k = 0; k < per; k++) {
            o[2 * k] = t[s[k] & 15];
            o[2 * k + 1] = t[s[k] >> 4];
        }
    }
}

#ifdef K3_HAVE_AVX2_PATH
/* MXFP4 (16 bytes a group): the low and the high nibbles through the group's 16 bytes,
 * interleaved back into value order */
__attribute__((target("avx2"))) static void k3_lut16_u8_avx2_1(
    const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups,
    const uint8_t *restrict lut, uint8_t *restrict out) {
    const __m128i m = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        __m128i t = _mm_loadu_si128((const __m128i *)(lut + 32 * (int64_t)codes[g]));
        __m128i v = _mm_loadu_si128((const __m128i *)(src + 16 * g));
        __m128i l = _mm_shuffle_epi8(t, _mm_and_si128(v, m));
        __m128i h = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m));
        _mm_storeu_si128((__m128i *)(out + 32 * g), _mm_unpacklo_epi8(l, h));
        _mm_storeu_si128((__m128i *)(out + 32 * g + 16), _mm_unpackhi_epi8(l, h));
    }
}
#endif

/* MXFP4 -> FP8 blocks with power-of-two scales, in one pass per band of b0 rows
 * (k3convert/quant/fp4_requant.py: _fp8_bytes has the derivation; its torch steps are the
 * reference). Per block (b0 rows x sub MX groups): eb, the largest code + exponent of the
 * group's largest magnitude code (m > 0) - the block maximum's exponent, biased; no such
 * group: a zero block. A nonzero block with eb - 127 outside [-118, 135] declines the
 * whole tensor (K3_FP8_DECLINE added to the return: the caller takes the float path);
 * e_out[block] = eb - 127 (zero block: -118). Every MX group's key, clamp(code - e + 8,
 * 0, 255), picks the e4m3 bytes of its values from lut (row key's first 16 bytes), and a
 * group whose m is above top[key] (the largest code the key holds exactly) is counted:
 * the return is that count (0: every value exact). */
#define K3_FP8_DECLINE ((int64_t)1 << 40)
typedef struct {
    const uint8_t *src, *codes, *lut, *top;
    uint8_t *out, *scratch;
    int16_t *e_out;
    int64_t gpr, b0, sub; /* MX groups a row, rows a block, MX groups a block */
    int simd;
} k3_fp8_args;

static const int8_t K3_EXP_OF_M[8] = {0, -1, 0, 0, 1, 1, 2, 2};

/* one band: the groups' largest magnitude codes, the blocks' exponents, the keys (into
 * the codes' place in buf), then one decode call for the whole band */
static int64_t k3_fp8_band(const k3_fp8_args *a, int64_t band, uint8_t *mbuf, uint8_t *kbuf) {
    int64_t gpr = a->gpr, b0 = a->b0, sub = a->sub, nb = gpr / sub, n = gpr * b0, miss = 0;
    const uint8_t *s = a->src + 16 * n * band, *e = a->codes + n * band;
    int16_t *eo = a->e_out + nb * band;
    k3_max_codes_1(s, n, 16, mbuf, a->simd);
    for (int64_t b = 0; b < nb; b++) eo[b] = -1000; /* biased; -1000: no value yet */
    for (int64_t r = 0, i = 0; r < b0; r++) /* i = r * gpr + b * sub + j, no division */
        for (int64_t b = 0; b < nb; b++) {
            int t = eo[b];
            for (int64_t j = 0; j < sub; j++, i++) {
                int v = mbuf[i] ? (int)e[i] + K3_EXP_OF_M[mbuf[i] & 7] : -1000;
                t = v > t ? v : t;
            }
            eo[b] = (int16_t)t;
        }
    int declined = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (eo[b] == -1000) {
            eo[b] = -118; /* a zero block: scale 2**-126, as the float path */
        } else {
            eo[b] -= 127;
            declined |= eo[b] < -118 || eo[b] > 135;
        }
    }
    if (declined) return K3_FP8_DECLINE;
    for (int64_t r = 0, i = 0; r < b0; r++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t j = 0; j < sub; j++, i++) {
                int key = (int)e[i] - eo[b] + 8;
                key = key < 0 ? 0 : key > 255 ? 255 : key;
                kbuf[i] = (uint8_t)key;
                miss += mbuf[i] > a->top[key];
            }
    uint8_t *o = a->out + 32 * n * band;
#ifdef K3_HAVE_AVX2_PATH
    if (k3_level(a->simd) >= 1) {
        k3_lut16_u8_avx2_1(s, kbuf, n, a->lut, o);
        return miss;
    }
#endif
    k3_lut_u8_generic_1(s, kbuf, n, 16, a->lut, o);
    return miss;
}

static int64_t k3_mx_fp8_block_body(const void *c, int64_t lo, int64_t hi) {
    const k3_fp8_args *a = (const k3_fp8_args *)c;
    int64_t n = a->gpr * a->b0, miss = 0;
    for (int64_t band = lo; band < hi; band++) {
        uint8_t *buf = a->scratch + 2 * n * band; /* the band's own: no allocation */
        int64_t r = k3_fp8_band(a, band, buf, buf + n);
        if (r >= K3_FP8_DECLINE) return K3_FP8_DECLINE;
        miss += r;
    }
    return miss;
}

/* src uint8 [bands * b0 rows x 16 gpr], codes uint8 [bands * b0 x gpr] (gpr a multiple of
 * sub), lut uint8 [256 x 32], top uint8 [256] -> out uint8 [rows x 32 gpr], e_out int16
 * [bands x gpr / sub]; scratch uint8 [2 x rows x gpr] (each group's largest code and
 * key); simd: the widest ISA level */
int64_t k3_mx_fp8_block(const uint8_t *src, const uint8_t *codes, int64_t bands, int64_t b0,
                        int64_t gpr, int64_t sub, const uint8_t *lut, const uint8_t *top,
                        uint8_t *out, int16_t *e_out, uint8_t *scratch, int simd,
                        int nthreads) {
    k3_fp8_args a = {src, codes, lut, top, out, scratch, e_out, gpr, b0, sub, simd};
    return k3_parallel(k3_mx_fp8_block_body, &a, bands, 1, nthreads);
}

/* flag bit 0: bfloat16 out (else float32); bits 2-3: the widest vector ISA a loop may use
 * (0 the portable loop, 1 AVX2, 2 AVX-512 BW + VBMI), taken where the CPU has it */
static int64_t k3_fp4_lut_body(const void *c, int64_t lo, int64_t hi) {
    const k3_args *a = (const k3_args *)c;
    int64_t per = a->per;
    const uint8_t *s = (const uint8_t *)a->src + per * lo, *e = (const uint8_t *)a->key + lo;
    int bf16 = a->flag & 1, level = k3_level(a->flag >> 2);
    if (bf16) {
        uint16_t *o = (uint16_t *)a->out + 2 * per * lo;
#ifdef K3_HAVE_AVX2_PATH
        if (level >= 2 && (per == 8 || per == 16)) {
            k3_lut_bf16_vbmi_1(s, e, hi - lo, per, (const uint8_t *)a->table, o);
            return 0;
        }
        if (level >= 1 && per == 16) {
            k3_lut16_bf16_avx2_1(s, e, hi - lo, (const uint8_t *)a->table, o);
            return 0;
        }
        if (level >= 1 && per == 8) {
            k3_lut8_bf16_avx2_1(s, e, hi - lo, (const uint8_t *)a->table, o);
            return 0;
        }
#endif
        k3_lut_bf16_generic_1(s, e, hi - lo, per, (const uint8_t *)a->table, o);
    } else {
        uint32_t *o = (uint32_t *)a->out + 2 * per * lo;
#ifdef K3_HAVE_AVX2_PATH
        if (level >= 1) {
            k3_lut_f32_avx2_1(s, e, hi - lo, per, (const uint32_t *)a->table, o);
            return 0;
        }
#endif
        k3_lut_f32_generic_1(s, e, hi - lo, per, (const uint32_t *)a->table, o);
    }
    return 0;
}
/* FP4 [groups x per bytes] (per 8: NVFP4, 16: MXFP4), one scale byte per group ->
 * bfloat16 [groups x 2 per]; lut: uint8 [256 x (16 low bytes, 16 high bytes)]; simd: the
 * widest ISA level to use (see k3_fp4_lut_body) */
void k3_fp4_lut_bf16(const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups,
                     int64_t per, const uint8_t *restrict lut, uint16_t *restrict out, int simd,
                     int nthreads) {
    k3_args a = {src, codes, lut, out, per, 1 | (simd << 2)};
    k3_parallel(k3_fp4_lut_body, &a, groups, per == 8 ? 2 : 1, nthreads);
}
/* the same to float32; lut: uint32 [256 x 16] float32 bits */
void k3_fp4_lut_f32(const uint8_t *restrict src, const uint8_t *restrict codes, int64_t groups,
                    int64_t per, const uint32_t *restrict lut, uint32_t *restrict out, int simd,
                    int nthreads) {
    k3_args a = {src, codes, lut, out, per, simd << 2};
    k3_parallel(k3_fp4_lut_body, &a, groups, 1, nthreads);
}

/* the ABI version the loader checks (bumped with any signature change) */
int k3_fp4_kernels_version(void) { return 23; }

/* the widest vector ISA level this CPU runs (0 portable, 1 AVX2, 2 AVX-512 BW + VBMI) */
int k3_fp4_simd_level(void) { return k3_level(2); }
