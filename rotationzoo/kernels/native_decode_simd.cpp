/* The vectorized inner loops of native_decode.cpp (AVX2 + FMA + F16C), one translation unit of their
 * own so that the two compile in parallel: scores of up to RB_MAX query rows over a tile of INT2 rows
 * and their value sums (the two fused across tiles where the scores use tables), and the window rows'
 * value sums (their scores take the portable loop). See native_decode.cpp for the method. */
#include "native_decode.h"

namespace rz {
namespace {

#if RZ_AVX2
/* out[j], j = 0..15: byte `off + j` of the 8 rows r[0..7] widened to 8 int32 lanes (lane u = row u): an
 * 8 x 16 byte transpose in three rounds of unpacks. */
inline void transpose8x16(const uint8_t *const r[8], int off, __m256i out[16]) {
    __m128i x[8];
    for (int u = 0; u < 8; u++) x[u] = _mm_loadu_si128((const __m128i *)(r[u] + off));
    __m128i a[8], b[8];
    for (int u = 0; u < 4; u++) { /* rows 2u, 2u+1 interleaved: bytes 0-7 (a[u]) and 8-15 (a[u+4]) */
        a[u] = _mm_unpacklo_epi8(x[2 * u], x[2 * u + 1]);
        a[u + 4] = _mm_unpackhi_epi8(x[2 * u], x[2 * u + 1]);
    }
    for (int h = 0; h < 2; h++) /* rows 0-3 and 4-7 of bytes 0-3, 4-7 (h = 0) or 8-11, 12-15 (h = 1) */
        for (int v = 0; v < 2; v++) {
            b[4 * h + 2 * v] = _mm_unpacklo_epi16(a[4 * h + 2 * v], a[4 * h + 2 * v + 1]);
            b[4 * h + 2 * v + 1] = _mm_unpackhi_epi16(a[4 * h + 2 * v], a[4 * h + 2 * v + 1]);
        }
    for (int h = 0; h < 2; h++)
        for (int v = 0; v < 2; v++) { /* bytes 8h + 4v + {0, 1} and {2, 3} of the 8 rows */
            const __m128i lo = _mm_unpacklo_epi32(b[4 * h + v], b[4 * h + 2 + v]);
            const __m128i hi = _mm_unpackhi_epi32(b[4 * h + v], b[4 * h + 2 + v]);
            const int j = 8 * h + 4 * v;
            out[j] = _mm256_cvtepu8_epi32(lo);
            out[j + 1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
            out[j + 2] = _mm256_cvtepu8_epi32(hi);
            out[j + 3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        }
}

/* Raw scores sum_i q'_i (c_i 4^a)(s_g) of RB query rows for tokens 0..nn (rows past n repeat the
 * last), stored [RB][TILE]. Eight tokens at a time with the code bytes transposed, so that each lane
 * is a token and no horizontal sum is needed: per byte j, each quarter is masked in place and converted
 * once for all RB rows, and one accumulator per (row, quarter) takes a multiply-add with the broadcast
 * query value. With several groups per row, each 8-byte chunk's quarter sums are scaled by the lanes'
 * group scales before they are added up. */
template <int D, int RB>
void k_int2_avx2(const uint8_t *base, int64_t st, int n, int nn, bool grouped, const float *qs, const float *ks,
                 const int *gidx, float *out) {
    constexpr int Q = D / 4, C8 = Q / 8;
    alignas(32) static const int32_t mask_bits[4][8] = {{3, 3, 3, 3, 3, 3, 3, 3}, {12, 12, 12, 12, 12, 12, 12, 12},
                                                         {48, 48, 48, 48, 48, 48, 48, 48},
                                                         {192, 192, 192, 192, 192, 192, 192, 192}};
    for (int t = 0; t < nn; t += 8) {
        const uint8_t *rows[8];
        for (int u = 0; u < 8; u++) rows[u] = base + (int64_t)(t + u < n ? t + u : n - 1) * st;
        __m256 tot[RB];
        for (int i = 0; i < RB; i++) tot[i] = _mm256_setzero_ps();
        for (int cb = 0; cb < Q / 16; cb++) {
            __m256i bj[16];
            transpose8x16(rows, 16 * cb, bj);
            for (int h = 0; h < 2; h++) { /* the 8-byte chunk c = 2 cb + h */
                __m256 acc[RB][4];
                for (int i = 0; i < RB; i++)
                    for (int a = 0; a < 4; a++) acc[i][a] = _mm256_setzero_ps();
                for (int jj = 0; jj < 8; jj++) {
                    const int j = 16 * cb + 8 * h + jj;
                    for (int a = 0; a < 4; a++) {
                        const __m256 x = _mm256_cvtepi32_ps(
                            _mm256_and_si256(bj[8 * h + jj], _mm256_load_si256((const __m256i *)mask_bits[a])));
                        for (int i = 0; i < RB; i++)
                            acc[i][a] = _mm256_fmadd_ps(_mm256_broadcast_ss(qs + i * D + a * Q + j), x, acc[i][a]);
                    }
                }
                if (grouped) {
                    for (int a = 0; a < 4; a++) {
                        const __m256 sg = _mm256_loadu_ps(ks + gidx[a * C8 + 2 * cb + h] * TILE + t);
                        for (int i = 0; i < RB; i++) tot[i] = _mm256_fmadd_ps(acc[i][a], sg, tot[i]);
                    }
                } else {
                    for (int i = 0; i < RB; i++)
                        tot[i] = _mm256_add_ps(tot[i], _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                                                     _mm256_add_ps(acc[i][2], acc[i][3])));
                }
            }
        }
        for (int i = 0; i < RB; i++) _mm256_storeu_ps(out + i * TILE + t, tot[i]);
    }
}

/* The scores' lookup tables where a row is one (scale, zero) group: byte j of a code row holds the codes
 * of dims a Q + j (a = 0..3), so its contribution to the 4 query rows of a block is a function of the
 * byte alone, T[j][b] = sum_a q_r[a Q + j] ((b >> 2a) & 3) as 4 lanes; a token's raw scores are the sum
 * of its Q entries: Q loads and adds instead of 4 Q multiply-adds per row and the unpacking. The 256
 * entries of a byte are built from partial sums, 2 adds each. */
template <int D>
void k_lut_build(const float *q, int rb, float *T) {
    constexpr int Q = D / 4;
    for (int j = 0; j < Q; j++) {
        float *tj = T + (size_t)j * 256 * 4;
        __m128 m[4][4]; /* m[a][c] = c q_r[a Q + j] */
        for (int a = 0; a < 4; a++) {
            alignas(16) float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int r = 0; r < rb; r++) v[r] = q[r * D + a * Q + j];
            const __m128 va = _mm_load_ps(v);
            for (int c = 0; c < 4; c++) m[a][c] = _mm_mul_ps(_mm_set1_ps((float)c), va);
        }
        for (int c3 = 0; c3 < 4; c3++)
            for (int c2 = 0; c2 < 4; c2++) {
                const __m128 s32 = _mm_add_ps(m[3][c3], m[2][c2]);
                for (int c1 = 0; c1 < 4; c1++) {
                    const __m128 s321 = _mm_add_ps(s32, m[1][c1]);
                    float *e = tj + ((c3 << 6) | (c2 << 4) | (c1 << 2)) * 4;
                    for (int c0 = 0; c0 < 4; c0++) _mm_store_ps(e + 4 * c0, _mm_add_ps(s321, m[0][c0]));
                }
            }
    }
}

/* Raw scores of rb <= 4 query rows for tokens 0..nn (rows past n repeat the last) from the tables T,
 * stored [rb][TILE]; four tokens at a time, four partial sums per token. */
template <int D>
void k_lut(const uint8_t *base, int64_t st, int n, int nn, int rb, const float *T, float *out) {
    constexpr int Q = D / 4;
    for (int t = 0; t < nn; t += 4) {
        __m128 res[4];
        for (int u = 0; u < 4; u++) {
            const uint8_t *row = base + (int64_t)(t + u < n ? t + u : n - 1) * st;
            __m128 acc[4];
            for (int k = 0; k < 4; k++) acc[k] = _mm_load_ps(T + ((size_t)k * 256 + row[k]) * 4);
            for (int j = 4; j < Q; j += 4)
                for (int k = 0; k < 4; k++)
                    acc[k] = _mm_add_ps(acc[k], _mm_load_ps(T + ((size_t)(j + k) * 256 + row[j + k]) * 4));
            res[u] = _mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3]));
        }
        _MM_TRANSPOSE4_PS(res[0], res[1], res[2], res[3]);
        for (int r = 0; r < rb; r++) _mm_storeu_ps(out + r * TILE + t, res[r]);
    }
}

/* Quarters per pass of the values: the RB x NA accumulators, the NA masks, the codes, one converted quarter
 * and the RB broadcast weights fit the 16 vector registers (a spilled accumulator costs more than a pass; with
 * one row GCC 12 keeps four accumulators in memory). In a C++ harness, d = 64, ns per token over a tile, before
 * (four quarters per pass up to 3 rows, accumulators stored at every token) and after: 9.6 -> 8.9 (1 row),
 * 18.8 -> 12.9 (2), 21.8 -> 14.3 (3), 29.8 -> 16.8 (4). */
template <int RB>
constexpr int V_QUARTERS = RB == 2 ? 4 : 2;

/* acc[r][dims] += sum_t w[r][k(chunk)][t] * c for RB rows over the n tokens of a tile (the padding's weights are
 * 0): per pass, the 8 dims at bytes 8c..8c+7 of V_QUARTERS<RB> quarters, so that 2 to 8 independent
 * accumulators take the multiply-adds of each token. Quarters are read as c 4^a (masked in place)
 * and scaled by 4^-a once per pass; with one group per row (kw = 1) every quarter reads the same weight
 * of a row (one broadcast, once the compiler merges them).
 * KEYS: the same loop also adds the table entries of KB = 2 V_QUARTERS<RB> key bytes (from byte j0) of each
 * token of the next tile to its 4 partial scores kp[t][4], so that part of the lookups' loads hides behind the
 * values' multiply-adds (about 1.05x the whole call: the values' unpacking and the lookups' adds take the same
 * vector pipes as the multiply-adds, which this loop nearly fills). */
template <int D, int RB, bool SHARED, bool KEYS>
inline void v_pass(const uint8_t *base, int64_t st, int n, const float *w, int kw, const int *kidx, float *acc, int c,
                   int a0, const uint8_t *kbase, int64_t kst, const float *T, float *kp, int j0) {
    constexpr int Q = D / 4, C8 = Q / 8, NA = V_QUARTERS<RB>, KB = 2 * NA;
    alignas(32) static const int32_t mask_bits[4][8] = {{3, 3, 3, 3, 3, 3, 3, 3}, {12, 12, 12, 12, 12, 12, 12, 12},
                                                         {48, 48, 48, 48, 48, 48, 48, 48},
                                                         {192, 192, 192, 192, 192, 192, 192, 192}};
    static const float unscale[4] = {1.0f, 0.25f, 0.0625f, 0.015625f};
    if (n <= 0) return; /* (a loop that may run zero times makes GCC 12 store every accumulator at every token) */
    const float *wq[NA];
    __m256i m[NA];
    __m256 s[RB][NA];
    for (int i = 0; i < NA; i++) {
        wq[i] = w + kidx[(a0 + i) * C8 + c] * TILE;
        m[i] = _mm256_load_si256((const __m256i *)mask_bits[a0 + i]);
        for (int r = 0; r < RB; r++) s[r][i] = _mm256_setzero_ps();
    }
    /* each key byte's table as its own base, addressed by the byte times 16 (one shift, no multiply-add) */
    const char *tk[KB];
    for (int k = 0; k < KB; k++) tk[k] = (const char *)(T + ((size_t)j0 + k) * 256 * 4);
    const uint8_t *vrow = base + 8 * c, *krow = kbase + j0;
    int t = 0;
    do { /* n >= 1 */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)vrow));
        for (int i = 0; i < NA; i++) {
            const __m256 x = _mm256_cvtepi32_ps(_mm256_and_si256(b, m[i]));
            for (int r = 0; r < RB; r++) /* one weight per row for all quarters when SHARED (kw = 1) */
                s[r][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(wq[SHARED ? 0 : i] + r * kw * TILE + t), x, s[r][i]);
        }
        vrow += st;
        if (KEYS) {
            __m128 ka = _mm_load_ps(kp + 4 * t);
            for (int k = 0; k < KB; k++)
                ka = _mm_add_ps(ka, _mm_load_ps((const float *)(tk[k] + ((size_t)krow[k] << 4))));
            _mm_store_ps(kp + 4 * t, ka);
            krow += kst;
        }
    } while (++t < n);
    for (int i = 0; i < NA; i++) {
        const __m256 f = _mm256_set1_ps(unscale[a0 + i]);
        float *o = acc + (a0 + i) * Q + 8 * c;
        for (int r = 0; r < RB; r++)
            _mm256_storeu_ps(o + r * D, _mm256_fmadd_ps(s[r][i], f, _mm256_loadu_ps(o + r * D)));
    }
}

template <int D, int RB>
void v_int2_avx2(const uint8_t *base, int64_t st, int n, int nn, const float *w, int kw, const int *kidx,
                 float *acc) {
    constexpr int C8 = D / 32, NA = V_QUARTERS<RB>;
    (void)nn; /* tokens past n carry weight 0: they add nothing */
    for (int c = 0; c < C8; c++)
        for (int a0 = 0; a0 < 4; a0 += NA) {
            if (kw == 1) v_pass<D, RB, true, false>(base, st, n, w, kw, kidx, acc, c, a0, NULL, 0, NULL, NULL, 0);
            else v_pass<D, RB, false, false>(base, st, n, w, kw, kidx, acc, c, a0, NULL, 0, NULL, NULL, 0);
        }
}

/* The value sums of one full tile (one value group per row) and the raw scores of the next full tile from the
 * tables T, in the same passes: pass p (chunk c, quarters a0..) also takes key bytes 2 NA p.. of every token
 * (C8 4 / NA passes of 2 NA bytes cover the Q bytes of a row). The partial scores kp [TILE][4] are then
 * transposed into out [RB][TILE], as k_lut stores them. */
template <int D, int RB>
void kv_fused_avx2(const uint8_t *vbase, int64_t vst, const float *w, const int *kidx, float *acc, const uint8_t *kbase,
                   int64_t kst, const float *T, float *kp, float *out) {
    constexpr int C8 = D / 32, NA = V_QUARTERS<RB>, KB = 2 * NA;
    static_assert((D / 4) == C8 * (4 / NA) * KB, "the passes cover every key byte once");
    memset(kp, 0, (size_t)TILE * 4 * sizeof(float));
    int j0 = 0;
    for (int c = 0; c < C8; c++)
        for (int a0 = 0; a0 < 4; a0 += NA, j0 += KB)
            v_pass<D, RB, true, true>(vbase, vst, TILE, w, 1, kidx, acc, c, a0, kbase, kst, T, kp, j0);
    for (int t = 0; t < TILE; t += 4) {
        __m128 r0 = _mm_load_ps(kp + 4 * t), r1 = _mm_load_ps(kp + 4 * t + 4), r2 = _mm_load_ps(kp + 4 * t + 8),
               r3 = _mm_load_ps(kp + 4 * t + 12);
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
        const __m128 rr[4] = {r0, r1, r2, r3};
        for (int r = 0; r < RB; r++) _mm_storeu_ps(out + r * TILE + t, rr[r]);
    }
}

/* acc[r] += sum_t w[r][t] x[t] over window rows: per row and 64 dims, eight accumulators in registers over the
 * tile (the portable loop loads and stores the accumulators at every token). */
template <int D>
void v_win_avx2(const float *x, int nn, int rb, const float *w, float *acc) {
    for (int r = 0; r < rb; r++)
        for (int c0 = 0; c0 < D; c0 += 64) {
            float *o = acc + r * D + c0;
            __m256 s[8];
            for (int i = 0; i < 8; i++) s[i] = _mm256_loadu_ps(o + 8 * i);
            for (int t = 0; t < nn; t++) {
                const __m256 p = _mm256_broadcast_ss(w + r * TILE + t);
                const float *xt = x + (int64_t)t * D + c0;
                for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(xt + 8 * i), s[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, s[i]);
        }
}

template <int D, int RB>
void fill_avx2(SimdTable &k) {
    k.k_int2[RB - 1] = k_int2_avx2<D, RB>;
    k.v_int2[RB - 1] = v_int2_avx2<D, RB>;
    k.kv_fused[RB - 1] = D <= 128 ? kv_fused_avx2<D, RB> : NULL;
}

template <int D>
void fill_avx2_all(SimdTable &k) {
    k.v_win = v_win_avx2<D>;
    fill_avx2<D, 1>(k);
    fill_avx2<D, 2>(k);
    fill_avx2<D, 3>(k);
    fill_avx2<D, 4>(k);
}

} // namespace

bool simd_table(int d, SimdTable *t) {
    t->k_lut_build = NULL;
    t->k_lut = NULL;
    if (d == 64) {
        fill_avx2_all<64>(*t);
        t->k_lut_build = k_lut_build<64>;
        t->k_lut = k_lut<64>;
    } else if (d == 128) {
        fill_avx2_all<128>(*t);
        t->k_lut_build = k_lut_build<128>;
        t->k_lut = k_lut<128>;
    } else if (d == 256) {
        fill_avx2_all<256>(*t);
    } else {
        return false;
    }
    return true;
}
#else
} // namespace

bool simd_table(int, SimdTable *) { return false; }
#endif

} // namespace rz
