/* Shared by native_decode.cpp and native_decode_simd.cpp (rotationzoo.kernels.native): the tile
 * size, the inner-loop signatures and the table of vectorized inner loops. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RZ_AVX2 1
#else
#define RZ_AVX2 0
#endif

namespace rz {

constexpr int TILE = 128;    /* tokens per tile (a multiple of 8) */
constexpr int RB_MAX = 4;    /* query rows per block sharing one pass over the codes */

/* Scores of RB rows over a tile of INT2 rows (codes, token stride, n rows, nn padded, several groups
 * per row, q, key scales [groups][TILE], chunk -> group, out [RB][TILE]); value sums over INT2 rows
 * (codes, stride, n, nn, weights [RB][kw][TILE], kw, chunk -> weight set, acc [RB][d]). */
typedef void (*k_int2_fn)(const uint8_t *, int64_t, int, int, bool, const float *, const float *, const int *, float *);
typedef void (*v_int2_fn)(const uint8_t *, int64_t, int, int, const float *, int, const int *, float *);
/* Scores by table lookup where a row is one group: k_lut_build(q [rb][d], rb, T) fills T [d/4][256][4] with
 * sum_a q_r[a d/4 + j] c_a(b) (lanes past rb zero); k_lut(codes, stride, n, nn, rb, T, out [rb][TILE]). */
typedef void (*k_lut_build_fn)(const float *, int, float *);
typedef void (*k_lut_fn)(const uint8_t *, int64_t, int, int, int, const float *, float *);
/* Value sums over window rows in fp32: v_win(x [TILE][d], nn, rb, weights [rb][TILE], acc [rb][d]). */
typedef void (*v_win_fn)(const float *, int, int, const float *, float *);
/* One full tile's value sums (as v_int2 with one value group per row) fused with the next full tile's scores
 * by table lookup (as k_lut): kv_fused[RB - 1](values' codes, stride, weights [RB][TILE], chunk -> weight set,
 * acc [RB][d], keys' codes, stride, T, scratch [TILE][4], out [RB][TILE]). */
typedef void (*kv_fused_fn)(const uint8_t *, int64_t, const float *, const int *, float *, const uint8_t *, int64_t,
                            const float *, float *, float *);

constexpr int LUT_MAX_ROWS = 8; /* query rows per KV head up to which the lookup tables are used */

struct SimdTable {
    k_int2_fn k_int2[RB_MAX]; /* [rows - 1] */
    v_int2_fn v_int2[RB_MAX];
    k_lut_build_fn k_lut_build; /* null where the tables are not used (d = 256: 256 KB per block) */
    k_lut_fn k_lut;
    kv_fused_fn kv_fused[RB_MAX]; /* null where k_lut is */
    v_win_fn v_win;
};

/* Fills `t` with the vectorized inner loops of head_dim d; false where none were compiled in. */
bool simd_table(int d, SimdTable *t);

#if RZ_AVX2
/* exp(x) for 8 lanes (Cephes' polynomial, about 1 ulp); x < -87 (and -inf) gives 0, NaN gives NaN (as expf:
   a score that overflowed to +inf makes the row NaN, as in the reference, never a silent 0). */
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    y = _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif


} // namespace rz
