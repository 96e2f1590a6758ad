/*
 * refitd native CPU quantizers: bfloat16 -> float8_e4m3fn, NVFP4, MXFP4 and INT4, byte-exact with
 * sidecar/numerics/reference.py and fourbit.py (../shared/SPEC.md section 1).
 *
 * C99 plus GCC vector extensions (gcc and clang take them; NVFP4's rounding), no torch headers, no
 * Python C-API: loaded with ctypes (which drops the GIL for the call), so several Python threads can
 * each run a share of one tensor. Built at run time by
 * sidecar/numerics/native/__init__.py with
 *     -O3 -march=native -ffp-contract=off -fno-fast-math
 * -ffp-contract=off is required: an FMA would round x * recip differently from torch.
 *
 * Every entry point takes a 3-d strided view [batch, n, k] of bfloat16 bits whose last dim is
 * contiguous (strides counted in elements), and a [begin, end) share of its work units, so that
 * threads can split one call. Outputs are the caller's buffers (row strides given, last dim
 * contiguous). A return value >= 0 from a quantizer says "NaN or Inf seen"; the caller then lets the
 * reference raise its own error (same message).
 *
 * The float32 -> e4m3fn conversion is c10's fp8e4m3fn_from_fp32_value (torch/headeronly/util/
 * Float8_e4m3fn.h) written without branches so gcc vectorizes it. The quantizers only ever convert
 * values within [-448 * (1 + 2^-22), 448 * (1 + 2^-22)] (or clamped ones), where every branch of c10's
 * function agrees with SPEC's RNE_e4m3.
 */

#include <stdint.h>
#include <string.h>

#define REFITD_NATIVE_ABI 2

#define BLOCK 128          /* block-FP8 tile edge */
#define MX_BLOCK 32        /* MXFP8 block length */
#define GROUP_BLOCKS 16    /* block-FP8 column blocks per pass: 128 x 2048 bf16 = 512 KiB, in L2 */
#define MX_PIECE 32        /* MXFP8 blocks per piece of a row (1024 elements: its scratch stays in L1) */
#define FP8_MAX 448.0f
#define FLT_MIN_BITS 0x00800000u /* 2^-126 */
#define MAG_MASK 0x7FFFu
#define BF16_NONFINITE 0x7F80u   /* sign-cleared bf16 bits >= this are Inf or NaN */

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

/* SPEC 1.1 / 1.3: 1.0 if amax == 0, else max(amax / 448, FLT_MIN), from sign-cleared bf16 bits. */
static inline float scale_from_amax_bits(uint32_t amax_bits) {
    if (amax_bits == 0) return 1.0f;
    const float scale = bf16_to_f32((uint16_t)amax_bits) / FP8_MAX;
    const float floor = f32_from_bits(FLT_MIN_BITS);
    return scale < floor ? floor : scale;
}

/* SPEC 1.2: clamp(ceil(log2(amax / 448)) + 127, 1, 254) from the quotient's bits (reference._e8m0_bytes). */
static inline uint32_t e8m0_byte(uint32_t amax_bits) {
    const uint32_t bits = f32_bits(bf16_to_f32((uint16_t)amax_bits) / FP8_MAX);
    uint32_t biased = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0);
    biased = biased < 1 ? 1 : biased;
    return biased > 254 ? 254 : biased;
}

/* exact float32 2^(127 - byte) for byte in [1, 254]; 2^-127 is a subnormal */
static inline float e8m0_multiplier(uint32_t byte) {
    const int32_t exponent = 127 - (int32_t)byte;
    return exponent == -127 ? f32_from_bits(UINT32_C(1) << 22) : f32_from_bits((uint32_t)(exponent + 127) << 23);
}

static void convert_row(const uint16_t *restrict x, uint8_t *restrict q, i64 len, float mult) {
    for (i64 t = 0; t < len; t++) q[t] = e4m3_from_f32_in_range(bf16_to_f32(x[t]) * mult);
}

/* the same with |x * mult| clamped to 448 first: an integer min on the magnitude's bits (one
   instruction; exact for every finite value, and NaN is refused before this runs) */
static void convert_row_clamped(const uint16_t *restrict x, uint8_t *restrict q, i64 len, float mult) {
    const uint32_t fp8_max_bits = UINT32_C(0x43E00000); /* 448.0f */
    for (i64 t = 0; t < len; t++) {
        const uint32_t bits = f32_bits(bf16_to_f32(x[t]) * mult);
        const uint32_t sign = bits & UINT32_C(0x80000000);
        uint32_t mag = bits ^ sign;
        mag = mag < fp8_max_bits ? mag : fp8_max_bits;
        q[t] = e4m3_from_f32_in_range(f32_from_bits(mag | sign));
    }
}

/* out[i] = max(in[2i] & mask, in[2i + 1] & mask): one level of a tree of maxima */
static void pair_max(const uint16_t *restrict in, uint16_t *restrict out, i64 n_out, uint16_t mask) {
    for (i64 i = 0; i < n_out; i++) {
        const uint16_t a = in[2 * i] & mask, b = in[2 * i + 1] & mask;
        out[i] = a > b ? a : b;
    }
}

static uint32_t row_amax_bits(const uint16_t *restrict x, i64 len) {
    uint16_t m = 0;
    for (i64 t = 0; t < len; t++) {
        const uint16_t v = x[t] & MAG_MASK;
        m = v > m ? v : m;
    }
    return m;
}

int refitd_native_abi(void) { return REFITD_NATIVE_ABI; }

/* --------------------------------------------------------------------------------------------- */
/* block-FP8: work units are 128-row bands, numbered b * ceil(n / 128) + band.                    */
/* Returns -1, or the first band (within [begin, end)) holding NaN/Inf.                          */

i64 refitd_block_fp8(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
                     i64 q_bstride, i64 q_rstride, float *s, i64 s_bstride, i64 s_rstride, i64 begin,
                     i64 end) {
    const i64 nb = (n + BLOCK - 1) / BLOCK, kb = (k + BLOCK - 1) / BLOCK;
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / nb, band = unit % nb;
        const i64 r0 = band * BLOCK, rows = n - r0 < BLOCK ? n - r0 : BLOCK;
        const uint16_t *xb = x + b * x_bstride + r0 * x_rstride;
        uint8_t *qb = q + b * q_bstride + r0 * q_rstride;
        float *sb = s + b * s_bstride + band * s_rstride;
        for (i64 j0 = 0; j0 < kb; j0 += GROUP_BLOCKS) {
            const i64 j1 = j0 + GROUP_BLOCKS < kb ? j0 + GROUP_BLOCKS : kb;
            uint16_t acc[GROUP_BLOCKS][BLOCK];
            memset(acc, 0, sizeof acc);
            /* amax: an element-wise max over the band's rows, reduced once per tile */
            for (i64 r = 0; r < rows; r++) {
                const uint16_t *xr = xb + r * x_rstride;
                for (i64 j = j0; j < j1; j++) {
                    const i64 c0 = j * BLOCK, w = k - c0 < BLOCK ? k - c0 : BLOCK;
                    uint16_t *restrict a = acc[j - j0];
                    const uint16_t *restrict xs = xr + c0;
                    for (i64 t = 0; t < w; t++) {
                        const uint16_t v = xs[t] & MAG_MASK;
                        a[t] = v > a[t] ? v : a[t];
                    }
                }
            }
            float mult[GROUP_BLOCKS];
            int bad = 0;
            for (i64 j = j0; j < j1; j++) {
                const uint32_t amax = row_amax_bits(acc[j - j0], BLOCK);
                bad |= amax >= BF16_NONFINITE;
                const float scale_inv = scale_from_amax_bits(amax);
                sb[j] = scale_inv;
                mult[j - j0] = 1.0f / scale_inv;
            }
            if (bad) return unit;
            /* No clamp: every |x| * RN(1 / scale_inv) <= 448 * (1 + 2^-22), which rounds to 448
               exactly as the clamped value would (reference._block_fp8_3d). */
            for (i64 r = 0; r < rows; r++) {
                const uint16_t *xr = xb + r * x_rstride;
                uint8_t *qr = qb + r * q_rstride;
                for (i64 j = j0; j < j1; j++) {
                    const i64 c0 = j * BLOCK, w = k - c0 < BLOCK ? k - c0 : BLOCK;
                    convert_row(xr + c0, qr + c0, w, mult[j - j0]);
                }
            }
        }
    }
    return -1;
}

/* --------------------------------------------------------------------------------------------- */
/* MXFP8: work units are rows, numbered b * n + row. Returns -1, or the first row holding NaN/Inf. */

i64 refitd_mxfp8(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, i64 begin, i64 end) {
    const i64 blocks = k / MX_BLOCK;
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        uint8_t *qr = q + b * q_bstride + row * q_rstride;
        uint8_t *sr = s + b * s_bstride + row * s_rstride;
        /* a row in pieces of MX_PIECE blocks: the amax of each block by a tree of pairwise maxima,
           their bytes and multipliers (one vectorized loop: the division is the costly part), each
           multiplier repeated over its block, then the conversion of the whole piece in one loop.
           (Converting block by block makes gcc use half-width vectors: about twice as slow.) */
        for (i64 j0 = 0; j0 < blocks; j0 += MX_PIECE) {
            const i64 m = blocks - j0 < MX_PIECE ? blocks - j0 : MX_PIECE;
            const uint16_t *xp = xr + j0 * MX_BLOCK;
            uint16_t tree[MX_PIECE * MX_BLOCK / 2], twig[MX_PIECE * MX_BLOCK / 4];
            uint32_t bytes[MX_PIECE];
            float mult[MX_PIECE], spread[MX_PIECE * MX_BLOCK];
            pair_max(xp, tree, m * MX_BLOCK / 2, MAG_MASK); /* 16 per block */
            pair_max(tree, twig, m * MX_BLOCK / 4, 0xFFFFu); /* 8 */
            pair_max(twig, tree, m * MX_BLOCK / 8, 0xFFFFu); /* 4 */
            pair_max(tree, twig, m * MX_BLOCK / 16, 0xFFFFu); /* 2 */
            pair_max(twig, tree, m, 0xFFFFu);                 /* 1: tree[j] is block j's amax bits */
            uint32_t worst = 0;
            for (i64 j = 0; j < m; j++) worst = tree[j] > worst ? tree[j] : worst;
            if (worst >= BF16_NONFINITE) return unit;
            for (i64 j = 0; j < m; j++) {
                bytes[j] = e8m0_byte(tree[j]);
                mult[j] = e8m0_multiplier(bytes[j]);
            }
            for (i64 j = 0; j < m; j++) sr[j0 + j] = (uint8_t)bytes[j];
            for (i64 j = 0; j < m; j++)
                for (i64 t = 0; t < MX_BLOCK; t++) spread[j * MX_BLOCK + t] = mult[j];
            /* No clamp: 2^e >= RN(amax / 448), so every |x| * 2^-e <= 448 * (1 + 2^-23). */
            uint8_t *restrict qp = qr + j0 * MX_BLOCK;
            for (i64 t = 0; t < m * MX_BLOCK; t++) qp[t] = e4m3_from_f32_in_range(bf16_to_f32(xp[t]) * spread[t]);
        }
    }
    return -1;
}

/* --------------------------------------------------------------------------------------------- */
/* FP8 per-tensor: work units are rows, numbered b * n + row.                                    */

/* max of the sign-cleared bits over rows [begin, end); >= 0x7F80 means NaN or Inf was seen */
i64 refitd_amax_bits(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, i64 begin, i64 end) {
    uint32_t m = 0;
    for (i64 unit = begin; unit < end; unit++) {
        const uint32_t r = row_amax_bits(x + (unit / n) * x_bstride + (unit % n) * x_rstride, k);
        m = r > m ? r : m;
    }
    return (i64)m;
}

/* the per-tensor scale of an amax given as sign-cleared bf16 bits (finite) */
float refitd_scale_from_amax_bits(i64 amax_bits) { return scale_from_amax_bits((uint32_t)amax_bits); }

/* q = RNE_e4m3(x * (1 / scale)), clamped to [-448, 448] when ``clamp`` (a caller's shared scale).
   Returns the max sign-cleared bits of the rows read (the caller refuses NaN/Inf from it). */
i64 refitd_fp8_per_tensor(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
                          i64 q_bstride, i64 q_rstride, float scale, int clamp, i64 begin, i64 end) {
    const float mult = 1.0f / scale;
    uint32_t m = 0;
    for (i64 unit = begin; unit < end; unit++) {
        const uint16_t *xr = x + (unit / n) * x_bstride + (unit % n) * x_rstride;
        uint8_t *qr = q + (unit / n) * q_bstride + (unit % n) * q_rstride;
        if (clamp) {
            const uint32_t r = row_amax_bits(xr, k);
            m = r > m ? r : m;
            convert_row_clamped(xr, qr, k, mult);
        } else {
            convert_row(xr, qr, k, mult);
        }
    }
    return (i64)m;
}

/* --------------------------------------------------------------------------------------------- */
/* 4-bit formats (SPEC 1.5-1.7). Work units are rows, numbered b * n + row; each returns -1, or the */
/* first row (within [begin, end)) holding NaN/Inf, like the FP8 ones.                            */

#define NVFP4_BLOCK 16
#define MXFP4_BLOCK 32
#define FOUR_PIECE 1024 /* elements of a row converted per pass (scratch stays in L1) */

/* RNE_e2m1 as a code 0-15: the count of midpoints passed (ties to the even code: > at the midpoints
   below an even code, >= at those below an odd one... i.e. above an odd one), saturating at 6, bit 3
   set iff v < 0. NaN compares false everywhere: code 0 (fourbit.e2m1_codes does the same). */
static inline uint8_t e2m1_code(float v) {
    const float a = fabsf_bits(v);
    /* 32-bit lanes throughout (the compares' width): measured faster than uint8 sums */
    uint32_t c = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f) +
                 (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
    return (uint8_t)(c | ((uint32_t)(v < 0.0f) << 3));
}

/* the value of a positive finite e4m3fn byte (branch-free, so loops over blocks vectorize) */
static inline float e4m3_value(uint32_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    const float sub = (float)m * f32_from_bits(UINT32_C(0x3B000000)); /* m * 2^-9 */
    const float normal = f32_from_bits(((e + 120u) << 23) | (m << 20));
    return e == 0 ? sub : normal;
}

/* amax bits of each of m blocks of 2^log2b elements of xp (sign-cleared bf16), by a tree of pairwise
   maxima (each level one vectorized loop), into out[0..m) */
static void block_amax_bits(const uint16_t *restrict xp, i64 m, int log2b, uint16_t *restrict out) {
    uint16_t a[FOUR_PIECE / 2], b[FOUR_PIECE / 4];
    i64 len = m << (log2b - 1);
    pair_max(xp, a, len, MAG_MASK);
    uint16_t *src = a, *dst = b;
    for (int level = 1; level < log2b; level++) {
        len >>= 1;
        pair_max(src, dst, len, 0xFFFFu);
        uint16_t *t = src;
        src = dst;
        dst = t;
    }
    for (i64 j = 0; j < m; j++) out[j] = src[j];
}

static void pack_codes(const uint8_t *restrict c, uint8_t *restrict q, i64 len) {
    for (i64 t = 0; t < len / 2; t++) q[t] = (uint8_t)(c[2 * t] | (c[2 * t + 1] << 4));
}

/* RNE_e2m1(x / d) for bf16 x and a float32 divisor d > 0 or == 0, without dividing per element:
   v = RN(|x| / d) is monotone in |x| (a correctly rounded division), so each of e2m1_code's eight
   tests on it ("v > 0.25", "v >= 0.75", ..., "v > 5", and "v > 0" for the sign: -0.0 is code 0) holds
   exactly for |x|'s sign-cleared bf16 bits at or above some threshold. The thresholds are found by
   a binary search running that very division (15 steps each), once per distinct scale byte of a
   call; then an element needs eight 16-bit compares (NVFP4_NEVER: the test holds for no finite x). */
#define NVFP4_NEVER 0x7F80u
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
#define NVFP4_TESTS 8

static inline int e2m1_test(int i, float v) {
    switch (i) {
    case 0: return v > 0.25f;
    case 1: return v >= 0.75f;
    case 2: return v > 1.25f;
    case 3: return v >= 1.75f;
    case 4: return v > 2.5f;
    case 5: return v >= 3.5f;
    case 6: return v > 5.0f;
    default: return v > 0.0f; /* the sign bit is set iff v < 0, i.e. x < 0 and RN(|x| / d) > 0 */
    }
}

static void e2m1_thresholds(float d, uint16_t *restrict out) {
    for (int i = 0; i < NVFP4_TESTS; i++) {
        uint32_t lo = 0, hi = NVFP4_NEVER;
        while (lo < hi) {
            const uint32_t mid = (lo + hi) / 2;
            const float v = bf16_to_f32((uint16_t)mid) / d; /* the kernel's exact float32 division */
            if (e2m1_test(i, v)) hi = mid;
            else lo = mid + 1;
        }
        out[i] = (uint16_t)lo;
    }
}

/* NVFP4: s = RNE_e4m3(clamp(amax_b == 0 ? 1 : amax_b / (6 gs), 2^-9, 448)); q = RNE_e2m1(x / (s * gs)).
   q [n, k/2] bytes, s [n, k/16] e4m3 bytes. */
i64 refitd_nvfp4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, float gs, i64 begin, i64 end) {
    const float six_gs = 6.0f * gs;
    const float lo = f32_from_bits(UINT32_C(0x3B000000)); /* 2^-9 */
    /* thresholds of each positive e4m3 scale byte (1..126), filled as bytes first appear */
    uint16_t thr[128][NVFP4_TESTS];
    uint8_t have[128];
    memset(have, 0, sizeof have);
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        uint8_t *qr = q + b * q_bstride + row * q_rstride;
        uint8_t *sr = s + b * s_bstride + row * s_rstride;
        for (i64 p0 = 0; p0 < k; p0 += FOUR_PIECE) {
            const i64 len = k - p0 < FOUR_PIECE ? k - p0 : FOUR_PIECE, m = len / NVFP4_BLOCK;
            const uint16_t *xp = xr + p0;
            uint16_t amax[FOUR_PIECE / NVFP4_BLOCK];
            uint16_t codes[FOUR_PIECE];
            uint8_t bytes[FOUR_PIECE / NVFP4_BLOCK];
            block_amax_bits(xp, m, 4, amax);
            uint32_t worst = 0;
            for (i64 j = 0; j < m; j++) worst = amax[j] > worst ? amax[j] : worst;
            if (worst >= BF16_NONFINITE) return unit;
            /* simple loops (each vectorizes; one loop doing it all does not) */
            float sfs[FOUR_PIECE / NVFP4_BLOCK];
            uint32_t codes32[FOUR_PIECE / NVFP4_BLOCK];
            for (i64 j = 0; j < m; j++) {
                const uint32_t a = amax[j];
                float sf = f32_from_bits(a << 16) / six_gs;
                sf = a == 0 ? 1.0f : sf;
                sf = sf < lo ? lo : sf;
                sfs[j] = sf > FP8_MAX ? FP8_MAX : sf;
            }
            for (i64 j = 0; j < m; j++) codes32[j] = e4m3_from_f32_in_range(sfs[j]);
            for (i64 j = 0; j < m; j++) bytes[j] = (uint8_t)codes32[j];
            memcpy(sr + p0 / NVFP4_BLOCK, bytes, (size_t)m);
            for (i64 j = 0; j < m; j++) {
                const uint32_t byte = codes32[j] & 0x7Fu;
                if (!have[byte]) {
                    e2m1_thresholds(e4m3_value(byte) * gs, thr[byte]);
                    have[byte] = 1;
                }
            }
            /* a block is one 16-lane vector of 16-bit values (GCC vector extensions: AVX2/AVX-512
               where -march has them, else narrower); a comparison's lanes are -1 or 0 */
            for (i64 j = 0; j < m; j++) {
                const uint16_t *th = thr[codes32[j] & 0x7Fu];
                u16x16 xv, a;
                memcpy(&xv, xp + j * NVFP4_BLOCK, sizeof xv);
                a = xv & MAG_MASK;
                const i16x16 below = (a >= th[0]) + (a >= th[1]) + (a >= th[2]) + (a >= th[3]) + (a >= th[4]) +
                                     (a >= th[5]) + (a >= th[6]);
                const u16x16 c = (u16x16)(-below) | (((xv >> 15) & (u16x16)(a >= th[7])) << 3);
                memcpy(codes + j * NVFP4_BLOCK, &c, sizeof c);
            }
            uint8_t *restrict qp = qr + p0 / 2;
            for (i64 t = 0; t < len / 2; t++) qp[t] = (uint8_t)(codes[2 * t] | (codes[2 * t + 1] << 4));
        }
    }
    return -1;
}

/* MXFP4: byte = clamp(E(amax) + (significand >= 1.75) - 2, 1, 254) (1 for amax == 0);
   q = RNE_e2m1(x * 2^(127 - byte)). q [n, k/2] bytes, s [n, k/32] bytes. */
i64 refitd_mxfp4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, i64 begin, i64 end) {
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        uint8_t *qr = q + b * q_bstride + row * q_rstride;
        uint8_t *sr = s + b * s_bstride + row * s_rstride;
        for (i64 p0 = 0; p0 < k; p0 += FOUR_PIECE) {
            const i64 len = k - p0 < FOUR_PIECE ? k - p0 : FOUR_PIECE;
            const uint16_t *xp = xr + p0;
            float spread[FOUR_PIECE];
            uint8_t codes[FOUR_PIECE];
            uint16_t amaxes[FOUR_PIECE / MXFP4_BLOCK];
            block_amax_bits(xp, len / MXFP4_BLOCK, 5, amaxes);
            uint32_t worst = 0;
            for (i64 j = 0; j < len / MXFP4_BLOCK; j++) {
                const uint32_t amax = amaxes[j];
                worst = amax > worst ? amax : worst;
                /* bf16 bits: exponent in bits 7..14, significand >= 1.75 iff the top two mantissa bits */
                int32_t byte = (int32_t)(amax >> 7) + ((amax & 0x60u) == 0x60u) - 2;
                byte = byte < 1 ? 1 : (byte > 254 ? 254 : byte);
                byte = amax == 0 ? 1 : byte;
                sr[p0 / MXFP4_BLOCK + j] = (uint8_t)byte;
                const float mult = e8m0_multiplier((uint32_t)byte);
                for (i64 t = 0; t < MXFP4_BLOCK; t++) spread[j * MXFP4_BLOCK + t] = mult;
            }
            if (worst >= BF16_NONFINITE) return unit;
            for (i64 t = 0; t < len; t++) codes[t] = e2m1_code(bf16_to_f32(xp[t]) * spread[t]);
            pack_codes(codes, qr + p0 / 2, len);
        }
    }
    return -1;
}

/* float32 -> bfloat16 bits, round to nearest even (finite values) */
static inline uint16_t bf16_bits_rne(float f) {
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16);
}

/* INT4 weight-only: s = amax == 0 ? 1 : amax / 7, rounded to bf16 unless scale_f32;
   q = clamp(RNE(x / s), -7, 7) (0 where x == 0: also when s underflowed to 0, where 0 / 0 is NaN);
   packed [n, k/8] int32 words (nibble q + 8 of element 8j + i at bits 4i), s [n, k/group]. */
i64 refitd_int4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, int32_t *q, i64 q_bstride,
                i64 q_rstride, void *s, i64 s_bstride, i64 s_rstride, i64 group, int scale_f32, i64 begin,
                i64 end) {
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        int32_t *qr = q + b * q_bstride + row * q_rstride;
        int log2g = 0;
        while (((i64)1 << log2g) < group) log2g++;
        if (((i64)1 << log2g) == group && group >= 8 && group <= FOUR_PIECE) {
            /* pieces of whole groups: group maxima by a tree, scales in one loop, then every element */
            for (i64 p0 = 0; p0 < k; p0 += FOUR_PIECE) {
                const i64 len = k - p0 < FOUR_PIECE ? k - p0 : FOUR_PIECE, m = len / group;
                const uint16_t *xp = xr + p0;
                uint16_t amax[FOUR_PIECE / 8];
                float sfs[FOUR_PIECE / 8], spread[FOUR_PIECE];
                uint8_t nib[FOUR_PIECE];
                block_amax_bits(xp, m, log2g, amax);
                uint32_t worst = 0;
                for (i64 j = 0; j < m; j++) worst = amax[j] > worst ? amax[j] : worst;
                if (worst >= BF16_NONFINITE) return unit;
                for (i64 j = 0; j < m; j++) {
                    const float sf = bf16_to_f32(amax[j]) / 7.0f;
                    sfs[j] = amax[j] == 0 ? 1.0f : sf;
                }
                const i64 at = b * s_bstride + row * s_rstride + p0 / group;
                if (scale_f32) {
                    memcpy((float *)s + at, sfs, (size_t)m * sizeof(float));
                } else {
                    uint16_t hs[FOUR_PIECE / 8];
                    for (i64 j = 0; j < m; j++) {
                        hs[j] = bf16_bits_rne(sfs[j]);
                        sfs[j] = bf16_to_f32(hs[j]);
                    }
                    memcpy((uint16_t *)s + at, hs, (size_t)m * sizeof(uint16_t));
                }
                for (i64 j = 0; j < m; j++)
                    for (i64 t = 0; t < group; t++) spread[j * group + t] = sfs[j];
                for (i64 t = 0; t < len; t++) {
                    const float xf = bf16_to_f32(xp[t]);
                    float v = __builtin_rintf(xf / spread[t]);
                    v = v > 7.0f ? 7.0f : (v < -7.0f ? -7.0f : v);
                    v = xf == 0.0f ? 0.0f : v;
                    nib[t] = (uint8_t)((int32_t)v + 8);
                }
                int32_t *qw = qr + p0 / 8;
                for (i64 j = 0; j < len / 8; j++) {
                    uint32_t word = 0;
                    for (int i = 0; i < 8; i++) word |= (uint32_t)nib[8 * j + i] << (4 * i);
                    qw[j] = (int32_t)word;
                }
            }
            continue;
        }
        for (i64 g0 = 0; g0 < k; g0 += group) {
            const uint16_t *xg = xr + g0;
            const uint32_t amax = row_amax_bits(xg, group);
            if (amax >= BF16_NONFINITE) return unit;
            float sf = amax == 0 ? 1.0f : bf16_to_f32((uint16_t)amax) / 7.0f;
            const i64 at = b * s_bstride + row * s_rstride + g0 / group;
            if (scale_f32) {
                ((float *)s)[at] = sf;
            } else {
                const uint16_t h = bf16_bits_rne(sf);
                ((uint16_t *)s)[at] = h;
                sf = bf16_to_f32(h);
            }
            uint8_t nib[1024];
            for (i64 c0 = 0; c0 < group; c0 += 1024) {
                const i64 len = group - c0 < 1024 ? group - c0 : 1024;
                for (i64 t = 0; t < len; t++) {
                    const float xf = bf16_to_f32(xg[c0 + t]);
                    float v = __builtin_rintf(xf / sf);
                    v = v > 7.0f ? 7.0f : (v < -7.0f ? -7.0f : v);
                    v = xf == 0.0f ? 0.0f : v;
                    nib[t] = (uint8_t)((int32_t)v + 8);
                }
                int32_t *qw = qr + (g0 + c0) / 8;
                for (i64 j = 0; j < len / 8; j++) {
                    uint32_t word = 0;
                    for (int i = 0; i < 8; i++) word |= (uint32_t)nib[8 * j + i] << (4 * i);
                    qw[j] = (int32_t)word;
                }
            }
        }
    }
    return -1;
}

/* test hooks: the conversions alone, over float32 values (in_range: |x| < 464 only) */
void refitd_e4m3_from_f32(const float *x, uint8_t *q, i64 len) {
    for (i64 t = 0; t < len; t++) q[t] = e4m3_from_f32(x[t]);
}

void refitd_e4m3_from_f32_in_range(const float *x, uint8_t *q, i64 len) {
    for (i64 t = 0; t < len; t++) q[t] = e4m3_from_f32_in_range(x[t]);
}

/* --------------------------------------------------------------------------------------------- */
/* A passthrough copied out of staging, then checked (sidecar/daemon/copyout.py; issue 21): bytes  */
/* [begin, end) of src go to dst a chunk at a time, each chunk scanned in dst, where it is still   */
/* in cache, never in src (a trainer may still write staging). An element of ``width`` bytes (2 or */
/* 4) is Inf or NaN when all the bits of ``expo`` (its exponent mask) are set. Returns 1 if one was */
/* seen, else 0. begin and end are multiples of width.                                            */

#define COPY_CHUNK 65536

i64 refitd_copy_check(uint8_t *dst, const uint8_t *src, i64 begin, i64 end, i64 width, i64 expo) {
    int bad = 0;
    for (i64 at = begin; at < end; at += COPY_CHUNK) {
        const i64 len = end - at < COPY_CHUNK ? end - at : COPY_CHUNK;
        memcpy(dst + at, src + at, (size_t)len);
        if (width == 2) {
            const uint16_t *d = (const uint16_t *)(dst + at), e = (uint16_t)expo;
            for (i64 t = 0; t < len / 2; t++) bad |= (d[t] & e) == e;
        } else {
            const uint32_t *d = (const uint32_t *)(dst + at), e = (uint32_t)expo;
            for (i64 t = 0; t < len / 4; t++) bad |= (d[t] & e) == e;
        }
    }
    return bad;
}
