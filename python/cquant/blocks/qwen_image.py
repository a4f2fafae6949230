"""Fused forward of Qwen-Image's QwenImageTransformerBlock.

Same math as diffusers' forward and QwenDoubleStreamAttnProcessor2_0 (transformer_qwenimage.py).
Text tokens come first in the joint sequence (rows [0, S_txt)), image tokens after, as the
processor concatenates them; the rotary tables (complex frequencies, one per stream) become one
cos / sin table in that order. The text mask, when given, becomes the same joint attention mask
the processor builds. Blocks with zero_cond_t (a per-token choice between two modulations,
modulate_index) run diffusers' forward.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import (QwenDoubleStreamAttnProcessor2_0,
                                                                 QwenImageTransformerBlock)

from .. import ops, torch_ops
from . import common as c


def _layers(module, names, dtype, device):
    layers = [c.sub(module, n) for n in names]
    kinds = [c.linear_kind(layer, dtype, device) if layer is not None else 0 for layer in layers]
    return (layers, kinds) if all(kinds) else None


def _modulation(mod):
    """Whether `mod` is the block's nn.Sequential(SiLU, Linear) (called as a whole: any layer)."""
    return type(mod) is torch.nn.Sequential and len(mod) == 2 and type(mod[0]) is torch.nn.SiLU


def _attention_parts(attn, dtype, device):
    if type(attn) is not Attention or type(attn.processor) is not QwenDoubleStreamAttnProcessor2_0:
        return None
    if not c.attention_module(attn) or attn.heads < 1 or attn.inner_dim % attn.heads:
        return None
    head_dim = attn.inner_dim // attn.heads
    if not c.head_dim_ok(head_dim, device):
        return None
    norm = c.qk_norm(c.sub(attn, "norm_q"), c.sub(attn, "norm_k"), head_dim, dtype)
    norm_added = c.qk_norm(c.sub(attn, "norm_added_q"), c.sub(attn, "norm_added_k"), head_dim, dtype)
    img = _layers(attn, ("to_q", "to_k", "to_v"), dtype, device)
    txt = _layers(attn, ("add_q_proj", "add_k_proj", "add_v_proj"), dtype, device)
    to_out = c.sub(attn, "to_out")
    out = _layers(to_out, ("0",), dtype, device)
    add_out = _layers(attn, ("to_add_out",), dtype, device)
    if None in (norm, norm_added, img, txt, out, add_out):
        return None
    if len(to_out) > 1 and not c.dropout_off(to_out._modules["1"]):
        return None
    return head_dim, norm, img, norm_added, txt, (out[0][0], out[1][0]), (add_out[0][0], add_out[1][0])


def _rope(image_rotary_emb, s_img, s_txt, head_dim, device):
    """(cos, sin) [S_txt + S_img, D / 2] from the processor's (image, text) complex frequencies,
    None for none; False where they do not fit (the caller falls back)."""
    if image_rotary_emb is None:
        return None
    if not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2:
        return False
    img, txt = image_rotary_emb
    for t, s in ((img, s_img), (txt, s_txt)):
        if not isinstance(t, torch.Tensor) or not t.is_complex() or t.shape != (s, head_dim // 2) or t.device != device:
            return False
    return c.rope_tables("complex", (txt, img))


@c.keep_name
class FusedQwenImageTransformerBlock(QwenImageTransformerBlock):
    """QwenImageTransformerBlock whose forward runs cquant's fused ops (blocks/common.py), falling
    back to QwenImageTransformerBlock.forward for any call it does not cover."""

    _cquant_unfused = QwenImageTransformerBlock

    @staticmethod
    def _cquant_refusal(block):
        if block.zero_cond_t:
            return "zero_cond_t: the modulation is chosen per token (modulate_index), which is not fused"
        return c.qk_norm_refusal(block.attn) or c.layer_norm_refusal(
            img_norm1=block.img_norm1, txt_norm1=block.txt_norm1, img_norm2=block.img_norm2,
            txt_norm2=block.txt_norm2)

    def _fused_parts(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                     joint_attention_kwargs, modulate_index):
        if self.zero_cond_t or modulate_index is not None:
            return None
        got = c.stream_inputs(self, FusedQwenImageTransformerBlock, joint_attention_kwargs, hidden_states,
                              encoder_hidden_states, temb)
        if got is None:
            return None
        dtype, device = got
        if encoder_hidden_states_mask is not None and (encoder_hidden_states_mask.device != device
                                                       or encoder_hidden_states_mask.requires_grad):
            return None
        m = self._modules
        if not (_modulation(m["img_mod"]) and _modulation(m["txt_mod"])):
            return None
        eps = [c.layer_norm_eps(m[n]) for n in ("img_norm1", "txt_norm1", "img_norm2", "txt_norm2")]
        attn = _attention_parts(m["attn"], dtype, device)
        img_mlp = c.feed_forward(m["img_mlp"], dtype, device)
        txt_mlp = c.feed_forward(m["txt_mlp"], dtype, device)
        if None in (*eps, attn, img_mlp, txt_mlp):
            return None
        return eps, attn, img_mlp, txt_mlp

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None,
                modulate_index: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._fused_parts(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                  joint_attention_kwargs, modulate_index)
        if parts is not None:
            head_dim = parts[1][0]
            rope = _rope(image_rotary_emb, hidden_states.shape[1], encoder_hidden_states.shape[1], head_dim,
                         hidden_states.device)
            if rope is not False:
                return self._fused(hidden_states.contiguous(), encoder_hidden_states.contiguous(),
                                   encoder_hidden_states_mask, temb, rope, *parts)
        return QwenImageTransformerBlock.forward(self, hidden_states, encoder_hidden_states,
                                                 encoder_hidden_states_mask, temb, image_rotary_emb,
                                                 joint_attention_kwargs, modulate_index)

    def _fused(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, rope, eps, attn,
               img_mlp, txt_mlp):
        o = torch_ops.ops_for(hidden_states, encoder_hidden_states, temb)
        img_eps1, txt_eps1, img_eps2, txt_eps2 = eps
        head_dim, norm, img_proj, norm_added, txt_proj, out, add_out = attn
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_shift1, img_scale1, img_gate1 = img_mod1.chunk(3, dim=-1)
        txt_shift1, txt_scale1, txt_gate1 = txt_mod1.chunk(3, dim=-1)
        b, s_img, _ = hidden_states.shape
        s_txt = encoder_hidden_states.shape[1]

        mask = None
        if encoder_hidden_states_mask is not None:  # as the processor builds it
            image_mask = torch.ones((b, s_img), dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]

        img_qkv = c.split_qkv(c.modulate(o, hidden_states, img_scale1, img_shift1, ops.NORM_LAYER, img_eps1,
                                         *img_proj), head_dim)
        txt_qkv = c.split_qkv(c.modulate(o, encoder_hidden_states, txt_scale1, txt_shift1, ops.NORM_LAYER, txt_eps1,
                                         *txt_proj), head_dim)
        bufs = c.joint_buffers(hidden_states, b, s_txt + s_img, img_qkv[0].shape[2], head_dim)
        c.write_heads(o, txt_qkv, norm_added, rope, bufs, 0)
        c.write_heads(o, img_qkv, norm, rope, bufs, s_txt)
        del img_qkv, txt_qkv
        joint = c.attention(bufs, self.attn.processor, mask)
        del bufs
        txt_attn, img_attn = joint[:, :s_txt].contiguous(), joint[:, s_txt:].contiguous()
        del joint

        hidden_states = c.gated(o, *out, img_attn, img_gate1, hidden_states)
        encoder_hidden_states = c.gated(o, *add_out, txt_attn, txt_gate1, encoder_hidden_states)
        img_shift2, img_scale2, img_gate2 = img_mod2.chunk(3, dim=-1)
        txt_shift2, txt_scale2, txt_gate2 = txt_mod2.chunk(3, dim=-1)
        hidden_states = c.mlp(o, img_mlp, hidden_states, img_scale2, img_shift2, img_eps2, img_gate2, hidden_states)
        encoder_hidden_states = c.mlp(o, txt_mlp, encoder_hidden_states, txt_scale2, txt_shift2, txt_eps2, txt_gate2,
                                      encoder_hidden_states)
        return c.clip_fp16(encoder_hidden_states), c.clip_fp16(hidden_states)
