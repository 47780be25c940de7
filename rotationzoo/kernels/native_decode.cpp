/* Decode attention over the OSCAR INT2 cache layout, for CPUs: rotationzoo.kernels.native.
 *
 * Same contract as the PyTorch reference (decode_reference.py) on validated inputs: queries
 * [B, Hq, S, d] fp32 in the model's basis, rotated here (q' = scale q R; the query rows of KV head h
 * are row i*S + s = token s of its i-th query head), keys/values [sink | INT2 codes + scale/zero |
 * recent] per (sequence, KV head), the output rotated back (o R_out) into [B, Hq, S, d]. Each
 * (sequence, KV head) is cut into `splits` ranges of key positions, the work items of the OpenMP
 * threads; the ranges are merged by their log-sum-exp at the end.
 *
 * A range is walked in tiles of TILE tokens. Per tile:
 *   1. scores of every query row of the KV head (rows shared by GQA heads and query tokens read each
 *      code row once, in blocks of up to RB_MAX rows), eight tokens at a time: their code bytes are
 *      transposed so that each 32-bit lane is a token, and each quarter is masked out in place,
 *      c * 4^a (bits 2a, 2a+1 of byte j hold dim a*Q + j), so one AND and one int-to-float conversion
 *      feed a multiply-add per query row with no horizontal sum; the 4^-a is folded into the query once
 *      per range (exact: a power of two). Scores are s * (q.c - z * sum q) per group (with several
 *      groups per row, each 8-byte chunk's sums are scaled by the tokens' group scales). Where a row is
 *      one group, d <= 128 and a KV head has at most LUT_MAX_ROWS query rows, q.c is read from tables
 *      instead: byte j's four codes contribute T[j][byte] to the rows of a 4-row block, built once per
 *      range (d/4 x 256 entries of 4 lanes), so a token costs d/4 loads and adds;
 *   2. an fp32 online softmax over the tile (vectorized exp), the causal rule and the optional mask;
 *   3. the values: weights p * s * 4^-a per query row and group, the codes widened and masked as for
 *      the keys, and sum_t w c - sum_t p s z accumulated per output dim in registers over the tile.
 *      Where the scores use the tables, a row is one value group and a KV head has at most RB_MAX query
 *      rows, a full tile's values run in the same passes as the next full tile's score lookups (part of
 *      the lookups' loads hides behind the values' multiply-adds; their adds share the vector pipes):
 *      about 1.05x the whole call at 32K and 128K tokens, SmolLM2's shape, 1 thread.
 * Nothing but one tile of scores and weights per thread is ever materialized. The inner loops use
 * AVX2/FMA intrinsics where the compiler targets them (native_decode_simd.cpp), portable loops
 * elsewhere and on request.
 *
 * An INT2 row is read as NaN when any of its groups has a scale or zero that is not finite or that
 * could dequantize past MAX_DEQUANT (|s| * max(|z|, |3 - z|) > 2^64, the same test as the
 * reference's, in the same fp32 operations): a NaN score (the quantizer flags a non-finite input row
 * with NaN scales) makes its query row NaN, and a NaN value row every query row of its head, as in
 * the PyTorch reference and the Triton kernel.
 */
#include <stddef.h>

#include "native_decode.h"

extern "C" {
/* One part of the cache: first element, strides (elements) of the sequence, KV-head and token
 * dimensions; the last dimension is contiguous. */
struct rz_part {
    const void *p;
    int64_t sb, sh, st;
};

/* The arguments, every field 8 bytes: the caller passes them as an array of int64 (pointers as
 * integers) in this order, and the softmax scale apart. */
struct rz_decode_args {
    int64_t b, h, rows, s, d, p, n, r; /* sequences, KV heads, query rows per KV head, query tokens,
                                          head_dim, sink / INT2 / recent tokens */
    int64_t causal;                    /* query token s sees positions <= total - S + s */
    int64_t win_bf16;                  /* sink and recent rows: bf16 (1) or fp32 (0) */
    int64_t gq;                        /* query heads per KV head (rows = gq * S) */
    int64_t sz_kind[2];                /* scales/zeros of keys, values: fp32 (0), bf16 (1), fp16 (2) */
    int64_t groups[2];                 /* (scale, zero) groups per row of keys, values */
    const float *q;                    /* [B, Hq, S, d] fp32 queries in the model's basis */
    int64_t q_sb, q_sh, q_ss;          /* their strides (elements); the last dimension is contiguous */
    const float *q_rot;                /* [d, d] (or per KV head, stride q_rot_sh) fp32: q' = scale q R (q_rot_t:
                                          q Rᵀ); or null */
    int64_t q_rot_sh, q_rot_t;
    const float *o_rot;                /* [d, d] (or per KV head) fp32: out = o R (o_rot_t: o Rᵀ); or null */
    int64_t o_rot_sh, o_rot_t;
    struct rz_part part[2][4];         /* [keys, values][sink, codes, scales_zeros, recent] */
    const uint8_t *mask;               /* optional [B|1, Hq|1, S, L] booleans (1 = attend), or null */
    int64_t mask_sb, mask_sh, mask_ss, mask_st;
    int64_t splits, threads, portable; /* ranges per (sequence, head); OpenMP threads; 1: no intrinsics */
    float *out;                        /* [B, Hq, S, d] fp32, contiguous */
    float scale;                       /* softmax scale (set from the argument) */
    float *ws;                         /* B * H * splits * rows * (d + 2) floats of partial results (allocated here) */
};

int rz_decode_int2(const int64_t *args, double scale);
int rz_decode_has_simd(void);
int64_t rz_decode_arg_count(void);
}

namespace {

using namespace rz;

constexpr int MAX_GROUPS = 16;
constexpr float MAX_DEQUANT = 0x1p64f; /* decode_reference.MAX_DEQUANT */

inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: value man * 2^-24 */
        float f = (float)man * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float load_scalar(const void *base, int64_t idx, int64_t kind) {
    if (kind == 0) return ((const float *)base)[idx];
    const uint16_t v = ((const uint16_t *)base)[idx];
    return kind == 1 ? bf16_to_f32(v) : f16_to_f32(v);
}

struct Job {
    const rz_decode_args *a;
    int64_t total, split_len, d, q4, gk, gv, kw; /* gk, gv: group sizes; kw: value groups per row */
};

/* Per-thread buffers of one tile. */
struct Scratch {
    float *qp;   /* [rows][d]: the rotated, scaled query rows */
    float *qs;   /* [rows][d]: query rows times 4^-quarter (INT2 keys) */
    float *qsum; /* [rows][groups_k]: sum of each key group of the query rows */
    float *sc;   /* [rows][TILE]: scores, then weights p */
    float *w;    /* [rows][kw][TILE]: value weights p * s of each value group */
    float *ks, *kz, *vs, *vz; /* [groups][TILE] scales and zeros of the tile's INT2 rows */
    float *kc, *vc;           /* [groups][TILE] s z (values: + bad) */
    float *kbad, *vbad;       /* [TILE]: NaN where the row is outside the domain, else 0 */
    float *x;    /* [TILE][d]: window rows in fp32 */
    float *ztm;  /* [rows][groups_v]: sum_t p s z of the INT2 values */
    float *tmp;  /* [TILE][RB_MAX]: raw scores, token-major (portable path) */
    float *lut;  /* [ceil(rows / 4)][d/4][256][4]: the scores' lookup tables of each 4-row block, or null */
    float *kp;   /* [TILE][4], 16-byte aligned: partial scores of the fused pass (with the tables) */
    int *kidx;   /* [4 * Q/8]: value group of each 8-dim chunk (quarter a, bytes 8c..8c+7) */
    int *gidx;   /* [4 * Q/8]: key group of each chunk */
};

/* Portable versions (any compiler, any CPU): the same sums in a plain order, RB at run time. */
template <int D>
void k_int2_portable(const uint8_t *base, int64_t st, int n, int nn, int rb, bool grouped, const float *qs,
                     const float *ks, const int *gidx, float *out) {
    constexpr int Q = D / 4;
    float xrow[D];
    for (int t = 0; t < nn; t++) {
        const uint8_t *row = base + (int64_t)(t < n ? t : n - 1) * st;
        for (int a = 0; a < 4; a++) {
            const int m = 3 << (2 * a);
            for (int j = 0; j < Q; j++) xrow[a * Q + j] = (float)(row[j] & m);
            if (grouped)
                for (int j = 0; j < Q; j++) xrow[a * Q + j] *= ks[gidx[a * (Q / 8) + j / 8] * TILE + t];
        }
        for (int r = 0; r < rb; r++) {
            float acc = 0.0f;
            for (int i = 0; i < D; i++) acc += qs[r * D + i] * xrow[i];
            out[r * TILE + t] = acc;
        }
    }
}

template <int D>
void k_win_portable(const float *x, int nn, int rb, const float *q, float *out) {
    for (int t = 0; t < nn; t++)
        for (int r = 0; r < rb; r++) {
            float acc = 0.0f;
            for (int i = 0; i < D; i++) acc += q[r * D + i] * x[t * D + i];
            out[r * TILE + t] = acc;
        }
}

template <int D>
void v_int2_portable(const uint8_t *base, int64_t st, int n, int nn, int rb, const float *w, int kw, const int *kidx,
                     float *acc) {
    constexpr int Q = D / 4;
    float xrow[D];
    for (int t = 0; t < nn; t++) {
        const uint8_t *row = base + (int64_t)(t < n ? t : n - 1) * st;
        for (int a = 0; a < 4; a++)
            for (int j = 0; j < Q; j++) xrow[a * Q + j] = (float)((row[j] >> (2 * a)) & 3);
        for (int r = 0; r < rb; r++)
            for (int c = 0; c < D / 8; c++) {
                const float p = w[(r * kw + kidx[c]) * TILE + t];
                for (int i = 0; i < 8; i++) acc[r * D + 8 * c + i] += p * xrow[8 * c + i];
            }
    }
}

template <int D>
void v_win_portable(const float *x, int nn, int rb, const float *w, float *acc) {
    for (int t = 0; t < nn; t++)
        for (int r = 0; r < rb; r++) {
            const float p = w[r * TILE + t];
            for (int i = 0; i < D; i++) acc[r * D + i] += p * x[t * D + i];
        }
}

/* The inner loops of one head_dim: vectorized (RB rows fixed at compile time) or portable. */
struct Kernels {
    bool portable;
    int d;
    SimdTable simd;
};

Kernels kernels_for(int64_t d, bool portable) {
    Kernels k;
    k.d = (int)d;
    k.portable = portable || !simd_table((int)d, &k.simd);
    return k;
}

void run_k_int2(const Kernels &k, const uint8_t *base, int64_t st, int n, int nn, int rb, bool grouped,
                const float *qs, const float *ks, const int *gidx, float *out) {
    if (!k.portable) return k.simd.k_int2[rb - 1](base, st, n, nn, grouped, qs, ks, gidx, out);
    if (k.d == 64) k_int2_portable<64>(base, st, n, nn, rb, grouped, qs, ks, gidx, out);
    else if (k.d == 128) k_int2_portable<128>(base, st, n, nn, rb, grouped, qs, ks, gidx, out);
    else k_int2_portable<256>(base, st, n, nn, rb, grouped, qs, ks, gidx, out);
}

void run_k_win(const Kernels &k, const float *x, int nn, int rb, const float *q, float *out) {
    if (k.d == 64) k_win_portable<64>(x, nn, rb, q, out);
    else if (k.d == 128) k_win_portable<128>(x, nn, rb, q, out);
    else k_win_portable<256>(x, nn, rb, q, out);
}

void run_v_int2(const Kernels &k, const uint8_t *base, int64_t st, int n, int nn, int rb, const float *w, int kw,
                const int *kidx, float *acc) {
    if (!k.portable) return k.simd.v_int2[rb - 1](base, st, n, nn, w, kw, kidx, acc);
    if (k.d == 64) v_int2_portable<64>(base, st, n, nn, rb, w, kw, kidx, acc);
    else if (k.d == 128) v_int2_portable<128>(base, st, n, nn, rb, w, kw, kidx, acc);
    else v_int2_portable<256>(base, st, n, nn, rb, w, kw, kidx, acc);
}

void run_v_win(const Kernels &k, const float *x, int nn, int rb, const float *w, float *acc) {
    if (!k.portable) return k.simd.v_win(x, nn, rb, w, acc);
    if (k.d == 64) v_win_portable<64>(x, nn, rb, w, acc);
    else if (k.d == 128) v_win_portable<128>(x, nn, rb, w, acc);
    else v_win_portable<256>(x, nn, rb, w, acc);
}

/* ---- one tile ---------------------------------------------------------------------------------- */

/* exp(sc[i] - base) for i < nn, in place; returns their sum. */
float exp_sum(float *sc, int nn, float base, bool simd) {
    float sum = 0.0f;
    int i = 0;
#if RZ_AVX2
    if (simd) {
        const __m256 b = _mm256_set1_ps(base);
        __m256 s = _mm256_setzero_ps();
        for (; i + 8 <= nn; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), b));
            _mm256_storeu_ps(sc + i, e);
            s = _mm256_add_ps(s, e);
        }
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    }
#else
    (void)simd;
#endif
    for (; i < nn; i++) {
        sc[i] = expf(sc[i] - base);
        sum += sc[i];
    }
    return sum;
}

/* Scales and zeros of INT2 rows i0..i0+n of one side as fp32 [groups][TILE] (zero past n), and
 * bad[t]: NaN where row t is outside decode's domain, else 0 (added to what the row contributes). */
void load_scales(const rz_decode_args *a, int side, int64_t bi, int64_t hi, int64_t i0, int n, int nn, float *s,
                 float *z, float *bad) {
    const rz_part &pt = a->part[side][2];
    const int64_t kind = a->sz_kind[side], groups = a->groups[side];
    const int64_t off0 = bi * pt.sb + hi * pt.sh + i0 * pt.st;
    int t0 = 0;
#if RZ_AVX2
    if (!a->portable && groups == 1 && pt.st == 2 && kind != 2) { /* one (scale, zero) per row, rows packed */
        for (; t0 + 8 <= n; t0 += 8) {
            __m256 lo, hi8;
            if (kind == 0) {
                const float *src = (const float *)pt.p + off0 + 2 * t0;
                lo = _mm256_loadu_ps(src);
                hi8 = _mm256_loadu_ps(src + 8);
            } else {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)pt.p + off0 + 2 * t0));
                lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
                hi8 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
            }
            const __m256 sv = _mm256_shuffle_ps(lo, hi8, 0x88), zv = _mm256_shuffle_ps(lo, hi8, 0xDD);
            _mm256_storeu_ps(s + t0, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sv), 0xD8)));
            _mm256_storeu_ps(z + t0, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(zv), 0xD8)));
        }
    }
#endif
    for (int t = t0; t < n; t++) {
        const int64_t off = off0 + t * pt.st;
        for (int64_t g = 0; g < groups; g++) {
            s[g * TILE + t] = load_scalar(pt.p, off + 2 * g, kind);
            z[g * TILE + t] = load_scalar(pt.p, off + 2 * g + 1, kind);
        }
    }
    for (int64_t g = 0; g < groups; g++)
        for (int t = n; t < nn; t++) s[g * TILE + t] = z[g * TILE + t] = 0.0f;
    for (int t = 0; t < nn; t++) bad[t] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const float *sg = s + g * TILE, *zg = z + g * TILE;
        for (int t = 0; t < nn; t++) {
            const float za = fabsf(zg[t]), zb = fabsf(3.0f - zg[t]);
            bad[t] += fabsf(sg[t]) * (za > zb ? za : zb) <= MAX_DEQUANT ? 0.0f : NAN;
        }
    }
}

/* The largest of sc[0..n) that is not NaN (at least `mx`), and whether one is NaN. */
float max_not_nan(const float *sc, int n, float mx, int *nan, bool simd) {
    int t = 0, found = 0;
#if RZ_AVX2
    if (simd) {
        __m256 m = _mm256_set1_ps(mx), un = _mm256_setzero_ps();
        for (; t + 8 <= n; t += 8) {
            const __m256 v = _mm256_loadu_ps(sc + t);
            m = _mm256_max_ps(v, m); /* a NaN lane keeps m */
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, m);
        for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
        found = !_mm256_testz_ps(un, un);
    }
#else
    (void)simd;
#endif
    for (; t < n; t++) {
        if (sc[t] != sc[t]) found = 1;
        else if (sc[t] > mx) mx = sc[t];
    }
    *nan |= found;
    return mx;
}

/* Window rows [pos0, pos0 + n) of side `side` as fp32 into x [TILE][d] (rows past n repeat the last). */
void load_window(const rz_decode_args *a, int side, int which, int64_t bi, int64_t hi, int64_t i0, int n, int nn,
                 float *x) {
    const rz_part &pt = a->part[side][which];
    const int64_t d = a->d;
    for (int t = 0; t < nn; t++) {
        const int64_t off = bi * pt.sb + hi * pt.sh + (i0 + (t < n ? t : n - 1)) * pt.st;
        float *dst = x + t * d;
        if (a->win_bf16) {
            const uint16_t *src = (const uint16_t *)pt.p + off;
            for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
        } else {
            memcpy(dst, (const float *)pt.p + off, (size_t)d * sizeof(float));
        }
    }
}

struct State {
    float *m, *l, *acc; /* [rows], [rows], [rows][d] of this work item */
};

/* The code row i of (sequence bi, KV head hi) in an INT2 part. */
inline const uint8_t *codes_at(const rz_part &pt, int64_t bi, int64_t hi, int64_t i) {
    return (const uint8_t *)pt.p + bi * pt.sb + hi * pt.sh + i * pt.st;
}

/* Fold one tile of `n` tokens at global positions pos0.. (kind 0 sink, 1 INT2, 2 recent; index i0
 * within its part) into the state of (bi, hi). INT2 tiles: `have_raw`: w.sc already holds the raw scores
 * (q.c of every query row, from the previous tile's fused pass); `defer_values`: the weights are left in
 * w.w and the caller adds the values (in a fused pass with the next tile's scores). */
void tile(const Job &jb, const Kernels &kn, Scratch &w, State &st, const float *q, int64_t bi, int64_t hi, int kind,
          int64_t pos0, int64_t i0, int n, bool have_raw = false, bool defer_values = false) {
    const rz_decode_args *a = jb.a;
    const int64_t rows = a->rows, d = jb.d;
    const int nn = (n + 7) & ~7;
    const bool simd = !kn.portable;
    const int gk = (int)a->groups[0], gv = (int)a->groups[1], kw = (int)jb.kw;
    /* 1. scores: s (q.c - z sum q) per group, NaN for a row outside the domain */
    if (kind == 1) {
        const rz_part &pt = a->part[0][1];
        const uint8_t *base = codes_at(pt, bi, hi, i0);
        load_scales(a, 0, bi, hi, i0, n, nn, w.ks, w.kz, w.kbad);
        for (int g = 0; g < gk; g++) {
            float *cg = w.kc + g * TILE;
            const float *sg = w.ks + g * TILE, *zg = w.kz + g * TILE;
            for (int t = 0; t < nn; t++) cg[t] = sg[t] * zg[t];
        }
        for (int64_t r0 = 0; r0 < rows && !have_raw; r0 += RB_MAX) {
            const int rb = (int)(rows - r0 < RB_MAX ? rows - r0 : RB_MAX);
            if (w.lut) kn.simd.k_lut(base, pt.st, n, nn, rb, w.lut + (r0 / RB_MAX) * d * 256, w.sc + r0 * TILE);
            else run_k_int2(kn, base, pt.st, n, nn, rb, gk > 1, w.qs + r0 * d, w.ks, w.gidx, w.sc + r0 * TILE);
        }
        for (int64_t r = 0; r < rows; r++) {
            float *sr = w.sc + r * TILE;
            const float *qs = w.qsum + r * gk;
            if (gk == 1) {
                const float q0 = qs[0];
                for (int t = 0; t < nn; t++) sr[t] = w.ks[t] * sr[t] - w.kc[t] * q0 + w.kbad[t];
            } else {
                for (int g = 0; g < gk; g++) {
                    const float qg = qs[g], *cg = w.kc + g * TILE;
                    for (int t = 0; t < nn; t++) sr[t] -= cg[t] * qg;
                }
                for (int t = 0; t < nn; t++) sr[t] += w.kbad[t];
            }
        }
    } else {
        load_window(a, 0, kind == 0 ? 0 : 3, bi, hi, i0, n, nn, w.x);
        for (int64_t r0 = 0; r0 < rows; r0 += RB_MAX) {
            const int rb = (int)(rows - r0 < RB_MAX ? rows - r0 : RB_MAX);
            run_k_win(kn, w.x, nn, rb, q + r0 * d, w.sc + r0 * TILE);
        }
    }
    /* 2. masks (after the NaN, as the reference) and the online softmax */
    const int64_t total = jb.total;
    const bool causal = a->causal && pos0 + n - 1 > total - a->s;
    for (int64_t r = 0; r < rows; r++) {
        float *sr = w.sc + r * TILE;
        for (int t = n; t < nn; t++) sr[t] = -INFINITY;
        if (causal) {
            const int64_t limit = total - a->s + r % a->s;
            for (int t = 0; t < n; t++)
                if (pos0 + t > limit) sr[t] = -INFINITY;
        }
        if (a->mask) {
            const uint8_t *mr = a->mask + bi * a->mask_sb + (hi * a->gq + r / a->s) * a->mask_sh + (r % a->s) * a->mask_ss;
            for (int t = 0; t < n; t++)
                if (!mr[(pos0 + t) * a->mask_st]) sr[t] = -INFINITY;
        }
        int nan = 0;
        const float mx = max_not_nan(sr, n, st.m[r], &nan, simd);
        const float base = mx == -INFINITY ? 0.0f : mx;
        const float alpha = expf(st.m[r] - base);
        const float sum = exp_sum(sr, nn, base, simd);
        st.l[r] = nan ? NAN : st.l[r] * alpha + sum;
        st.m[r] = mx;
        if (alpha != 1.0f) {
            float *ar = st.acc + r * d;
            for (int64_t i = 0; i < d; i++) ar[i] *= alpha;
            float *zr = w.ztm + r * gv;
            for (int g = 0; g < gv; g++) zr[g] *= alpha;
        }
    }
    /* 3. values: weights p s per group (NaN for a row outside the domain), minus sum p s z per group */
    if (kind == 1) {
        load_scales(a, 1, bi, hi, i0, n, nn, w.vs, w.vz, w.vbad);
        for (int g = 0; g < gv; g++) {
            float *cg = w.vc + g * TILE;
            const float *sg = w.vs + g * TILE, *zg = w.vz + g * TILE;
            for (int t = 0; t < nn; t++) cg[t] = sg[t] * zg[t] + w.vbad[t];
        }
        for (int64_t r = 0; r < rows; r++) {
            const float *p = w.sc + r * TILE;
            for (int k = 0; k < kw; k++) {
                float *wr = w.w + (r * kw + k) * TILE;
                const float *sk = w.vs + k * TILE;
                for (int t = 0; t < nn; t++) wr[t] = p[t] * sk[t] + w.vbad[t];
            }
            float *zr = w.ztm + r * gv;
            for (int g = 0; g < gv; g++) {
                const float *cg = w.vc + g * TILE;
                float zs = 0.0f;
                for (int t = 0; t < nn; t++) zs += p[t] * cg[t];
                zr[g] += zs;
            }
        }
        const rz_part &pt = a->part[1][1];
        const uint8_t *base = codes_at(pt, bi, hi, i0);
        for (int64_t r0 = 0; r0 < rows && !defer_values; r0 += RB_MAX) {
            const int rb = (int)(rows - r0 < RB_MAX ? rows - r0 : RB_MAX);
            run_v_int2(kn, base, pt.st, n, nn, rb, w.w + r0 * kw * TILE, kw, w.kidx, st.acc + r0 * d);
        }
    } else {
        load_window(a, 1, kind == 0 ? 0 : 3, bi, hi, i0, n, nn, w.x);
        for (int64_t r0 = 0; r0 < rows; r0 += RB_MAX) {
            const int rb = (int)(rows - r0 < RB_MAX ? rows - r0 : RB_MAX);
            run_v_win(kn, w.x, nn, rb, w.sc + r0 * TILE, st.acc + r0 * d);
        }
    }
}

/* Whether full INT2 tiles run their values fused with the next tile's scores: the lookup tables, one value
 * group per row and the query rows of a KV head in one block. */
bool use_fused(const Job &jb, const Kernels &kn, const Scratch &w) {
    return w.lut != NULL && jb.kw == 1 && jb.a->rows <= RB_MAX && kn.simd.kv_fused[jb.a->rows - 1] != NULL;
}

/* One work item: positions [lo, hi) of (sequence, KV head). */
void run_item(const Job &jb, const Kernels &kn, Scratch &w, int64_t item) {
    const rz_decode_args *a = jb.a;
    const int64_t rows = a->rows, d = jb.d, q4 = jb.q4;
    const int gk = (int)a->groups[0], gv = (int)a->groups[1];
    const int64_t bh = item / a->splits, sp = item % a->splits;
    const int64_t bi = bh / a->h, hi = bh % a->h;
    const int64_t lo = sp * jb.split_len;
    const int64_t end = lo + jb.split_len < jb.total ? lo + jb.split_len : jb.total;
    const int64_t per = a->b * a->h * a->splits;
    State st = {a->ws + item * rows, a->ws + per * rows + item * rows, a->ws + 2 * per * rows + item * rows * d};
    for (int64_t r = 0; r < rows; r++) {
        st.m[r] = -INFINITY;
        st.l[r] = 0.0f;
    }
    memset(st.acc, 0, (size_t)(rows * d) * sizeof(float));
    memset(w.ztm, 0, (size_t)(rows * gv) * sizeof(float));
    float *q = w.qp; /* q' = scale q R of each query row of the KV head */
    const float *rq = a->q_rot ? a->q_rot + hi * a->q_rot_sh : NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *src = a->q + bi * a->q_sb + (hi * a->gq + r / a->s) * a->q_sh + (r % a->s) * a->q_ss;
        float *dst = q + r * d;
        if (rq && a->q_rot_t) { /* q'[j] = scale sum_k q[k] R[j][k] */
            for (int64_t j = 0; j < d; j++) {
                const float *rj = rq + j * d;
                float acc = 0.0f;
                for (int64_t k = 0; k < d; k++) acc += src[k] * rj[k];
                dst[j] = acc * a->scale;
            }
        } else if (rq) {
            for (int64_t j = 0; j < d; j++) dst[j] = 0.0f;
            for (int64_t k = 0; k < d; k++) {
                const float x = src[k];
                const float *rk = rq + k * d;
                for (int64_t j = 0; j < d; j++) dst[j] += x * rk[j];
            }
            for (int64_t j = 0; j < d; j++) dst[j] *= a->scale;
        } else {
            for (int64_t j = 0; j < d; j++) dst[j] = src[j] * a->scale;
        }
    }
    if (a->n > 0 && end > a->p && lo < a->p + a->n) { /* the query as the INT2 keys need it */
        const int64_t ggk = d / gk;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < d; i++) {
                const int64_t aq = i / q4;
                w.qs[r * d + i] = q[r * d + i] * (aq == 0 ? 1.0f : aq == 1 ? 0.25f : aq == 2 ? 0.0625f : 0.015625f);
            }
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < gk; g++) {
                float sum = 0.0f;
                for (int64_t i = g * ggk; i < (g + 1) * ggk; i++) sum += q[r * d + i];
                w.qsum[r * gk + g] = sum;
            }
        if (w.lut)
            for (int64_t r0 = 0; r0 < rows; r0 += RB_MAX)
                kn.simd.k_lut_build(q + r0 * d, (int)(rows - r0 < RB_MAX ? rows - r0 : RB_MAX),
                                    w.lut + (r0 / RB_MAX) * d * 256);
    }
    const int64_t bounds[4] = {0, a->p, a->p + a->n, jb.total};
    /* INT2 tiles in pairs of full tiles: one tile's values and the next one's scores in the same passes */
    const kv_fused_fn fused = use_fused(jb, kn, w) ? kn.simd.kv_fused[rows - 1] : NULL;
    for (int kind = 0; kind < 3; kind++) {
        const int64_t s0 = lo > bounds[kind] ? lo : bounds[kind];
        const int64_t s1 = end < bounds[kind + 1] ? end : bounds[kind + 1];
        bool have_raw = false;
        for (int64_t p0 = s0; p0 < s1; p0 += TILE) {
            const int n = (int)(s1 - p0 < TILE ? s1 - p0 : TILE);
            const bool fuse = fused != NULL && kind == 1 && n == TILE && s1 - p0 >= 2 * TILE;
            tile(jb, kn, w, st, q, bi, hi, kind, p0, p0 - bounds[kind], n, have_raw, fuse);
            if (fuse) {
                const rz_part &kp = a->part[0][1], &vp = a->part[1][1];
                const int64_t i0 = p0 - bounds[kind];
                fused(codes_at(vp, bi, hi, i0), vp.st, w.w, w.kidx, st.acc, codes_at(kp, bi, hi, i0 + TILE), kp.st,
                      w.lut, w.kp, w.sc);
            }
            have_raw = fuse;
        }
    }
    if (a->n > 0) { /* minus sum_t p s z of each value group */
        const int64_t ggv = d / gv;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < d; i++) st.acc[r * d + i] -= w.ztm[r * gv + i / ggv];
    }
}

struct Buffers {
    float *mem;
    Scratch s;
};

/* Whether the scores use lookup tables: vectorized loops that have them for this head_dim, one (scale, zero)
 * group per key row, and few enough query rows per KV head for the tables to stay small. */
bool use_lut(const Job &jb, const Kernels &kn) {
    return !kn.portable && kn.simd.k_lut_build != NULL && jb.a->groups[0] == 1 && jb.a->rows <= LUT_MAX_ROWS &&
           jb.a->n > 0;
}

bool alloc_scratch(const Job &jb, const Kernels &kn, Buffers &b) {
    const rz_decode_args *a = jb.a;
    const int64_t rows = a->rows, d = jb.d, c8 = jb.q4 / 8;
    const int64_t lut = use_lut(jb, kn) ? (rows + RB_MAX - 1) / RB_MAX * d * 256 + 4 : 0;
    const int64_t floats = 2 * rows * d + rows * MAX_GROUPS + rows * TILE + rows * jb.kw * TILE + 7 * MAX_GROUPS * TILE +
                           2 * TILE + TILE * d + rows * MAX_GROUPS + TILE * RB_MAX + 8 * c8 + 64 + lut + (lut ? 4 * TILE : 0);
    b.mem = (float *)malloc((size_t)floats * sizeof(float));
    if (b.mem == NULL) return false;
    float *p = b.mem;
    Scratch &s = b.s;
    s.qp = p; p += rows * d;
    s.qs = p; p += rows * d;
    s.qsum = p; p += rows * MAX_GROUPS;
    s.sc = p; p += rows * TILE;
    s.w = p; p += rows * jb.kw * TILE;
    s.ks = p; p += MAX_GROUPS * TILE;
    s.kz = p; p += MAX_GROUPS * TILE;
    s.vs = p; p += MAX_GROUPS * TILE;
    s.vz = p; p += MAX_GROUPS * TILE;
    s.kc = p; p += MAX_GROUPS * TILE;
    s.vc = p; p += MAX_GROUPS * TILE;
    s.kbad = p; p += TILE;
    s.vbad = p; p += TILE;
    s.x = p; p += TILE * d;
    s.ztm = p; p += rows * MAX_GROUPS;
    s.tmp = p; p += TILE * RB_MAX;
    s.lut = s.kp = NULL;
    if (lut) { /* 16-byte aligned (lut holds 4 floats of slack) */
        s.lut = (float *)(((uintptr_t)p + 15) & ~(uintptr_t)15);
        s.kp = s.lut + (lut - 4);
        p += lut + 4 * TILE;
    }
    s.kidx = (int *)p; p += 4 * c8;
    s.gidx = (int *)p;
    for (int64_t aq = 0; aq < 4; aq++)
        for (int64_t c = 0; c < c8; c++) {
            const int64_t dim = aq * jb.q4 + 8 * c;
            s.gidx[aq * c8 + c] = (int)(dim / jb.gk);
            s.kidx[aq * c8 + c] = (int)(dim / jb.gv);
        }
    return true;
}

/* Merge the splits of (sequence, KV head) bh by their log-sum-exp, rotate (o R_out) and write its
 * query rows into out [B, Hq, S, d]. */
void merge_one(const Job &jb, int64_t bh, float *o) {
    const rz_decode_args *a = jb.a;
    const int64_t rows = a->rows, d = jb.d, splits = a->splits, per = a->b * a->h * splits;
    const float *ws_m = a->ws, *ws_l = a->ws + per * rows, *ws_acc = a->ws + 2 * per * rows;
    const int64_t bi = bh / a->h, hi = bh % a->h;
    const float *ro = a->o_rot ? a->o_rot + hi * a->o_rot_sh : NULL;
    for (int64_t r = 0; r < rows; r++) {
        float mx = -INFINITY;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float ms = ws_m[(bh * splits + sp) * rows + r];
            if (ms > mx) mx = ms;
        }
        const float base = mx == -INFINITY ? 0.0f : mx;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        float l = 0.0f;
        for (int64_t sp = 0; sp < splits; sp++) {
            const int64_t item = bh * splits + sp;
            const float ls = ws_l[item * rows + r];
            if (ls == 0.0f) continue; /* a range with no visible key */
            const float e = expf(ws_m[item * rows + r] - base);
            l += ls * e;
            const float *acc = ws_acc + (item * rows + r) * d;
            for (int64_t i = 0; i < d; i++) o[i] += acc[i] * e;
        }
        const float inv = l == 0.0f ? 0.0f : 1.0f / l; /* a row that sees no key: 0 */
        float *dst = a->out + ((bi * a->h + hi) * a->gq + r / a->s) * a->s * d + (r % a->s) * d;
        if (ro && a->o_rot_t) { /* out[j] = sum_k o[k] R[j][k] */
            for (int64_t j = 0; j < d; j++) {
                const float *rj = ro + j * d;
                float acc = 0.0f;
                for (int64_t k = 0; k < d; k++) acc += o[k] * rj[k];
                dst[j] = acc * inv;
            }
        } else if (ro) {
            for (int64_t j = 0; j < d; j++) dst[j] = 0.0f;
            for (int64_t k = 0; k < d; k++) {
                const float x = o[k] * inv;
                const float *rk = ro + k * d;
                for (int64_t j = 0; j < d; j++) dst[j] += x * rk[j];
            }
        } else {
            for (int64_t i = 0; i < d; i++) dst[i] = o[i] * inv;
        }
    }
}

/* Runs the work items on the OpenMP threads of the process (torch's own pool when torch loaded
 * libgomp first, so the two never compete for cores); with one thread no parallel region is
 * entered at all, so a process forked after its parent used the OpenMP pool can still call it.
 * Returns 1 when a tile buffer could not be allocated. */
int run_all(const Job &jb, const Kernels &kn, int threads) {
    const rz_decode_args *a = jb.a;
    const int64_t items = a->b * a->h * a->splits, heads = a->b * a->h;
    int error = 0;
    if (threads <= 1) {
        Buffers b;
        if (!alloc_scratch(jb, kn, b)) return 1;
        for (int64_t item = 0; item < items; item++) run_item(jb, kn, b.s, item);
        for (int64_t bh = 0; bh < heads; bh++) merge_one(jb, bh, b.s.qp);
        free(b.mem);
        return 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : error)
    {
        Buffers b;
        const bool ok = alloc_scratch(jb, kn, b);
        if (!ok) error = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (ok) run_item(jb, kn, b.s, item);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads; bh++)
            if (ok) merge_one(jb, bh, b.s.qp);
        if (ok) free(b.mem);
    }
    return error;
}

} // namespace

/* Returns 0 on success, 1 when memory ran out, 2 for arguments outside what this kernel takes.
 * `args`: rz_decode_arg_count() int64 values, the fields of struct rz_decode_args before `scale`. */
int rz_decode_int2(const int64_t *args, double scale) {
    struct rz_decode_args args_copy;
    memcpy(&args_copy, args, (size_t)rz_decode_arg_count() * sizeof(int64_t));
    args_copy.scale = (float)scale;
    const struct rz_decode_args *a = &args_copy;
    if ((a->d != 64 && a->d != 128 && a->d != 256) || a->rows < 1 || a->s < 1 || a->splits < 1) return 2;
    for (int side = 0; side < 2; side++)
        if (a->groups[side] < 1 || a->groups[side] > MAX_GROUPS || a->d % a->groups[side]) return 2;
    Job jb;
    jb.a = a;
    jb.total = a->p + a->n + a->r;
    jb.split_len = (jb.total + a->splits - 1) / a->splits;
    jb.d = a->d;
    jb.q4 = a->d / 4;
    jb.gk = a->d / a->groups[0];
    jb.gv = a->d / a->groups[1];
    jb.kw = (int)a->groups[1];
    const Kernels kn = kernels_for(a->d, a->portable != 0);
    const int64_t items = a->b * a->h * a->splits;
    int threads = (int)(a->threads < items ? a->threads : items);
    if (threads < 1) threads = 1;
    args_copy.ws = (float *)malloc((size_t)(items * a->rows * (a->d + 2)) * sizeof(float));
    if (args_copy.ws == NULL) return 1;
    const int rc = run_all(jb, kn, threads);
    free(args_copy.ws);
    return rc;
}

/* 1 when the vectorized inner loops were compiled in (AVX2 + FMA + F16C), else 0. */
int rz_decode_has_simd(void) { return RZ_AVX2; }

/* How many int64 values rz_decode_int2 reads from `args`. */
int64_t rz_decode_arg_count(void) { return (int64_t)(offsetof(struct rz_decode_args, scale) / sizeof(int64_t)); }
