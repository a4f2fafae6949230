"""Fused forwards of diffusion-transformer blocks (cquant.optimize installs them).

Each module here defines, for one diffusers block class, a subclass whose forward runs cquant's
fused ops and falls back to the diffusers forward for any call it does not cover; optimize swaps a
block's __class__ to it (unoptimize swaps it back). The subclass keeps the diffusers class's
__name__, so code that finds blocks by class name (diffusers' _no_split_modules,
_repeated_blocks for compile_repeated_blocks, print(model)) sees the block it knows; its
__qualname__ names the fused class, so pickles find it.
"""

from __future__ import annotations


def fused_classes():
    """{diffusers class: fused subclass} (imports diffusers)."""
    from .flux import FusedFluxSingleTransformerBlock, FusedFluxTransformerBlock
    from .norm import FusedAdaLayerNormContinuous
    from .qwen_image import FusedQwenImageTransformerBlock
    from .sd3 import FusedJointTransformerBlock

    classes = (FusedFluxTransformerBlock, FusedFluxSingleTransformerBlock, FusedJointTransformerBlock,
               FusedQwenImageTransformerBlock, FusedAdaLayerNormContinuous)
    return {cls._cquant_unfused: cls for cls in classes}


def static_refusal(module, fused_cls):
    """Why `module` would never take fused_cls's fused path (its configuration, fixed at
    construction), or None."""
    return fused_cls._cquant_refusal(module)
