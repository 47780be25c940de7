/* The vectorized inner loops of native_decode.cpp (AVX2 + FMA + F16C), one translation unit of their
 * own so that the two compile in parallel: scores of up to RB_MAX query rows over a tile of INT2 or
 * rows, and their value sums (window rows take the portable loops). See native_decode.cpp for the method. */
#include "native_decode.h"

namespace rz {
namespace {

#if RZ_AVX2
/* [s0, s1, s2, s3]: the lane sums of four vectors. */
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Raw scores sum_i q'_i (c_i 4^a)(s_g) of RB query rows for tokens 0..nn (rows past n repeat the
 * last), stored [RB][TILE]. Two tokens at a time, with PAR accumulators per token and row, keep
 * enough independent multiply-add chains in flight. */
template <int D, int RB>
void k_int2_avx2(const uint8_t *base, int64_t st, int n, int nn, bool grouped, const float *qs, const float *ks,
                 const int *gidx, float *out) {
    constexpr int Q = D / 4, C8 = Q / 8, PAR = RB <= 3 ? 2 : 1;
    alignas(32) static const int32_t mask_bits[4][8] = {{3, 3, 3, 3, 3, 3, 3, 3}, {12, 12, 12, 12, 12, 12, 12, 12},
                                                         {48, 48, 48, 48, 48, 48, 48, 48},
                                                         {192, 192, 192, 192, 192, 192, 192, 192}};
    for (int t = 0; t < nn; t += 4) {
        __m128 res[4];
        for (int u = 0; u < 4; u += 2) {
            const uint8_t *row0 = base + (int64_t)(t + u < n ? t + u : n - 1) * st;
            const uint8_t *row1 = base + (int64_t)(t + u + 1 < n ? t + u + 1 : n - 1) * st;
            __m256 acc0[RB][PAR], acc1[RB][PAR];
            for (int r = 0; r < RB; r++)
                for (int k = 0; k < PAR; k++) acc0[r][k] = acc1[r][k] = _mm256_setzero_ps();
            for (int c = 0; c < C8; c++) {
                const __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row0 + 8 * c)));
                const __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row1 + 8 * c)));
                for (int aq = 0; aq < 4; aq++) {
                    const __m256i m = _mm256_load_si256((const __m256i *)mask_bits[aq]);
                    __m256 x0 = _mm256_cvtepi32_ps(_mm256_and_si256(w0, m));
                    __m256 x1 = _mm256_cvtepi32_ps(_mm256_and_si256(w1, m));
                    if (grouped) {
                        const float *sg = ks + gidx[aq * C8 + c] * TILE + t + u;
                        x0 = _mm256_mul_ps(x0, _mm256_broadcast_ss(sg));
                        x1 = _mm256_mul_ps(x1, _mm256_broadcast_ss(sg + 1));
                    }
                    const int k = aq % PAR;
                    for (int r = 0; r < RB; r++) {
                        const __m256 qv = _mm256_loadu_ps(qs + r * D + aq * Q + 8 * c);
                        acc0[r][k] = _mm256_fmadd_ps(x0, qv, acc0[r][k]);
                        acc1[r][k] = _mm256_fmadd_ps(x1, qv, acc1[r][k]);
                    }
                }
            }
            __m256 s0[4], s1[4];
            for (int r = 0; r < 4; r++) s0[r] = s1[r] = _mm256_setzero_ps();
            for (int r = 0; r < RB; r++) {
                s0[r] = PAR == 2 ? _mm256_add_ps(acc0[r][0], acc0[r][PAR - 1]) : acc0[r][0];
                s1[r] = PAR == 2 ? _mm256_add_ps(acc1[r][0], acc1[r][PAR - 1]) : acc1[r][0];
            }
            res[u] = hsum4(s0[0], s0[1], s0[2], s0[3]);
            res[u + 1] = hsum4(s1[0], s1[1], s1[2], s1[3]);
        }
        _MM_TRANSPOSE4_PS(res[0], res[1], res[2], res[3]);
        for (int r = 0; r < RB; r++) _mm_storeu_ps(out + r * TILE + t, res[r]);
    }
}

/* acc[r][dims] += sum_t w[r][k(chunk)][t] * c for RB rows: per pass, the 8 dims at bytes 8c..8c+7 of
 * every quarter (all four with up to 3 rows, two at a time with 4), so that 8 to 12 independent
 * accumulators take the multiply-adds of each token. Quarters are read as c 4^a (masked in place)
 * and scaled by 4^-a once per pass; with one group per row (kw = 1) each row's weight is broadcast
 * once per token for all quarters. */
template <int D, int RB, bool SHARED>
inline void v_pass(const uint8_t *base, int64_t st, int n, int nn, const float *w, int kw, const int *kidx,
                   float *acc, int c, int a0) {
    constexpr int Q = D / 4, C8 = Q / 8, NA = RB <= 3 ? 4 : 2;
    alignas(32) static const int32_t mask_bits[4][8] = {{3, 3, 3, 3, 3, 3, 3, 3}, {12, 12, 12, 12, 12, 12, 12, 12},
                                                         {48, 48, 48, 48, 48, 48, 48, 48},
                                                         {192, 192, 192, 192, 192, 192, 192, 192}};
    static const float unscale[4] = {1.0f, 0.25f, 0.0625f, 0.015625f};
    const float *wq[NA];
    __m256 s[RB][NA];
    for (int i = 0; i < NA; i++) {
        wq[i] = w + kidx[(a0 + i) * C8 + c] * TILE;
        for (int r = 0; r < RB; r++) s[r][i] = _mm256_setzero_ps();
    }
    for (int t = 0; t < nn; t++) {
        const uint8_t *row = base + (int64_t)(t < n ? t : n - 1) * st + 8 * c;
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)row));
        if (SHARED) {
            __m256 p[RB];
            for (int r = 0; r < RB; r++) p[r] = _mm256_broadcast_ss(wq[0] + r * kw * TILE + t);
            for (int i = 0; i < NA; i++) {
                const __m256 x = _mm256_cvtepi32_ps(
                    _mm256_and_si256(b, _mm256_load_si256((const __m256i *)mask_bits[a0 + i])));
                for (int r = 0; r < RB; r++) s[r][i] = _mm256_fmadd_ps(p[r], x, s[r][i]);
            }
        } else {
            for (int i = 0; i < NA; i++) {
                const __m256 x = _mm256_cvtepi32_ps(
                    _mm256_and_si256(b, _mm256_load_si256((const __m256i *)mask_bits[a0 + i])));
                for (int r = 0; r < RB; r++)
                    s[r][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(wq[i] + r * kw * TILE + t), x, s[r][i]);
            }
        }
    }
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
    constexpr int C8 = D / 32, NA = RB <= 3 ? 4 : 2;
    for (int c = 0; c < C8; c++)
        for (int a0 = 0; a0 < 4; a0 += NA) {
            if (kw == 1) v_pass<D, RB, true>(base, st, n, nn, w, kw, kidx, acc, c, a0);
            else v_pass<D, RB, false>(base, st, n, nn, w, kw, kidx, acc, c, a0);
        }
}

template <int D, int RB>
void fill_avx2(SimdTable &k) {
    k.k_int2[RB - 1] = k_int2_avx2<D, RB>;
    k.v_int2[RB - 1] = v_int2_avx2<D, RB>;
}

template <int D>
void fill_avx2_all(SimdTable &k) {
    fill_avx2<D, 1>(k);
    fill_avx2<D, 2>(k);
    fill_avx2<D, 3>(k);
    fill_avx2<D, 4>(k);
}

} // namespace

bool simd_table(int d, SimdTable *t) {
    if (d == 64) fill_avx2_all<64>(*t);
    else if (d == 128) fill_avx2_all<128>(*t);
    else if (d == 256) fill_avx2_all<256>(*t);
    else return false;
    return true;
}
#else
} // namespace

bool simd_table(int, SimdTable *) { return false; }
#endif

} // namespace rz
