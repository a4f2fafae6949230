"""Fused forward of SD3's JointTransformerBlock (SD3, SD3.5: Q/K RMSNorm, dual attention, and the
last block whose text stream stops after the attention, context_pre_only).

Same math as diffusers' forward (attention.py) and JointAttnProcessor2_0 /
FusedJointAttnProcessor2_0 (attention_processor.py). Image tokens come first in the joint
sequence (rows [0, S_img)), text tokens after, as those processors concatenate them. There is no
rotary embedding; qk_norm_rope applies the Q/K RMSNorm where the processor does (the fused-QKV
processor applies none) and writes both streams into the joint q / k / v tensors.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention, FusedJointAttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, SD35AdaLayerNormZeroX

from .. import ops, torch_ops
from . import common as c

_NO_NORM = (False, None, None, 0.0)


def _attention_parts(attn, dtype, device, joint):
    """(head_dim, image q/k norm, image projections, text q/k norm, text projections) of an SD3
    Attention as its processor computes them, or None where the fused forward must fall back."""
    processor = type(attn.processor)
    if type(attn) is not Attention or processor not in (JointAttnProcessor2_0, FusedJointAttnProcessor2_0):
        return None
    if not c.attention_module(attn) or attn.spatial_norm is not None or attn.group_norm is not None:
        return None
    fused = processor is FusedJointAttnProcessor2_0
    if fused and not joint:
        return None  # that processor needs the text stream
    names = ("to_qkv",) if fused else ("to_q", "to_k", "to_v")
    added = ("to_added_qkv",) if fused else ("add_q_proj", "add_k_proj", "add_v_proj")
    img = _layers(attn, names, dtype, device)
    txt = _layers(attn, added, dtype, device) if joint else ([], [])
    if img is None or txt is None:
        return None
    width = img[0][0].out_features // (3 if fused else 1)
    if width % attn.heads:
        return None
    head_dim = width // attn.heads
    if not c.head_dim_ok(head_dim, device):
        return None
    if fused:  # FusedJointAttnProcessor2_0 applies no Q/K norm
        return head_dim, _NO_NORM, img, _NO_NORM, txt
    norm = c.qk_norm(attn.norm_q, attn.norm_k, head_dim, dtype)
    norm_added = c.qk_norm(getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None), head_dim,
                           dtype) if joint else _NO_NORM
    if norm is None or norm_added is None:
        return None
    return head_dim, norm, img, norm_added, txt


def _layers(module, names, dtype, device):
    layers = [c.sub(module, n) for n in names]
    kinds = [c.linear_kind(layer, dtype, device) if layer is not None else 0 for layer in layers]
    return (layers, kinds) if all(kinds) else None


def _output(module, name, dtype, device):
    found = _layers(module, (name,), dtype, device)
    return None if found is None else (found[0][0], found[1][0])


def _to_out(attn, dtype, device):
    if len(attn.to_out) != 2 or not c.dropout_off(attn.to_out[1]):
        return None
    return _output(attn.to_out, "0", dtype, device)


@c.keep_name
class FusedJointTransformerBlock(JointTransformerBlock):
    """JointTransformerBlock whose forward runs cquant's fused ops (blocks/common.py), falling back
    to JointTransformerBlock.forward for any call it does not cover."""

    _cquant_unfused = JointTransformerBlock

    @staticmethod
    def _cquant_refusal(block):
        norms = {"norm1.norm": block.norm1.norm, "norm1_context.norm": block.norm1_context.norm,
                 "norm2": block.norm2}
        if not block.context_pre_only:
            norms["norm2_context"] = block.norm2_context
        return (c.qk_norm_refusal(block.attn) or (block.attn2 is not None and c.qk_norm_refusal(block.attn2))
                or c.layer_norm_refusal(**norms))

    def _fused_parts(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs):
        if self._chunk_size is not None:
            return None
        got = c.stream_inputs(self, FusedJointTransformerBlock, joint_attention_kwargs, hidden_states,
                              encoder_hidden_states, temb)
        if got is None:
            return None
        dtype, device = got
        dual = self.use_dual_attention
        norm1 = type(self.norm1) is (SD35AdaLayerNormZeroX if dual else AdaLayerNormZero)
        eps1 = c.adaln_zero(self.norm1) if norm1 else None
        if self.context_pre_only:
            ok = type(self.norm1_context) is AdaLayerNormContinuous and c.plain_module(self.norm1_context) \
                and type(self.norm1_context.silu) is torch.nn.SiLU
            eps1c = c.layer_norm_eps(self.norm1_context.norm) if ok else None
            eps2c, ff_context, add_out = 0.0, (), ()
        else:
            eps1c = c.adaln_zero(self.norm1_context) if type(self.norm1_context) is AdaLayerNormZero else None
            eps2c = c.layer_norm_eps(self.norm2_context)
            ff_context = c.feed_forward(self.ff_context, dtype, device)
            add_out = _output(self.attn, "to_add_out", dtype, device)
        eps2 = c.layer_norm_eps(self.norm2)
        attn = _attention_parts(self.attn, dtype, device, joint=True)
        out = _to_out(self.attn, dtype, device)
        ff = c.feed_forward(self.ff, dtype, device)
        if None in (eps1, eps1c, eps2, eps2c, attn, out, ff, ff_context, add_out):
            return None
        if self.attn.context_pre_only != self.context_pre_only:
            return None
        attn2 = out2 = None
        if dual:
            attn2 = _attention_parts(self.attn2, dtype, device, joint=False)
            out2 = _to_out(self.attn2, dtype, device)
            if attn2 is None or out2 is None:
                return None
        return (eps1, eps1c, eps2, eps2c), attn, out, add_out, ff, ff_context, attn2, out2

    def forward(self, hidden_states: torch.FloatTensor, encoder_hidden_states: torch.FloatTensor,
                temb: torch.FloatTensor, joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._fused_parts(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        if parts is not None:
            return self._fused(hidden_states.contiguous(), encoder_hidden_states.contiguous(), temb, *parts)
        return JointTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)

    def _fused(self, hidden_states, encoder_hidden_states, temb, eps, attn, out, add_out, ff, ff_context, attn2,
               out2):
        o = torch_ops.ops_for(hidden_states, encoder_hidden_states, temb)
        eps1, eps1c, eps2, eps2c = eps
        emb = self.norm1.linear(self.norm1.silu(temb))
        if self.use_dual_attention:
            (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
             gate_msa2) = emb.chunk(9, dim=1)
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        if self.context_pre_only:
            norm = self.norm1_context
            c_scale_msa, c_shift_msa = norm.linear(norm.silu(temb).to(encoder_hidden_states.dtype)).chunk(2, dim=1)
        else:
            (c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp,
             c_gate_mlp) = self.norm1_context.linear(self.norm1_context.silu(temb)).chunk(6, dim=1)
        b, s_img, _ = hidden_states.shape
        s_txt = encoder_hidden_states.shape[1]
        head_dim, norm, img_proj, norm_added, txt_proj = attn

        img_qkv = c.split_qkv(c.modulate(o, hidden_states, scale_msa, shift_msa, ops.NORM_LAYER, eps1, *img_proj),
                              head_dim)
        txt_qkv = c.split_qkv(c.modulate(o, encoder_hidden_states, c_scale_msa, c_shift_msa, ops.NORM_LAYER, eps1c,
                                         *txt_proj), head_dim)
        bufs = c.joint_buffers(hidden_states, b, s_img + s_txt, img_qkv[0].shape[2], head_dim)
        c.write_heads(o, img_qkv, norm, None, bufs, 0)
        c.write_heads(o, txt_qkv, norm_added, None, bufs, s_img)
        del img_qkv, txt_qkv
        joint = c.attention(bufs, self.attn.processor)
        del bufs
        img_attn = joint[:, :s_img].contiguous()
        txt_attn = None if self.context_pre_only else joint[:, s_img:].contiguous()
        del joint

        residual = hidden_states
        hidden_states = c.gated(o, *out, img_attn, gate_msa, hidden_states)
        if attn2 is not None:
            head_dim2, norm2, proj2, _, _ = attn2
            qkv = c.split_qkv(c.modulate(o, residual, scale_msa2, shift_msa2, ops.NORM_LAYER, eps1, *proj2),
                              head_dim2)
            bufs = c.joint_buffers(residual, b, s_img, qkv[0].shape[2], head_dim2)
            c.write_heads(o, qkv, norm2, None, bufs, 0)
            del qkv
            attn_out2 = c.attention(bufs, self.attn2.processor)
            del bufs
            hidden_states = c.gated(o, *out2, attn_out2, gate_msa2, hidden_states)
        hidden_states = c.mlp(o, ff, hidden_states, scale_mlp, shift_mlp, eps2, gate_mlp, hidden_states)

        if self.context_pre_only:
            return None, hidden_states
        encoder_hidden_states = c.gated(o, *add_out, txt_attn, c_gate_msa, encoder_hidden_states)
        encoder_hidden_states = c.mlp(o, ff_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp, eps2c,
                                      c_gate_mlp, encoder_hidden_states)
        return encoder_hidden_states, hidden_states
