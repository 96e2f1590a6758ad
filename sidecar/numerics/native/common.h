/*
 * Shared by the native quantizers (quant.c: FP8 formats; fourbit.c: 4-bit formats): float32 / bfloat16
 * bits, c10's float32 -> e4m3fn conversion, the exact E8M0 multiplier, a row's amax. See quant.c's header
 * for the build and the conventions.
 */

#ifndef REFITD_NATIVE_COMMON_H
#define REFITD_NATIVE_COMMON_H

#include <stdint.h>
#include <string.h>

#define FP8_MAX 448.0f
#define MAG_MASK 0x7FFFu
#define BF16_NONFINITE 0x7F80u /* sign-cleared bf16 bits >= this are Inf or NaN */

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

#endif
