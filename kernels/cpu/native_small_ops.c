/* The small operations of a decode step, each one call from Python instead of several ATen ops:
 * residual add + RMSNorm, the argmax of logit rows, SiLU-and-multiply, rotary of q and k plus the
 * K/V cache write, and the bf16 twins of the three. The fused decode layers (native_decode_layers.c)
 * run the same row functions (add_rms_norm_row, silu_mul, silu_mul_rounded, rotate_store_row,
 * check_rows). A part of native.c, compiled inside it after native_common.h.
 */
#include "native_common.h"

/* o[i] = silu(g[i]) * u[i] for i < n. */
static void silu_mul(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#ifdef VEC
    const vec_t one = vset1(1.0f), zero = vset1(0.0f);
    for (; i + VEC <= n; i += VEC) {
        vec_t gv = vload(g + i);
        vstore(o + i, vmul(vdiv(gv, vadd(one, vexp(vsub(zero, gv)))), vload(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = g[i] / (1.0f + kvb_expf(-g[i])) * u[i];
}

/* One row of kvb_add_rms_norm: o = w * (x' * rsqrt(mean(x'^2) + eps)) with x' = xr + rr (stored
 * into xr), or xr itself where rr is NULL. Not inlined: kvb_add_rms_norm and the fused layers'
 * batched schedule run this one machine code, so that their sums are the same bits (an inlined
 * copy may vectorize its reduction in another order). */
static __attribute__((noinline)) void add_rms_norm_row(float *xr, const float *rr, const float *w, float *o,
                                                      int64_t dim, float eps) {
    float ss = 0.0f;
    if (rr != NULL) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) {
            float v = xr[i] + rr[i];
            xr[i] = v;
            ss += v * v;
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    }
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
}

/* out[r] = w * (x'[r] * rsqrt(mean(x'[r]^2) + eps)) with x' = x + res; x' is stored into x (the
 * new residual) when res is given. */
void kvb_add_rms_norm(float *x, const float *res, const float *w, float *out, int64_t rows, int64_t dim,
                      float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * dim >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x + r * dim, res != NULL ? res + r * dim : NULL, w, out + r * dim, dim, eps);
}

/* The first index of x[0:n]'s largest value, as torch.argmax answers: a NaN counts as larger than
 * any number, so a row holding one gets its first NaN's index. Two passes: the maximum (and whether
 * there is a NaN) in one vectorized sweep, then the first match, searched 64 values at a time with
 * a vectorized test per run (the row, 192 KB for a 49,152-token vocabulary, is in L2 by then). */
static int64_t argmax_row(const float *x, int64_t n) {
    float mx = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        mx = v > mx ? v : mx;
        nan |= v != v;
    }
    for (int64_t b = 0; b < n; b += 64) {
        const int64_t e = b + 64 < n ? b + 64 : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < e; i++) hit |= nan ? x[i] != x[i] : x[i] == mx;
        if (hit)
            for (int64_t i = b; i < e; i++)
                if (nan ? x[i] != x[i] : x[i] == mx) return i;
    }
    return 0;  /* not reached: n >= 1 and the maximum (or a NaN) is in the row */
}

/* out[r] = argmax of row r of x [rows, cols], rows `stride` floats apart. ATen's argmax over the
 * last axis took 3.3 ms for 64 rows of SmolLM2's 49,152 logits (a batched greedy step's sampling,
 * Xeon 167, 2 threads): 4 GB/s over data the head had just written. */
int kvb_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int nthreads) {
    if (rows < 0 || cols < 1 || stride < cols) return KVB_BAD_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols);
    return KVB_OK;
}

/* out[r, i] = silu(x[r, i]) * x[r, half + i], x [rows, 2 half] (gate columns, then up). */
void kvb_silu_and_mul(const float *x, float *out, int64_t rows, int64_t half, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * half >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * half;
        silu_mul(g, g + half, out + r * half, half);
    }
}

/* silu_mul with a bf16 tensor's roundings, over fp32 values that are bf16 already (the fused bf16
 * layers, kvb_silu_and_mul_bf16): o = bf16(bf16(silu(g)) * u), kept as fp32; o may be g. */
static void silu_mul_rounded(const float *g, const float *u, float *o, int64_t n) {
    float ones[256];
    for (int i = 0; i < 256; i++) ones[i] = 1.0f;
    for (int64_t c = 0; c < n; c += 256) {
        const int64_t m = n - c < 256 ? n - c : 256;
        silu_mul(g + c, ones, o + c, m);  /* silu(gate) in fp32 (times 1: exact) */
        for (int64_t i = c; i < c + m; i++) o[i] = round_bf16(round_bf16(o[i]) * u[i]);
    }
}

/* Rotate (rotate-half convention) the hq query and hkv key heads at the start of each row of
 * qkv [rows, row_stride] in place, by cos_sin [max_pos, d] (cos in the first d/2 columns, sin in
 * the last); then, when k_plane is given, copy each row's hkv key heads (rotated) and the hkv
 * value heads after them to slot slots[t] of k_plane / v_plane ([num_slots, hkv, d] each). */
/* Checks each token's position and (when slots is given) its cache slot; 0 when all are in range. */
static int check_rows(int64_t rows, const int64_t *positions, int64_t max_pos, const int64_t *slots,
                      int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) return KVB_BAD_INDEX;
        if (slots != NULL && (slots[t] < 0 || slots[t] >= num_slots)) return KVB_BAD_INDEX;
    }
    return KVB_OK;
}

/* One token's rotary (its hq + hkv heads at the start of row, by the cos/sin row cs) and, when
 * k_plane is given, its rotated K and its V copied to the cache slot. bf16 (the fused bf16
 * layers: row holds bf16 values as fp32): the rotated values rounded to bf16, as
 * kvb_rotary_store_bf16 rounds them, and the planes bf16. */
static void rotate_store_row(float *row, const float *cs, int64_t hq, int64_t hkv, int64_t d, void *k_plane,
                             void *v_plane, int64_t slot, int bf16) {
    const int64_t half = d / 2, kv = hkv * d;
    const float *sn = cs + half;
    for (int64_t h = 0; h < hq + hkv; h++) {
        float *x1 = row + h * d, *x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            float a = x1[j], b = x2[j];
            x1[j] = a * cs[j] - b * sn[j];
            x2[j] = b * cs[j] + a * sn[j];
        }
    }
    if (bf16) {
#pragma omp simd
        for (int64_t j = 0; j < (hq + hkv) * d; j++) row[j] = round_bf16(row[j]);
    }
    if (k_plane == NULL) return;
    const float *k = row + hq * d, *v = k + kv;
    if (!bf16) {
        memcpy((float *)k_plane + slot * kv, k, (size_t)kv * sizeof(float));
        memcpy((float *)v_plane + slot * kv, v, (size_t)kv * sizeof(float));
        return;
    }
    uint16_t *kp = (uint16_t *)k_plane + slot * kv, *vp = (uint16_t *)v_plane + slot * kv;
    for (int64_t j = 0; j < kv; j++) kp[j] = f32_bf16(k[j]), vp[j] = f32_bf16(v[j]);  /* exact: bf16 values */
}

int kvb_rotary_store(float *qkv, int64_t rows, int64_t row_stride, int64_t hq, int64_t hkv, int64_t d,
                     const int64_t *positions, const float *cos_sin, int64_t max_pos, float *k_plane,
                     float *v_plane, const int64_t *slots, int64_t num_slots, int nthreads) {
    if (d % 2 || (hq + 2 * hkv) * d > row_stride) return KVB_BAD_SHAPE;
    if (check_rows(rows, positions, max_pos, k_plane != NULL ? slots : NULL, num_slots)) return KVB_BAD_INDEX;
#pragma omp parallel for num_threads(nthreads) if (rows * row_stride >= PAR_WORK && rows > 1)
    for (int64_t t = 0; t < rows; t++)
        rotate_store_row(qkv + t * row_stride, cos_sin + positions[t] * d, hq, hkv, d, k_plane, v_plane,
                         k_plane != NULL ? slots[t] : 0, 0);
    return KVB_OK;
}

/* ---- bf16 twins of the three small ops, for bf16 models ----
 * Each computes in fp32 and rounds to bf16 where the PyTorch reference's bf16 tensors round (the
 * residual sum, the normalized row before the weight, the product; silu's output, the product;
 * the rotated values), so they differ from it only by the fp32 summation order of the norm's
 * mean of squares and by the exp polynomial. */
/* kvb_add_rms_norm over bf16 rows and a bf16 weight: x' = bf16(x + res) into x; out =
 * bf16(w * bf16(x' * rsqrt(mean(x'^2) + eps))). */
void kvb_add_rms_norm_bf16(uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out, int64_t rows,
                           int64_t dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * dim >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * dim, *o = out + r * dim;
        float ss = 0.0f;
        if (res != NULL) {
            const uint16_t *rr = res + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] = f32_bf16(bf16_f32(xr[i]) + bf16_f32(rr[i]));
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) {
            float v = bf16_f32(xr[i]);
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = f32_bf16(bf16_f32(w[i]) * bf16_f32(f32_bf16(bf16_f32(xr[i]) * inv)));
    }
}

/* kvb_silu_and_mul over bf16: out = bf16(bf16(silu(gate)) * up). */
void kvb_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t half, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * half >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * half, *u = g + half;
        uint16_t *o = out + r * half;
        float gate[256], up[256];  /* a chunk of each in fp32 (widening is exact) */
        for (int64_t c = 0; c < half; c += 256) {
            int64_t n = half - c < 256 ? half - c : 256;
            for (int64_t i = 0; i < n; i++) gate[i] = bf16_f32(g[c + i]), up[i] = bf16_f32(u[c + i]);
            silu_mul_rounded(gate, up, gate, n);
            for (int64_t i = 0; i < n; i++) o[c + i] = f32_bf16(gate[i]);  /* exact: bf16 values */
        }
    }
}

/* kvb_rotary_store over a bf16 qkv and bf16 cache planes (cos_sin stays fp32): the rotation in
 * fp32, rounded once to bf16, then K and V copied to the slot. */
int kvb_rotary_store_bf16(uint16_t *qkv, int64_t rows, int64_t row_stride, int64_t hq, int64_t hkv, int64_t d,
                          const int64_t *positions, const float *cos_sin, int64_t max_pos, uint16_t *k_plane,
                          uint16_t *v_plane, const int64_t *slots, int64_t num_slots, int nthreads) {
    if (d % 2 || (hq + 2 * hkv) * d > row_stride) return KVB_BAD_SHAPE;
    if (check_rows(rows, positions, max_pos, k_plane != NULL ? slots : NULL, num_slots)) return KVB_BAD_INDEX;
    const int64_t half = d / 2, kv = hkv * d;
#pragma omp parallel for num_threads(nthreads) if (rows * row_stride >= PAR_WORK && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        uint16_t *row = qkv + t * row_stride;
        const float *cs = cos_sin + positions[t] * d, *sn = cs + half;
        for (int64_t h = 0; h < hq + hkv; h++) {
            uint16_t *x1 = row + h * d, *x2 = x1 + half;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                float a = bf16_f32(x1[j]), b = bf16_f32(x2[j]);
                x1[j] = f32_bf16(a * cs[j] - b * sn[j]);
                x2[j] = f32_bf16(b * cs[j] + a * sn[j]);
            }
        }
        if (k_plane != NULL) {
            memcpy(k_plane + slots[t] * kv, row + hq * d, (size_t)kv * sizeof(uint16_t));
            memcpy(v_plane + slots[t] * kv, row + (hq + hkv) * d, (size_t)kv * sizeof(uint16_t));
        }
    }
    return KVB_OK;
}
