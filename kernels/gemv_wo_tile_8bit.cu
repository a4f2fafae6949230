/* The per-tile weight-only GEMV (gemv_wo_tile.cuh) for the int8 and fp8 decoders. */
#include "gemv_wo_tile.cuh"

namespace cq_wo {

cq_status gemv_tile_launch_8bit(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  static const GemvLauncher launchers[][kXModes] = {CQ_GEMV_TILE_MODES(CodecInt8), CQ_GEMV_TILE_MODES(CodecE4M3), CQ_GEMV_TILE_MODES(CodecE5M2)};
  static const int codecs[] = {kCodecInt8, kCodecE4M3, kCodecE5M2};
  for (int i = 0; i < (int)(sizeof codecs / sizeof codecs[0]); ++i)
    if (codecs[i] == codec) return launchers[i][xmode](a, grid, s);
  return cq_fail(CQ_ERR_INTERNAL, "gemv: decoder %d is not among the int8 and fp8 ones", codec);
}

}  // namespace cq_wo
