/* The per-tile weight-only GEMV (gemv_wo_tile.cuh) for the 3-, 5- and 7-bit fpX decoders. */
#include "gemv_wo_tile.cuh"

namespace cq_wo {

cq_status gemv_tile_launch_fp357(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  static const GemvLauncher launchers[][kXModes] = {CQ_GEMV_TILE_MODES(CodecFp3), CQ_GEMV_TILE_MODES(CodecFp5), CQ_GEMV_TILE_MODES(CodecFp7)};
  static const int codecs[] = {kCodecFp3, kCodecFp5, kCodecFp7};
  for (int i = 0; i < (int)(sizeof codecs / sizeof codecs[0]); ++i)
    if (codecs[i] == codec) return launchers[i][xmode](a, grid, s);
  return cq_fail(CQ_ERR_INTERNAL, "gemv: decoder %d is not among the 3-, 5- and 7-bit fpX ones", codec);
}

}  // namespace cq_wo
