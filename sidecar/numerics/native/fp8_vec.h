/*
 * The FP8 quantizers' conversion (quant.c), 32 bfloat16 elements at a time with AVX-512BW: byte for byte
 * e4m3_from_f32_in_range(RN(x * mult)) (common.h, c10's conversion), without the float32 arithmetic per
 * element. Where -march lacks AVX-512BW, VL or VBMI (vpermt2b: Skylake-X and Cascade Lake have AVX-512
 * without it), REFITD_FP8_VEC is 0 and quant.c keeps its plain loops
 * (which gcc vectorizes, two to three times slower).
 *
 * c10 rounds |v| < 2^-6 (e4m3's subnormals) by a float add and the rest on v's bits. Which branch a lane
 * takes is monotone in |x|, so it is decided by two thresholds on |x|'s sign-cleared bf16 bits, found once
 * per scale by running the very float32 multiplication (first_passing, common.h): lanes at or above t_norm
 * take the normal branch, lanes below t_one round to a zero magnitude, and only a vector holding a lane
 * in [t_one, t_norm) (rare: |x| under amax / 2^15 or so) takes the float path, both branches. A normal
 * lane's code is 8 E + T[m] + offset (E, m: |x|'s exponent field and significand; T: a byte table per
 * scale, see fp8_scale_vec), MXFP8's (a power of two) its bits rebased and rounded in 16-bit lanes. The
 * sign is or-ed in last (-0 for a negative x rounding to zero, as c10). Block-FP8 and per-tensor write
 * q's 64-byte lines whole by streaming stores where q is aligned (no read of q's lines first: per-tensor
 * 8.6-9.7 -> 6.4-8.9 ms on bench/native_ab.c's slab, block-FP8 the same); quant.c's entry points end in
 * a store fence.
 */

#ifndef REFITD_NATIVE_FP8_VEC_H
#define REFITD_NATIVE_FP8_VEC_H

#include "common.h"

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define REFITD_FP8_VEC 1

/* A scale's constants. Above t_norm, RN(|x| * mult) is a normal float32 and c10 rounds its bits, which
   depend on |x|'s exponent field E and 7-bit significand m apart: multiplying by 2 adds one to v's exponent
   and 8 to its code. So code(|x|) = 8 E + T[m] + offset, T a 128-entry byte table per scale, looked up 64
   bytes at a time (vpermt2b reads an index's low seven bits: a bf16's low byte is E's last bit and m).
   Where a subnormal x reaches e4m3's normal range (a multiplier past 2^119), or the multiplier is itself
   subnormal, the scale takes the float path (table = 0). */
typedef struct {
    __m512i lo, hi;       /* T[0..63], T[64..127] */
    __m512i offset;       /* 16-bit lanes */
    __m512i t_one, t_norm; /* 16-bit lanes */
    __m512 mult;
    int table;
} fp8_scale_vec;

/* c10's normal branch, unbounded: the code of a positive normal float32 rebased to e4m3 and rounded to
   nearest even on the bits (beyond 0x7E for v >= 464) */
static inline int32_t e4m3_normal_code(uint32_t bits) {
    return (int32_t)(((int64_t)bits - (INT64_C(120) << 23) + 0x7FFFF + ((bits >> 20) & 1u)) >> 20);
}

/* the thresholds of multiplier ``mult`` (RN(|x| * mult) > 2^-10, a nonzero code, from t_one on;
   RN(|x| * mult) >= 2^-6, e4m3's normal range, from t_norm on) and its code table */
static inline void fp8_scale_init(fp8_scale_vec *s, float mult) {
    const uint32_t t_norm = first_passing(mult, 1, f32_from_bits(UINT32_C(0x3C800000)), 0);
    s->mult = _mm512_set1_ps(mult);
    s->t_one = _mm512_set1_epi16((short)first_passing(mult, 1, f32_from_bits(UINT32_C(0x3A800000)), 1));
    s->t_norm = _mm512_set1_epi16((short)t_norm);
    /* the exponent field at which |x| * mult is in [1, 4): every code of that binade is normal */
    const int32_t e = 254 - (int32_t)(f32_bits(mult) >> 23);
    s->table = t_norm >= 0x80 && (f32_bits(mult) >> 23) != 0 && e >= 1 && e <= 254;
    s->lo = s->hi = s->offset = _mm512_setzero_si512();
    if (!s->table) return;
    int32_t code[128], least = INT32_MAX;
    for (int m = 0; m < 128; m++) {
        const float v = bf16_to_f32((uint16_t)(((uint32_t)e << 7) | (uint32_t)m)) * mult;
        code[m] = e4m3_normal_code(f32_bits(v)) - 8 * e;
        least = code[m] < least ? code[m] : least;
    }
    uint8_t table[128];
    for (int m = 0; m < 128; m++) table[m] = (uint8_t)(code[m] - least); /* 0..16: a binade and a carry */
    memcpy(&s->lo, table, 64);
    memcpy(&s->hi, table + 64, 64);
    s->offset = _mm512_set1_epi16((short)least);
}

/* the e4m3 magnitude codes of RN(a * mult) by the float path: a the sign-cleared bits of 32 bf16 (16-bit
   lanes, in order), clamped to 448 first when ``clamp``; zero in the lanes below t_one */
static inline __m512i fp8_magnitudes_float(__m512i a, const fp8_scale_vec *s, int clamp) {
    const __m512i zero = _mm512_setzero_si512();
    /* widened by interleaving with zero within each 128-bit lane; packus undoes the interleave */
    __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)), s->mult);
    __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)), s->mult);
    if (clamp) {
        lo = _mm512_min_ps(lo, _mm512_set1_ps(FP8_MAX));
        hi = _mm512_min_ps(hi, _mm512_set1_ps(FP8_MAX));
    }
    const __mmask32 normal = _mm512_cmpge_epu16_mask(a, s->t_norm);
    const __mmask32 sub = _mm512_mask_cmpge_epu16_mask(~normal, a, s->t_one);
    const __m512i codes = _mm512_maskz_mov_epi16(
        normal, _mm512_packus_epi32(e4m3_normal(_mm512_castps_si512(lo)), e4m3_normal(_mm512_castps_si512(hi))));
    return _mm512_mask_mov_epi16(codes, sub, _mm512_packus_epi32(e4m3_subnormal(lo), e4m3_subnormal(hi)));
}

/* the same codes of x (32 bf16, a = its sign-cleared bits): by the table where the scale has one and no
   lane rounds to a subnormal, else by the float path */
static inline __m512i fp8_magnitudes(__m512i x, __m512i a, const fp8_scale_vec *s, int clamp) {
    const __mmask32 normal = _mm512_cmpge_epu16_mask(a, s->t_norm);
    if (!s->table || _mm512_mask_cmpge_epu16_mask(~normal, a, s->t_one)) return fp8_magnitudes_float(a, s, clamp);
    const __m512i t = _mm512_maskz_permutex2var_epi8(UINT64_C(0x5555555555555555), s->lo, x, s->hi);
    const __m512i e8 = _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi16(0x7F8));
    const __m512i codes = _mm512_maskz_add_epi16(normal, _mm512_add_epi16(t, e8), s->offset);
    return clamp ? _mm512_min_epu16(codes, _mm512_set1_epi16(0x7E)) : codes;
}

/* the codes' bytes with x's sign, stored for ``keep`` lanes */
static inline void fp8_store(uint8_t *q, __m512i x, __m512i codes, __mmask32 keep) {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi16(x, 8), _mm512_set1_epi16(0x80));
    _mm256_mask_storeu_epi8(q, keep, _mm512_cvtepi16_epi8(_mm512_or_si512(codes, sign)));
}

static inline __mmask32 lanes(i64 len) { return len >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << len) - 1); }

/* q[0..len) = RNE_e4m3(RN(x * mult)) (clamped when ``clamp``); returns the largest sign-cleared bits met */
/* the bytes of 32 codes with x's sign (the 32 lanes of fp8_store, in a register) */
static inline __m256i fp8_bytes(__m512i x, __m512i codes) {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi16(x, 8), _mm512_set1_epi16(0x80));
    return _mm512_cvtepi16_epi8(_mm512_or_si512(codes, sign));
}

static inline uint32_t fp8_convert(const uint16_t *x, uint8_t *q, i64 len, const fp8_scale_vec *s, int clamp) {
    const __m512i mag = _mm512_set1_epi16(MAG_MASK);
    __m512i worst = _mm512_setzero_si512();
    i64 t = 0;
    if (((uintptr_t)q & 63) == 0) /* whole cache lines streamed past the cache: no read of q's lines first */
        for (; t + 64 <= len; t += 64) {
            const __m512i x0 = _mm512_loadu_si512(x + t), a0 = _mm512_and_si512(x0, mag);
            const __m512i x1 = _mm512_loadu_si512(x + t + 32), a1 = _mm512_and_si512(x1, mag);
            worst = _mm512_max_epu16(worst, _mm512_max_epu16(a0, a1));
            const __m256i b0 = fp8_bytes(x0, fp8_magnitudes(x0, a0, s, clamp));
            const __m256i b1 = fp8_bytes(x1, fp8_magnitudes(x1, a1, s, clamp));
            _mm512_stream_si512((void *)(q + t), _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1));
        }
    for (; t + 32 <= len; t += 32) {
        const __m512i xv = _mm512_loadu_si512(x + t), a = _mm512_and_si512(xv, mag);
        worst = _mm512_max_epu16(worst, a);
        fp8_store(q + t, xv, fp8_magnitudes(xv, a, s, clamp), ~(__mmask32)0);
    }
    if (t < len) {
        const __mmask32 keep = lanes(len - t);
        const __m512i xv = _mm512_maskz_loadu_epi16(keep, x + t), a = _mm512_and_si512(xv, mag);
        worst = _mm512_max_epu16(worst, a);
        fp8_store(q + t, xv, fp8_magnitudes(xv, a, s, clamp), keep);
    }
    const __m512i low = _mm512_and_si512(worst, _mm512_set1_epi32(0xFFFF));
    return _mm512_reduce_max_epu32(_mm512_max_epu32(low, _mm512_srli_epi32(worst, 16)));
}

/* MXFP8: one block of 32 whose scale byte is ``byte`` (>= MX_VEC_MIN_BYTE): v = |x| * 2^(127 - byte) is
   exact and its bf16 bits are a's minus (byte - 127) << 7, so n = a - (byte - 7) << 7 is v's bits rebased
   to e4m3's exponent bias: v >= 2^-6 (normal) iff n >= 128, v > 2^-10 iff n > -384, and a normal code is
   n with its low four bits rounded off to nearest even. A block holding a lane that rounds to a subnormal
   takes the float path. */
#define MX_VEC_MIN_BYTE 11u /* below, 2^(byte - 137) is no normal bf16 */

/* a block holding a lane that rounds to a subnormal (rare): the float path */
static __attribute__((noinline)) __m256i mxfp8_block_float(const uint16_t *x, uint32_t byte) {
    const __m512i xv = _mm512_loadu_si512(x), a = _mm512_and_si512(xv, _mm512_set1_epi16(MAG_MASK));
    fp8_scale_vec s;
    s.mult = _mm512_set1_ps(e8m0_multiplier(byte));
    s.t_one = _mm512_set1_epi16((short)(((byte - 10) << 7) + 1)); /* past 2^(byte - 137) */
    s.t_norm = _mm512_set1_epi16((short)((byte - 6) << 7));      /* 2^(byte - 133) */
    return fp8_bytes(xv, fp8_magnitudes_float(a, &s, 0));
}

/* the 32 bytes of one block of x scaled by ``byte`` (>= MX_VEC_MIN_BYTE; stored plainly: two blocks streamed
   a 64-byte line at a time measured slower on one thread, 11.4 vs 9.7 ms on bench/native_ab.c's slab) */
static inline __m256i mxfp8_block(const uint16_t *x, uint32_t byte) {
    const __m512i xv = _mm512_loadu_si512(x), a = _mm512_and_si512(xv, _mm512_set1_epi16(MAG_MASK));
    const __m512i n = _mm512_sub_epi16(a, _mm512_set1_epi16((short)((byte - 7) << 7)));
    const __mmask32 normal = _mm512_cmpgt_epi16_mask(n, _mm512_set1_epi16(127));
    if (__builtin_expect(_mm512_mask_cmpgt_epi16_mask(~normal, n, _mm512_set1_epi16(-384)) != 0, 0))
        return mxfp8_block_float(x, byte);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(n, 4), _mm512_set1_epi16(1));
    const __m512i up = _mm512_add_epi16(_mm512_add_epi16(n, _mm512_set1_epi16(7)), odd);
    return fp8_bytes(xv, _mm512_maskz_srli_epi16(normal, up, 4));
}

#else
#define REFITD_FP8_VEC 0
#endif

#endif
