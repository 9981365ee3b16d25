/* The small fp32 operations of a CPU decode step, each one call from Python instead of several
 * ATen ops: residual add + RMSNorm, rotary of q and k plus the K/V cache write, SiLU-and-multiply,
 * and decode attention read in place from the paged cache.
 *
 * Why: at batch 1 a SmolLM2 step ran 1,144 ATen ops, and on an Intel Xeon with AMX (2 vCPUs,
 * torch 2.13) the time between its 121 matmuls was 17 ms of a 41 ms step; ATen's fp32 rms_norm
 * alone took 13 us standalone and ~65 us after a matmul. These loops are short and plain: gcc
 * -O3 -march=native vectorizes them for the CPU it builds on (AVX2, AVX-512).
 *
 * Numerics: the same formulas as kvbatch/kernels/reference.py, computed in fp32; sums and the
 * exponential are ordered and rounded differently from ATen's (not bit for bit; the tests bound
 * the difference). exp is a Cephes-style polynomial (below ~2 ulp over the range used), so that
 * the loops vectorize without libm calls.
 *
 * Every index read from a tensor (positions, slots, block ids, context lengths) is checked
 * against the bounds passed in; a bad one returns a nonzero code and writes nothing past a
 * buffer. Threads: OpenMP where a call carries enough work, on the libgomp torch has loaded.
 *
 * Built and loaded by kvbatch/kernels/cpu_native.py (ctypes, no torch headers).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define KVB_OK 0
#define KVB_BAD_INDEX 1
#define KVB_BAD_SHAPE 2
#define KVB_NO_MEMORY 3
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define PAR_WORK (1 << 15)  /* elements from which a call splits across threads */

/* Int8 and bf16 weights are held in blocks of W_BLOCK output columns, [ceil(out / W_BLOCK), in,
 * W_BLOCK] (the last block's missing columns zero): a block's weights are one contiguous run,
 * streamed front to back while its sums stay in registers. (The [in, out] layout, a band of each
 * input row's columns per pass, streamed int8 at under half the rate of fp32, and bf16 at half
 * (10 against 18-19 GB/s of a plain widening read, Xeon 167): runs a quarter or half as long
 * between jumps, and the sums loaded and stored on every pass.) */
#define W_BLOCK 16

int kvb_native_abi_version(void) { return 10; }
int kvb_block_cols(void) { return W_BLOCK; }

static inline float kvb_expf(float x) {
    x = fminf(fmaxf(x, -87.3f), 88.3f);
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);  /* x - n ln2, ln2 split in two (Cody-Waite) */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } scale;  /* 2^n as a float's bits */
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* The same exp on whole vectors (gcc does not vectorize the bit cast above by itself). */
#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vec_t;
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vfma _mm512_fmadd_ps
static inline vec_t vexp(vec_t x) {
    x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.3f)), vset1(88.3f));
    vec_t n = _mm512_roundscale_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
typedef __m256 vec_t;
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vfma _mm256_fmadd_ps
static inline vec_t vexp(vec_t x) {
    x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.3f)), vset1(88.3f));
    vec_t n = _mm256_round_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
#ifdef VEC
    vec_t r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec_t p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
#if VEC == 16
    return _mm512_scalef_ps(p, n);
#else
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return vmul(p, _mm256_castsi256_ps(bits));
#endif
}
#endif

/* x[i] = exp(x[i] - sub) for i < n; returns their sum. */
static float exp_sub_sum(float *x, int64_t n, float sub) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef VEC
    vec_t acc = vset1(0.0f), s = vset1(sub);
    for (; i + VEC <= n; i += VEC) {
        vec_t e = vexp(vsub(vload(x + i), s));
        vstore(x + i, e);
        acc = vadd(acc, e);
    }
    float lanes[VEC];
    vstore(lanes, acc);
    for (int k = 0; k < VEC; k++) sum += lanes[k];
#endif
    for (; i < n; i++) {
        x[i] = kvb_expf(x[i] - sub);
        sum += x[i];
    }
    return sum;
}

/* bf16 <-> fp32, for bf16 models (the bf16 twins below, bf16 weights and caches). */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;  /* exact: bf16 is the top half of an fp32 */
    return v.f;
}

static inline uint16_t f32_bf16(float f) {  /* round to nearest, ties to even, as torch does; NaN stays NaN */
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* f rounded to the nearest bf16, kept as fp32: where a bf16 tensor of the reference would round. */
static inline float round_bf16(float f) { return bf16_f32(f32_bf16(f)); }

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

/* Checks every index a decode step follows; 0 when all are in range. */
static int check_decode_indices(int64_t n_seqs, const int32_t *block_tables, int64_t table_stride,
                                const int32_t *context_lens, int64_t num_blocks, int64_t block_size,
                                int64_t *max_len, int64_t *total) {
    *max_len = *total = 0;
    for (int64_t n = 0; n < n_seqs; n++) {
        int64_t len = context_lens[n];
        if (len < 0 || len > table_stride * block_size) return KVB_BAD_INDEX;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            int32_t blk = block_tables[n * table_stride + b];
            if (blk < 0 || blk >= num_blocks) return KVB_BAD_INDEX;
        }
        *max_len = len > *max_len ? len : *max_len;
        *total += len;
    }
    return KVB_OK;
}

/* out[j * out_stride] = scale * q_j . k for the group's query heads: one load of each slice of k
 * for all of them, each dot summed in vector lanes and reduced once (a plain loop would reduce
 * every dot across lanes as it goes: measured ~10x slower on an AVX-512 Xeon). */
static inline void qk_dots(const float *q, int64_t group, const float *k, int64_t d, float scale, float *out,
                           int64_t out_stride) {
#if defined(__AVX512F__)
    if (d % 16 == 0 && group <= MAX_GROUP) {
        __m512 acc[MAX_GROUP];
        for (int64_t j = 0; j < group; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) {
            const __m512 kv = _mm512_loadu_ps(k + e);
            for (int64_t j = 0; j < group; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + e), kv, acc[j]);
        }
        for (int64_t j = 0; j < group; j++) out[j * out_stride] = _mm512_reduce_add_ps(acc[j]) * scale;
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0 && group <= MAX_GROUP) {
        __m256 acc[MAX_GROUP];
        for (int64_t j = 0; j < group; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 8) {
            const __m256 kv = _mm256_loadu_ps(k + e);
            for (int64_t j = 0; j < group; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e), kv, acc[j]);
        }
        for (int64_t j = 0; j < group; j++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[j * out_stride] = _mm_cvtss_f32(v) * scale;
        }
        return;
    }
#endif
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + j * d;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t e = 0; e < d; e++) acc += qj[e] * k[e];
        out[j * out_stride] = acc * scale;
    }
}

#ifdef VEC
/* The sums of 4 vectors' lanes, as one 4-float vector (each a dot product summed in lanes). */
static inline __m128 sum4(vec_t a0, vec_t a1, vec_t a2, vec_t a3) {
#if VEC == 16
    /* 128-bit lanes added pairwise across the vectors, then the 4 floats within each lane */
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, v));  /* lane c's sum, c = 0..3 */
#else
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#endif
}

/* VEC values of the cache (or weight) at base + index as fp32: a bf16 one's widened (exact: bf16
 * is the top half of an fp32). */
static inline vec_t kv_load(const void *base, int64_t index, int bf16) {
    if (!bf16) return vload((const float *)base + index);
    const uint16_t *src = (const uint16_t *)base + index;
#if VEC == 16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
#else
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
#endif
}

/* qk_dots for 4 consecutive positions at k + index, + stride, ... (d a multiple of VEC; a bf16
 * cache widened as it is read): each head's 4 dots summed in vector lanes, then reduced together
 * (sum4). Why: one lane reduction per dot cost more than the dot itself. On an AVX-512 Xeon the
 * whole attention took 69 core cycles per position and KV head from cache with qk_dots (its
 * accumulators on the stack, a reduction per dot), 35 with this. */
static inline __attribute__((always_inline)) void qk_dots4(const float *q, int64_t group, const void *k,
                                                           int64_t index, int64_t stride, int64_t d, int bf16,
                                                           float scale, float *out, int64_t out_stride) {
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + j * d;
        vec_t a0 = vset1(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < d; e += VEC) {
            const vec_t qv = vload(qj + e);
            a0 = vfma(qv, kv_load(k, index + e, bf16), a0);
            a1 = vfma(qv, kv_load(k, index + stride + e, bf16), a1);
            a2 = vfma(qv, kv_load(k, index + 2 * stride + e, bf16), a2);
            a3 = vfma(qv, kv_load(k, index + 3 * stride + e, bf16), a3);
        }
        _mm_storeu_ps(out + j * out_stride, _mm_mul_ps(sum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
}
#endif

#if defined(__AVX512BF16__)
/* qk_dots4 over a bf16 cache on a CPU with AVX512-BF16, for up to 4 query heads (d a multiple of
 * 32): each 32-value slice of the 4 keys is loaded once for all the heads and multiplied with
 * vdpbf16ps, 32 products and their pairwise sums in one instruction, where the widening loop
 * widens every slice again per head (two instructions per 16 values) and then multiplies 16 at a
 * time. Numerics: the queries are bf16 values (qb, converted exactly), so each product is exact
 * in fp32 as in the widening loop; the sums are fp32 in another order (pairs first), and bf16
 * subnormals count as zero (the instruction's rule). */
static inline __attribute__((always_inline)) void qk_dots4_dpbf16(const __m512bh *qb, int64_t group,
                                                                  const uint16_t *k, int64_t index, int64_t stride,
                                                                  int64_t d, float scale, float *out,
                                                                  int64_t out_stride) {
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a[j][c] = _mm512_setzero_ps();
    const int64_t slices = d / 32;
    for (int64_t e = 0; e < slices; e++) {
        const uint16_t *k0 = k + index + 32 * e;
        const __m512bh k0v = (__m512bh)_mm512_loadu_si512(k0), k1v = (__m512bh)_mm512_loadu_si512(k0 + stride),
                       k2v = (__m512bh)_mm512_loadu_si512(k0 + 2 * stride),
                       k3v = (__m512bh)_mm512_loadu_si512(k0 + 3 * stride);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            if (j < group) {
                const __m512bh qv = qb[j * slices + e];
                a[j][0] = _mm512_dpbf16_ps(a[j][0], qv, k0v);
                a[j][1] = _mm512_dpbf16_ps(a[j][1], qv, k1v);
                a[j][2] = _mm512_dpbf16_ps(a[j][2], qv, k2v);
                a[j][3] = _mm512_dpbf16_ps(a[j][3], qv, k3v);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        if (j < group)
            _mm_storeu_ps(out + j * out_stride, _mm_mul_ps(sum4(a[j][0], a[j][1], a[j][2], a[j][3]), _mm_set1_ps(scale)));
}

/* The group's queries [group, d] (bf16 values held as fp32) as bf16 pairs for qk_dots4_dpbf16:
 * element i of slice e is q[32 e + i], as the keys' slice is laid out. */
static void queries_bf16(const float *q, int64_t group, int64_t d, __m512bh *qb) {
    for (int64_t j = 0; j < group; j++)
        for (int64_t e = 0; e < d; e += 32)
            qb[(j * d + e) / 32] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + j * d + e + 16), _mm512_loadu_ps(q + j * d + e));
}
#endif

/* One cache position's d values as fp32: the fp32 cache itself, or a bf16 cache's values widened
 * into tmp (bf16 is the top half of an fp32: widening is exact). */
static inline const float *cache_pos(const void *base, int64_t index, int64_t d, int bf16, float *tmp) {
    if (!bf16) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    int64_t e = 0;
#ifdef VEC
    for (; e + VEC <= d; e += VEC) vstore(tmp + e, kv_load(base, index + e, 1));
#endif
    for (; e < d; e++) tmp[e] = bf16_f32(src[e]);
    return tmp;
}

/* Ask for KV head g's rows of the cache block `block` (its first `left` positions, at most a block),
 * ahead of reading them: a sequence's blocks lie scattered, so the hardware prefetchers, which
 * follow runs of addresses, cannot see the next block coming. */
static inline void prefetch_block(const void *cache, int32_t block, int64_t block_size, int64_t hkv, int64_t g,
                                  int64_t d, int bf16, int64_t left) {
    const int64_t m = left < block_size ? left : block_size, esize = bf16 ? 2 : 4;
    const char *base = (const char *)cache + (((int64_t)block * block_size * hkv + g) * d) * esize;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < d * esize; b += 64) __builtin_prefetch(base + i * hkv * d * esize + b, 0, 3);
}

#ifdef VEC
/* The weighted sum of V over columns [e0, e0 + 4 VEC) of the head for up to 4 query heads per KV
 * head (Llama 3, SmolLM2, Qwen2: groups of 2-4): the 16 accumulators stay in registers (the
 * generic loop below keeps them in memory, a store-to-load chain per position: measured the hot
 * spot at long contexts). AVX-512 covers head size 64 in one pass, AVX2 in two. */
static void pv_cols(const float *scores, int64_t p_begin, int64_t p_end, int64_t group, const void *v_cache,
                    int bf16, const int32_t *table, int64_t block_size, int64_t hkv, int64_t g, int64_t d, int64_t e0,
                    const float *inv, float *og) {
    const int64_t len = p_end - p_begin;
    vec_t a[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a[j][c] = vset1(0.0f);
    const int64_t pos_stride = hkv * d;
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block_size) {
        const int64_t vb = ((int64_t)table[p0 / block_size] * block_size * hkv + g) * d + e0;
        const int64_t m = p_end - p0 < block_size ? p_end - p0 : block_size;
        if (e0 == 0 && p0 + block_size < p_end)
            prefetch_block(v_cache, table[p0 / block_size + 1], block_size, hkv, g, d, bf16, p_end - p0 - block_size);
        for (int64_t i = 0; i < m; i++) {
            const int64_t at = vb + i * pos_stride;  /* a bf16 cache widened in registers as it is read */
            const vec_t v0 = kv_load(v_cache, at, bf16), v1 = kv_load(v_cache, at + VEC, bf16),
                        v2 = kv_load(v_cache, at + 2 * VEC, bf16), v3 = kv_load(v_cache, at + 3 * VEC, bf16);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (j < group) {
                    const vec_t w = vset1(scores[j * len + p0 - p_begin + i]);
                    a[j][0] = vfma(w, v0, a[j][0]);
                    a[j][1] = vfma(w, v1, a[j][1]);
                    a[j][2] = vfma(w, v2, a[j][2]);
                    a[j][3] = vfma(w, v3, a[j][3]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        if (j < group)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) vstore(og + j * d + e0 + c * VEC, vmul(a[j][c], vset1(inv[j])));
}
#endif

/* Attention of the `group` query heads sharing KV head g, for one sequence, over its positions
 * [p_begin, p_end) (p_begin a multiple of block_size): og gets the softmax-weighted sum of V over
 * those positions, normalized by their own softmax sum; stats (when not NULL) gets each head's
 * score maximum and sum of exp(score - maximum), so that parts of one sequence can be combined
 * (attend_tasks). scores: scratch of group * (p_end - p_begin) floats. */
static void attend(const float *qg, float *og, int64_t group, int64_t g, int64_t hkv, int64_t d,
                   const void *k_cache, const void *v_cache, int bf16, int64_t block_size, const int32_t *table,
                   int64_t p_begin, int64_t p_end, float scale, float *scores, float *stats) {
    const int64_t pos_stride = hkv * d, len = p_end - p_begin;
    float tmp[MAX_HEAD_DIM];
    if (len <= 0) {
        memset(og, 0, (size_t)(group * d) * sizeof(float));
        if (stats != NULL)
            for (int64_t j = 0; j < group; j++) stats[2 * j] = -INFINITY, stats[2 * j + 1] = 0.0f;
        return;
    }
    /* scores[j, p] = scale * q_j . k_p */
#if defined(__AVX512BF16__)
    __m512bh qb[4 * MAX_HEAD_DIM / 32];
    const int dp = bf16 && d % 32 == 0 && group <= 4;
    if (dp) queries_bf16(qg, group, d, qb);
#endif
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block_size) {
        const int64_t kb = ((int64_t)table[p0 / block_size] * block_size * hkv + g) * d;
        const int64_t m = p_end - p0 < block_size ? p_end - p0 : block_size;
        float *sp = scores + (p0 - p_begin);
        int64_t i = 0;
        if (p0 + block_size < p_end) prefetch_block(k_cache, table[p0 / block_size + 1], block_size, hkv, g, d, bf16,
                                                    p_end - p0 - block_size);
#if defined(__AVX512BF16__)
        for (; dp && i + 4 <= m; i += 4) {
            const int64_t at = kb + i * pos_stride;
            if (d == 64)
                qk_dots4_dpbf16(qb, group, k_cache, at, pos_stride, 64, scale, sp + i, len);
            else
                qk_dots4_dpbf16(qb, group, k_cache, at, pos_stride, d, scale, sp + i, len);
        }
#endif
#ifdef VEC
        /* each case inlined with its constants: head size 64 (most models) unrolled */
        for (; d % VEC == 0 && i + 4 <= m; i += 4) {
            const int64_t at = kb + i * pos_stride;
            if (d == 64 && bf16)
                qk_dots4(qg, group, k_cache, at, pos_stride, 64, 1, scale, sp + i, len);
            else if (d == 64)
                qk_dots4(qg, group, k_cache, at, pos_stride, 64, 0, scale, sp + i, len);
            else if (bf16)
                qk_dots4(qg, group, k_cache, at, pos_stride, d, 1, scale, sp + i, len);
            else
                qk_dots4(qg, group, k_cache, at, pos_stride, d, 0, scale, sp + i, len);
        }
#endif
        for (; i < m; i++)
            qk_dots(qg, group, cache_pos(k_cache, kb + i * pos_stride, d, bf16, tmp), d, scale, sp + i, len);
    }
    float inv[MAX_GROUP];
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * len, mx = sj[0];
#pragma omp simd reduction(max : mx)
        for (int64_t p = 1; p < len; p++) mx = sj[p] > mx ? sj[p] : mx;
        const float sum = exp_sub_sum(sj, len, mx);
        inv[j] = 1.0f / sum;
        if (stats != NULL) stats[2 * j] = mx, stats[2 * j + 1] = sum;
    }
#ifdef VEC
    if (d % (4 * VEC) == 0 && group <= 4) {
        for (int64_t e0 = 0; e0 < d; e0 += 4 * VEC)
            pv_cols(scores, p_begin, p_end, group, v_cache, bf16, table, block_size, hkv, g, d, e0, inv, og);
        return;
    }
#endif
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    memset(acc, 0, (size_t)(group * d) * sizeof(float));
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block_size) {
        const int64_t vb = ((int64_t)table[p0 / block_size] * block_size * hkv + g) * d;
        const int64_t m = p_end - p0 < block_size ? p_end - p0 : block_size;
        for (int64_t i = 0; i < m; i++) {
            const float *vp = cache_pos(v_cache, vb + i * pos_stride, d, bf16, tmp);
            for (int64_t j = 0; j < group; j++) {
                const float w = scores[j * len + p0 - p_begin + i];
                float *aj = acc + j * d;
#pragma omp simd
                for (int64_t e = 0; e < d; e++) aj[e] += w * vp[e];
            }
        }
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t e = 0; e < d; e++) og[j * d + e] = acc[j * d + e] * inv[j];
}

/* How a call's attention is cut into tasks: one per (sequence, KV head), and when that leaves
 * the threads too few tasks (batch 1 has as many as KV heads, 3 for SmolLM2 on 2 threads: one
 * thread idle a third of the time), each long sequence's positions also in parts of `part`
 * positions, combined afterwards (flash-decoding's split over the context). */
typedef struct {
    int64_t part;  /* positions per part, a multiple of block_size; 0: no sequence is split */
    int64_t n_seqs, n_items;  /* items: (sequence, part) pairs; tasks = n_items * hkv */
    int64_t *item_seq, *item_begin, *seq_first;  /* per item: sequence, first position; per sequence: first item */
    float *part_out, *part_stats;  /* per item and query head: d outputs; (max, sum). NULL when unsplit */
} split_t;

/* Parts of at least this many positions: a part's fixed costs (its own max and sum, the combine)
 * stay small against its dot products. */
#define MIN_PART 128
/* Aim for this many tasks per thread, so that unequal tasks still even out. */
#define TASKS_PER_THREAD 8

static int64_t parts_of(const split_t *sp, int64_t len) {
    return sp->part && len > sp->part ? (len + sp->part - 1) / sp->part : 1;
}

static int plan_split(split_t *sp, int64_t n_seqs, const int32_t *context_lens, int64_t total, int64_t hkv,
                      int64_t hq, int64_t d, int64_t block_size, int nthreads) {
    memset(sp, 0, sizeof *sp);
    sp->n_seqs = n_seqs;
    const int64_t want = (int64_t)TASKS_PER_THREAD * nthreads;
    if (nthreads > 1 && n_seqs * hkv < want && total > MIN_PART) {
        int64_t part = (total * hkv + want - 1) / want;
        part = part < MIN_PART ? MIN_PART : part;
        sp->part = (part + block_size - 1) / block_size * block_size;
    }
    for (int64_t n = 0; n < n_seqs; n++) sp->n_items += parts_of(sp, context_lens[n]);
    sp->item_seq = malloc((size_t)(2 * sp->n_items + n_seqs + 1) * sizeof(int64_t));
    if (sp->item_seq == NULL) return KVB_NO_MEMORY;
    sp->item_begin = sp->item_seq + sp->n_items;
    sp->seq_first = sp->item_begin + sp->n_items;
    int64_t k = 0;
    for (int64_t n = 0; n < n_seqs; n++) {
        sp->seq_first[n] = k;
        for (int64_t c = 0; c < parts_of(sp, context_lens[n]); c++, k++)
            sp->item_seq[k] = n, sp->item_begin[k] = c * sp->part;
    }
    sp->seq_first[n_seqs] = k;
    if (sp->n_items > n_seqs) {
        sp->part_out = malloc((size_t)(sp->n_items * hq * (d + 2)) * sizeof(float));
        if (sp->part_out == NULL) {
            free(sp->item_seq);
            return KVB_NO_MEMORY;
        }
        sp->part_stats = sp->part_out + sp->n_items * hq * d;
    }
    return KVB_OK;
}

/* Whether decode attention over n_seqs sequences (total positions) runs on several threads: the
 * standalone kernel and the fused layers' MKL schedule both ask here, as the answer sets the split
 * (plan_split's thread count), and with it the bits. */
static inline int attention_parallel(int64_t n_seqs, int64_t hkv, int64_t d, int64_t total) {
    return n_seqs * hkv > 1 && total * hkv * d >= PAR_WORK;
}

static void free_split(split_t *sp) {
    free(sp->item_seq);
    free(sp->part_out);
}

/* Every task of the split, then the combination of the split sequences' parts: called by every
 * thread of an OpenMP region (each with its own scores scratch of group * max(part, longest
 * unsplit context) floats). q: row n, head h at q + n * q_row_stride + h * d; out [n_seqs, hq, d]. */
static void attend_tasks(const split_t *sp, const float *q, int64_t q_row_stride, float *out, int64_t hq,
                         int64_t hkv, int64_t d, const void *k_cache, const void *v_cache, int bf16,
                         int64_t block_size, const int32_t *block_tables, int64_t table_stride,
                         const int32_t *context_lens, float scale, float *scores) {
    const int64_t group = hq / hkv, tasks = sp->n_items * hkv;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t k = task / hkv, g = task % hkv, n = sp->item_seq[k], len = context_lens[n];
        const int64_t begin = sp->item_begin[k], h0 = g * group;
        const float *qg = q + n * q_row_stride + h0 * d;
        if (parts_of(sp, len) == 1)
            attend(qg, out + (n * hq + h0) * d, group, g, hkv, d, k_cache, v_cache, bf16, block_size,
                   block_tables + n * table_stride, 0, len, scale, scores, NULL);
        else
            attend(qg, sp->part_out + (k * hq + h0) * d, group, g, hkv, d, k_cache, v_cache, bf16, block_size,
                   block_tables + n * table_stride, begin, begin + sp->part < len ? begin + sp->part : len, scale,
                   scores, sp->part_stats + (k * hq + h0) * 2);
    }
    if (sp->part_out == NULL) return;
    /* out = sum over parts of w_c o_c / sum of w_c, w_c = sum_c exp(max_c - max): the softmax over
     * the whole context, from each part's own */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < sp->n_seqs * hq; t++) {
        const int64_t n = t / hq, h = t % hq, k0 = sp->seq_first[n], k1 = sp->seq_first[n + 1];
        if (k1 - k0 == 1) continue;
        float mx = -INFINITY, wsum = 0.0f;
        for (int64_t k = k0; k < k1; k++) mx = fmaxf(mx, sp->part_stats[(k * hq + h) * 2]);
        float *o = out + (n * hq + h) * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t k = k0; k < k1; k++) {
            const float w = sp->part_stats[(k * hq + h) * 2 + 1] * expf(sp->part_stats[(k * hq + h) * 2] - mx);
            const float *oc = sp->part_out + (k * hq + h) * d;
            wsum += w;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) o[e] += w * oc[e];
        }
        const float inv = 1.0f / wsum;
#pragma omp simd
        for (int64_t e = 0; e < d; e++) o[e] *= inv;
    }
}

/* How many (sequence, part) items plan_split cuts n_seqs contexts into on nthreads threads (the
 * tests pin the split with it); -1 when out of memory. */
int64_t kvb_attention_parts(int64_t n_seqs, const int32_t *context_lens, int64_t hkv, int64_t block_size,
                            int nthreads) {
    int64_t total = 0;
    for (int64_t n = 0; n < n_seqs; n++) total += context_lens[n];
    split_t sp;
    if (plan_split(&sp, n_seqs, context_lens, total, hkv, hkv, 1, block_size, nthreads)) return -1;
    const int64_t items = sp.n_items;
    free_split(&sp);
    return items;
}

/* One query token per sequence against its paged context, read where it lies.
 * q: row n, head h at q + n * q_row_stride + h * d; k_cache / v_cache [num_blocks, block_size,
 * hkv, d], fp32, or bf16 when bf16 is set (q and out stay fp32); block_tables int32 [n_seqs,
 * table_stride]; context_lens int32 [n_seqs]; out [n_seqs, hq, d]. Query head h reads KV head
 * h / (hq / hkv). A sequence with context 0 gets zeros. */
int kvb_decode_attention(const float *q, int64_t n_seqs, int64_t q_row_stride, int64_t hq, int64_t hkv, int64_t d,
                         const void *k_cache, const void *v_cache, int bf16, int64_t num_blocks, int64_t block_size,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                         float scale, float *out, int nthreads) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || block_size <= 0) return KVB_BAD_SHAPE;
    int64_t max_len, total;
    if (check_decode_indices(n_seqs, block_tables, table_stride, context_lens, num_blocks, block_size, &max_len,
                             &total))
        return KVB_BAD_INDEX;
    const int parallel = attention_parallel(n_seqs, hkv, d, total);
    split_t sp;
    if (plan_split(&sp, n_seqs, context_lens, total, hkv, hq, d, block_size, parallel ? nthreads : 1))
        return KVB_NO_MEMORY;
    const int64_t group = hq / hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        float *scores = malloc((size_t)(group * (max_len > 0 ? max_len : 1)) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed)
            attend_tasks(&sp, q, q_row_stride, out, hq, hkv, d, k_cache, v_cache, bf16, block_size, block_tables,
                         table_stride, context_lens, scale, scores);
        free(scores);
    }
    free_split(&sp);
    return failed ? KVB_NO_MEMORY : KVB_OK;
}

/* ------------------------------------------------------------------ the fused decode layers */

/* y[r, c0:c1] = x[r, i0:i1] @ w[i0:i1, c0:c1] for w [in, out] (the BLAS layout the engine keeps: the
 * weight transposed), over rows r; each 4 rows of w are read from memory once for all x rows. */
static void gemv_cols(const float *x, int64_t rows, const float *w, int64_t in, int64_t out, float *y, int64_t i0,
                      int64_t i1, int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = c0; c < c1; c++) y[r * out + c] = 0.0f;
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        const float *w0 = w + i * out, *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * in;
            const float x0 = xr[i], x1 = xr[i + 1], x2 = xr[i + 2], x3 = xr[i + 3];
            float *yr = y + r * out;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) yr[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
        }
    }
    for (; i < i1; i++) {
        const float *w0 = w + i * out;
        for (int64_t r = 0; r < rows; r++) {
            const float x0 = x[r * in + i];
            float *yr = y + r * out;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) yr[c] += x0 * w0[c];
        }
    }
}

/* y[r, :] = x[r, :] @ w for an fp32 w [in, out], from inside a parallel region of n threads (all of
 * them call it): thread t multiplies its run of w's rows (inputs [in t / n, in (t + 1) / n)) into
 * partial sums of every column (thread 0 into y itself, the others into partials, rows x out floats
 * each), then, after a barrier, adds the others' partials into y for its columns [c0, c1) and, where
 * also > 0, [also + c0, also + c1). So each thread streams one contiguous run of the weight: a band of
 * columns per thread (the split the blocked kinds take) reads 1-3 KB of each weight row and jumps,
 * and streamed SmolLM2's projections at 23-26 GB/s where this split and a plain read of the same
 * bytes reached 30-31 (Xeon 167, 2 threads, a scratch harness). The sums over an input run are
 * added to the others' at the end: the order differs from a one-thread product by that split. */
static void gemv_rows_split(const float *x, int64_t rows, const float *w, int64_t in, int64_t out, float *y,
                            float *partials, int t, int n, int64_t c0, int64_t c1, int64_t also) {
    float *mine = t == 0 ? y : partials + (int64_t)(t - 1) * rows * out;
    gemv_cols(x, rows, w, in, out, mine, in * t / n, in * (t + 1) / n, 0, out);
#pragma omp barrier
    for (int64_t part = 0; part < (also > 0 ? 2 : 1); part++) {
        const int64_t lo = c0 + part * also, hi = c1 + part * also;
        for (int o = 1; o < n; o++) {
            const float *po = partials + (int64_t)(o - 1) * rows * out;
            for (int64_t r = 0; r < rows; r++) {
                float *yr = y + r * out;
                const float *pr = po + r * out;
#pragma omp simd
                for (int64_t c = lo; c < hi; c++) yr[c] += pr[c];
            }
        }
    }
}

#ifdef VEC
#define W_VECS (W_BLOCK / VEC)  /* vectors per block row: 1 with AVX-512, 2 with AVX2 */
#define W_ACC 8  /* accumulator sets (rows x split) of a pass, within the registers */
/* Bytes of a block prefetched ahead. 8 KB streamed a 56 MB bf16 weight a little faster, but
 * SmolLM2's int8 projections (9 KB blocks) at one row took 10.9 ms against 8.4 (Xeon 167). */
#define W_AHEAD 4096

/* VEC int8 values widened to fp32 (exact). */
static inline vec_t load_i8(const int8_t *p) {
#if VEC == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

/* VEC weights of a block at element index as fp32: int8 or bf16 widened (both exact). */
static inline vec_t load_w(const void *blk, int64_t index, int bf16) {
    return bf16 ? kv_load(blk, index, 1) : load_i8((const int8_t *)blk + index);
}

/* out[r, 0:W_BLOCK] = (x[r, :] @ blk) (times scale for int8) for `rows` rows (1 to W_ROWS; each
 * its own accumulators, the input split `split` ways so that several multiply-add chains run at
 * once: one chain per row waited on the multiply-add's latency, measured 90 GFLOP/s over 8 rows
 * on a Xeon 167), blk int8 or bf16. Inlined with constants. */
static inline __attribute__((always_inline)) void w_block(const void *blk, int bf16, int64_t in, const float *x,
                                                          int64_t x_stride, const float *scale, int rows,
                                                          int split, float *out) {
    const int64_t esize = bf16 ? 2 : 1;
    vec_t acc[W_ACC][W_VECS];
    for (int a = 0; a < W_ACC; a++)
        for (int v = 0; v < W_VECS; v++) acc[a][v] = vset1(0.0f);
    int64_t i = 0;
    for (; i + split <= in; i += split) {
        /* a block ends every few KB: ask ahead, where the hardware prefetcher stops at the page;
         * every cache line of the step (a bf16 step of 4 block rows spans two: asking for one of
         * them streamed 19-21 GB/s against 23-24 on a Xeon 167, 2 threads) */
        for (int64_t o = 0; o < split * W_BLOCK * esize; o += 64)
            __builtin_prefetch((const char *)blk + i * W_BLOCK * esize + W_AHEAD + o, 0, 2);
        for (int u = 0; u < split; u++)
            for (int v = 0; v < W_VECS; v++) {
                const vec_t w = load_w(blk, (i + u) * W_BLOCK + v * VEC, bf16);
                for (int r = 0; r < rows; r++)
                    acc[r * split + u][v] = vfma(vset1(x[r * x_stride + i + u]), w, acc[r * split + u][v]);
            }
    }
    for (; i < in; i++)
        for (int v = 0; v < W_VECS; v++) {
            const vec_t w = load_w(blk, i * W_BLOCK + v * VEC, bf16);
            for (int r = 0; r < rows; r++) acc[r * split][v] = vfma(vset1(x[r * x_stride + i]), w, acc[r * split][v]);
        }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < W_VECS; v++) {
            vec_t sum = acc[r * split][v];
            for (int u = 1; u < split; u++) sum = vadd(sum, acc[r * split + u][v]);
            vstore(out + r * W_BLOCK + v * VEC, bf16 ? sum : vmul(sum, vload(scale + v * VEC)));
        }
}
#endif

#if defined(__AVX512BF16__) && defined(VEC) && VEC == 16
#define W_DPBF16 1
/* x [rows, in] (in even; bf16 values held as fp32, as a bf16 model's activations are) as bf16
 * pairs: xp[r * in / 2 + i] holds x[r, 2i] in its low half and x[r, 2i + 1] in its high half
 * (rounded to nearest even: exact for bf16 values). */
static void x_pairs(const float *x, int64_t rows, int64_t in, uint32_t *xp) {
    const int64_t half = in / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * in;
        uint32_t *pr = xp + r * half;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16)
            _mm512_storeu_si512(pr + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 2 * i + 16),
                                                                     _mm512_loadu_ps(xr + 2 * i)));
        for (; i < half; i++) pr[i] = (uint32_t)f32_bf16(xr[2 * i]) | (uint32_t)f32_bf16(xr[2 * i + 1]) << 16;
    }
}

/* w_block for bf16 blocks on a CPU with AVX512-BF16 (in even): two block rows (inputs 2p and
 * 2p + 1, 64 bytes) loaded at once, their columns interleaved into pairs (vpermw), and multiplied
 * with each x row's pair by vdpbf16ps: one instruction for 32 products and their sums, where the
 * widening loop spends two to widen each 16 weights and one multiply-add per 16 products and x
 * row, plus a broadcast of each x value. Numerics: the products are exact in fp32 as in that loop
 * (x is bf16 values); the sums run in another order (pairs first), and bf16 subnormals count as
 * zero (the instruction's rule). */
static inline __attribute__((always_inline)) void w_block_dpbf16(const uint16_t *blk, int64_t in, const uint32_t *xp,
                                                                 int rows, int split, float *out) {
    const int64_t half = in / 2;
    /* element 2c <- column c of the first row, 2c + 1 <- column c of the second */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 acc[W_ACC];
    for (int a = 0; a < W_ACC; a++) acc[a] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + split <= half; p += split) {
        for (int64_t o = 0; o < split * 4 * W_BLOCK; o += 64)  /* every line, as w_block asks */
            __builtin_prefetch((const char *)blk + p * 4 * W_BLOCK + W_AHEAD + o, 0, 2);
        for (int u = 0; u < split; u++) {
            const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(
                pairs, _mm512_loadu_si512(blk + (p + u) * 2 * W_BLOCK));
            for (int r = 0; r < rows; r++)
                acc[r * split + u] = _mm512_dpbf16_ps(acc[r * split + u], wv,
                                                      (__m512bh)_mm512_set1_epi32((int)xp[r * half + p + u]));
        }
    }
    for (; p < half; p++) {
        const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(blk + p * 2 * W_BLOCK));
        for (int r = 0; r < rows; r++)
            acc[r * split] = _mm512_dpbf16_ps(acc[r * split], wv, (__m512bh)_mm512_set1_epi32((int)xp[r * half + p]));
    }
    for (int r = 0; r < rows; r++) {
        __m512 sum = acc[r * split];
        for (int u = 1; u < split; u++) sum = _mm512_add_ps(sum, acc[r * split + u]);
        _mm512_storeu_ps(out + r * W_BLOCK, sum);
    }
}
#else
#define W_DPBF16 0
#endif

/* Rows of x per pass over a block (each pass streams the block once): AVX-512 (32 registers)
 * takes 8, AVX2 (16) 4. */
#if defined(VEC) && VEC == 16
#define W_ROWS 8
#else
#define W_ROWS 4
#endif

/* y[r, c0:c1] = x[r, :] @ w[:, c0:c1] for blocked weights w, over rows r (the activations stay
 * fp32: weight-only): int8 with per-column scales (padded to whole blocks), or bf16 (scale NULL). */
static void gemv_cols_blocks(const float *x, int64_t rows, const void *w, int bf16, const float *scale, int64_t in,
                             int64_t out, float *y, int64_t c0, int64_t c1) {
    float tmp[8 * W_BLOCK];
    const int64_t esize = bf16 ? 2 : 1;
#if W_DPBF16
    uint32_t *xp = bf16 && in % 2 == 0 ? malloc((size_t)(rows * in / 2) * sizeof(uint32_t)) : NULL;
    if (xp != NULL) x_pairs(x, rows, in, xp);  /* NULL (odd in, no memory): the widening loop */
#endif
    for (int64_t blk = c0 / W_BLOCK; blk * W_BLOCK < c1; blk++) {
        const void *wb = (const char *)w + blk * in * W_BLOCK * esize;
        const float *sb = bf16 ? NULL : scale + blk * W_BLOCK;
        const int64_t lo = c0 > blk * W_BLOCK ? c0 : blk * W_BLOCK;
        const int64_t hi = c1 < (blk + 1) * W_BLOCK ? c1 : (blk + 1) * W_BLOCK;
        for (int64_t r0 = 0; r0 < rows; r0 += W_ROWS) {
            const int64_t n = rows - r0 < W_ROWS ? rows - r0 : W_ROWS;
            const float *xr = x + r0 * in;
#ifdef VEC
/* One pass of n rows over the block through PASS(rows, split), rows and split constants so the
 * pass inlines with them: the split that keeps rows x split accumulators within the registers.
 * One table per ISA, shared by every kind of block pass. */
#if VEC == 16  /* rows x split accumulators of one vector each: 4-8 chains */
#define W_PASS(PASS)                          \
    switch (n) {                              \
        case 1: PASS(1, 4); break;            \
        case 2: PASS(2, 4); break;            \
        case 3: PASS(3, 2); break;            \
        case 4: PASS(4, 2); break;            \
        case 5: PASS(5, 1); break;            \
        case 6: PASS(6, 1); break;            \
        case 7: PASS(7, 1); break;            \
        default: PASS(8, 1); break;           \
    }
#else  /* two vectors a block row: rows x split x 2 registers, at most 8 */
#define W_PASS(PASS)                          \
    switch (n) {                              \
        case 1: PASS(1, 4); break;            \
        case 2: PASS(2, 2); break;            \
        case 3: PASS(3, 1); break;            \
        default: PASS(4, 1); break;           \
    }
#endif
#define W_WIDEN_BF16(R, S) w_block(wb, 1, in, xr, in, sb, R, S, tmp)
#define W_WIDEN_I8(R, S) w_block(wb, 0, in, xr, in, sb, R, S, tmp)
#if W_DPBF16
#define W_DP_BF16(R, S) w_block_dpbf16(wb, in, xp + r0 * (in / 2), R, S, tmp)
            if (xp != NULL) {
                W_PASS(W_DP_BF16)
            } else
#undef W_DP_BF16
#endif
            if (bf16) {
                W_PASS(W_WIDEN_BF16)
            } else {
                W_PASS(W_WIDEN_I8)
            }
#undef W_WIDEN_BF16
#undef W_WIDEN_I8
#undef W_PASS
#else
            for (int64_t r = 0; r < n; r++)
                for (int64_t c = 0; c < W_BLOCK; c++) {
                    float acc = 0.0f;
                    for (int64_t i = 0; i < in; i++) {
                        const int64_t at = i * W_BLOCK + c;
                        acc += xr[r * in + i] * (bf16 ? bf16_f32(((const uint16_t *)wb)[at]) : (float)((const int8_t *)wb)[at]);
                    }
                    tmp[r * W_BLOCK + c] = bf16 ? acc : acc * sb[c];
                }
#endif
            for (int64_t r = 0; r < n; r++)
                memcpy(y + (r0 + r) * out + lo, tmp + r * W_BLOCK + (lo - blk * W_BLOCK),
                       (size_t)(hi - lo) * sizeof(float));
        }
    }
#if W_DPBF16
    free(xp);
#endif
}

/* Another library's kernel for a weight of its own format (the GGUF blocks of
 * kvbatch/engine/models/gguf_kernels.c, kvb_gguf_cols): y[r * out + c] = x[r, :] . column c of the
 * [in, out] product, for c in [c0, c1) and every row r; called from inside the fused layers'
 * threads, so it starts none of its own. */
typedef void (*kvb_cols_fn)(const void *w, int32_t qtype, const float *x, int64_t rows, int64_t in, int64_t out,
                            float *y, int64_t c0, int64_t c1);

/* A projection's weight as the fused layers and kvb_gemv take it, by kind: fp32 [in, out]; int8
 * in blocks of W_BLOCK columns standing for w[i, c] * scale[c] (scale padded like the blocks);
 * bf16 in blocks of W_BLOCK columns; another library's format and kernel (the fused layers only);
 * MKL's packed fp32 layout, multiplied by the step's sgemm_compute (the fused layers' batched
 * schedule only). The activations are fp32 in every kind. */
#define KVB_W_F32 0
#define KVB_W_I8 1
#define KVB_W_BF16 2
#define KVB_W_COLS 3
#define KVB_W_MKL 4
typedef struct {
    const void *w;
    const float *scale;  /* KVB_W_I8 only */
    int32_t kind;
    int32_t qtype;  /* KVB_W_COLS: the weight type, passed to cols */
    kvb_cols_fn cols;  /* KVB_W_COLS only */
} kvb_proj_t;

static void gemv_proj(const float *x, int64_t rows, const kvb_proj_t *p, int64_t in, int64_t out, float *y,
                      int64_t c0, int64_t c1) {
    if (p->kind == KVB_W_COLS)
        p->cols(p->w, p->qtype, x, rows, in, out, y, c0, c1);
    else if (p->kind == KVB_W_I8 || p->kind == KVB_W_BF16)
        gemv_cols_blocks(x, rows, p->w, p->kind == KVB_W_BF16, p->scale, in, out, y, c0, c1);
    else
        gemv_cols(x, rows, (const float *)p->w, in, out, y, 0, in, c0, c1);
}

/* This thread's part of y = x @ w inside a parallel region of n threads (every thread calls it): its
 * columns [c0, c1) and, where also > 0, [also + c0, also + c1) of y are final on return. An fp32
 * [in, out] weight is split by inputs (gemv_rows_split; partials: (n - 1) x rows x out floats), the
 * blocked kinds and another library's kernel by columns (each block one contiguous run already). */
static void proj_part(const float *x, int64_t rows, const kvb_proj_t *p, int64_t in, int64_t out, float *y,
                      float *partials, int t, int n, int64_t c0, int64_t c1, int64_t also) {
    if (p->kind == KVB_W_F32 && n > 1) {
        gemv_rows_split(x, rows, (const float *)p->w, in, out, y, partials, t, n, c0, c1, also);
        return;
    }
    gemv_proj(x, rows, p, in, out, y, c0, c1);
    if (also > 0) gemv_proj(x, rows, p, in, out, y, also + c0, also + c1);
}

/* y[r, c0:c1] rounded to bf16 values (the fused bf16 layers: where the per-op path's bf16 output
 * tensor rounds). */
static void round_cols(float *y, int64_t rows, int64_t stride, int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * stride;
#pragma omp simd
        for (int64_t c = c0; c < c1; c++) yr[c] = round_bf16(yr[c]);
    }
}

/* This thread's number and its team's size (0 and 1 outside a parallel region). */
static inline void team(int *t, int *n) {
    *t = 0;
    *n = 1;
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *n = omp_get_num_threads();
#endif
}

/* This thread's share [*c0, *c1) of `out` columns, in whole cache lines. */
static void share(int64_t out, int t, int n, int64_t *c0, int64_t *c1) {
    const int64_t lines = (out + 15) / 16;
    *c0 = lines * t / n * 16;
    *c1 = t == n - 1 ? out : lines * (t + 1) / n * 16;
    if (*c1 > out) *c1 = out;
    if (*c0 > out) *c0 = out;
}

/* Column chunks of a standalone GEMV: each thread's band of a wide output (the LM head's
 * 49,152 columns) is walked in pieces whose rows of y stay in L1/L2 across the input rows. */
#define GEMV_CHUNK 2048

/* y[:, c0:c1] = x @ the projection's columns c0..c1, GEMV_CHUNK columns at a time. */
static void gemv_band(const float *x, int64_t rows, const kvb_proj_t *p, int64_t in, int64_t out, float *y,
                      int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c += GEMV_CHUNK)
        gemv_proj(x, rows, p, in, out, y, c, c + GEMV_CHUNK < c1 ? c + GEMV_CHUNK : c1);
}

/* y [rows, out] = x [rows, in] @ w [in, out] (+ bias [out], or NULL), w fp32, int8 or bf16 (not KVB_W_COLS):
 * the fused layers' GEMV as its own call, for the kernel measurement to time against BLAS and
 * oneDNN (or, int8 blocks with their scales, against the int8 routes), and for the projections
 * of a bucket it won outside the fused layers (the LM head). */
int kvb_gemv(const float *x, int64_t rows, const void *w, const float *scale, int kind, int64_t in, int64_t out,
             const float *bias, float *y, int nthreads) {
    if (rows <= 0 || in <= 0 || out <= 0 || kind < KVB_W_F32 || kind > KVB_W_BF16) return KVB_BAD_SHAPE;
    const kvb_proj_t proj = {w, scale, kind, 0, NULL};
    const int parallel = in * out >= PAR_WORK && nthreads > 1;
    /* an fp32 weight is split by inputs, as in the fused layers: the other threads' partial sums */
    float *partials = NULL;
    if (parallel && kind == KVB_W_F32) {
        partials = malloc((size_t)((nthreads - 1) * rows * out) * sizeof(float));
        if (partials == NULL) return KVB_NO_MEMORY;
    }
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        int t, n;
        team(&t, &n);
        int64_t c0, c1;
        share(out, t, n, &c0, &c1);
        if (kind == KVB_W_F32 && n > 1) {
            proj_part(x, rows, &proj, in, out, y, partials, t, n, c0, c1, 0);
        } else {  /* a band of columns, in chunks whose rows of y stay in L1/L2 */
            gemv_band(x, rows, &proj, in, out, y, c0, c1);
        }
        if (bias != NULL)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t k = c0; k < c1; k++) y[r * out + k] += bias[k];
    }
    free(partials);
    return KVB_OK;
}

/* A kept token's fp32 logit: its head row w . x, summed in fp32 (both greedy heads). */
static inline float head_logit(const float *w, const float *x, int64_t dim) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < dim; i++) dot += w[i] * x[i];
    return dot;
}

/* The greedy head's selection for a batch of rows screened by an integer GEMM (greedy_head.py,
 * "batched rows"): row r's approximate logit of token v is
 *     a = s[r, v] + sw[v] y[r, v]
 * (s: the int8 rows' products with the int8 head, scaled by oneDNN to fp32; y, on entry: the outlier
 * columns' fp32 products with the int8 head's unscaled values), its bound xn[r] error[v] + cr[r]
 * wn[v], widened by 2^-21 |a| for the roundings of s and of a kept in fp32. Every token whose upper
 * bound reaches the row's best lower bound gets its fp32 logit head[v] . x[r], every other one -inf,
 * written over y. Rows are shared among the threads. */
int kvb_screen_select(const float *restrict s, float *restrict y, int64_t rows, int64_t vocab,
                      const float *restrict sw, const double *xn, const float *restrict error, const double *cr,
                      const float *restrict wn, const float *x, const float *head, int64_t dim, int nthreads) {
    if (rows < 0 || vocab <= 0 || dim <= 0) return KVB_BAD_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * vocab >= PAR_WORK && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict sr = s + r * vocab;
        float *restrict yr = y + r * vocab;
        const double xe = xn[r], c = cr[r];
        double best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t v = 0; v < vocab; v++) {
            const double a = (double)sr[v] + (double)sw[v] * (double)yr[v];
            const double low = a - ((double)error[v] * xe + c * (double)wn[v] + fabs(a) * 0x1p-21);
            best = low > best ? low : best;
            yr[v] = (float)a;
        }
        const int all = !(best > -INFINITY && best < INFINITY);  /* a non-finite row: every token exactly */
#pragma omp simd
        for (int64_t v = 0; v < vocab; v++) {
            const double a = (double)yr[v];
            const double up = a + (double)error[v] * xe + c * (double)wn[v] + fabs(a) * 0x1p-21;
            yr[v] = all || !(up < best) ? 0.0f : -INFINITY;  /* 0: kept, its logit computed below */
        }
        const float *xr = x + r * dim;
        for (int64_t b = 0; b < vocab; b += 64) {
            const int64_t e = b + 64 < vocab ? b + 64 : vocab;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t v = b; v < e; v++) hit |= yr[v] == 0.0f;
            if (!hit) continue;
            for (int64_t v = b; v < e; v++) {
                if (yr[v] == 0.0f) yr[v] = head_logit(head + v * dim, xr, dim);
            }
        }
    }
    return KVB_OK;
}

/* The greedy LM head (engine/models/greedy_head.py) in one call: y [rows, vocab] = the screen's
 * logits x @ w' for an fp32 x [rows, dim] and the head's int8 blocks (q, scale), then, per row, every
 * token whose upper bound y_v + error_v ||x|| reaches the best lower bound max_v (y_v - error_v ||x||)
 * gets its fp32 logit head[v, :] . x (a dot product over the fp32 head rows [vocab, dim]), every other
 * token -inf. Each thread screens its own band of columns; the bands' lower bounds are combined after
 * a barrier (lo: nthreads x rows doubles of scratch). The bounds and comparisons run in double, so
 * their own roundings cannot drop a token the bound keeps. (As torch ops after the GEMV, the bound
 * and the selection took 0.43 ms a step at one row: each op's first touch of code and data after the
 * weights' stream; here they run on the band each thread just wrote.) */
int kvb_greedy_head(const float *x, int64_t rows, const int8_t *q, const float *scale, int64_t dim, int64_t vocab,
                    const float *error, const float *head, float *y, int nthreads) {
    if (rows <= 0 || dim <= 0 || vocab <= 0) return KVB_BAD_SHAPE;
    const kvb_proj_t proj = {q, scale, KVB_W_I8, 0, NULL};
    const int parallel = dim * vocab >= PAR_WORK && nthreads > 1;
    const int threads = parallel ? nthreads : 1;
    double *lo = malloc((size_t)(threads * rows + rows) * sizeof(double));
    if (lo == NULL) return KVB_NO_MEMORY;
    double *xn = lo + threads * rows;  /* ||x_r||_2 */
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0.0;
        for (int64_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        xn[r] = sqrt(ss);
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
        int t, n;
        team(&t, &n);
        int64_t c0, c1;
        share(vocab, t, n, &c0, &c1);
        gemv_band(x, rows, &proj, dim, vocab, y, c0, c1);
        for (int64_t r = 0; r < rows; r++) {
            const float *yr = y + r * vocab;
            double best = -INFINITY;
            for (int64_t v = c0; v < c1; v++) {
                const double low = (double)yr[v] - (double)error[v] * xn[r];
                best = low > best ? low : best;
            }
            lo[t * rows + r] = best;
        }
#pragma omp barrier
        for (int64_t r = 0; r < rows; r++) {
            double best = -INFINITY;
            for (int o = 0; o < n; o++) best = lo[o * rows + r] > best ? lo[o * rows + r] : best;
            float *yr = y + r * vocab;
            const float *xr = x + r * dim;
            for (int64_t v = c0; v < c1; v++) {
                /* "not below": a NaN (from a NaN or infinite x) is kept and recomputed, as the full
                 * head would give it */
                if (!((double)yr[v] + (double)error[v] * xn[r] < best)) {
                    yr[v] = head_logit(head + v * dim, xr, dim);
                } else {
                    yr[v] = -INFINITY;
                }
            }
        }
    }
    free(lo);
    return KVB_OK;
}

/* resid = h (copy) or resid + h; x = w * (resid * rsqrt(mean(resid^2) + eps)), per row. rb: with
 * kvb_add_rms_norm_bf16's roundings (the fused bf16 layers). */
static void add_norm_rows(float *resid, const float *h, int copy, const float *w, float *x, int64_t rows,
                          int64_t dim, float eps, int rb) {
    for (int64_t r = 0; r < rows; r++) {
        float *rr = resid + r * dim, *xr = x + r * dim;
        const float *hr = h + r * dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) {
            float v = copy ? hr[i] : rr[i] + hr[i];
            v = rb ? round_bf16(v) : v;
            rr[i] = v;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        if (rb) {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] = round_bf16(w[i] * round_bf16(rr[i] * inv));
        } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] = w[i] * (rr[i] * inv);
        }
    }
}

typedef struct {
    const float *input_norm, *post_norm;  /* [dim] */
    kvb_proj_t qkv, o, gate_up, down;  /* [in, out] each */
    const float *qkv_bias;  /* [qkv out] or NULL */
    void *k_plane, *v_plane;  /* this layer's cache, [num_slots, hkv, d] each (bf16 when the step's bf16 is set) */
} kvb_layer_t;

typedef struct {
    int64_t rows, dim, hq, hkv, d, inter, max_pos, num_slots, num_blocks, block_size, table_stride;
    float eps, scale;
    const int64_t *positions, *slots;  /* [rows] */
    const float *cos_sin;  /* [max_pos, d] */
    const int32_t *block_tables, *context_lens;  /* [rows, table_stride], [rows] */
    int32_t bf16;  /* a bf16 model: bf16 caches, and every value rounded where its per-op path rounds */
    const void *sgemm_compute;  /* MKL's cblas_sgemm_compute, for KVB_W_MKL projections; else NULL */
} kvb_step_t;

/* MKL's cblas_sgemm_compute (mkl_cblas.h; MKL_INT 32-bit, the LP64 symbols torch's CPU library
 * exports), reached through the address the caller looked up: this library links no MKL. */
typedef void (*kvb_sgemm_compute_fn)(int layout, int transa, int transb, int m, int n, int k, const float *a,
                                     int lda, const void *b, int ldb, float beta, float *c, int ldc);

/* y [rows, out] = x [rows, in] @ an MKL-packed weight: the call engine/models/mkl_packed.py's
 * linear makes (row-major, A as is, B packed, beta 0), so that the batched schedule's products
 * are the per-op path's bits. MKL runs its own threads: called outside any parallel region. */
static void mkl_proj(const kvb_step_t *s, const float *x, int64_t rows, const kvb_proj_t *p, int64_t in,
                     int64_t out, float *y) {
    ((kvb_sgemm_compute_fn)s->sgemm_compute)(101, 111, 151, (int)rows, (int)out, (int)in, x, (int)in, p->w,
                                             (int)out, 0.0f, y, (int)out);
}

/* kvb_decode_layers for projections held in MKL's packed layout (a decode step whose row bucket the
 * kernel choice gave to MKL: 2-64 rows on the Xeon 167, any count it runs): the same layer, each projection one MKL call between
 * parallel loops of the small ops (MKL threads itself, so the layer cannot be one OpenMP region
 * as the GEMV schedule's is). What it saves against the per-op path is the Python between the
 * ~9 calls of each layer, and the other threads' idle spinning through it. Same bits as that
 * path: the same kernels in the same order (the norm per row, rotary and cache write, attention
 * split as kvb_decode_attention splits it, MKL's call, SiLU-and-multiply). fp32 only. */
static int decode_layers_mkl(const kvb_layer_t *layers, int64_t n_layers, const kvb_step_t *s, float *h,
                             float *resid, int has_resid, float *work, int nthreads, int64_t max_len, int64_t total) {
    const int64_t rows = s->rows, dim = s->dim, hq = s->hq, hkv = s->hkv, d = s->d, inter = s->inter;
    const int64_t group = hq / hkv, qkv_out = (hq + 2 * hkv) * d;
    float *x = work, *qkv = x + rows * dim, *attn = qkv + rows * qkv_out, *gu = attn + rows * hq * d,
          *act = gu + rows * 2 * inter;
    /* the per-op calls' thread rules: a loop splits where kvb_add_rms_norm, kvb_rotary_store and
     * kvb_silu_and_mul split, attention where kvb_decode_attention does (attention_parallel: its
     * split changes bits) */
    const int norm_par = rows * dim >= PAR_WORK && rows > 1, rot_par = rows * qkv_out >= PAR_WORK && rows > 1,
              silu_par = rows * inter >= PAR_WORK && rows > 1,
              attn_par = attention_parallel(rows, hkv, d, total);
    const int attn_threads = attn_par ? nthreads : 1;
    split_t sp;
    if (plan_split(&sp, rows, s->context_lens, total, hkv, hq, d, s->block_size, attn_threads)) return KVB_NO_MEMORY;
    const int64_t per_thread = group * (max_len > 0 ? max_len : 1);
    float *scores = malloc((size_t)(attn_threads * per_thread) * sizeof(float));
    if (scores == NULL) {
        free_split(&sp);
        return KVB_NO_MEMORY;
    }
    /* The per-op path's buffers, as it hands them on: a norm adds the residual into its input (the
     * layer's input, then the o projection's output), which becomes the residual, so h and resid
     * trade places twice a layer and each layer ends with them where it found them. */
    for (int64_t l = 0; l < n_layers; l++) {
        const kvb_layer_t *L = layers + l;
        const int first = l == 0 && !has_resid;  /* the embedding is the residual as it is */
#pragma omp parallel for num_threads(nthreads) if (norm_par)
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_row(h + r * dim, first ? NULL : resid + r * dim, L->input_norm, x + r * dim, dim, s->eps);
        mkl_proj(s, x, rows, &L->qkv, dim, qkv_out, qkv);
#pragma omp parallel for num_threads(nthreads) if (rot_par)
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_out;
            if (L->qkv_bias != NULL)
                for (int64_t c = 0; c < qkv_out; c++) row[c] += L->qkv_bias[c];
            rotate_store_row(row, s->cos_sin + s->positions[r] * d, hq, hkv, d, L->k_plane, L->v_plane, s->slots[r], 0);
        }
#pragma omp parallel num_threads(attn_threads) if (attn_par)
        {
            int t, n;
            team(&t, &n);
            attend_tasks(&sp, qkv, qkv_out, attn, hq, hkv, d, L->k_plane, L->v_plane, 0, s->block_size,
                         s->block_tables, s->table_stride, s->context_lens, s->scale, scores + t * per_thread);
        }
        mkl_proj(s, attn, rows, &L->o, hq * d, dim, resid);  /* h holds the residual now */
#pragma omp parallel for num_threads(nthreads) if (norm_par)
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_row(resid + r * dim, h + r * dim, L->post_norm, x + r * dim, dim, s->eps);
        mkl_proj(s, x, rows, &L->gate_up, dim, 2 * inter, gu);
#pragma omp parallel for num_threads(nthreads) if (silu_par)
        for (int64_t r = 0; r < rows; r++) silu_mul(gu + r * 2 * inter, gu + r * 2 * inter + inter, act + r * inter, inter);
        mkl_proj(s, act, rows, &L->down, inter, dim, h);
    }
    free(scores);
    free_split(&sp);
    return KVB_OK;
}

/* A decode step of `rows` sequences (one token each) through n_layers dense Llama layers, in one
 * OpenMP region: per layer, residual add + RMSNorm, the qkv projection (+ bias), rotary and the
 * K/V cache write, attention over the paged cache, the o projection, residual add + RMSNorm,
 * gate/up with SiLU-and-multiply, down. On entry h [rows, dim] is the layer input (the embedding
 * when has_resid is 0) and resid the running residual; on return h is the last layer's output and
 * resid the residual before it, as LlamaModel.forward keeps them. work: rows * (dim + qkv_out +
 * hq d + 2 inter + inter) floats of scratch.
 *
 * A bf16 model (s->bf16; bf16 weights and caches) runs the same step in fp32 with every value
 * rounded to bf16 where the per-op path's bf16 tensors round (each projection's output, the norms'
 * and the bf16 small ops' own roundings, the attention output), so it differs from that path by
 * summation order only; h and resid are fp32 holding bf16 values.
 *
 * Projections of kind KVB_W_MKL (every one of them, fp32, s->sgemm_compute set) run the batched
 * schedule instead (decode_layers_mkl: MKL's calls between parallel loops, not one region). */
int kvb_decode_layers(const kvb_layer_t *layers, int64_t n_layers, const kvb_step_t *s, float *h, float *resid,
                      int has_resid, float *work, int nthreads) {
    const int64_t rows = s->rows, dim = s->dim, hq = s->hq, hkv = s->hkv, d = s->d, inter = s->inter;
    const int rb = s->bf16 != 0;
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || d % 2 || s->block_size <= 0 || rows <= 0)
        return KVB_BAD_SHAPE;
    if (check_rows(rows, s->positions, s->max_pos, s->slots, s->num_slots)) return KVB_BAD_INDEX;
    int64_t max_len, total;
    if (check_decode_indices(rows, s->block_tables, s->table_stride, s->context_lens, s->num_blocks, s->block_size,
                             &max_len, &total))
        return KVB_BAD_INDEX;
    int mkl = 0;  /* projections held by MKL: every one of them (KVB_W_MKL), and fp32 */
    for (int64_t l = 0; l < n_layers; l++) {
        const kvb_proj_t *ps[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) mkl += ps[i]->kind == KVB_W_MKL;
    }
    if (mkl) {
        if (mkl != 4 * n_layers || rb || s->sgemm_compute == NULL) return KVB_BAD_SHAPE;
        return decode_layers_mkl(layers, n_layers, s, h, resid, has_resid, work, nthreads, max_len, total);
    }
    const int64_t group = hq / hkv, qkv_out = (hq + 2 * hkv) * d;
    float *x = work, *qkv = x + rows * dim, *attn = qkv + rows * qkv_out, *gu = attn + rows * hq * d,
          *act = gu + rows * 2 * inter;
    /* the other threads' partial sums of an fp32 projection (proj_part), rows x the widest output each */
    int64_t widest = qkv_out > 2 * inter ? qkv_out : 2 * inter;
    widest = widest > dim ? widest : dim;
    float *partials = nthreads > 1 ? malloc((size_t)((nthreads - 1) * rows * widest) * sizeof(float)) : NULL;
    if (nthreads > 1 && partials == NULL) return KVB_NO_MEMORY;
    split_t sp;  /* the same context lengths in every layer: one plan for all */
    if (plan_split(&sp, rows, s->context_lens, total, hkv, hq, d, s->block_size, nthreads)) {
        free(partials);
        return KVB_NO_MEMORY;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int t, n;
        team(&t, &n);
        float *scores = malloc((size_t)(group * (max_len > 0 ? max_len : 1)) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int64_t l = 0; l < n_layers && !failed; l++) {
            const kvb_layer_t *L = layers + l;
            int64_t c0, c1;
#pragma omp single
            add_norm_rows(resid, h, l == 0 && !has_resid, L->input_norm, x, rows, dim, s->eps, rb);
            share(qkv_out, t, n, &c0, &c1);
            proj_part(x, rows, &L->qkv, dim, qkv_out, qkv, partials, t, n, c0, c1, 0);
            if (L->qkv_bias != NULL)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = c0; c < c1; c++) qkv[r * qkv_out + c] += L->qkv_bias[c];
            if (rb) round_cols(qkv, rows, qkv_out, c0, c1);
#pragma omp barrier
#pragma omp single
            for (int64_t r = 0; r < rows; r++)
                rotate_store_row(qkv + r * qkv_out, s->cos_sin + s->positions[r] * d, hq, hkv, d, L->k_plane,
                                 L->v_plane, s->slots[r], rb);
            attend_tasks(&sp, qkv, qkv_out, attn, hq, hkv, d, L->k_plane, L->v_plane, rb, s->block_size,
                         s->block_tables, s->table_stride, s->context_lens, s->scale, scores);
            if (rb) {  /* every task's output rounded before any thread reads it (the loop's barrier) */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) round_cols(attn + r * hq * d, 1, 0, 0, hq * d);
            }
            share(dim, t, n, &c0, &c1);
            proj_part(attn, rows, &L->o, hq * d, dim, h, partials, t, n, c0, c1, 0);
            if (rb) round_cols(h, rows, dim, c0, c1);
#pragma omp barrier
#pragma omp single
            add_norm_rows(resid, h, 0, L->post_norm, x, rows, dim, s->eps, rb);
            /* gate columns [c0, c1) and the up columns inter + [c0, c1) on one thread, so it can
             * apply SiLU-and-multiply to its own columns without waiting for the others */
            share(inter, t, n, &c0, &c1);
            proj_part(x, rows, &L->gate_up, dim, 2 * inter, gu, partials, t, n, c0, c1, inter);
            for (int64_t r = 0; r < rows; r++) {
                float *g = gu + r * 2 * inter;
                if (rb) {
                    round_cols(g, 1, 0, c0, c1);
                    round_cols(g, 1, 0, inter + c0, inter + c1);
                    silu_mul_rounded(g + c0, g + inter + c0, act + r * inter + c0, c1 - c0);
                } else {
                    silu_mul(g + c0, g + inter + c0, act + r * inter + c0, c1 - c0);
                }
            }
#pragma omp barrier
            share(dim, t, n, &c0, &c1);
            proj_part(act, rows, &L->down, inter, dim, h, partials, t, n, c0, c1, 0);
            if (rb) round_cols(h, rows, dim, c0, c1);
#pragma omp barrier
        }
        free(scores);
    }
    free_split(&sp);
    free(partials);
    return failed ? KVB_NO_MEMORY : KVB_OK;
}
