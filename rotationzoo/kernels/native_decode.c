/* Decode attention over the OSCAR INT2 cache layout, for CPUs: rotationzoo.kernels.native.
 *
 * Same contract as the PyTorch reference (decode_reference.py) on validated, prepared inputs: the
 * queries are already rotated and scaled ([B, H, rows, d] fp32, row i*S + s is query token s of the
 * i-th query head of KV head h); keys/values are [sink | INT2 codes + scale/zero | recent] per
 * (sequence, KV head). Each (sequence, KV head) is cut into `splits` ranges of key positions; a
 * range is walked in tiles of TILE tokens, each INT2 row dequantized in registers ((c - z) * s per
 * group, codes quarter-interleaved: byte j holds dims j, j+Q, j+2Q, j+3Q at bits 0-1 .. 6-7) and
 * folded into an fp32 online softmax; the ranges are merged by their log-sum-exp. Nothing but one
 * tile of scores per thread is ever materialized. Ranges run on `threads` OpenMP threads.
 *
 * An INT2 row is read as NaN when any of its groups has a scale or zero that is not finite or that
 * could dequantize past MAX_DEQUANT (|s| * max(|z|, |3 - z|) > 2^64, the same test as the
 * reference's, in the same fp32 operations): a NaN score (the quantizer flags a non-finite input row
 * with NaN scales) makes its query row NaN, and a NaN value row every query row of its head, as in
 * the PyTorch reference and the Triton kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64
#define MAX_D 256
#define MAX_DEQUANT 0x1p64f /* decode_reference.MAX_DEQUANT */

typedef struct {
    const void *p;    /* first element */
    int64_t sb, sh;   /* strides (elements) of the sequence and KV-head dimensions */
    int64_t st;       /* stride (elements) of the token dimension; the last dimension is contiguous */
} part_t;

typedef struct {
    int64_t b, h, rows, s, d, p, n, r;
    int causal;
    const float *q;                 /* [B, H, rows, d] contiguous, rotated and scaled */
    part_t sink[2], recent[2];      /* [.., d] fp32 (win_bf16 = 0) or bf16 (1); side 0 keys, 1 values */
    int win_bf16;
    part_t codes[2];                /* uint8 [.., d/4] */
    part_t sz[2];                   /* fp32 [.., 2 * groups] interleaved (scale, zero) */
    int groups[2];
    int64_t splits, split_len;
    float *ws_m, *ws_l, *ws_acc;    /* per (sequence, head, split): [rows], [rows], [rows, d] */
} job_t;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row `idx` of window part `w` (sequence bi, head hi) as fp32 into out[d]. */
static inline __attribute__((always_inline)) void window_row(const job_t *j, const part_t *w, int64_t bi, int64_t hi, int64_t idx, float *out,
                                                              const int64_t d) {
    int64_t off = bi * w->sb + hi * w->sh + idx * w->st;
    if (j->win_bf16) {
        const uint16_t *src = (const uint16_t *)w->p + off;
        for (int64_t i = 0; i < d; i++) out[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(out, (const float *)w->p + off, (size_t)d * sizeof(float));
    }
}

/* INT2 row `idx` of side `side` dequantized: out[i] = (code_i - z_g) * s_g. */
static inline __attribute__((always_inline)) void int2_row(const job_t *j, int side, int64_t bi, int64_t hi, int64_t idx, float *out,
                                                            const int64_t d) {
    const part_t *c = &j->codes[side], *z = &j->sz[side];
    const uint8_t *bytes = (const uint8_t *)c->p + bi * c->sb + hi * c->sh + idx * c->st;
    const float *sz = (const float *)z->p + bi * z->sb + hi * z->sh + idx * z->st;
    const int64_t quarter = d / 4, g = d / j->groups[side];
    int bad = 0;
    for (int k = 0; k < j->groups[side]; k++) {
        const float za = fabsf(sz[2 * k + 1]), zb = fabsf(3.0f - sz[2 * k + 1]);
        bad |= !(fabsf(sz[2 * k]) * (za > zb ? za : zb) <= MAX_DEQUANT);
    }
    if (bad) {
        for (int64_t i = 0; i < d; i++) out[i] = NAN;
        return;
    }
    for (int a = 0; a < 4; a++) {
        const int shift = 2 * a;
        float *dst = out + a * quarter;
#pragma omp simd
        for (int64_t i = 0; i < quarter; i++) dst[i] = (float)((bytes[i] >> shift) & 3);
    }
    for (int k = 0; k < j->groups[side]; k++) {
        const float s = sz[2 * k], zero = sz[2 * k + 1];
        float *dst = out + k * g;
#pragma omp simd
        for (int64_t i = 0; i < g; i++) dst[i] = (dst[i] - zero) * s;
    }
}

/* Key (side 0) or value (side 1) at global position pos of (bi, hi). */
static inline __attribute__((always_inline)) void fetch(const job_t *j, int side, int64_t bi, int64_t hi, int64_t pos, float *out,
                                                         const int64_t d) {
    if (pos < j->p) window_row(j, &j->sink[side], bi, hi, pos, out, d);
    else if (pos < j->p + j->n) int2_row(j, side, bi, hi, pos - j->p, out, d);
    else window_row(j, &j->recent[side], bi, hi, pos - j->p - j->n, out, d);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* One work item: positions [lo, hi) of (bi, head) folded into m, l, acc of that item. */
static inline __attribute__((always_inline)) void run_item_d(job_t *j, int64_t item, float *scores, float *row,
                                                             const int64_t d) {
    const int64_t rows = j->rows, total = j->p + j->n + j->r;
    const int64_t bh = item / j->splits, sp = item % j->splits;
    const int64_t bi = bh / j->h, hi = bh % j->h;
    const int64_t lo = sp * j->split_len;
    const int64_t end = lo + j->split_len < total ? lo + j->split_len : total;
    const float *q = j->q + bh * rows * d;
    float *m = j->ws_m + item * rows, *l = j->ws_l + item * rows, *acc = j->ws_acc + item * rows * d;
    for (int64_t r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, (size_t)(rows * d) * sizeof(float));
    for (int64_t t0 = lo; t0 < end; t0 += TILE) {
        const int64_t n = end - t0 < TILE ? end - t0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            fetch(j, 0, bi, hi, t0 + t, row, d);
            for (int64_t r = 0; r < rows; r++) {
                float sc = dot(q + r * d, row, d);
                if (j->causal && t0 + t > total - j->s + r % j->s) sc = -INFINITY;
                scores[r * TILE + t] = sc;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float *sr = scores + r * TILE;
            float mx = m[r];
            int nan = 0;
            for (int64_t t = 0; t < n; t++) {
                if (sr[t] != sr[t]) nan = 1;
                else if (sr[t] > mx) mx = sr[t];
            }
            if (nan) { l[r] = NAN; }
            const float base = mx == -INFINITY ? 0.0f : mx;
            const float alpha = expf(m[r] - base);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) { sr[t] = expf(sr[t] - base); sum += sr[t]; }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
            float *ar = acc + r * d;
            if (alpha != 1.0f)
                for (int64_t i = 0; i < d; i++) ar[i] *= alpha;
        }
        for (int64_t t = 0; t < n; t++) {
            fetch(j, 1, bi, hi, t0 + t, row, d);
            for (int64_t r = 0; r < rows; r++) {
                const float w = scores[r * TILE + t];
                float *ar = acc + r * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ar[i] += w * row[i];
            }
        }
    }
}

static void run_item_64(job_t *j, int64_t item, float *scores, float *row) { run_item_d(j, item, scores, row, 64); }
static void run_item_128(job_t *j, int64_t item, float *scores, float *row) { run_item_d(j, item, scores, row, 128); }
static void run_item_256(job_t *j, int64_t item, float *scores, float *row) { run_item_d(j, item, scores, row, 256); }

static void run_item(job_t *j, int64_t item, float *scores, float *row) {
    if (j->d == 64) run_item_64(j, item, scores, row);
    else if (j->d == 128) run_item_128(j, item, scores, row);
    else run_item_256(j, item, scores, row);
}

/* Runs the work items on the OpenMP threads of the process (torch's own pool when torch loaded
 * libgomp first, so the two never compete for cores); with one thread no parallel region is
 * entered at all, so a process forked after its parent used the OpenMP pool can still call it.
 * Returns 1 when a tile buffer could not be allocated. */
static int run_all(job_t *j, int threads) {
    const int64_t items = j->b * j->h * j->splits;
    int error = 0;
    if (threads <= 1) {
        float *scores = (float *)malloc((size_t)(j->rows * TILE + MAX_D) * sizeof(float));
        if (scores == NULL) return 1;
        for (int64_t item = 0; item < items; item++) run_item(j, item, scores, scores + j->rows * TILE);
        free(scores);
        return 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : error)
    {
        float *scores = (float *)malloc((size_t)(j->rows * TILE + MAX_D) * sizeof(float));
        if (scores == NULL) error = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (scores != NULL) run_item(j, item, scores, scores + j->rows * TILE);
        free(scores);
    }
    return error;
}

/* Merge the splits of each (sequence, head) into out [B, H, rows, d] (natural dim order). */
static void merge(const job_t *j, float *out) {
    const int64_t rows = j->rows, d = j->d;
    for (int64_t bh = 0; bh < j->b * j->h; bh++) {
        for (int64_t r = 0; r < rows; r++) {
            float mx = -INFINITY;
            for (int64_t sp = 0; sp < j->splits; sp++) {
                const float ms = j->ws_m[(bh * j->splits + sp) * rows + r];
                if (ms > mx) mx = ms;
            }
            const float base = mx == -INFINITY ? 0.0f : mx;
            float *o = out + (bh * rows + r) * d;
            memset(o, 0, (size_t)d * sizeof(float));
            float l = 0.0f;
            for (int64_t sp = 0; sp < j->splits; sp++) {
                const int64_t item = bh * j->splits + sp;
                const float ls = j->ws_l[item * rows + r];
                if (ls == 0.0f) continue; /* a range with no visible key */
                const float e = expf(j->ws_m[item * rows + r] - base);
                l += ls * e;
                const float *a = j->ws_acc + (item * rows + r) * d;
                for (int64_t i = 0; i < d; i++) o[i] += a[i] * e;
            }
            const float inv = 1.0f / l;
            for (int64_t i = 0; i < d; i++) o[i] *= inv;
        }
    }
}

/* Returns 0 on success, 1 when memory ran out. `parts` is 6 parts of 4 int64 each: for keys then
 * values, (pointer, sb, sh, st) of sink, codes, scales_zeros, recent; see job_t. */
int rz_decode_int2(int64_t b, int64_t h, int64_t rows, int64_t s, int64_t d, int64_t p, int64_t n, int64_t r,
                   int causal, const float *q, const int64_t *parts, int win_bf16, int k_groups, int v_groups,
                   int64_t splits, int threads, float *ws, float *out) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.b = b; j.h = h; j.rows = rows; j.s = s; j.d = d; j.p = p; j.n = n; j.r = r;
    j.causal = causal; j.q = q; j.win_bf16 = win_bf16;
    j.groups[0] = k_groups; j.groups[1] = v_groups;
    for (int side = 0; side < 2; side++) {
        part_t *dst[4] = {&j.sink[side], &j.codes[side], &j.sz[side], &j.recent[side]};
        for (int k = 0; k < 4; k++) {
            const int64_t *src = parts + (side * 4 + k) * 4;
            dst[k]->p = (const void *)(intptr_t)src[0];
            dst[k]->sb = src[1]; dst[k]->sh = src[2]; dst[k]->st = src[3];
        }
    }
    const int64_t total = p + n + r;
    j.splits = splits < 1 ? 1 : splits;
    j.split_len = (total + j.splits - 1) / j.splits;
    j.ws_m = ws;
    j.ws_l = ws + b * h * j.splits * rows;
    j.ws_acc = ws + 2 * b * h * j.splits * rows;
    int64_t items = b * h * j.splits;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    if (run_all(&j, threads)) return 1;
    merge(&j, out);
    return 0;
}
