/* Decode attention read in place from the paged K/V cache (fp32 or bf16): one query token per
 * sequence, each (sequence, KV head) a task, long contexts split into parts combined afterwards
 * (split_t, plan_split, attend_tasks; the fused decode layers run the same tasks). A sliding window
 * (kvb_decode_attention's `window`: Gemma 3) reads each context from its window's first block and
 * weighs the positions before the window 0. Attention sinks (`sinks`: gpt-oss) add exp(sink - max) to
 * each head's softmax denominator, the maximum taken over the sink too. A part of native.c, compiled inside it after
 * native_common.h and native_small_ops.c.
 */
#include "native_common.h"

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
 * [p_from, p_end), read from p_begin (a multiple of block_size, at or below p_from; positions
 * [p_begin, p_from), a sliding window's start inside its first block, weigh exactly 0): og gets the
 * softmax-weighted sum of V over those positions, normalized by their own softmax sum; stats (when
 * not NULL) gets each head's score maximum and sum of exp(score - maximum), so that parts of one
 * sequence can be combined (attend_tasks). scores: scratch of group * (p_end - p_begin) floats.
 * sinks (gpt-oss; NULL: none): the group's sink logits, each joining its head's softmax denominator
 * only (the maximum includes it: sum += exp(sink - max)); given for a whole context, never a part. */
static void attend(const float *qg, float *og, int64_t group, int64_t g, int64_t hkv, int64_t d,
                   const void *k_cache, const void *v_cache, int bf16, int64_t block_size, const int32_t *table,
                   int64_t p_begin, int64_t p_end, int64_t p_from, float scale, float *scores, float *stats,
                   const float *sinks) {
    const int64_t pos_stride = hkv * d, len = p_end - p_begin, skip = p_from > p_begin ? p_from - p_begin : 0;
    float tmp[MAX_HEAD_DIM];
    if (len <= skip) {
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
        float *sj = scores + j * len, mx = sj[skip];
#pragma omp simd reduction(max : mx)
        for (int64_t p = skip + 1; p < len; p++) mx = sj[p] > mx ? sj[p] : mx;
        if (sinks != NULL && sinks[j] > mx) mx = sinks[j];
        float sum = exp_sub_sum(sj + skip, len - skip, mx);
        if (sinks != NULL) sum += kvb_expf(sinks[j] - mx);
        if (skip) memset(sj, 0, (size_t)skip * sizeof(float));  /* before the window: weight 0 */
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

/* The first position a query at len - 1 sees under a sliding window of `window` keys (0: none). */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The first position read: window_start's block's first. */
static inline int64_t read_start(int64_t len, int64_t window, int64_t block_size) {
    return window_start(len, window) / block_size * block_size;
}

/* plan_split over each sequence's positions from read_start (window 0: all of them). */
static int plan_split_window(split_t *sp, int64_t n_seqs, const int32_t *context_lens, int64_t total, int64_t hkv,
                             int64_t hq, int64_t d, int64_t block_size, int nthreads, int64_t window) {
    memset(sp, 0, sizeof *sp);
    sp->n_seqs = n_seqs;
    const int64_t want = (int64_t)TASKS_PER_THREAD * nthreads;
    if (nthreads > 1 && n_seqs * hkv < want && total > MIN_PART) {
        int64_t part = (total * hkv + want - 1) / want;
        part = part < MIN_PART ? MIN_PART : part;
        sp->part = (part + block_size - 1) / block_size * block_size;
    }
    for (int64_t n = 0; n < n_seqs; n++)
        sp->n_items += parts_of(sp, context_lens[n] - read_start(context_lens[n], window, block_size));
    sp->item_seq = malloc((size_t)(2 * sp->n_items + n_seqs + 1) * sizeof(int64_t));
    if (sp->item_seq == NULL) return KVB_NO_MEMORY;
    sp->item_begin = sp->item_seq + sp->n_items;
    sp->seq_first = sp->item_begin + sp->n_items;
    int64_t k = 0;
    for (int64_t n = 0; n < n_seqs; n++) {
        const int64_t a0 = read_start(context_lens[n], window, block_size);
        sp->seq_first[n] = k;
        for (int64_t c = 0; c < parts_of(sp, context_lens[n] - a0); c++, k++)
            sp->item_seq[k] = n, sp->item_begin[k] = a0 + c * sp->part;
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

static int plan_split(split_t *sp, int64_t n_seqs, const int32_t *context_lens, int64_t total, int64_t hkv,
                      int64_t hq, int64_t d, int64_t block_size, int nthreads) {
    return plan_split_window(sp, n_seqs, context_lens, total, hkv, hq, d, block_size, nthreads, 0);
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
 * unsplit context) floats). q: row n, head h at q + n * q_row_stride + h * d; out [n_seqs, hq, d].
 * sinks: [hq] sink logits or NULL (see attend); a split sequence adds them when its parts combine. */
static void attend_tasks_window(const split_t *sp, const float *q, int64_t q_row_stride, float *out, int64_t hq,
                                int64_t hkv, int64_t d, const void *k_cache, const void *v_cache, int bf16,
                                int64_t block_size, const int32_t *block_tables, int64_t table_stride,
                                const int32_t *context_lens, float scale, float *scores, int64_t window,
                                const float *sinks) {
    const int64_t group = hq / hkv, tasks = sp->n_items * hkv;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t k = task / hkv, g = task % hkv, n = sp->item_seq[k], len = context_lens[n];
        const int64_t begin = sp->item_begin[k], h0 = g * group, from = window_start(len, window);
        const float *qg = q + n * q_row_stride + h0 * d;
        if (parts_of(sp, len - read_start(len, window, block_size)) == 1)
            attend(qg, out + (n * hq + h0) * d, group, g, hkv, d, k_cache, v_cache, bf16, block_size,
                   block_tables + n * table_stride, begin, len, from, scale, scores, NULL,
                   sinks != NULL ? sinks + h0 : NULL);
        else
            attend(qg, sp->part_out + (k * hq + h0) * d, group, g, hkv, d, k_cache, v_cache, bf16, block_size,
                   block_tables + n * table_stride, begin, begin + sp->part < len ? begin + sp->part : len, from,
                   scale, scores, sp->part_stats + (k * hq + h0) * 2, NULL);
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
        if (sinks != NULL) mx = fmaxf(mx, sinks[h]);
        float *o = out + (n * hq + h) * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t k = k0; k < k1; k++) {
            const float w = sp->part_stats[(k * hq + h) * 2 + 1] * expf(sp->part_stats[(k * hq + h) * 2] - mx);
            const float *oc = sp->part_out + (k * hq + h) * d;
            wsum += w;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) o[e] += w * oc[e];
        }
        if (sinks != NULL) wsum += kvb_expf(sinks[h] - mx);
        const float inv = 1.0f / wsum;
#pragma omp simd
        for (int64_t e = 0; e < d; e++) o[e] *= inv;
    }
}

static void attend_tasks(const split_t *sp, const float *q, int64_t q_row_stride, float *out, int64_t hq,
                         int64_t hkv, int64_t d, const void *k_cache, const void *v_cache, int bf16,
                         int64_t block_size, const int32_t *block_tables, int64_t table_stride,
                         const int32_t *context_lens, float scale, float *scores) {
    attend_tasks_window(sp, q, q_row_stride, out, hq, hkv, d, k_cache, v_cache, bf16, block_size, block_tables,
                        table_stride, context_lens, scale, scores, 0, NULL);
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

/* One query token per sequence against its paged context, read where it lies (window > 0: a
 * sliding window, the last `window` positions of each context only; 0: all of them).
 * q: row n, head h at q + n * q_row_stride + h * d; k_cache / v_cache [num_blocks, block_size,
 * hkv, d], fp32, or bf16 when bf16 is set (q and out stay fp32); block_tables int32 [n_seqs,
 * table_stride]; context_lens int32 [n_seqs]; out [n_seqs, hq, d]. Query head h reads KV head
 * h / (hq / hkv). A sequence with context 0 gets zeros. sinks: [hq] fp32 sink logits (gpt-oss), each
 * joining its head's softmax denominator only; NULL: none. */
int kvb_decode_attention(const float *q, int64_t n_seqs, int64_t q_row_stride, int64_t hq, int64_t hkv, int64_t d,
                         const void *k_cache, const void *v_cache, int bf16, int64_t num_blocks, int64_t block_size,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                         float scale, float *out, int nthreads, int64_t window, const float *sinks) {
    if (window < 0) return KVB_BAD_SHAPE;
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || block_size <= 0) return KVB_BAD_SHAPE;
    int64_t max_len, total;
    if (check_decode_indices(n_seqs, block_tables, table_stride, context_lens, num_blocks, block_size, &max_len,
                             &total))
        return KVB_BAD_INDEX;
    if (window > 0)  /* the positions read: from each window's first block */
        for (int64_t n = 0; n < n_seqs; n++) total -= read_start(context_lens[n], window, block_size);
    const int parallel = attention_parallel(n_seqs, hkv, d, total);
    split_t sp;
    if (plan_split_window(&sp, n_seqs, context_lens, total, hkv, hq, d, block_size, parallel ? nthreads : 1, window))
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
            attend_tasks_window(&sp, q, q_row_stride, out, hq, hkv, d, k_cache, v_cache, bf16, block_size,
                                block_tables, table_stride, context_lens, scale, scores, window, sinks);
        free(scores);
    }
    free_split(&sp);
    return failed ? KVB_NO_MEMORY : KVB_OK;
}
