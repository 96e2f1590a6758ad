/*
 * refitd native CPU quantizers, 4-bit formats (SPEC 1.5-1.7): NVFP4, MXFP4 and INT4 weight-only,
 * byte-exact with sidecar/numerics/fourbit.py. Conventions (strided [batch, n, k] views, [begin, end)
 * shares, -1 or the first row holding NaN/Inf) are quant.c's; see its header.
 *
 * All three round a quotient (or product) of each element and its block's scale to a 4-bit code:
 * E2M1 (RNE to {0, .5, 1, 1.5, 2, 3, 4, 6}) or INT4 (RNE to an integer, clamped to 7). Neither is computed
 * per element. v = RN(|x| op d) is monotone in |x| (op: the float32 division or multiplication the
 * reference runs), so each of the code's tests ("v > 0.25", "v >= 0.75", ...) holds exactly for |x|'s
 * sign-cleared bf16 bits at or above some threshold. The thresholds of a scale are found once, by running
 * that very operation on a handful of bf16 values (first_passing), and an element's code is the count of
 * the thresholds at or below it: seven 16-bit compares, sixteen elements at a time. Pairs of codes are
 * packed into bytes in the register.
 *
 * Work units are rows, numbered b * n + row. Rows are taken a piece of FOUR_PIECE elements at a time (the
 * piece's block maxima, scale bytes and codes stay in L1).
 */

#include "common.h"

#define NVFP4_BLOCK 16
#define MXFP4_BLOCK 32
#define FOUR_PIECE 1024                /* elements of a row per pass */
#define NVFP4_SCALE_MIN 0.001953125f   /* 2^-9: SPEC 1.5's lower clamp of a block scale */
#define TESTS 8                        /* seven magnitude tests (code 1..7) and E2M1's sign test */

/* 16 lanes of 16 bits (GCC vector extensions, gcc and clang: AVX2 / AVX-512 where -march has them, else
   narrower); a comparison's lanes are -1 or 0 */
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

/* ---------------------------------------------------------------------------------------------- */
/* thresholds                                                                                     */

/* E2M1 (fourbit.e2m1_codes): code c >= i + 1 iff v passes test i; ties go to the even code, so the
   midpoints below an odd code are strict and those below an even one are not. Test 7: "v > 0", E2M1's
   sign (bit 3 is set iff x < 0 and RN(|x| op d) > 0; -0.0 and quotients that underflow are code 0). */
static const float E2M1_AT[TESTS] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.0f};
static const uint8_t E2M1_STRICT[TESTS] = {1, 0, 1, 0, 1, 0, 1, 1};
/* INT4 (fourbit.quantize_int4): |q| = min(7, RNE(v)) >= i + 1 iff v passes test i (RNE: .5 goes down to
   0, 1.5 up to 2, ...) */
static const float INT4_AT[7] = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f};
static const uint8_t INT4_STRICT[7] = {1, 0, 1, 0, 1, 0, 1};

/* a scale's TESTS thresholds, each minus one (so that "a >= threshold" is the one-instruction signed
   "a > threshold - 1": sign-cleared bf16 bits and thresholds are below 0x8000), broadcast to a vector */
static void thresholds(float d, int multiply, const float *at, const uint8_t *strict, int tests,
                       i16x16 *restrict out) {
    for (int i = 0; i < tests; i++) {
        const i16x16 zero = {0};
        out[i] = zero + (int16_t)(first_passing(d, multiply, at[i], strict[i]) - 1);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* codes: sixteen elements at a time, as 32-bit lanes holding code(2t) | code(2t + 1) << 4 in their low byte */

static inline i16x16 load16(const uint16_t *x) {
    i16x16 v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* minus the count of th[0..6] at or below |x| (the code's magnitude, negated) */
static inline i16x16 minus_magnitude(i16x16 a, const i16x16 *th) {
    return ((a > th[0]) + (a > th[1])) + ((a > th[2]) + (a > th[3])) + ((a > th[4]) + (a > th[5])) + (a > th[6]);
}

static inline u8x32 code_pairs(i16x16 c) {
    u32x8 w;
    memcpy(&w, &c, sizeof w);
    w |= w >> 12;
    u8x32 bytes;
    memcpy(&bytes, &w, sizeof bytes);
    return bytes;
}

/* E2M1 codes: magnitude, bit 3 for x < 0 past the sign threshold */
static inline u8x32 e2m1_pairs(const uint16_t *x, const i16x16 *th) {
    const i16x16 xv = load16(x), a = xv & (int16_t)MAG_MASK;
    return code_pairs(-minus_magnitude(a, th) | ((xv >> 15) & (a > th[7]) & 8));
}

/* INT4 nibbles: 8 + q, q = +-magnitude by x's sign */
static inline u8x32 int4_pairs(const uint16_t *x, const i16x16 *th) {
    const i16x16 xv = load16(x), sign = xv >> 15; /* -1 where x < 0 */
    return code_pairs(((-minus_magnitude(xv & (int16_t)MAG_MASK, th) ^ sign) - sign) + 8);
}

static inline u8x16 pack2(u8x32 lo, u8x32 hi) {
    return __builtin_shufflevector(lo, hi, 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
}

static inline u8x8 pack1(u8x32 lo) { return __builtin_shufflevector(lo, lo, 0, 4, 8, 12, 16, 20, 24, 28); }

/* E2M1 codes of n16 runs of sixteen elements of x, run r with the thresholds of scale byte
   codes[r >> shift] (thr[byte]: a block of 16 << shift elements a byte), packed into q[0..8 n16) */
static void e2m1_runs(const uint16_t *restrict x, i64 n16, const i16x16 (*thr)[TESTS], const uint32_t *codes,
                      int shift, uint8_t *restrict q, const uint16_t *ahead) {
    i64 r = 0;
    for (; r + 2 <= n16; r += 2) {
        if (ahead) __builtin_prefetch(ahead + 16 * r, 0, 3); /* a line of another row per line of x */
        const u8x16 b = pack2(e2m1_pairs(x + 16 * r, thr[codes[r >> shift]]),
                              e2m1_pairs(x + 16 * (r + 1), thr[codes[(r + 1) >> shift]]));
        memcpy(q + 8 * r, &b, sizeof b);
    }
    if (r < n16) {
        const u8x8 b = pack1(e2m1_pairs(x + 16 * r, thr[codes[r >> shift]]));
        memcpy(q + 8 * r, &b, sizeof b);
    }
}

/* Rows shorter than a piece (a down projection's 512) are taken several at a time where they follow one
   another in x and in every output (row strides equal to the row's length in each): as one row of their
   total length, which the kernels' loops run at the cost per element of long rows (the per-row work of
   a row of 512, NVFP4 and INT4: ~0.21 -> ~0.17 ns an element). Nothing crosses a row: every block and
   group lies within one. */

/* how many rows to take as one (at most ``most``, and at most ``left``: a share's rows still to do): 1
   unless the strides are dense */
static inline i64 rows_at_once(i64 k, int dense, i64 most, i64 left) {
    most = left < most ? left : most;
    if (!dense || k >= FOUR_PIECE) return 1;
    const i64 rows = FOUR_PIECE / k;
    return rows < most ? (rows > 0 ? rows : 1) : most;
}

/* the first of ``rows`` rows of k elements at x (stride k) holding NaN/Inf, from ``unit`` (a piece of them did) */
static i64 first_nonfinite_row(const uint16_t *x, i64 k, i64 rows, i64 unit) {
    for (i64 r = 0; r < rows; r++)
        if (row_amax_bits(x + r * k, k) >= BF16_NONFINITE) return unit + r;
    return unit;
}

/* ---------------------------------------------------------------------------------------------- */
/* NVFP4                                                                                          */

/* the value of a positive finite e4m3fn byte */
static inline float e4m3_value(uint32_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    return e == 0 ? (float)m * f32_from_bits(UINT32_C(0x3B000000)) /* m * 2^-9 */
                  : f32_from_bits(((e + 120u) << 23) | (m << 20));
}

/* A call's table of E2M1 thresholds per scale byte covers the bytes [*lo, *hi] met so far (a call's bytes
   span a few binades); this widens it to [bmin, bmax], filling only the new bytes. NVFP4's divisor for
   byte b is e4m3(b) * gs, MXFP4's multiplier 2^(127 - b). */
static void grow_thresholds(i16x16 (*thr)[TESTS], uint32_t *lo, uint32_t *hi, uint32_t bmin, uint32_t bmax,
                            float gs, int mxfp4) {
    const uint32_t from = bmin < *lo ? bmin : *lo, to = bmax > *hi ? bmax : *hi;
    for (uint32_t byte = from; byte <= to; byte++) {
        if (byte >= *lo && byte <= *hi) continue;
        if (mxfp4) thresholds(e8m0_multiplier(byte), 1, E2M1_AT, E2M1_STRICT, TESTS, thr[byte]);
        else thresholds(e4m3_value(byte) * gs, 0, E2M1_AT, E2M1_STRICT, TESTS, thr[byte]);
    }
    *lo = from;
    *hi = to;
}

/* a global scale's state: gs, and the thresholds of the positive e4m3 scale bytes [lo_byte, hi_byte] met
   so far (a call's bytes span a few binades: filled as the range grows) */
typedef struct {
    float gs, six_gs;
    uint32_t lo_byte, hi_byte;
    i16x16 thr[128][TESTS];
} nvfp4_state;

static void nvfp4_state_init(nvfp4_state *st, float gs) {
    st->gs = gs;
    st->six_gs = 6.0f * gs;
    st->lo_byte = 128;
    st->hi_byte = 0;
}

/* block_amaxes of m blocks of 16, not inlined into nvfp4_piece's instances (with m a constant, gcc warns of
   an iteration of its last loop that never runs) */
static __attribute__((noinline, noclone)) void nvfp4_amaxes(const uint16_t *x, i64 m, uint32_t *out) { block_amaxes(x, m, 1, out); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define REFITD_FOUR_VEC 1
/* NVFP4's scale bytes of m blocks from their maxima (float32 bits), sixteen at a time: codes[j] (and the
   bytes at sp) = e4m3_from_f32_in_range(clamp(amax == 0 ? 1 : amax / six_gs, 2^-9, 448)), the scalar
   loops' very operations (which gcc vectorized only in part: 0.068 -> 0.055 ns an element for the blocks'
   maxima and scales, in L2); *bmin, *bmax their range. Nonzero (nothing written) if a maximum is NaN/Inf. */
static inline int nvfp4_scales_vec(const uint32_t *amax, i64 m, float six_gs, uint32_t *codes, uint8_t *sp,
                                   uint32_t *bmin, uint32_t *bmax) {
    __m512i worst = _mm512_setzero_si512();
    for (i64 j = 0; j < m; j += 16) {
        const __mmask16 keep = m - j >= 16 ? 0xFFFF : (__mmask16)((1u << (m - j)) - 1);
        worst = _mm512_max_epu32(worst, _mm512_maskz_loadu_epi32(keep, amax + j));
    }
    if (_mm512_cmpge_epu32_mask(worst, _mm512_set1_epi32((int)NONFINITE_F32))) return 1;
    const __m512 div = _mm512_set1_ps(six_gs), one = _mm512_set1_ps(1.0f);
    const __m512 lo = _mm512_set1_ps(NVFP4_SCALE_MIN), hi = _mm512_set1_ps(FP8_MAX);
    __m512i least = _mm512_set1_epi32(127), most = _mm512_setzero_si512();
    for (i64 j = 0; j < m; j += 16) {
        const __mmask16 keep = m - j >= 16 ? 0xFFFF : (__mmask16)((1u << (m - j)) - 1);
        const __m512i a = _mm512_maskz_loadu_epi32(keep, amax + j);
        __m512 sf = _mm512_div_ps(_mm512_castsi512_ps(a), div);
        sf = _mm512_mask_mov_ps(sf, _mm512_cmpeq_epi32_mask(a, _mm512_setzero_si512()), one);
        sf = _mm512_min_ps(_mm512_max_ps(sf, lo), hi); /* as the scalar selects: sf is never NaN here */
        /* e4m3_from_f32_in_range, positive: below 2^-6 by the float add, else rebased and rounded on the bits */
        const __m512i bits = _mm512_castps_si512(sf);
        const __mmask16 small = _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32((int)(UINT32_C(121) << 23)));
        const __m512i code = _mm512_mask_mov_epi32(e4m3_normal(bits), small, e4m3_subnormal(sf));
        _mm512_mask_storeu_epi32(codes + j, keep, code);
        _mm_mask_storeu_epi8(sp + j, keep, _mm512_cvtepi32_epi8(code));
        least = _mm512_mask_min_epu32(least, keep, least, code);
        most = _mm512_mask_max_epu32(most, keep, most, code);
    }
    *bmin = _mm512_reduce_min_epu32(least);
    *bmax = _mm512_reduce_max_epu32(most);
    return 0;
}
#else
#define REFITD_FOUR_VEC 0
#endif

/* m blocks of 16 elements (a piece of a row, m <= FOUR_PIECE / 16): q [8 m] bytes, s [m] e4m3 bytes; nonzero if
   they hold NaN/Inf. Inlined with m a constant for the usual pieces (nvfp4_row): loops of a fixed count,
   without the vector loops' scalar ends (a row of 512 cost ~50 ns over its arithmetic) */
static inline __attribute__((always_inline)) int nvfp4_piece(nvfp4_state *st, const uint16_t *xp, uint8_t *qp,
                                                             uint8_t *sp, i64 m, const uint16_t *ahead) {
    uint32_t amax[FOUR_PIECE / NVFP4_BLOCK], codes[FOUR_PIECE / NVFP4_BLOCK];
    nvfp4_amaxes(xp, m, amax);
#if REFITD_FOUR_VEC
    uint32_t bmin, bmax;
    if (nvfp4_scales_vec(amax, m, st->six_gs, codes, sp, &bmin, &bmax)) return 1;
#else
    uint8_t bytes[FOUR_PIECE / NVFP4_BLOCK];
    float sfs[FOUR_PIECE / NVFP4_BLOCK];
    if (largest(amax, m) >= NONFINITE_F32) return 1;
    /* simple loops (each vectorizes; one doing it all does not) */
    for (i64 j = 0; j < m; j++) {
        float sf = f32_from_bits(amax[j]) / st->six_gs;
        sf = amax[j] == 0 ? 1.0f : sf;
        sf = sf < NVFP4_SCALE_MIN ? NVFP4_SCALE_MIN : sf;
        sfs[j] = sf > FP8_MAX ? FP8_MAX : sf;
    }
    for (i64 j = 0; j < m; j++) codes[j] = e4m3_from_f32_in_range(sfs[j]);
    uint32_t bmin = 127, bmax = 0; /* apart from the conversion: each loop vectorizes whole */
    for (i64 j = 0; j < m; j++) {
        bmin = codes[j] < bmin ? codes[j] : bmin;
        bmax = codes[j] > bmax ? codes[j] : bmax;
    }
    for (i64 j = 0; j < m; j++) bytes[j] = (uint8_t)codes[j];
    memcpy(sp, bytes, (size_t)m);
#endif
    if (bmin < st->lo_byte || bmax > st->hi_byte)
        grow_thresholds(st->thr, &st->lo_byte, &st->hi_byte, bmin, bmax, st->gs, 0);
    e2m1_runs(xp, m, (const i16x16(*)[TESTS])st->thr, codes, 0, qp, ahead);
    return 0;
}

/* one row of k elements: q [k/2] bytes, s [k/16] e4m3 bytes; nonzero if it holds NaN/Inf. ahead: another row
   of ahead_len elements to prefetch while computing (NULL: none) */
static int nvfp4_row(nvfp4_state *st, const uint16_t *xr, uint8_t *qr, uint8_t *sr, i64 k, const uint16_t *ahead,
                     i64 ahead_len) {
    for (i64 p0 = 0; p0 < k; p0 += FOUR_PIECE) {
        const i64 len = k - p0 < FOUR_PIECE ? k - p0 : FOUR_PIECE, m = len / NVFP4_BLOCK;
        const uint16_t *pf = ahead && p0 + len <= ahead_len ? ahead + p0 : NULL;
        int bad;
        if (m == FOUR_PIECE / NVFP4_BLOCK) /* a whole piece (rows of 1024 elements or more) */
            bad = nvfp4_piece(st, xr + p0, qr + p0 / 2, sr + p0 / NVFP4_BLOCK, FOUR_PIECE / NVFP4_BLOCK, pf);
        else if (m == 32) /* rows of 512 (a down projection's) */
            bad = nvfp4_piece(st, xr + p0, qr + p0 / 2, sr + p0 / NVFP4_BLOCK, 32, pf);
        else
            bad = nvfp4_piece(st, xr + p0, qr + p0 / 2, sr + p0 / NVFP4_BLOCK, m, pf);
        if (bad) return 1;
    }
    return 0;
}

/* NVFP4: s = RNE_e4m3(clamp(amax_b == 0 ? 1 : amax_b / (6 gs), 2^-9, 448)); q = RNE_e2m1(x / (s * gs)).
   q [n, k/2] bytes, s [n, k/16] e4m3 bytes. */
i64 refitd_nvfp4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, float gs, i64 begin, i64 end) {
    nvfp4_state st;
    nvfp4_state_init(&st, gs);
    const int dense = x_rstride == k && q_rstride == k / 2 && s_rstride == k / NVFP4_BLOCK;
    for (i64 unit = begin; unit < end;) {
        const i64 b = unit / n, row = unit % n;
        const i64 rows = rows_at_once(k, dense, n - row, end - unit);
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        if (nvfp4_row(&st, xr, q + b * q_bstride + row * q_rstride, s + b * s_bstride + row * s_rstride, rows * k,
                      NULL, 0))
            return first_nonfinite_row(xr, k, rows, unit);
        unit += rows;
    }
    return -1;
}

/* NVFP4 scale groups (common.h's run_groups): gs = amax / 2688 in float32 (1 for amax == 0: SPEC 1.5's
   global scale, fourbit.nvfp4_global_scale), then the members' rows by it */
static void nvfp4_group_scale(void *ctx, uint32_t amax, float *scale) {
    *scale = amax == 0 ? 1.0f : bf16_to_f32((uint16_t)amax) / (6.0f * FP8_MAX);
    nvfp4_state_init(ctx, *scale);
}

static i64 nvfp4_group_row(void *ctx, const i64 *f, i64 unit, i64 most, const uint16_t *ahead, i64 ahead_len) {
    const i64 b = unit / f[2], row = unit % f[2], k = f[3];
    const i64 rows = rows_at_once(k, f[5] == k && f[8] == k / 2 && f[11] == k / NVFP4_BLOCK, most, most);
    const int bad = nvfp4_row(ctx, member_x(f, unit), (uint8_t *)(uintptr_t)f[6] + b * f[7] + row * f[8],
                              (uint8_t *)(uintptr_t)f[9] + b * f[10] + row * f[11], rows * k, ahead, ahead_len);
    return bad ? 0 : rows;
}

/* groups [begin, end) of members (common.h's layout): scales[g] is group g's gs. Returns -1, or the first
   group holding NaN/Inf. */
i64 refitd_nvfp4_groups(const i64 *members, const i64 *first, i64 begin, i64 end, float *scales) {
    nvfp4_state st;
    return run_groups(members, first, begin, end, scales, NULL, &st, nvfp4_group_scale, nvfp4_group_row);
}

/* the groups of [*claim, end) this thread takes from the counter *claim, which every thread running the run
   shares (run_groups): -1, or the first group it met holding NaN/Inf */
i64 refitd_nvfp4_groups_claimed(const i64 *members, const i64 *first, i64 *claim, i64 end, float *scales) {
    nvfp4_state st;
    return run_groups(members, first, 0, end, scales, claim, &st, nvfp4_group_scale, nvfp4_group_row);
}

/* ---------------------------------------------------------------------------------------------- */
/* MXFP4                                                                                          */

/* MXFP4: byte = clamp(E(amax) + (significand >= 1.75) - 2, 1, 254) (1 for amax == 0);
   q = RNE_e2m1(x * 2^(127 - byte)). q [n, k/2] bytes, s [n, k/32] bytes. */
i64 refitd_mxfp4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, uint8_t *q, i64 q_bstride,
                 i64 q_rstride, uint8_t *s, i64 s_bstride, i64 s_rstride, i64 begin, i64 end) {
    i16x16 thr[256][TESTS]; /* thresholds of the scale bytes [lo_byte, hi_byte] met so far */
    uint32_t lo_byte = 256, hi_byte = 0;
    const int dense = x_rstride == k && q_rstride == k / 2 && s_rstride == k / MXFP4_BLOCK;
    for (i64 unit = begin; unit < end;) {
        const i64 b = unit / n, row = unit % n;
        const i64 rows = rows_at_once(k, dense, n - row, end - unit), kr = rows * k;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        uint8_t *qr = q + b * q_bstride + row * q_rstride;
        uint8_t *sr = s + b * s_bstride + row * s_rstride;
        for (i64 p0 = 0; p0 < kr; p0 += FOUR_PIECE) {
            const i64 len = kr - p0 < FOUR_PIECE ? kr - p0 : FOUR_PIECE, m = len / MXFP4_BLOCK;
            const uint16_t *xp = xr + p0;
            uint32_t amax[FOUR_PIECE / MXFP4_BLOCK], codes[FOUR_PIECE / MXFP4_BLOCK];
            block_amaxes(xp, m, 2, amax);
            if (largest(amax, m) >= NONFINITE_F32) return first_nonfinite_row(xr, k, rows, unit);
            uint32_t bmin = 255, bmax = 0;
            for (i64 j = 0; j < m; j++) {
                /* float32 bits: the exponent field, and significand >= 1.75 iff the top two mantissa bits */
                const uint32_t a = amax[j];
                int32_t byte = (int32_t)(a >> 23) + (((a >> 21) & 3u) == 3u) - 2;
                byte = byte < 1 ? 1 : (byte > 254 ? 254 : byte);
                codes[j] = a == 0 ? 1u : (uint32_t)byte;
                sr[p0 / MXFP4_BLOCK + j] = (uint8_t)codes[j];
                bmin = codes[j] < bmin ? codes[j] : bmin;
                bmax = codes[j] > bmax ? codes[j] : bmax;
            }
            if (bmin < lo_byte || bmax > hi_byte) grow_thresholds(thr, &lo_byte, &hi_byte, bmin, bmax, 0.0f, 1);
            e2m1_runs(xp, 2 * m, (const i16x16(*)[TESTS])thr, codes, 1, qr + p0 / 2, NULL);
        }
        unit += rows;
    }
    return -1;
}

/* ---------------------------------------------------------------------------------------------- */
/* INT4 weight-only                                                                               */

/* float32 -> bfloat16 bits, round to nearest even (finite values) */
static inline uint16_t bf16_bits_rne(float f) {
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16);
}

/* a group's scale from its amax (bf16 bits): amax / 7 (1 for amax == 0), rounded to bf16 unless scale_f32 */
static inline float int4_scale(uint32_t amax, int scale_f32) {
    const float sf = amax == 0 ? 1.0f : bf16_to_f32((uint16_t)amax) / 7.0f;
    return scale_f32 ? sf : bf16_to_f32(bf16_bits_rne(sf));
}

/* INT4's thresholds depend on the group's amax alone (no global scale): one table per scale dtype for the
   whole process, indexed by the amax's bf16 bits and filled on first use (1 MiB of zeroed memory, of which
   the entries of the amaxes met are touched: 16 bytes each, so a model's few hundred stay in L1 beside the
   streamed weights; held as vectors, 224 bytes each, they measured slower on a slab in memory). An entry is
   claimed (0 -> 1) by one thread, written, then published (-> 2); a thread finding it claimed computes its
   own copy. */
#define INT4_TESTS 7
static uint16_t int4_table[2][BF16_NONFINITE][TESTS];
static uint8_t int4_state[2][BF16_NONFINITE];

static const uint16_t *int4_fill(uint32_t amax, int f32, uint16_t *restrict scratch) {
    const float sf = int4_scale(amax, f32);
    for (int i = 0; i < INT4_TESTS; i++)
        scratch[i] = (uint16_t)(first_passing(sf, 0, INT4_AT[i], INT4_STRICT[i]) - 1);
    uint8_t expected = 0;
    if (!__atomic_compare_exchange_n(&int4_state[f32][amax], &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return scratch;
    memcpy(int4_table[f32][amax], scratch, INT4_TESTS * sizeof *scratch);
    __atomic_store_n(&int4_state[f32][amax], 2, __ATOMIC_RELEASE);
    return int4_table[f32][amax];
}

/* the thresholds - 1 of a group of this amax (bf16 bits): the table's entry, or scratch filled */
static inline const uint16_t *int4_thresholds(uint32_t amax, int f32, uint16_t *restrict scratch) {
    if (__atomic_load_n(&int4_state[f32][amax], __ATOMIC_ACQUIRE) == 2) return int4_table[f32][amax];
    return int4_fill(amax, f32, scratch);
}

/* groups of a multiple of 16 elements: a pass takes a piece of whole groups where the group divides
   FOUR_PIECE, else one group; each group's amax by block_amaxes, its scale, its thresholds from the
   table, then its runs of sixteen. */
/* block_amaxes for int4_piece, not inlined into its instances (as nvfp4_amaxes) */
static __attribute__((noinline, noclone)) void int4_amaxes(const uint16_t *x, i64 m, i64 vecs, uint32_t *out) {
    block_amaxes(x, m, vecs, out);
}

/* m groups of 16 * vecs elements at xp: q at qp (nibbles), their scales at s_at (float32 if f32, else bf16
   bits); nonzero if they hold NaN/Inf. Inlined with m and vecs constants for group 32's usual pieces
   (int4_rows_fast): loops of a fixed count */
static inline __attribute__((always_inline)) int int4_piece(const uint16_t *xp, uint8_t *qp, void *s_at, i64 m,
                                                            i64 vecs, int f32) {
    const i64 group = 16 * vecs;
    uint32_t amax[FOUR_PIECE / 16];
    int4_amaxes(xp, m, vecs, amax);
    if (largest(amax, m) >= NONFINITE_F32) return 1;
    /* the groups' scales in simple loops (they vectorize) */
    float sfs[FOUR_PIECE / 16];
    for (i64 j = 0; j < m; j++) sfs[j] = amax[j] == 0 ? 1.0f : f32_from_bits(amax[j]) / 7.0f;
    if (f32) {
        memcpy(s_at, sfs, (size_t)m * sizeof(float));
    } else {
        uint16_t hs[FOUR_PIECE / 16];
        for (i64 j = 0; j < m; j++) hs[j] = bf16_bits_rne(sfs[j]);
        memcpy(s_at, hs, (size_t)m * sizeof(uint16_t));
    }
    for (i64 j = 0; j < m; j++) {
        uint16_t scratch[TESTS];
        const uint16_t *t = int4_thresholds(amax[j] >> 16, f32, scratch);
        const i16x16 zero = {0};
        /* the group's thresholds broadcast into registers (not through memory) */
        const i16x16 th[INT4_TESTS] = {zero + (int16_t)t[0], zero + (int16_t)t[1], zero + (int16_t)t[2],
                                       zero + (int16_t)t[3], zero + (int16_t)t[4], zero + (int16_t)t[5],
                                       zero + (int16_t)t[6]};
        const uint16_t *xg = xp + j * group;
        uint8_t *qg = qp + j * group / 2;
        i64 v = 0;
        for (; v + 2 <= vecs; v += 2) {
            const u8x16 bytes = pack2(int4_pairs(xg + 16 * v, th), int4_pairs(xg + 16 * (v + 1), th));
            memcpy(qg + 8 * v, &bytes, sizeof bytes);
        }
        if (v < vecs) {
            const u8x8 bytes = pack1(int4_pairs(xg + 16 * v, th));
            memcpy(qg + 8 * v, &bytes, sizeof bytes);
        }
    }
    return 0;
}

static i64 int4_rows_fast(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, int32_t *q,
                          i64 q_bstride, i64 q_rstride, void *s, i64 s_bstride, i64 s_rstride, i64 group,
                          int scale_f32, i64 begin, i64 end) {
    const i64 vecs = group / 16, span = FOUR_PIECE % group == 0 ? FOUR_PIECE : group;
    const int f32 = scale_f32 != 0;
    const size_t s_size = f32 ? sizeof(float) : sizeof(uint16_t);
    const int dense = x_rstride == k && q_rstride == k / 8 && s_rstride == k / group;
    for (i64 unit = begin; unit < end;) {
        const i64 b = unit / n, row = unit % n;
        const i64 rows = rows_at_once(k, dense, n - row, end - unit), kr = rows * k;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        uint8_t *qr = (uint8_t *)(q + b * q_bstride + row * q_rstride); /* int32 words, little-endian */
        for (i64 p0 = 0; p0 < kr; p0 += span) {
            const i64 len = kr - p0 < span ? kr - p0 : span, m = len / group;
            void *s_at = (char *)s + (size_t)(b * s_bstride + row * s_rstride + p0 / group) * s_size;
            int bad;
            if (vecs == 2 && m == FOUR_PIECE / 32) /* group 32 (the default), a whole piece */
                bad = int4_piece(xr + p0, qr + p0 / 2, s_at, FOUR_PIECE / 32, 2, f32);
            else if (vecs == 2 && m == 16) /* group 32, rows of 512 (a down projection's) */
                bad = int4_piece(xr + p0, qr + p0 / 2, s_at, 16, 2, f32);
            else
                bad = int4_piece(xr + p0, qr + p0 / 2, s_at, m, vecs, f32);
            if (bad) return first_nonfinite_row(xr, k, rows, unit);
        }
        unit += rows;
    }
    return -1;
}

/* q + 8 of x / sf, clamped (0 where x == 0), as a nibble */
static inline uint8_t int4_nibble(uint16_t x, float sf) {
    const float xf = bf16_to_f32(x);
    float v = __builtin_rintf(xf / sf);
    v = v > 7.0f ? 7.0f : (v < -7.0f ? -7.0f : v);
    v = xf == 0.0f ? 0.0f : v;
    return (uint8_t)((int32_t)v + 8);
}

/* len nibbles (a multiple of 8), eight to an int32 word */
static void int4_pack(const uint8_t *restrict nib, i64 len, int32_t *restrict qw) {
    for (i64 j = 0; j < len / 8; j++) {
        uint32_t word = 0;
        for (int i = 0; i < 8; i++) word |= (uint32_t)nib[8 * j + i] << (4 * i);
        qw[j] = (int32_t)word;
    }
}

/* groups of 8 (the only multiple of 8 the threshold path leaves that divides FOUR_PIECE): a piece of them
   at a time, their maxima by a tree of pairwise maxima, scales in simple loops, then every element */
static i64 int4_rows_group8(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, int32_t *q,
                            i64 q_bstride, i64 q_rstride, void *s, i64 s_bstride, i64 s_rstride, int scale_f32,
                            i64 begin, i64 end) {
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        int32_t *qr = q + b * q_bstride + row * q_rstride;
        for (i64 p0 = 0; p0 < k; p0 += FOUR_PIECE) {
            const i64 len = k - p0 < FOUR_PIECE ? k - p0 : FOUR_PIECE, m = len / 8;
            uint16_t tree[FOUR_PIECE / 2], twig[FOUR_PIECE / 4];
            pair_max(xr + p0, tree, len / 2, MAG_MASK);
            pair_max(tree, twig, len / 4, 0xFFFFu);
            pair_max(twig, tree, m, 0xFFFFu); /* tree[j]: group j's amax bits */
            uint32_t worst = 0;
            for (i64 j = 0; j < m; j++) worst = tree[j] > worst ? tree[j] : worst;
            if (worst >= BF16_NONFINITE) return unit;
            float sfs[FOUR_PIECE / 8], spread[FOUR_PIECE];
            for (i64 j = 0; j < m; j++) sfs[j] = tree[j] == 0 ? 1.0f : bf16_to_f32(tree[j]) / 7.0f;
            const i64 at = b * s_bstride + row * s_rstride + p0 / 8;
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
                for (i64 t = 0; t < 8; t++) spread[8 * j + t] = sfs[j];
            uint8_t nib[FOUR_PIECE];
            for (i64 t = 0; t < len; t++) nib[t] = int4_nibble(xr[p0 + t], spread[t]);
            int4_pack(nib, len, qr + p0 / 8);
        }
    }
    return -1;
}

/* INT4 weight-only: s = amax == 0 ? 1 : amax / 7, rounded to bf16 unless scale_f32;
   q = clamp(RNE(x / s), -7, 7) (0 where x == 0: also when s underflowed to 0, where 0 / 0 is NaN);
   packed [n, k/8] int32 words (nibble q + 8 of element 8j + i at bits 4i), s [n, k/group].
   Groups the threshold path does not take (not a multiple of 16) divide per element: groups of 8 a piece
   of them at a time, others (24, 40, ...) a group at a time. */
i64 refitd_int4(const uint16_t *x, i64 n, i64 k, i64 x_bstride, i64 x_rstride, int32_t *q, i64 q_bstride,
                i64 q_rstride, void *s, i64 s_bstride, i64 s_rstride, i64 group, int scale_f32, i64 begin,
                i64 end) {
    if (group % 16 == 0)
        return int4_rows_fast(x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride,
                              group, scale_f32, begin, end);
    if (group == 8)
        return int4_rows_group8(x, n, k, x_bstride, x_rstride, q, q_bstride, q_rstride, s, s_bstride, s_rstride,
                                scale_f32, begin, end);
    for (i64 unit = begin; unit < end; unit++) {
        const i64 b = unit / n, row = unit % n;
        const uint16_t *xr = x + b * x_bstride + row * x_rstride;
        int32_t *qr = q + b * q_bstride + row * q_rstride;
        for (i64 g0 = 0; g0 < k; g0 += group) {
            const uint32_t amax = row_amax_bits(xr + g0, group);
            if (amax >= BF16_NONFINITE) return unit;
            const float sf = int4_scale(amax, scale_f32);
            const i64 at = b * s_bstride + row * s_rstride + g0 / group;
            if (scale_f32) ((float *)s)[at] = sf;
            else ((uint16_t *)s)[at] = (uint16_t)(f32_bits(sf) >> 16);
            uint8_t nib[FOUR_PIECE];
            for (i64 c0 = 0; c0 < group; c0 += FOUR_PIECE) {
                const i64 len = group - c0 < FOUR_PIECE ? group - c0 : FOUR_PIECE;
                for (i64 t = 0; t < len; t++) nib[t] = int4_nibble(xr[g0 + c0 + t], sf);
                int4_pack(nib, len, qr + (g0 + c0) / 8);
            }
        }
    }
    return -1;
}
