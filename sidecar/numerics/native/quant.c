/*
 * refitd native CPU quantizers: bfloat16 -> float8_e4m3fn (this file; NVFP4, MXFP4 and INT4 in fourbit.c,
 * shared helpers in common.h), byte-exact with sidecar/numerics/reference.py and fourbit.py
 * (docs/spec.md section 1).
 *
 * C99 plus GCC vector extensions (gcc and clang take them; the 4-bit codes) and, where -march has AVX2,
 * its intrinsics (the block maxima), where it has AVX-512BW, VL and VBMI, fp8_vec.h's FP8 conversions (a code
 * table per scale on the input's bits; without them the plain loops below run); no torch headers, no
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

#include "common.h"
#include "fp8_vec.h"

#define REFITD_NATIVE_ABI 2

#define BLOCK 128          /* block-FP8 tile edge */
#define MX_BLOCK 32        /* MXFP8 block length */
#define GROUP_BLOCKS 16    /* block-FP8 column blocks per pass: 128 x 2048 bf16 = 512 KiB, in L2 */
#define MX_PIECE 32        /* MXFP8 blocks per piece of a row (1024 elements: its scratch stays in L1) */
#define FLT_MIN_BITS 0x00800000u /* 2^-126 */

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

#if defined(__AVX2__)
/* Without fp8_vec.h (CPUs without AVX-512 VBMI: AVX2 ones such as AMD Zen 2 and 3, and Skylake-X and
   Cascade Lake) the conversion runs the float path with AVX2: sixteen elements at a time, each the very
   float32 multiplication and c10 conversion of e4m3_from_f32_in_range (its subnormal branch by the float
   add, the normal one on the bits, chosen per lane). gcc left the plain loop scalar: a build for x86-64-v3,
   one thread, bench/native_ab.c's 64M elements (same run): block-FP8 106 -> 23 ms (12 -> 54% of memcpy),
   MXFP8 105 -> 18 ms (12 -> 70%), FP8 per-tensor with its scale given 96 -> 13 ms (13 -> 95%). */

/* c10's conversion of eight float32 lanes (|v| < 464, or clamped to 448 first), with their signs */
static inline __m256i e4m3_in_range8(__m256 v, int clamp) {
    const __m256i bits0 = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(bits0, _mm256_set1_epi32((int)UINT32_C(0x80000000)));
    __m256i bits = _mm256_xor_si256(bits0, sign);
    if (clamp) bits = _mm256_min_epu32(bits, _mm256_set1_epi32((int)UINT32_C(0x43E00000))); /* 448.0f */
    const __m256i denorm_mask = _mm256_set1_epi32((int)(UINT32_C(141) << 23));
    const __m256i denorm = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    const __m256i rebias = _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF)));
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, rebias), odd), 20);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(UINT32_C(121) << 23)), bits);
    return _mm256_or_si256(_mm256_blendv_epi8(normal, denorm, small), _mm256_srli_epi32(sign, 24));
}

/* q[0..len) = e4m3(RN(x * mult)), clamped to 448 first when ``clamp`` */
static inline i64 convert_avx2(const uint16_t *restrict x, uint8_t *restrict q, i64 len, float mult, int clamp) {
    const __m256 m = _mm256_set1_ps(mult);
    const __m256i zero = _mm256_setzero_si256();
    i64 t = 0;
    for (; t + 16 <= len; t += 16) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + t));
        /* x << 16 in 32-bit lanes: elements 0-3 and 8-11, then 4-7 and 12-15; packus puts them back */
        const __m256 lo = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, xv)), m);
        const __m256 hi = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, xv)), m);
        const __m256i words = _mm256_packus_epi32(e4m3_in_range8(lo, clamp), e4m3_in_range8(hi, clamp));
        const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(words, words), 0x08);
        _mm_storeu_si128((__m128i *)(q + t), _mm256_castsi256_si128(bytes));
    }
    return t;
}
#endif

static void convert_row(const uint16_t *restrict x, uint8_t *restrict q, i64 len, float mult) {
    i64 t = 0;
#if defined(__AVX2__)
    t = convert_avx2(x, q, len, mult, 0);
#endif
    for (; t < len; t++) q[t] = e4m3_from_f32_in_range(bf16_to_f32(x[t]) * mult);
}

#if !REFITD_FP8_VEC
/* the same with |x * mult| clamped to 448 first: an integer min on the magnitude's bits (one
   instruction; exact for every finite value, and NaN is refused before this runs) */
static void convert_row_clamped(const uint16_t *restrict x, uint8_t *restrict q, i64 len, float mult) {
    const uint32_t fp8_max_bits = UINT32_C(0x43E00000); /* 448.0f */
    i64 t0 = 0;
#if defined(__AVX2__)
    t0 = convert_avx2(x, q, len, mult, 1);
#endif
    for (i64 t = t0; t < len; t++) {
        const uint32_t bits = f32_bits(bf16_to_f32(x[t]) * mult);
        const uint32_t sign = bits & UINT32_C(0x80000000);
        uint32_t mag = bits ^ sign;
        mag = mag < fp8_max_bits ? mag : fp8_max_bits;
        q[t] = e4m3_from_f32_in_range(f32_from_bits(mag | sign));
    }
}
#endif

int refitd_native_abi(void) { return REFITD_NATIVE_ABI; }

/* --------------------------------------------------------------------------------------------- */
/* block-FP8: work units are 128-row bands, numbered b * ceil(n / 128) + band.                    */
/* Returns -1, or the first band (within [begin, end)) holding NaN/Inf.                          */

static i64 block_fp8_units(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
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
#if REFITD_FP8_VEC
            fp8_scale_vec scales[GROUP_BLOCKS];
            for (i64 j = j0; j < j1; j++) fp8_scale_init(&scales[j - j0], mult[j - j0]);
#endif
            for (i64 r = 0; r < rows; r++) {
                const uint16_t *xr = xb + r * x_rstride;
                uint8_t *qr = qb + r * q_rstride;
                for (i64 j = j0; j < j1; j++) {
                    const i64 c0 = j * BLOCK, w = k - c0 < BLOCK ? k - c0 : BLOCK;
#if REFITD_FP8_VEC
                    fp8_convert(xr + c0, qr + c0, w, &scales[j - j0], 0);
#else
                    convert_row(xr + c0, qr + c0, w, mult[j - j0]);
#endif
                }
            }
        }
    }
    return -1;
}

#if REFITD_FP8_VEC
/* a piece of MXFP8 blocks some of which have a byte under MX_VEC_MIN_BYTE (amax below 2^-113, or 0: an
   all-zero block): those by the plain loop, the others by fp8_vec.h */
static __attribute__((noinline)) void mxfp8_piece_mixed(const uint16_t *x, uint8_t *q, const uint32_t *code, i64 m) {
    for (i64 j = 0; j < m; j++) {
        if (code[j] >= MX_VEC_MIN_BYTE) _mm256_storeu_si256((__m256i *)(q + j * MX_BLOCK), mxfp8_block(x + j * MX_BLOCK, code[j]));
        else convert_row(x + j * MX_BLOCK, q + j * MX_BLOCK, MX_BLOCK, e8m0_multiplier(code[j]));
    }
}
#endif

/* --------------------------------------------------------------------------------------------- */
/* MXFP8: work units are rows, numbered b * n + row. Returns -1, or the first row holding NaN/Inf. */

static i64 mxfp8_units(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
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
#if REFITD_FP8_VEC
            /* block maxima eight at a time (block_amaxes), the bytes from their bits: amax / 448 has
               significand 1.m / 1.75 and exponent E - 8, so ceil(log2) is E - 8, plus one where m > 1.75
               (the division never rounds onto a power of two: 1.m is a bf16) */
            uint32_t amax[MX_PIECE], code[MX_PIECE];
            block_amaxes(xp, m, MX_BLOCK / 16, amax);
            if (largest(amax, m) >= NONFINITE_F32) return unit;
            for (i64 j = 0; j < m; j++) {
                const int32_t e = (int32_t)(amax[j] >> 23) - 8 + ((amax[j] & UINT32_C(0x7FFFFF)) > UINT32_C(0x600000));
                code[j] = (uint32_t)(e < 1 ? 1 : (e > 254 ? 254 : e));
            }
            for (i64 j = 0; j < m; j++) sr[j0 + j] = (uint8_t)code[j];
            uint32_t least = 255;
            for (i64 j = 0; j < m; j++) least = code[j] < least ? code[j] : least;
            if (least >= MX_VEC_MIN_BYTE) /* the common case: a tight loop, its constants in registers */
                for (i64 j = 0; j < m; j++)
                    _mm256_storeu_si256((__m256i *)(qr + (j0 + j) * MX_BLOCK), mxfp8_block(xp + j * MX_BLOCK, code[j]));
            else
                mxfp8_piece_mixed(xp, qr + j0 * MX_BLOCK, code, m);
            continue;
#endif
            uint16_t tree[MX_PIECE * MX_BLOCK / 2], twig[MX_PIECE * MX_BLOCK / 4];
            uint32_t bytes[MX_PIECE];
            float mult[MX_PIECE];
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
            /* No clamp: 2^e >= RN(amax / 448), so every |x| * 2^-e <= 448 * (1 + 2^-23). */
            uint8_t *restrict qp = qr + j0 * MX_BLOCK;
#if defined(__AVX2__)
            for (i64 j = 0; j < m; j++) convert_row(xp + j * MX_BLOCK, qp + j * MX_BLOCK, MX_BLOCK, mult[j]);
#else
            float spread[MX_PIECE * MX_BLOCK];
            for (i64 j = 0; j < m; j++)
                for (i64 t = 0; t < MX_BLOCK; t++) spread[j * MX_BLOCK + t] = mult[j];
            for (i64 t = 0; t < m * MX_BLOCK; t++) qp[t] = e4m3_from_f32_in_range(bf16_to_f32(xp[t]) * spread[t]);
#endif
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

/* a per-tensor scale's conversion state: the multiplier 1 / scale (and fp8_vec.h's table for it) */
typedef struct {
    float mult;
#if REFITD_FP8_VEC
    fp8_scale_vec sv;
#endif
} pt_scale;

static void pt_scale_init(pt_scale *p, float scale) {
    p->mult = 1.0f / scale;
#if REFITD_FP8_VEC
    fp8_scale_init(&p->sv, p->mult);
#endif
}

/* one row: q = RNE_e4m3(x * mult), clamped to [-448, 448] when ``clamp``; returns the max sign-cleared
   bits of the row when ``clamp`` (the plain loop does not look without it) */
static inline uint32_t pt_row(const uint16_t *xr, uint8_t *qr, i64 k, const pt_scale *p, int clamp) {
#if REFITD_FP8_VEC
    return fp8_convert(xr, qr, k, &p->sv, clamp);
#else
    if (!clamp) {
        convert_row(xr, qr, k, p->mult);
        return 0;
    }
    convert_row_clamped(xr, qr, k, p->mult);
    return row_amax_bits(xr, k);
#endif
}

/* q = RNE_e4m3(x * (1 / scale)), clamped to [-448, 448] when ``clamp`` (a caller's shared scale).
   Returns the max sign-cleared bits of the rows read (the caller refuses NaN/Inf from it). */
static i64 fp8_per_tensor_units(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
                          i64 q_bstride, i64 q_rstride, float scale, int clamp, i64 begin, i64 end) {
    pt_scale p;
    pt_scale_init(&p, scale);
    uint32_t m = 0;
    for (i64 unit = begin; unit < end; unit++) {
        const uint16_t *xr = x + (unit / n) * x_bstride + (unit % n) * x_rstride;
        uint8_t *qr = q + (unit / n) * q_bstride + (unit % n) * q_rstride;
        const uint32_t r = pt_row(xr, qr, k, &p, clamp);
        m = r > m ? r : m;
    }
    return (i64)m;
}

/* FP8 per-tensor scale groups (common.h's run_groups): each group's scale from its amax, then its members
   converted clamped by it, as a caller's shared scale is */
static void pt_group_scale(void *ctx, uint32_t amax, float *scale) {
    *scale = scale_from_amax_bits(amax);
    pt_scale_init(ctx, *scale);
}

static i64 pt_group_row(void *ctx, const i64 *f, i64 unit, i64 most, const uint16_t *ahead, i64 ahead_len) {
    (void)most, (void)ahead, (void)ahead_len; /* a row at a time: the hardware's prefetch keeps up */
    uint8_t *qr = (uint8_t *)(uintptr_t)f[6] + (unit / f[2]) * f[7] + (unit % f[2]) * f[8];
    pt_row(member_x(f, unit), qr, f[3], ctx, 1);
    return 1;
}

/* --------------------------------------------------------------------------------------------- */
/* The entry points: each kernel, then a store fence (fp8_vec.h streams whole lines of q past the  */
/* cache; the fence orders them before the caller, or another thread, reads q).                  */

static inline i64 fenced(i64 result) {
#if REFITD_FP8_VEC
    _mm_sfence();
#endif
    return result;
}

i64 refitd_block_fp8(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
                     i64 q_bstride, i64 q_rstride, float *s, i64 s_bstride, i64 s_rstride, i64 begin,
                     i64 end) {
    return fenced(block_fp8_units(x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride,
                                  begin, end));
}

i64 refitd_mxfp8(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, i64 begin, i64 end) {
    return fenced(mxfp8_units(x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride,
                              begin, end));
}

i64 refitd_fp8_per_tensor(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q,
                          i64 q_bstride, i64 q_rstride, float scale, int clamp, i64 begin, i64 end) {
    return fenced(fp8_per_tensor_units(x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, scale, clamp, begin,
                                       end));
}

/* groups [begin, end) of members (common.h's layout; s unused): scales[g] is group g's scale. Returns -1,
   or the first group holding NaN/Inf. */
i64 refitd_fp8_per_tensor_groups(const i64 *members, const i64 *first, i64 begin, i64 end, float *scales) {
    pt_scale p;
    return fenced(run_groups(members, first, begin, end, scales, NULL, &p, pt_group_scale, pt_group_row));
}

/* the groups of [*claim, end) this thread takes from the counter *claim, which every thread running the run
   shares (run_groups): -1, or the first group it met holding NaN/Inf */
i64 refitd_fp8_per_tensor_groups_claimed(const i64 *members, const i64 *first, i64 *claim, i64 end,
                                         float *scales) {
    pt_scale p;
    return fenced(run_groups(members, first, 0, end, scales, claim, &p, pt_group_scale, pt_group_row));
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
