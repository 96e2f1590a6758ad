/*
 * Shared by the native quantizers (quant.c and fp8_vec.h: FP8 formats; fourbit.c: 4-bit formats): float32
 * / bfloat16 bits, c10's float32 -> e4m3fn conversion, the exact E8M0 multiplier, a row's amax, the bf16
 * threshold where a monotone test of a scaled value starts to hold (first_passing), blocks' maxima, and the
 * scale groups' pipeline (run_groups: FP8 per-tensor's and NVFP4's groups). See quant.c's header for the
 * build and the conventions.
 */

#ifndef REFITD_NATIVE_COMMON_H
#define REFITD_NATIVE_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define FP8_MAX 448.0f
#define MAG_MASK 0x7FFFu
#define BF16_NONFINITE 0x7F80u /* sign-cleared bf16 bits >= this are Inf or NaN */
#define NEVER 0x7F80u          /* a threshold no finite bf16 reaches */

typedef int64_t i64;

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

static inline float fabsf_bits(float f) { return f32_from_bits(f32_bits(f) & UINT32_C(0x7FFFFFFF)); }

/* c10::detail::fp8e4m3fn_from_fp32_value, branch-free: the full function, for any float32. */
static inline uint8_t e4m3_from_f32(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20;    /* 480.0f: first value past e4m3fn's range */
    const uint32_t denorm_mask = UINT32_C(141) << 23; /* ((127 - 7) + (23 - 3) + 1) */
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    /* below 2^-6 (e4m3fn's smallest normal): round by a float add of 2^14, as c10 does */
    const uint32_t denorm = f32_bits(f32_from_bits(bits) + f32_from_bits(denorm_mask)) - denorm_mask;
    /* normal: rebias the exponent and round to nearest even on the bits */
    const uint32_t mant_odd = (bits >> 20) & 1u;
    const uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF) + mant_odd) >> 20;
    uint32_t r = bits < (UINT32_C(121) << 23) ? (denorm & 0xFFu) : (normal & 0xFFu);
    r = r == 0x7Fu ? 0x7Eu : r; /* rounding carried into the NaN pattern: saturate */
    const uint32_t big = bits > UINT32_C(0x7F800000) ? 0x7Fu : 0x7Eu;
    r = bits >= fp8_max ? big : r;
    return (uint8_t)(r | (sign >> 24));
}

/* The same function for |f| < 464, all the quantizers ever convert (every scaled value is at most
   448 * (1 + 2^-22), or clamped to 448). There c10's overflow and NaN branches never apply, and
   rounding cannot carry into 0x7F (that needs |f| >= 464), so two of its selects go: gcc's vector
   code is about twice as fast. tests/test_native_quant.py checks it against torch's cast. */
static inline uint8_t e4m3_from_f32_in_range(float f) {
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    const uint32_t denorm = f32_bits(f32_from_bits(bits) + f32_from_bits(denorm_mask)) - denorm_mask;
    const uint32_t mant_odd = (bits >> 20) & 1u;
    const uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF) + mant_odd) >> 20;
    const uint32_t r = bits < (UINT32_C(121) << 23) ? denorm : normal;
    return (uint8_t)(r | (sign >> 24));
}

#if defined(__AVX512F__)
/* e4m3_from_f32_in_range's two branches on sixteen positive float32 lanes (fp8_vec.h's FP8 conversions,
   fourbit.c's NVFP4 scales). c10's normal branch on the bits (valid for 2^-6 <= v < 464): rebias, round to
   nearest even */
static inline __m512i e4m3_normal(__m512i bits) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    const __m512i rebias = _mm512_set1_epi32((int32_t)(UINT32_C(0xC4000000) + UINT32_C(0x7FFFF)));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, rebias), odd), 20);
}

/* c10's subnormal branch (v < 2^-6): v + 2^14 rounds v to a multiple of 2^-9 */
static inline __m512i e4m3_subnormal(__m512 v) {
    const __m512i denorm_mask = _mm512_set1_epi32((int32_t)(UINT32_C(141) << 23));
    return _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(v, _mm512_castsi512_ps(denorm_mask))), denorm_mask);
}
#endif

/* exact float32 2^(127 - byte) for byte in [1, 254]; 2^-127 is a subnormal */
static inline float e8m0_multiplier(uint32_t byte) {
    const int32_t exponent = 127 - (int32_t)byte;
    return exponent == -127 ? f32_from_bits(UINT32_C(1) << 22) : f32_from_bits((uint32_t)(exponent + 127) << 23);
}

static inline uint32_t row_amax_bits(const uint16_t *restrict x, i64 len) {
    uint16_t m = 0;
    for (i64 t = 0; t < len; t++) {
        const uint16_t v = x[t] & MAG_MASK;
        m = v > m ? v : m;
    }
    return m;
}

/* out[i] = max(in[2i] & mask, in[2i + 1] & mask): one level of a tree of maxima */
static inline void pair_max(const uint16_t *restrict in, uint16_t *restrict out, i64 n_out, uint16_t mask) {
    for (i64 i = 0; i < n_out; i++) {
        const uint16_t a = in[2 * i] & mask, b = in[2 * i + 1] & mask;
        out[i] = a > b ? a : b;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* thresholds: where a monotone test of RN(|x| op d) starts to hold, as sign-cleared bf16 bits       */

/* whether RN(a op d) passes the test (at, strict): v > at if strict, else v >= at */
static inline int passes(uint32_t a, float d, int multiply, float at, int strict) {
    const float x = bf16_to_f32((uint16_t)a);
    const float v = multiply ? x * d : x / d; /* the reference's very float32 operation */
    return strict ? v > at : v >= at;
}

/* The smallest sign-cleared bf16 a for which RN(a op d) passes (at, strict); NEVER where no finite a does.
   d > 0, or d == 0 for a division (RN(a / 0) is Inf for a > 0 and NaN, failing every test, for a = 0).
   Starts at the bf16 at or below at * d (at / d), which is within a step or two, and steps to the exact
   threshold; one more than four steps away is found by a binary search over all finite bf16. */
static inline uint32_t first_passing(float d, int multiply, float at, int strict) {
    const float guess = multiply ? at / d : at * d;
    uint32_t a = f32_bits(guess) >> 16, steps = 0;
    a = a > NEVER ? NEVER : a; /* Inf, NaN (never for d > 0) */
    while (a > 0 && steps < 4 && passes(a - 1, d, multiply, at, strict)) a--, steps++;
    while (a < NEVER && steps < 4 && !passes(a, d, multiply, at, strict)) a++, steps++;
    if (steps == 4) {
        uint32_t lo = 0, hi = NEVER;
        while (lo < hi) {
            const uint32_t mid = (lo + hi) / 2;
            if (passes(mid, d, multiply, at, strict)) hi = mid;
            else lo = mid + 1;
        }
        a = lo;
    }
    return a;
}

/* ---------------------------------------------------------------------------------------------- */
/* block maxima                                                                                   */

/* float32 bits of the amax of each of m blocks of 16 * vecs elements of x (bf16), into out[0..m).
   With AVX2, eight blocks at a time: each block's vectors folded into one, then a transposing tree
   (blocks i and i + 4 into one register's halves, then 64-bit, then 32-bit interleaves: two shuffles and
   a max a level) leaves block j's two last partial maxima in 32-bit lane j. */
static inline void block_amaxes(const uint16_t *restrict x, i64 m, i64 vecs, uint32_t *restrict out) {
    i64 j = 0;
#if defined(__AVX2__)
    const __m256i mag = _mm256_set1_epi16(MAG_MASK), hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    for (; j + 8 <= m; j += 8) {
        __m256i y[8];
        for (int i = 0; i < 8; i++) {
            const uint16_t *xb = x + (j + i) * 16 * vecs;
            y[i] = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)xb), mag);
            for (i64 v = 1; v < vecs; v++) {
                const __m256i next = _mm256_loadu_si256((const __m256i *)(xb + 16 * v));
                y[i] = _mm256_max_epu16(y[i], _mm256_and_si256(next, mag));
            }
        }
        __m256i t[4];
        for (int i = 0; i < 4; i++) /* [b0|b4] [b1|b5] [b2|b6] [b3|b7], 8 partials each */
            t[i] = _mm256_max_epu16(_mm256_permute2x128_si256(y[i], y[i + 4], 0x20),
                                    _mm256_permute2x128_si256(y[i], y[i + 4], 0x31));
        /* [b0 b2 | b4 b6] and [b1 b3 | b5 b7], 4 partials each */
        const __m256i u0 = _mm256_max_epu16(_mm256_unpacklo_epi64(t[0], t[2]), _mm256_unpackhi_epi64(t[0], t[2]));
        const __m256i u1 = _mm256_max_epu16(_mm256_unpacklo_epi64(t[1], t[3]), _mm256_unpackhi_epi64(t[1], t[3]));
        /* [b0 b1 b0 b1] [b2 b3 b2 b3] (first and second pairs of partials), then b0..b3 | b4..b7, 2 each */
        const __m256i vl = _mm256_unpacklo_epi32(u0, u1), vh = _mm256_unpackhi_epi32(u0, u1);
        const __m256i w = _mm256_max_epu16(_mm256_unpacklo_epi64(vl, vh), _mm256_unpackhi_epi64(vl, vh));
        _mm256_storeu_si256((__m256i *)(out + j),
                            _mm256_max_epu32(_mm256_and_si256(w, hi16), _mm256_slli_epi32(w, 16)));
    }
    for (; j < m; j++) { /* the last few blocks one at a time: a horizontal max in the register */
        const uint16_t *xb = x + j * 16 * vecs;
        __m256i y = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)xb), mag);
        for (i64 v = 1; v < vecs; v++)
            y = _mm256_max_epu16(y, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xb + 16 * v)), mag));
        __m128i h = _mm_max_epu16(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
        h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0xB1));
        h = _mm_max_epu16(h, _mm_srli_epi32(h, 16));
        out[j] = (uint32_t)_mm_cvtsi128_si32(h) << 16;
    }
#endif
    for (; j < m; j++) out[j] = row_amax_bits(x + j * 16 * vecs, 16 * vecs) << 16;
}

static inline uint32_t largest(const uint32_t *v, i64 m) {
    uint32_t worst = 0;
    for (i64 j = 0; j < m; j++) worst = v[j] > worst ? v[j] : worst;
    return worst;
}

#define NONFINITE_F32 ((uint32_t)BF16_NONFINITE << 16)

/* ---------------------------------------------------------------------------------------------- */
/* scale groups as a pipeline (quant.c: FP8 per-tensor, fourbit.c: NVFP4)                         */
/*                                                                                                */
/* A format with one scale over a group of tensors (an expert's gate and up) reads the group twice:  */
/* its amax, then the conversion by the scale that amax gives. run_groups takes a run of groups and  */
/* reads the next group's amax rows interleaved with a group's conversion (in proportion to their   */
/* sizes), so the memory reads of the next group overlap the conversion of this one, which reads its */
/* rows again from cache: about one pass over memory, not two after each other. Threads sharing a   */
/* run take its groups one at a time from a shared counter (claim), so each keeps that pipeline and */
/* a slower core takes fewer groups.                                                               */
/*                                                                                                */
/* members: MEMBER_FIELDS int64 a tensor: x, batch, n, k, x_bstride, x_rstride, q, q_bstride,       */
/* q_rstride, s, s_bstride, s_rstride (pointers as integers, strides in elements of each buffer's   */
/* type); group g's members are first[g] .. first[g + 1] - 1. A member's rows are numbered           */
/* b * n + row, as the kernels' units.                                                            */

#define MEMBER_FIELDS 12
/* how far past the next group's read position a row function prefetches: lines asked for that early
   arrive before the amax reads them (C alone, one thread, 32 Qwen3.5 gate_up groups, NVFP4: 16.3-16.9 ms
   at the read position itself, 14.4-15.0 at 1024 elements on; 2048 and more measured slower still) */
#define AHEAD_ELEMS 1024

static inline i64 member_rows(const i64 *f) { return f[1] * f[2]; }

static inline const uint16_t *member_x(const i64 *f, i64 unit) {
    return (const uint16_t *)(uintptr_t)f[0] + (unit / f[2]) * f[4] + (unit % f[2]) * f[5];
}

static inline i64 group_elems(const i64 *members, i64 m0, i64 m1) {
    i64 total = 0;
    for (i64 m = m0; m < m1; m++) total += member_rows(members + m * MEMBER_FIELDS) * members[m * MEMBER_FIELDS + 3];
    return total;
}

/* a group's amax read a row at a time */
typedef struct {
    const i64 *members;
    i64 m, m_end, unit, read;
    uint32_t amax;
} amax_cursor;

static inline void cursor_start(amax_cursor *c, const i64 *members, i64 m0, i64 m1) {
    c->members = members;
    c->m = m0;
    c->m_end = m1;
    c->unit = c->read = 0;
    c->amax = 0;
}

/* reads rows until ``target`` elements of the group are read (or all of them) */
static inline void cursor_read(amax_cursor *c, i64 target) {
    while (c->read < target && c->m < c->m_end) {
        const i64 *f = c->members + c->m * MEMBER_FIELDS;
        if (c->unit >= member_rows(f)) {
            c->m++;
            c->unit = 0;
            continue;
        }
        const uint32_t r = row_amax_bits(member_x(f, c->unit), f[3]);
        c->amax = r > c->amax ? r : c->amax;
        c->read += f[3];
        c->unit++;
    }
}

/* a format's part: a group's scale from its amax (finite; stored in *scale, the state set up in ctx),
   then the rows of each member converted by it, some at a time: rows from ``unit`` on, at most ``most``,
   given the ahead_len elements the next group's amax reads after them (NULL if none) to prefetch; returns
   the rows it took (>= 1), 0 for NaN or Inf seen */
typedef void (*group_scale_fn)(void *ctx, uint32_t amax, float *scale);
typedef i64 (*group_row_fn)(void *ctx, const i64 *member, i64 unit, i64 most, const uint16_t *ahead, i64 ahead_len);

/* where a cursor reads next (NULL at the group's end), and in *len how far on it reads contiguously: its
   next row, and the rows after it in its member's batch where they follow one another in memory */
static inline const uint16_t *cursor_peek(const amax_cursor *c, i64 *len) {
    for (i64 m = c->m, unit = c->unit; m < c->m_end; m++, unit = 0) {
        const i64 *f = c->members + m * MEMBER_FIELDS;
        if (unit < member_rows(f)) {
            *len = f[5] == f[3] ? (f[2] - unit % f[2]) * f[3] : f[3];
            return member_x(f, unit);
        }
    }
    *len = 0;
    return NULL;
}

/* the group a thread takes next: with ``claim``, the next not yet taken by any thread sharing it (the
   caller sets it to the run's first group); without, the one after ``g`` */
static inline i64 next_group(i64 *claim, i64 g) {
    return claim ? __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED) : g + 1;
}

/* groups [begin, end), in order; or, with ``claim``, the groups of [*claim, end) this thread takes one at a
   time as it comes free, the other threads sharing ``claim`` taking the rest (a slower core takes fewer).
   Either way the group after the one converting is the one this thread takes next, whose amax it reads
   meanwhile. Returns -1, or the first group it met holding NaN/Inf (it takes no group after that one;
   with ``claim`` the caller takes the least over its threads). */
static i64 run_groups(const i64 *members, const i64 *first, i64 begin, i64 end, float *scales, i64 *claim,
                      void *ctx, group_scale_fn scale_fn, group_row_fn row_fn) {
    i64 g = claim ? next_group(claim, 0) : begin;
    if (g >= end) return -1;
    amax_cursor next;
    cursor_start(&next, members, first[g], first[g + 1]);
    cursor_read(&next, INT64_MAX);
    while (g < end) {
        if (next.amax >= BF16_NONFINITE) return g;
        scale_fn(ctx, next.amax, &scales[g]);
        const i64 after = next_group(claim, g), m1 = first[g + 1];
        const i64 n0 = after < end ? first[after] : m1, n1 = after < end ? first[after + 1] : m1;
        const double ratio = (double)group_elems(members, n0, n1) / (double)(group_elems(members, first[g], m1) | 1);
        cursor_start(&next, members, n0, n1);
        i64 done = 0;
        for (i64 m = first[g]; m < m1; m++) {
            const i64 *f = members + m * MEMBER_FIELDS;
            for (i64 u = 0; u < member_rows(f);) {
                /* what the next group's amax reads, from AHEAD_ELEMS past its next read on: a row function
                   may prefetch it while it computes, so that those reads are served from cache */
                i64 ahead_len;
                const uint16_t *ahead = cursor_peek(&next, &ahead_len);
                if (ahead && ahead_len > AHEAD_ELEMS) ahead += AHEAD_ELEMS, ahead_len -= AHEAD_ELEMS;
                const i64 took = row_fn(ctx, f, u, f[2] - u % f[2], ahead, ahead_len);
                if (took == 0) return g;
                u += took;
                done += took * f[3];
                cursor_read(&next, (i64)((double)done * ratio));
            }
        }
        cursor_read(&next, INT64_MAX);
        g = after;
    }
    return -1;
}

#endif
