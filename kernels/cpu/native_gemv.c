/* The native GEMV: y = x @ w for a few rows (decode, small batches) over fp32 [in, out] weights
 * (split by inputs across the threads), int8 and bf16 weights in blocks of W_BLOCK columns, another
 * library's format through its kernel (the GGUF blocks), as the fused decode layers
 * (native_decode_layers.c) multiply and as a call of its own (kvb_gemv); and the greedy LM head
 * over int8 screen blocks (kvb_greedy_head, kvb_screen_select). A part of native.c, compiled inside
 * it after native_common.h, native_small_ops.c and native_attention.c.
 */
#include "native_common.h"

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
 * kvbatch/kernels/cpu/gguf_kernels.c, kvb_gguf_cols): y[r * out + c] = x[r, :] . column c of the
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

/* The greedy LM head (kernels/cpu/greedy_head.py) in one call: y [rows, vocab] = the screen's
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
