/* Clip, uniform INT2-quantize and pack rows, for CPUs: rotationzoo.kernels.native (C-style C++).
 *
 * Bit for bit the PyTorch reference (reference.py: _levels, clip_rows / bisect_clip_rows,
 * uniform_params, pack_codes, quantize_rows) for uniform levels: every value is computed by the same
 * IEEE fp32 operations in the same order, so this file is compiled without contraction or
 * reassociation (-ffp-contract=off, no fast-math). Lloyd-Max levels stay in PyTorch. Rows run on
 * `threads` OpenMP threads (torch's pool; the caller passes torch's thread count) when there are many.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 256

extern "C" void rz_quantize_uniform(int64_t n, int64_t d, const void *x, int x_bf16, int64_t x_stride, int clip_index,
                                    int bisect, int64_t group_size, int sz_kind, uint8_t *codes, void *sz, int threads);

namespace {

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 (its vectorized path writes NaN as 0xFFFF). */
static inline uint16_t f32_to_bf16(float f) {
    if (isnan(f)) return 0xFFFF;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

/* Round to nearest even, as torch's float -> half (c10's fp16_ieee_from_fp32_value: overflow to inf,
 * subnormals rounded, NaN as a quiet NaN). */
static inline uint16_t f32_to_f16(float f) {
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero;
    uint32_t w;
    memcpy(&w, &f, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_f;
    memcpy(&bias_f, &bias_bits, 4);
    base = bias_f + base;
    uint32_t bits;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* The k-th smallest (0-based) of a[0..n) by quickselect (a is reordered). */
static float select_kth(float *a, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = a[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                const float t = a[i]; a[i] = a[j]; a[j] = t;
                i++; j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

typedef struct {
    int64_t d, x_stride, group_size;
    const void *x;
    int x_bf16, clip_index, bisect, sz_kind; /* sz_kind: fp32 (0), bf16 (1), fp16 (2) */
    uint8_t *codes;
    void *sz;
} qjob_t;

/* One row of rz_quantize_uniform. */
inline __attribute__((always_inline)) void quantize_row(const qjob_t *jb, int64_t row) {
    const int64_t d = jb->d, x_stride = jb->x_stride, group_size = jb->group_size;
    const void *x = jb->x;
    const int x_bf16 = jb->x_bf16, clip_index = jb->clip_index, bisect = jb->bisect, sz_kind = jb->sz_kind;
    uint8_t *codes = jb->codes;
    void *sz = jb->sz;
    const int64_t groups = d / group_size, quarter = d / 4;
    const float range_eps = (float)1e-8, three = 3.0f, half = 0.5f;
    float v[MAX_D], a[MAX_D];
    uint8_t q[MAX_D];
    int bad = 0;
    if (x_bf16) {
        const uint16_t *src = (const uint16_t *)x + row * x_stride;
        for (int64_t i = 0; i < d; i++) v[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(v, (const float *)x + row * x_stride, (size_t)d * sizeof(float));
    }
    for (int64_t i = 0; i < d; i++) bad |= isnan(v[i]) != 0;
    if (bad)
        for (int64_t i = 0; i < d; i++) v[i] = 0.0f;
    if (clip_index >= 0) {
        for (int64_t i = 0; i < d; i++) a[i] = fabsf(v[i]);
        float thr;
        if (bisect > 0) {
            const int64_t target = d - clip_index;
            float lo = 0.0f, hi = 0.0f;
            for (int64_t i = 0; i < d; i++) hi = a[i] > hi ? a[i] : hi;
            for (int it = 0; it < bisect; it++) {
                const float mid = (lo + hi) * half;
                int64_t above = 0;
                for (int64_t i = 0; i < d; i++) above += a[i] > mid;
                if (above > target) lo = mid;
                else hi = mid;
            }
            thr = hi;
        } else {
            thr = select_kth(a, (int)d, clip_index);
        }
        const float neg = -thr;
        for (int64_t i = 0; i < d; i++) {
            float t = v[i] > neg ? v[i] : neg;
            v[i] = t < thr ? t : thr;
        }
    }
    for (int64_t i = 0; i < d; i++) bad |= isinf(v[i]) != 0;
    if (bad)
        for (int64_t i = 0; i < d; i++) v[i] = 0.0f;
    for (int64_t i = 0; i < d; i++) v[i] = v[i] + 0.0f;
    float *out_f = (float *)sz + row * 2 * groups;
    uint16_t *out_h = (uint16_t *)sz + row * 2 * groups;
    for (int64_t g = 0; g < groups; g++) {
        const float *vg = v + g * group_size;
        float mn = vg[0], mx = vg[0];
        for (int64_t i = 1; i < group_size; i++) {
            mn = vg[i] < mn ? vg[i] : mn;
            mx = vg[i] > mx ? vg[i] : mx;
        }
        float range = mx - mn;
        range = range > range_eps ? range : range_eps;
        const float scale = range / three;
        const float zero = -mn / scale;
        for (int64_t i = 0; i < group_size; i++) {
            const float t = vg[i] / scale + zero + half;
            float f = floorf(t);
            f = f < 0.0f ? 0.0f : (f > three ? three : f);
            q[g * group_size + i] = (uint8_t)f;
        }
        const float s_out = bad ? NAN : scale, z_out = bad ? NAN : zero;
        if (sz_kind == 1) {
            out_h[2 * g] = f32_to_bf16(s_out);
            out_h[2 * g + 1] = f32_to_bf16(z_out);
        } else if (sz_kind == 2) {
            out_h[2 * g] = f32_to_f16(s_out);
            out_h[2 * g + 1] = f32_to_f16(z_out);
        } else {
            out_f[2 * g] = s_out;
            out_f[2 * g + 1] = z_out;
        }
    }
    uint8_t *c = codes + row * quarter;
    for (int64_t j = 0; j < quarter; j++)
        c[j] = bad ? 0 : (uint8_t)(q[j] | q[j + quarter] << 2 | q[j + 2 * quarter] << 4 | q[j + 3 * quarter] << 6);
}

} // namespace

/* Rows x[n, d] (fp32, or bf16 when x_bf16) with row stride x_stride elements. clip_index < 0: no
 * clip; bisect > 0: that many bisection passes instead of the exact threshold. Writes codes [n, d/4]
 * and scales_zeros [n, 2 * d / group_size] (fp32, bf16 or fp16 by sz_kind), both contiguous. Runs on
 * `threads` OpenMP threads; with 1 (or few rows) no parallel region is entered at all, so a process
 * forked after its parent used the OpenMP pool can still call it. */
void rz_quantize_uniform(int64_t n, int64_t d, const void *x, int x_bf16, int64_t x_stride, int clip_index,
                         int bisect, int64_t group_size, int sz_kind, uint8_t *codes, void *sz, int threads) {
    const qjob_t jb = {d, x_stride, group_size, x, x_bf16, clip_index, bisect, sz_kind, codes, sz};
    if (threads > 1 && n >= 256) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < n; row++) quantize_row(&jb, row);
    } else {
        for (int64_t row = 0; row < n; row++) quantize_row(&jb, row);
    }
}
