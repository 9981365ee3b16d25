/* The fused decode layers: a decode step through every dense Llama layer in one call
 * (kvb_decode_layers: one OpenMP region over the GEMV's projections; decode_layers_mkl: MKL's
 * packed sgemm between parallel loops of the small ops). Built from the other parts' row
 * functions, attention tasks and projections, so that it computes what the per-op path computes.
 * A part of native.c, compiled inside it after native_common.h, native_small_ops.c,
 * native_attention.c and native_gemv.c.
 */
#include "native_common.h"

/* y[r, c0:c1] rounded to bf16 values (the fused bf16 layers: where the per-op path's bf16 output
 * tensor rounds). */
static void round_cols(float *y, int64_t rows, int64_t stride, int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * stride;
#pragma omp simd
        for (int64_t c = c0; c < c1; c++) yr[c] = round_bf16(yr[c]);
    }
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

/* y [rows, out] = x [rows, in] @ an MKL-packed weight: the call kernels/cpu/mkl_packed.py's
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
