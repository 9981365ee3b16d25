/* What every part of the native CPU kernels shares (native.c compiles the parts as one library):
 * the C headers, the status codes and limits, the blocked weights' width, the fp32 exp polynomial
 * (scalar and on whole vectors, with the vector macros of the ISA the build targets), bf16 <-> fp32,
 * a vector of cache or weight values widened to fp32 (kv_load), and the OpenMP team helper.
 * Included once, by native.c (each part includes it too, for its own readers and tools).
 */
#ifndef KVB_NATIVE_COMMON_H
#define KVB_NATIVE_COMMON_H

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

#ifdef VEC
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
#endif

/* This thread's number and its team's size (0 and 1 outside a parallel region). */
static inline void team(int *t, int *n) {
    *t = 0;
    *n = 1;
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *n = omp_get_num_threads();
#endif
}

#endif /* KVB_NATIVE_COMMON_H */
