"""Fused forward of diffusers' AdaLayerNormContinuous (the final norm_out of Flux, SD3, Qwen-Image):
the norm and the modulation in one pass (cquant::norm_modulate)."""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaLayerNormContinuous

from .. import torch_ops
from . import common as c


@c.keep_name
class FusedAdaLayerNormContinuous(AdaLayerNormContinuous):
    """AdaLayerNormContinuous computing norm(x) * (1 + scale) + shift in one pass; calls it does not
    cover run AdaLayerNormContinuous.forward."""

    _cquant_unfused = AdaLayerNormContinuous
    _cquant_only_as = "norm_out"  # the model's final norm; blocks fuse their own

    @staticmethod
    def _cquant_refusal(module):
        if c.continuous_norm(module.norm) is None:
            return f"its norm is {type(module.norm).__name__} with affine parameters or of another kind; only " \
                   "LayerNorm and RMSNorm without affine parameters are fused"
        return None

    def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
        norm = self._fused_norm(x, conditioning_embedding)
        if norm is None:
            return AdaLayerNormContinuous.forward(self, x, conditioning_embedding)
        # diffusers' order: scale first, then shift
        scale, shift = self.linear(self.silu(conditioning_embedding).to(x.dtype)).chunk(2, dim=1)
        x = x.contiguous()
        out, _ = torch_ops.ops_for(x, scale, shift).norm_modulate(x, scale, shift, norm[0], norm[1], c.NONE)
        return out

    def _fused_norm(self, x, emb):
        if type(self) is not FusedAdaLayerNormContinuous or c.global_hooks() or type(self.silu) is not torch.nn.SiLU:
            return None
        if x.ndim != 3 or emb.ndim != 2 or emb.shape[0] != x.shape[0]:
            return None
        if not c.inputs_ok((x,), x.dtype, x.device) or not c.no_grad_needed(self, (x, emb)):
            return None
        return c.continuous_norm(self.norm)
