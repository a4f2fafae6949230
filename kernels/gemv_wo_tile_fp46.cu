/* The per-tile weight-only GEMV (gemv_wo_tile.cuh) for the 4- and 6-bit fpX decoders. */
#include "gemv_wo_tile.cuh"

namespace cq_wo {

cq_status gemv_tile_launch_fp46(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  static const GemvLauncher launchers[][kXModes] = {CQ_GEMV_TILE_MODES(CodecFp4), CQ_GEMV_TILE_MODES(CodecFp6)};
  static const int codecs[] = {kCodecFp4, kCodecFp6};
  for (int i = 0; i < (int)(sizeof codecs / sizeof codecs[0]); ++i)
    if (codecs[i] == codec) return launchers[i][xmode](a, grid, s);
  return cq_fail(CQ_ERR_INTERNAL, "gemv: decoder %d is not among the 4- and 6-bit fpX ones", codec);
}

}  // namespace cq_wo
