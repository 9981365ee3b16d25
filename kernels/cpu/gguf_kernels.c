/* GGUF Q4_0 / Q4_1 / Q8_0 blocks times fp32 rows, without dequantizing the weight first.
 *
 * y[r, o] = sum over the 32-weight blocks b of row o:  d_b * dot(q_b, x[r, b]) + m_b * sum(x[r, b])
 *
 * Block layouts (ggml's, as the GGUF file holds them; one weight row is k / 32 blocks in a row):
 *   Q4_0 (type 2): fp16 d, 16 bytes of nibbles; weight = (nibble - 8) * d, so m = -8 d
 *   Q4_1 (type 3): fp16 d, fp16 m, 16 bytes of nibbles; weight = nibble * d + m
 *   Q8_0 (type 8): fp16 d, 32 int8; weight = q * d (no m)
 * Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
 *
 * The weights are exactly the values a dequantize-then-multiply path uses; only the summation
 * order differs. Activations stay fp32 (no int8 rounding of x, unlike llama.cpp's dot products).
 * AVX-512 (a block's 32 weights as two vectors of 16), else AVX2 + FMA + F16C (four of 8), where the
 * compiler targets them (-march=native), plain C otherwise. Threads:
 * OpenMP over output rows; built against the libgomp torch has loaded (same soname), so one
 * thread pool serves both.
 *
 * Built and loaded by kvbatch/kernels/cpu/gguf_kernels.py (ctypes, no torch headers).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVB_AVX2 1
#else
#define KVB_AVX2 0
#endif
#if KVB_AVX2 && defined(__AVX512F__)
#define KVB_AVX512 1
#else
#define KVB_AVX512 0
#endif

enum { KVB_Q4_0 = 2, KVB_Q4_1 = 3, KVB_Q8_0 = 8 };
#define QK 32
#define ROW_GROUP 4 /* x rows sharing one decode of a weight block */

int kvb_abi_version(void) { return 2; }
int kvb_simd(void) { return KVB_AVX512 ? 2 : KVB_AVX2; }  /* 2: AVX-512, 1: AVX2, 0: plain C */

static inline float half_to_float(uint16_t h) {
#if KVB_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        float v = ldexpf((float)mant, -24); /* zero or subnormal: exact */
        return sign ? -v : v;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static int block_bytes(int qtype) {
    switch (qtype) {
    case KVB_Q4_0: return 18;
    case KVB_Q4_1: return 20;
    case KVB_Q8_0: return 34;
    default: return 0;
    }
}

/* d and m of a block (m = 0 for Q8_0, -8 d for Q4_0) and where its quants start. */
static inline const uint8_t *block_head(int qtype, const uint8_t *blk, float *d, float *m) {
    *d = half_to_float(read_u16(blk));
    if (qtype == KVB_Q4_1) { *m = half_to_float(read_u16(blk + 2)); return blk + 4; }
    *m = qtype == KVB_Q4_0 ? -8.0f * *d : 0.0f;
    return blk + 2;
}

#if KVB_AVX512
/* A block's 32 quants as two vectors of 16 floats: half the conversions and multiply-adds of the
 * AVX2 decode, which bound the kernel from a few rows on (SmolLM2's Q4_1 projections at 8 rows:
 * 12.4-12.9 ms against the AVX2 build's 22.0, at one row 3.9 against 4.9; EPYC family 26,
 * 2 threads, bench_gguf_kernel.py). */
typedef __m512 gvec_t;
#define GW 16
#define gv_zero _mm512_setzero_ps
#define gv_set1 _mm512_set1_ps
#define gv_load _mm512_loadu_ps
#define gv_mul _mm512_mul_ps
#define gv_fmadd _mm512_fmadd_ps
#define gv_hsum _mm512_reduce_add_ps

/* The 32 quants of a block as two vectors of 16 floats (weights 0-15, 16-31). */
static inline void decode_quants(int qtype, const uint8_t *qs, __m512 q[2]) {
    if (qtype == KVB_Q8_0) {
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
    } else {
        const __m128i low4 = _mm_set1_epi8(0x0f), raw = _mm_loadu_si128((const __m128i *)qs);
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
    }
}
#elif KVB_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

typedef __m256 gvec_t;
#define GW 8
#define gv_zero _mm256_setzero_ps
#define gv_set1 _mm256_set1_ps
#define gv_load _mm256_loadu_ps
#define gv_mul _mm256_mul_ps
#define gv_fmadd _mm256_fmadd_ps
#define gv_hsum hsum256

/* The 32 quants of a block as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31). */
static inline void decode_quants(int qtype, const uint8_t *qs, __m256 q[4]) {
    if (qtype == KVB_Q8_0) {
        __m128i a = _mm_loadu_si128((const __m128i *)qs), b = _mm_loadu_si128((const __m128i *)(qs + 16));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    } else {
        const __m128i low4 = _mm_set1_epi8(0x0f);
        __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}
#endif

/* row_group and output_row are always inlined: a weight row is short (SmolLM2's 576 inputs are 18
 * blocks), and gcc otherwise kept row_group a function of its own with R a run-time value, whose
 * accumulators it zeroed in memory (rep stos) for every row: SmolLM2's Q4_1 projections at one row
 * 3.26 -> 2.56 ms (AVX-512 build), 4.45 -> 3.43 (AVX2), the same sums (EPYC family 26, 2 threads,
 * the two builds alternated). */
#if KVB_AVX2  /* and AVX-512: the vector type and width above */
#define GV (QK / GW)  /* vectors per block */
/* R (1..ROW_GROUP, a constant at each call site so the loops unroll) rows of x against weight
 * row `w`; xsum[r * nb + b] = sum of x row r over block b (unused for Q8_0). */
static inline __attribute__((always_inline)) void row_group(int qtype, int R, const uint8_t *w, int64_t nb, int bsize, const float *x,
                             int64_t k, const float *xsum, float *out) {
    gvec_t acc[ROW_GROUP];
    float macc[ROW_GROUP];
    for (int r = 0; r < R; r++) { acc[r] = gv_zero(); macc[r] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        float d, m;
        const uint8_t *qs = block_head(qtype, w + b * bsize, &d, &m);
        gvec_t q[GV];
        decode_quants(qtype, qs, q);
        const gvec_t dv = gv_set1(d);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * k + b * QK;
            gvec_t s = gv_mul(q[0], gv_load(xb));
            for (int v = 1; v < GV; v++) s = gv_fmadd(q[v], gv_load(xb + v * GW), s);
            acc[r] = gv_fmadd(dv, s, acc[r]);
            if (qtype != KVB_Q8_0) macc[r] = fmaf(m, xsum[r * nb + b], macc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = gv_hsum(acc[r]) + macc[r];
}
#else
static inline __attribute__((always_inline)) void row_group(int qtype, int R, const uint8_t *w, int64_t nb, int bsize, const float *x,
                             int64_t k, const float *xsum, float *out) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * k;
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float d, m, s = 0.0f;
            const uint8_t *qs = block_head(qtype, w + b * bsize, &d, &m);
            const float *xb = xr + b * QK;
            if (qtype == KVB_Q8_0) {
                for (int j = 0; j < QK; j++) s += (float)(int8_t)qs[j] * xb[j];
            } else {
                for (int j = 0; j < QK / 2; j++) s += (float)(qs[j] & 0x0f) * xb[j] + (float)(qs[j] >> 4) * xb[j + QK / 2];
            }
            total += d * s + (qtype == KVB_Q8_0 ? 0.0f : m * xsum[r * nb + b]);
        }
        out[r] = total;
    }
}
#endif

/* One weight row against every x row, ROW_GROUP rows per decode of its blocks; y[r * n] gets row r. */
static inline __attribute__((always_inline)) void output_row(int qtype, const uint8_t *w, int64_t nb, int bsize, const float *x, int64_t k,
                              int64_t rows, const float *xsum, float *y, int64_t n) {
    float out[ROW_GROUP];
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_GROUP) {
        const int64_t left = rows - r0;
        const float *xr = x + r0 * k, *xs = xsum ? xsum + r0 * nb : NULL;
        const int R = left >= ROW_GROUP ? ROW_GROUP : (int)left;
        switch (R) { /* a constant R in each call: its loops unroll */
        case 4: row_group(qtype, 4, w, nb, bsize, xr, k, xs, out); break;
        case 3: row_group(qtype, 3, w, nb, bsize, xr, k, xs, out); break;
        case 2: row_group(qtype, 2, w, nb, bsize, xr, k, xs, out); break;
        default: row_group(qtype, 1, w, nb, bsize, xr, k, xs, out); break;
        }
        for (int r = 0; r < R; r++) y[(r0 + r) * n] = out[r];
    }
}

/* xsum[i] = the sum of x's i-th run of 32 values, for `count` runs (rows * k / 32). */
static void block_sums(const float *x, int64_t count, float *xsum) {
    for (int64_t i = 0; i < count; i++) {
        const float *xb = x + i * QK;
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += xb[j];
        xsum[i] = s;
    }
}

/* Weight rows [o0, o1) against every x row: y[r * n + o]. */
static void output_rows(int qtype, const uint8_t *w, int64_t o0, int64_t o1, int64_t nb, int bsize, const float *x,
                        int64_t k, int64_t rows, const float *xsum, float *y, int64_t n) {
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *wo = w + o * nb * bsize;
        switch (qtype) { /* a constant qtype in each inlined copy */
        case KVB_Q4_0: output_row(KVB_Q4_0, wo, nb, bsize, x, k, rows, xsum, y + o, n); break;
        case KVB_Q4_1: output_row(KVB_Q4_1, wo, nb, bsize, x, k, rows, xsum, y + o, n); break;
        default: output_row(KVB_Q8_0, wo, nb, bsize, x, k, rows, xsum, y + o, n); break;
        }
    }
}

/* Rows of x kvb_gguf_cols takes per pass over the weight, and the longest row of x it takes: its
 * block sums live on the stack (32 KB), so it allocates nothing inside the caller's threads. */
#define COLS_ROWS 8
#define COLS_MAX_K 32768
int kvb_gguf_cols_max_rows(void) { return COLS_ROWS; }
int kvb_gguf_cols_max_k(void) { return COLS_MAX_K; }

/* The fused decode layers' entry (kvbatch/kernels/cpu/native_gemv.c calls it through a pointer, from
 * inside its own threads, one range of outputs each): y[r * n + o] for weight rows o in [o0, o1)
 * of the blocks `w` of an [n, k] weight and every row r of x [rows, k]; the same sums, in the same
 * order, as kvb_gguf_matmul's. Arguments it cannot take (k past COLS_MAX_K or not a multiple of
 * 32, rows past COLS_ROWS, an unknown qtype) are refused by the caller before the call
 * (gguf_kernels.fused_weight and the fused layers' checks); here they leave y as it was. */
void kvb_gguf_cols(const void *w, int32_t qtype, const float *x, int64_t rows, int64_t k, int64_t n, float *y,
                   int64_t o0, int64_t o1) {
    const int bsize = block_bytes(qtype);
    if (bsize == 0 || k <= 0 || k % QK != 0 || k > COLS_MAX_K || rows <= 0 || rows > COLS_ROWS) return;
    float xsum[COLS_ROWS * (COLS_MAX_K / QK)];
    if (qtype != KVB_Q8_0) block_sums(x, rows * (k / QK), xsum);
    output_rows(qtype, (const uint8_t *)w, o0, o1, k / QK, bsize, x, k, rows, qtype != KVB_Q8_0 ? xsum : NULL, y, n);
}

/* y [rows, n] = x [rows, k] times the blocks `w` of an [n, k] weight (k a multiple of 32, the
 * rows of x and y contiguous). Returns 0, or -1 for arguments it cannot take. */
int kvb_gguf_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                    int nthreads) {
    const int bsize = block_bytes(qtype);
    if (bsize == 0 || k <= 0 || k % QK != 0 || n < 0 || rows < 0) return -1;
    if (n == 0 || rows == 0) return 0;
    const int64_t nb = k / QK;
    float *xsum = NULL;
    if (qtype != KVB_Q8_0) { /* one pass over x, shared by every output */
        xsum = (float *)malloc((size_t)(rows * nb) * sizeof(float));
        if (xsum == NULL) return -1;
        block_sums(x, rows * nb, xsum);
    }
    if (nthreads < 1) nthreads = 1;
    (void)nthreads;
    /* static: each thread streams one contiguous run of weight rows, which the hardware prefetcher
     * follows; chunks of 16 rows handed out in turn (dynamic, 16) left it a 5-7 KB run between
     * jumps: SmolLM2's Q4_1 projections at one row 7.8-11.5 ms against 3.9 (EPYC family 26,
     * 2 threads, bench_gguf_kernel.py); software prefetch ahead did not help either schedule. */
#pragma omp parallel num_threads(nthreads) if (n * rows * k >= (1 << 16))
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        output_rows(qtype, w, n * t / nt, n * (t + 1) / nt, nb, bsize, x, k, rows, xsum, y, n);
    }
    free(xsum);
    return 0;
}
