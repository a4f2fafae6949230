/* The host policy of the weight-only GEMV: which decoder and x mode, which kernel (per tile or
 * persistent) and how many warps split K. */
#include <atomic>

#include "gemv_wo.cuh"
#include "linear_impl.cuh"

namespace cq_wo {

/* The decoder of a format: the one place formats map to specialisations. */
cq_status codec_of(const cq_format_info *f, const char *op, int *codec) {
  switch (f->id) {
    case CQ_FORMAT_INT8: *codec = kCodecInt8; return CQ_OK;
    case CQ_FORMAT_FP8_E4M3: *codec = kCodecE4M3; return CQ_OK;
    case CQ_FORMAT_FP8_E5M2: *codec = kCodecE5M2; return CQ_OK;
    default: break;
  }
  if (f->kind == CQ_KIND_FLOAT && f->specials == CQ_SPECIALS_NONE && f->packed && f->bits >= 3 && f->bits <= 7) {
    *codec = kCodecFp3 + (f->bits - 3);
    return CQ_OK;
  }
  return cq_fail(CQ_ERR_UNSUPPORTED, "%s: %s (%d-bit codes) has no CUDA decoder; the kernels take int8, fp8 and "
                 "fpX with 3..7 bits", op, f->name, f->bits);
}

namespace {

/* Codes of one unit for a run-time bit width. */
int64_t unit_codes(int bits) {
  switch (bits) {
    case 3: return WoUnit<3>::kCodes;
    case 4: return WoUnit<4>::kCodes;
    case 5: return WoUnit<5>::kCodes;
    case 6: return WoUnit<6>::kCodes;
    case 7: return WoUnit<7>::kCodes;
    default: return WoUnit<8>::kCodes;
  }
}

/* Whether every value of a format is exact in f16 (bf16 = 0, f16 = 1); cached
 * per format id, since the answer never changes. */
bool format_fits(const cq_format_info *f, int half) {
  static std::atomic<signed char> cache[2][0x200];
  const int id = (int)f->id;
  if (id >= 0 && id < 0x200) {
    const signed char known = cache[half][id].load(std::memory_order_relaxed);
    if (known) return known > 0;
  }
  bool fits = true;
  for (uint32_t code = 0; code < (1u << f->bits) && fits; ++code) {
    const float v = f->decode(f, code);
    if (v != v) continue; /* NaN stays NaN in both */
    const float back = half ? cq_f16_to_f32(cq_f32_to_f16(v)) : cq_bf16_to_f32(cq_f32_to_bf16(v));
    fits = back == v;
  }
  if (id >= 0 && id < 0x200) cache[half][id].store(fits ? 1 : -1, std::memory_order_relaxed);
  return fits;
}

/* The persistent kernel runs on compute capability 9.0 in builds with sm_90a code, where it was
 * measured (its shared memory fits the 227 KB a block may take there), for the decoders and x
 * modes it is built for; other GPUs and calls run the per-tile kernel, as does every call with
 * CQUANT_GEMV_PERSISTENT=0. *forced is set by CQUANT_GEMV_PERSISTENT=1 (take it for every shape
 * it can run). */
bool stream_usable(const cq_device_info &info, int codec, int xmode, int *forced) {
  const int setting = cq_settings_now().gemv_persistent;
  *forced = setting == 1;
  return setting != 0 && cq_cc_runs_sm90a(info.cc) && info.sms > 0 && gemv_persistent_built(codec, xmode);
}

/* Warps splitting K: as many as there are quads, up to 8, preferring a count
 * that divides the quads evenly (no warp idles while another finishes). */
int gemv_k_warps(int64_t quads) {
  if (quads <= kGemvWarps) return (int)quads;
  int best = kGemvWarps;
  double best_use = 0.0;
  for (int kw = kGemvWarps; kw >= kGemvWarps / 2; --kw) {
    const int64_t per_warp = (quads + kw - 1) / kw;
    const double use = (double)quads / (double)(per_warp * kw);
    if (use > best_use + 1e-9) best = kw, best_use = use;
  }
  return best;
}


}  // namespace
}  // namespace cq_wo

using namespace cq_wo;

cq_status cq_gemv_wo_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                     const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                                     const cq_linear_out *out, void *stream) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  if (p->act_format != CQ_FORMAT_NONE)
    return cq_fail(CQ_ERR_INVALID_ARG, "gemv: act_format %d; the weight-only GEMV takes unquantized activations",
                   p->act_format);
  if (m > CQ_GEMV_MAX_M)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: x has %lld rows; the weight-only GEMV takes at most %d",
                   (long long)m, CQ_GEMV_MAX_M);
  int codec;
  CQ_TRY(codec_of(wf, "gemv", &codec));
  int xmode;
  switch (x->dtype) {
    case CQ_DTYPE_BF16: xmode = kXBf16; break;
    case CQ_DTYPE_F16: xmode = format_fits(wf, 1) ? kXF16 : kXSplit; break;
    case CQ_DTYPE_F32: xmode = kXSplit; break;
    default:
      return cq_fail(CQ_ERR_TYPE, "gemv: x has dtype %s; expected float32, float16 or bfloat16",
                     cq_dtype_name(x->dtype));
  }
  if (xmode != kXF16 && !format_fits(wf, 0))
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: the values of %s are not all exact in bfloat16", wf->name);
  cq_device_info info;
  CQ_TRY(cq_require_cc(x->device_id, CQ_MIN_CC_WEIGHT_ONLY, "the weight-only GEMV", NULL));
  CQ_TRY(cq_device_info_get(x->device_id, &info));

  const int64_t codes_per_unit = unit_codes(wf->bits);
  const int64_t units = (k + codes_per_unit - 1) / codes_per_unit;
  GemvWoArgs a;
  a.x = x->data, a.w = static_cast<const uint8_t *>(w->data), a.w_scale = static_cast<const float *>(w_scale->data);
  a.bias = bias ? bias->data : nullptr, a.y = out->y, a.ldy = out->ldy;
  a.gate = out->gate, a.gate_dtype = out->gate_dtype, a.ldg = out->ldg, a.rows_per_sample = out->rows_per_sample;
  a.residual = out->residual, a.ldr = out->ldr;
  a.m = m, a.n = n, a.k = k, a.row_bytes = cq_packed_row_bytes(wf, k);
  if ((units + 3) / 4 > 0x3fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: rows of %lld codes are more than the kernel indexes", (long long)k);
  a.quads = (int)((units + 3) / 4);
  /* 16-bit x is loaded 16 bytes at a time with no bounds checks in the quads
   * that lie wholly inside K; the last, partial one checks every element */
  const bool x_vec = x->dtype != CQ_DTYPE_F32 && (uintptr_t)x->data % 16 == 0 && k % 8 == 0;
  a.fast_quads = x_vec ? (int)(k / (4 * codes_per_unit)) : 0;
  a.fmt = cq_format_params_of(wf);
  a.x_dtype = x->dtype;
  a.scale_per_row = p->weight_granularity == CQ_GRANULARITY_ROW;
  a.bias_f32 = bias && bias->dtype == CQ_DTYPE_F32;
  a.activation = p->activation;
  a.w_vec = (uintptr_t)w->data % 16 == 0 && a.row_bytes % 16 == 0;
  a.groups = 1;
  const int64_t tiles = (n + 15) / 16;
  const int sms = info.sms, smem_optin = info.smem_optin;
  int forced = 0;
  /* Measured on H100 (benchmarks/results/gemv_h100.md): the persistent kernel
   * wins where every SM gets two or more row tiles of at least 8 quads; with
   * fewer tiles it leaves SMs idle or unbalanced, with short rows its ring
   * barely fills, and fp4's 1.5 items a warp per tile lose to the per-tile
   * kernel's simpler loop (so fp4 has none). */
  if (a.w_vec && a.quads > 0 && tiles > 0 && stream_usable(info, codec, xmode, &forced) &&
      (forced || (tiles >= 2 * (int64_t)sms && a.quads >= 8))) {
    /* groups of kw warps split K (kw <= quads); 16 warps a CTA, one CTA an SM */
    a.kw = (int)(a.quads < kStreamWarps ? a.quads : kStreamWarps);
    a.groups = kStreamWarps / a.kw;
    if (gemv_persistent_smem(wf->bits, a.kw * a.groups, a.kw) <= (size_t)smem_optin) {
      const int64_t ctas = (tiles + a.groups - 1) / a.groups;
      return gemv_persistent_launch(codec, xmode, a, (unsigned)(ctas < sms ? ctas : sms), cq_stream(stream));
    }
    a.groups = 1;
  }
  a.kw = gemv_k_warps(a.quads);
  const int64_t grid = tiles;
  if (grid > 0x7fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: %lld output features is more than one launch covers", (long long)n);
  return gemv_tile_launch(codec, xmode, a, (unsigned)grid, cq_stream(stream));
}
