/* CPU reference of fused attention (see cquant.h for the math of both modes).
 * Each (batch, head) pair is one OpenMP task: its keys and values are turned
 * into fp32 (or codes) once, then every query row is done on its own. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cq_numerics.h"
#include "cquant-impl.h"

#define LOG2E_F 1.44269504088896340736f

/* Element (b, s, h, d) of a [B, S, H, D] tensor. */
static int64_t at(const cq_tensor *t, int64_t b, int64_t s, int64_t h, int64_t d) {
  return b * t->strides[0] + s * t->strides[1] + h * t->strides[2] + d * t->strides[3];
}

/* Rows [S, D] of head (b, h) of t as fp32. */
static void gather(const cq_tensor *t, int64_t b, int64_t h, int64_t rows, int64_t dim, float *dst) {
  for (int64_t s = 0; s < rows; ++s)
    for (int64_t d = 0; d < dim; ++d) dst[s * dim + d] = cq_load_float(t->data, t->dtype, at(t, b, s, h, d));
}

static void store_lse(cq_tensor *lse, const cq_attention_dims *n, int64_t b, int64_t h, int64_t i, float v) {
  if (lse) ((float *)lse->data)[(b * n->heads + h) * n->seq_q + i] = v;
}

/* ---- full precision: fp64 scores, softmax and sums (two passes per row) ---- */

static int full_head(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, float scale, const cq_attention_dims *n,
                     int64_t b, int64_t h, cq_tensor *out, cq_tensor *lse) {
  const int64_t skv = n->seq_kv, dim = n->head_dim;
  float *kf = cq_alloc(skv * dim, sizeof *kf), *vf = cq_alloc(skv * dim, sizeof *vf);
  float *qf = cq_alloc(dim, sizeof *qf);
  double *s = cq_alloc(skv, sizeof *s), *acc = cq_alloc(dim, sizeof *acc);
  int ok = kf && vf && qf && s && acc;
  if (ok) {
    gather(k, b, h, skv, dim, kf);
    gather(v, b, h, skv, dim, vf);
    for (int64_t i = 0; i < n->seq_q; ++i) {
      for (int64_t d = 0; d < dim; ++d) qf[d] = cq_load_float(q->data, q->dtype, at(q, b, i, h, d));
      double m = -INFINITY;
      for (int64_t j = 0; j < skv; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < dim; ++d) dot += (double)qf[d] * (double)kf[j * dim + d];
        s[j] = (double)scale * dot;
        if (s[j] > m || s[j] != s[j]) m = s[j];
      }
      double l = 0.0;
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0;
      for (int64_t j = 0; j < skv; ++j) {
        double pj = exp(s[j] - m);
        l += pj;
        for (int64_t d = 0; d < dim; ++d) acc[d] += pj * (double)vf[j * dim + d];
      }
      for (int64_t d = 0; d < dim; ++d) cq_store_float(out->data, out->dtype, at(out, b, i, h, d), (float)(acc[d] / l));
      store_lse(lse, n, b, h, i, (float)(m + log(l)));
    }
  }
  free(kf), free(vf), free(qf), free(s), free(acc);
  return ok;
}

/* ---- 8-bit: the quantized math of cquant.h, step by step ---- */

/* int8 codes and scales of consecutive blocks of `block` rows of x [rows, dim]. */
static void quantize_int8_blocks(const float *x, int64_t rows, int64_t dim, int64_t block, int8_t *codes, float *scales) {
  for (int64_t r0 = 0, blk = 0; r0 < rows; r0 += block, ++blk) {
    int64_t r1 = r0 + block < rows ? r0 + block : rows;
    float amax = 0.0f, scale, inv;
    for (int64_t i = r0 * dim; i < r1 * dim; ++i) amax = cq_amax_step(amax, x[i]);
    cq_scale_from_amax(amax, 127.0f, &scale, &inv);
    for (int64_t i = r0 * dim; i < r1 * dim; ++i) codes[i] = (int8_t)cq_int8_encode(x[i] * inv);
    scales[blk] = scale;
  }
}

typedef struct int8_head {
  float *qs, *ks, *vf, *kmean, *sq, *sk, *sv, *qbias; /* q', k - kmean, fp32 values, ... */
  int8_t *qc, *kc, *vc;
} int8_head;

static void int8_head_free(int8_head *w) {
  free(w->qs), free(w->ks), free(w->vf), free(w->kmean), free(w->sq), free(w->sk), free(w->sv), free(w->qbias);
  free(w->qc), free(w->kc), free(w->vc);
}

static int int8_head_alloc(int8_head *w, const cq_attention_dims *n, int64_t qb, int64_t kb) {
  const int64_t sq = n->seq_q, skv = n->seq_kv, dim = n->head_dim; /* each product <= an input's element count */
  memset(w, 0, sizeof *w);
  w->qs = cq_alloc(sq * dim, sizeof(float));
  w->ks = cq_alloc(skv * dim, sizeof(float));
  w->vf = cq_alloc(skv * dim, sizeof(float));
  w->kmean = cq_alloc(dim, sizeof(float));
  w->sq = cq_alloc((sq + qb - 1) / qb, sizeof(float));
  w->sk = cq_alloc((skv + kb - 1) / kb, sizeof(float));
  w->sv = cq_alloc(dim, sizeof(float));
  w->qbias = cq_alloc(sq, sizeof(float));
  w->qc = cq_alloc(sq * dim, 1);
  w->kc = cq_alloc(skv * dim, 1);
  w->vc = cq_alloc(skv * dim, 1);
  return w->qs && w->ks && w->vf && w->kmean && w->sq && w->sk && w->sv && w->qbias && w->qc && w->kc && w->vc;
}

/* Smooth and quantize K, quantize Q (scale and log2(e) folded in). */
static void int8_prepare_qk(const cq_tensor *q, const cq_tensor *k, float scale, int64_t qb, int64_t kb,
                            const cq_attention_dims *n, int64_t b, int64_t h, int8_head *w) {
  const int64_t sq = n->seq_q, skv = n->seq_kv, dim = n->head_dim;
  gather(k, b, h, skv, dim, w->ks);
  for (int64_t d = 0; d < dim; ++d) {
    double sum = 0.0;
    for (int64_t j = 0; j < skv; ++j) sum += w->ks[j * dim + d];
    w->kmean[d] = (float)(sum / (double)skv);
  }
  for (int64_t j = 0; j < skv; ++j)
    for (int64_t d = 0; d < dim; ++d) w->ks[j * dim + d] -= w->kmean[d];
  quantize_int8_blocks(w->ks, skv, dim, kb, w->kc, w->sk);

  const float qmul = scale * LOG2E_F;
  gather(q, b, h, sq, dim, w->qs);
  for (int64_t i = 0; i < sq; ++i) {
    double bias = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      w->qs[i * dim + d] *= qmul;
      bias += (double)w->qs[i * dim + d] * (double)w->kmean[d];
    }
    w->qbias[i] = (float)bias;
  }
  quantize_int8_blocks(w->qs, sq, dim, qb, w->qc, w->sq);
}

/* Quantize V to int8 per channel over all keys (cq_quantize's math). A channel whose amax is not
 * finite gets inv = 0, so all-zero codes (NaN * 0 encodes to 0), and a NaN scale. */
static void int8_prepare_v(const cq_tensor *v, const cq_attention_dims *n, int64_t b, int64_t h, int8_head *w) {
  const int64_t skv = n->seq_kv, dim = n->head_dim;
  gather(v, b, h, skv, dim, w->vf);
  for (int64_t d = 0; d < dim; ++d) {
    float amax = 0.0f, inv;
    for (int64_t j = 0; j < skv; ++j) amax = cq_amax_step(amax, w->vf[j * dim + d]);
    cq_scale_from_amax(amax, 127.0f, &w->sv[d], &inv);
    for (int64_t j = 0; j < skv; ++j) w->vc[j * dim + d] = (int8_t)cq_int8_encode(w->vf[j * dim + d] * inv);
  }
}

/* Max of the block scales and of the scaled code-row norms of `rows` rows in blocks of `block`:
 * (A, Bq) of Q or (C, Bk) of K in cq_attn8_logit_error. NaN scales propagate. */
static void int8_rows_bound(const int8_t *codes, const float *scales, int64_t rows, int64_t dim, int64_t block,
                            float *scale_max, float *norm_max) {
  float smax = 0.0f, nmax = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t sum_sq = 0;
    for (int64_t d = 0; d < dim; ++d) sum_sq += (int32_t)codes[r * dim + d] * (int32_t)codes[r * dim + d];
    const float sc = scales[r / block];
    smax = cq_amax_step(smax, sc);
    nmax = cq_amax_step(nmax, cq_attn8_row_norm(sc, sum_sq));
  }
  *scale_max = smax, *norm_max = nmax;
}

/* E of a prepared head (cquant.h): the rms bound on its logit error, log2 units. */
static float int8_logit_error(const int8_head *w, const cq_attention_dims *n, int64_t qb, int64_t kb) {
  float a, bq, c, bk;
  int8_rows_bound(w->qc, w->sq, n->seq_q, n->head_dim, qb, &a, &bq);
  int8_rows_bound(w->kc, w->sk, n->seq_kv, n->head_dim, kb, &c, &bk);
  return cq_attn8_logit_error(a, bq, c, bk, (int)n->head_dim);
}

/* Whether the 8-bit mode hands a head with estimate e to the full-precision math (NaN included). */
static int int8_head_falls_back(float e) { return !(e <= CQ_ATTENTION_INT8_MAX_LOGIT_ERROR); }

/* One head of the 8-bit mode: quantize, then the 8-bit math, or the full-precision math where
 * the head's logit-error estimate passes CQ_ATTENTION_INT8_MAX_LOGIT_ERROR. */
static int int8_head_run(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                         const cq_attention_dims *n, int64_t b, int64_t h, cq_tensor *out, cq_tensor *lse) {
  const int64_t sq = n->seq_q, skv = n->seq_kv, dim = n->head_dim;
  const int64_t qb = cq_attention_q_block(p), kb = cq_attention_k_block(p);
  int8_head w;
  /* a tile holds at most skv keys: a k_block beyond the sequence must not size the logits */
  const int64_t tile = kb < skv ? kb : skv;
  float *s = cq_alloc(tile, sizeof *s), *acc = cq_alloc(dim, sizeof *acc);
  int32_t *pc = cq_alloc(tile, sizeof *pc);
  int64_t *pv = cq_alloc(dim, sizeof *pv);
  int ok = int8_head_alloc(&w, n, qb, kb) && s && acc && pc && pv;
  if (ok) int8_prepare_qk(q, k, p->scale, qb, kb, n, b, h, &w);
  if (ok && int8_head_falls_back(int8_logit_error(&w, n, qb, kb))) {
    int8_head_free(&w);
    free(s), free(acc), free(pc), free(pv);
    return full_head(q, k, v, p->scale, n, b, h, out, lse);
  }
  if (ok) {
    int8_prepare_v(v, n, b, h, &w);
    for (int64_t i = 0; i < sq; ++i) {
      const int8_t *qi = w.qc + i * dim;
      const float sqi = w.sq[i / qb];
      float m = -INFINITY, l = 0.0f;
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
      for (int64_t j0 = 0; j0 < skv; j0 += kb) {
        const int64_t nj = j0 + kb < skv ? kb : skv - j0;
        const float sqk = sqi * w.sk[j0 / kb];
        float mt = -INFINITY;
        for (int64_t j = 0; j < nj; ++j) {
          const int8_t *kj = w.kc + (j0 + j) * dim;
          int64_t dot = 0; /* exact for any head dim (int32 would wrap past D = 133144) */
          for (int64_t d = 0; d < dim; ++d) dot += (int32_t)qi[d] * (int32_t)kj[d];
          s[j] = (float)dot * sqk;
          mt = fmaxf(mt, s[j]);
        }
        const float mn = fmaxf(m, mt);
        const float alpha = exp2f(m - mn), beta = exp2f(mt - mn); /* alpha = 0 at the first tile */
        /* u8 codes of P at the tile's own max, then exact integer sums (int64: any k_block) */
        int64_t ls = 0;
        for (int64_t j = 0; j < nj; ++j) {
          pc[j] = (int32_t)cq_rint(exp2f(s[j] - mt) * 255.0f); /* in [0, 255] */
          ls += pc[j];
        }
        for (int64_t d = 0; d < dim; ++d) pv[d] = 0;
        for (int64_t j = 0; j < nj; ++j) {
          const int8_t *vj = w.vc + (j0 + j) * dim;
          for (int64_t d = 0; d < dim; ++d) pv[d] += (int64_t)pc[j] * vj[d];
        }
        l = fmaf(beta, (float)ls, l * alpha);
        for (int64_t d = 0; d < dim; ++d) acc[d] = fmaf(beta, (float)pv[d], acc[d] * alpha);
        m = mn;
      }
      for (int64_t d = 0; d < dim; ++d)
        cq_store_float(out->data, out->dtype, at(out, b, i, h, d), acc[d] / l * w.sv[d]);
      store_lse(lse, n, b, h, i, (m + (log2f(l) - log2f(255.0f)) + w.qbias[i]) / LOG2E_F);
    }
  }
  int8_head_free(&w);
  free(s), free(acc), free(pc), free(pv);
  return ok;
}

/* No keys (cquant.h): out = 0, the empty sum of values, and lse = log 0 = -inf. */
static void empty_keys(const cq_attention_dims *n, cq_tensor *out, cq_tensor *lse) {
  for (int64_t b = 0; b < n->batch; ++b)
    for (int64_t h = 0; h < n->heads; ++h)
      for (int64_t i = 0; i < n->seq_q; ++i) {
        for (int64_t d = 0; d < n->head_dim; ++d) cq_store_float(out->data, out->dtype, at(out, b, i, h, d), 0.0f);
        store_lse(lse, n, b, h, i, -INFINITY);
      }
}

/* E of every head into bound [B, H] (cq_attention_int8_logit_error_ref; arguments checked). */
cq_status cq_attention_int8_logit_error_cpu(const cq_tensor *q, const cq_tensor *k, const cq_attention_params *p,
                                            const cq_attention_dims *n, cq_tensor *bound) {
  const int64_t pairs = n->batch * n->heads, qb = cq_attention_q_block(p), kb = cq_attention_k_block(p);
  float *dst = (float *)bound->data;
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    if (n->seq_q == 0 || n->seq_kv == 0) { /* nothing is quantized: no error */
      dst[bh] = 0.0f;
      continue;
    }
    int8_head w;
    const int ok = int8_head_alloc(&w, n, qb, kb);
    if (ok) {
      int8_prepare_qk(q, k, p->scale, qb, kb, n, bh / n->heads, bh % n->heads, &w);
      dst[bh] = int8_logit_error(&w, n, qb, kb);
    }
    int8_head_free(&w);
    failed = failed || !ok;
  }
  if (failed)
    return cq_fail(CQ_ERR_OOM, "attention: no host memory for the temporaries of one head (seq_kv = %lld, head_dim = %lld)",
                   (long long)n->seq_kv, (long long)n->head_dim);
  return CQ_OK;
}

cq_status cq_attention_cpu(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                           const cq_attention_dims *n, cq_tensor *out, cq_tensor *lse) {
  if (n->batch == 0 || n->heads == 0 || n->seq_q == 0) return CQ_OK; /* nothing to write */
  if (n->seq_kv == 0) {
    empty_keys(n, out, lse);
    return CQ_OK;
  }
  const int64_t pairs = n->batch * n->heads;
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    const int64_t b = bh / n->heads, h = bh % n->heads;
    int ok = p->mode == CQ_ATTENTION_INT8 ? int8_head_run(q, k, v, p, n, b, h, out, lse)
                                          : full_head(q, k, v, p->scale, n, b, h, out, lse);
    failed = failed || !ok;
  }
  if (failed)
    return cq_fail(CQ_ERR_OOM, "attention: no host memory for the temporaries of one head (seq_kv = %lld, head_dim = %lld)",
                   (long long)n->seq_kv, (long long)n->head_dim);
  return CQ_OK;
}
