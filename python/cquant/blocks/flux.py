"""Fused forwards of Flux's blocks (FluxTransformerBlock, FluxSingleTransformerBlock).

Same math as diffusers' forwards (transformer_flux.py, FluxAttnProcessor), with the element-wise
work moved into the passes of cquant's fused ops (blocks/common.py). Text tokens come first in
the joint sequence (rows [0, S_txt)), image tokens after, as FluxAttnProcessor concatenates them.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import (FluxAttention, FluxAttnProcessor,
                                                            FluxSingleTransformerBlock, FluxTransformerBlock)

from .. import ops, torch_ops
from . import common as c


def _projections(attn, dtype, device, added):
    """The layers FluxAttnProcessor calls for q / k / v (one fused layer or three) with their kinds."""
    if attn.fused_projections:
        names = ("to_added_qkv",) if added else ("to_qkv",)
    else:
        names = ("add_q_proj", "add_k_proj", "add_v_proj") if added else ("to_q", "to_k", "to_v")
    layers = [c.sub(attn, n) for n in names]
    kinds = [c.linear_kind(layer, dtype, device) if layer is not None else 0 for layer in layers]
    return (layers, kinds) if all(kinds) else None


def _attention_parts(attn, dtype, device, joint):
    """What the fused forward needs of a FluxAttention, or None where it must fall back."""
    if type(attn) is not FluxAttention or type(attn.processor) is not FluxAttnProcessor:
        return None
    if not c.attention_module(attn):
        return None
    head_dim = attn.head_dim
    if not c.head_dim_ok(head_dim, device):
        return None
    norm = c.qk_norm(c.sub(attn, "norm_q"), c.sub(attn, "norm_k"), head_dim, dtype)
    img = _projections(attn, dtype, device, added=False)
    if norm is None or img is None:
        return None
    if not joint:
        return head_dim, norm, img, None, None
    if attn.added_kv_proj_dim is None or attn.pre_only:
        return None
    norm_added = c.qk_norm(c.sub(attn, "norm_added_q"), c.sub(attn, "norm_added_k"), head_dim, dtype)
    txt = _projections(attn, dtype, device, added=True)
    if norm_added is None or txt is None:
        return None
    return head_dim, norm, img, norm_added, txt


def _output_layer(module, name, dtype, device):
    layer = c.sub(module, name)
    kind = c.linear_kind(layer, dtype, device) if layer is not None else 0
    return (layer, kind) if kind else None


def _rope(image_rotary_emb, seq, head_dim, device):
    """(cos, sin) for qk_norm_rope from Flux's (cos, sin) [S, D], None for none; False where the
    tables do not fit the sequence or live elsewhere (the caller falls back)."""
    if image_rotary_emb is None:
        return None
    if not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2:
        return False
    cos, sin = image_rotary_emb
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or head_dim % 2:
        return False
    if cos.shape != (seq, head_dim) or sin.shape != (seq, head_dim) or cos.is_complex() or sin.is_complex():
        return False
    if cos.device != device or sin.device != device:
        return False
    return c.rope_tables("interleaved", (cos, sin))


def _project_heads(o, x, scale, shift, eps, proj, head_dim):
    layers, kinds = proj
    return c.split_qkv(c.modulate(o, x, scale, shift, ops.NORM_LAYER, eps, layers, kinds), head_dim)


@c.keep_name
class FusedFluxTransformerBlock(FluxTransformerBlock):
    """FluxTransformerBlock whose forward runs cquant's fused ops (blocks/common.py), falling back
    to FluxTransformerBlock.forward for any call it does not cover."""

    _cquant_unfused = FluxTransformerBlock

    @staticmethod
    def _cquant_refusal(block):
        return c.qk_norm_refusal(block.attn) or c.layer_norm_refusal(
            **{"norm1.norm": block.norm1.norm, "norm1_context.norm": block.norm1_context.norm,
               "norm2": block.norm2, "norm2_context": block.norm2_context})

    def _fused_parts(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs):
        got = c.stream_inputs(self, FusedFluxTransformerBlock, joint_attention_kwargs, hidden_states,
                              encoder_hidden_states, temb)
        if got is None:
            return None
        dtype, device = got
        m = self._modules
        norm1, norm1_context, attn_mod = m["norm1"], m["norm1_context"], m["attn"]
        if type(norm1) is not AdaLayerNormZero or type(norm1_context) is not AdaLayerNormZero:
            return None
        eps1, eps1c = c.adaln_zero(norm1), c.adaln_zero(norm1_context)
        eps2, eps2c = c.layer_norm_eps(m["norm2"]), c.layer_norm_eps(m["norm2_context"])
        attn = _attention_parts(attn_mod, dtype, device, joint=True)
        to_out = c.sub(attn_mod, "to_out")
        if None in (eps1, eps1c, eps2, eps2c, attn) or len(to_out) != 2 or not c.dropout_off(to_out._modules["1"]):
            return None
        out = _output_layer(to_out, "0", dtype, device)
        add_out = _output_layer(attn_mod, "to_add_out", dtype, device)
        ff = c.feed_forward(m["ff"], dtype, device)
        ff_context = c.feed_forward(m["ff_context"], dtype, device)
        if None in (out, add_out, ff, ff_context):
            return None
        return (eps1, eps1c, eps2, eps2c), attn, out, add_out, ff, ff_context

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._fused_parts(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        if parts is not None:
            (eps1, eps1c, eps2, eps2c), attn, out, add_out, ff, ff_context = parts
            head_dim, norm, img_proj, norm_added, txt_proj = attn
            b, s_img, _ = hidden_states.shape
            s_txt = encoder_hidden_states.shape[1]
            rope = _rope(image_rotary_emb, s_txt + s_img, head_dim, hidden_states.device)
            if rope is not False:
                return self._fused(hidden_states.contiguous(), encoder_hidden_states.contiguous(), temb, rope,
                                   eps1, eps1c, eps2, eps2c, head_dim, norm, img_proj, norm_added, txt_proj, out,
                                   add_out, ff, ff_context)
        return FluxTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                            joint_attention_kwargs)

    def _fused(self, hidden_states, encoder_hidden_states, temb, rope, eps1, eps1c, eps2, eps2c, head_dim, norm,
               img_proj, norm_added, txt_proj, out, add_out, ff, ff_context):
        o = torch_ops.ops_for(hidden_states, encoder_hidden_states, temb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1.linear(
            self.norm1.silu(temb)).chunk(6, dim=1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context.linear(
            self.norm1_context.silu(temb)).chunk(6, dim=1)
        b, s_img, _ = hidden_states.shape
        s_txt = encoder_hidden_states.shape[1]

        img_qkv = _project_heads(o, hidden_states, scale_msa, shift_msa, eps1, img_proj, head_dim)
        txt_qkv = _project_heads(o, encoder_hidden_states, c_scale_msa, c_shift_msa, eps1c, txt_proj, head_dim)
        bufs = c.joint_buffers(hidden_states, b, s_txt + s_img, img_qkv[0].shape[2], head_dim)
        c.write_heads(o, txt_qkv, norm_added, rope, bufs, 0)
        c.write_heads(o, img_qkv, norm, rope, bufs, s_txt)
        del img_qkv, txt_qkv
        joint = c.attention(bufs, self.attn.processor)
        del bufs
        txt_attn, img_attn = joint[:, :s_txt].contiguous(), joint[:, s_txt:].contiguous()
        del joint

        hidden_states = c.gated(o, *out, img_attn, gate_msa, hidden_states)
        hidden_states = c.mlp(o, ff, hidden_states, scale_mlp, shift_mlp, eps2, gate_mlp, hidden_states)
        encoder_hidden_states = c.gated(o, *add_out, txt_attn, c_gate_msa, encoder_hidden_states)
        encoder_hidden_states = c.mlp(o, ff_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp, eps2c,
                                      c_gate_mlp, encoder_hidden_states)
        return c.clip_fp16(encoder_hidden_states), hidden_states


def _gelu_mlp(block, dtype, device):
    """(proj_mlp, kind) when the block computes gelu_tanh(proj_mlp(x)): act_mlp a tanh GELU after a
    layer without activation, or an identity after cquant fused the GELU into the layer."""
    act, layer = c.sub(block, "act_mlp"), c.sub(block, "proj_mlp")
    if type(act) is torch.nn.GELU and act.approximate == "tanh" and c.plain_module(act):
        fused = None
    elif type(act) is torch.nn.Identity:
        fused = "gelu_tanh"
    else:
        return None
    kind = c.linear_kind(layer, dtype, device, fused)
    return (layer, kind) if kind else None


@c.keep_name
class FusedFluxSingleTransformerBlock(FluxSingleTransformerBlock):
    """FluxSingleTransformerBlock whose forward runs cquant's fused ops: the MLP's first layer
    writes its output beside the attention output in the one buffer proj_out reads (no
    torch.cat), and proj_out adds its gated output to the residual in its epilogue."""

    _cquant_unfused = FluxSingleTransformerBlock

    @staticmethod
    def _cquant_refusal(block):
        return c.qk_norm_refusal(block.attn) or c.layer_norm_refusal(**{"norm.norm": block.norm.norm})

    def _fused_parts(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs):
        got = c.stream_inputs(self, FusedFluxSingleTransformerBlock, joint_attention_kwargs, hidden_states,
                              encoder_hidden_states, temb)
        if got is None:
            return None
        dtype, device = got
        norm = self._modules["norm"]
        eps = c.adaln_zero(norm) if type(norm) is AdaLayerNormZeroSingle else None
        attn = _attention_parts(self._modules["attn"], dtype, device, joint=False)
        mlp = _gelu_mlp(self, dtype, device)
        out = _output_layer(self, "proj_out", dtype, device)
        if None in (eps, attn, mlp, out):
            return None
        return eps, attn, mlp, out

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._fused_parts(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        if parts is not None:
            eps, (head_dim, norm, proj, _, _), mlp, out = parts
            s_txt = encoder_hidden_states.shape[1]
            rope = _rope(image_rotary_emb, s_txt + hidden_states.shape[1], head_dim, hidden_states.device)
            layers = proj[0]
            width = layers[0].out_features // 3 if len(layers) == 1 else layers[0].out_features
            if rope is not False and out[0].in_features == width + mlp[0].out_features:
                return self._fused(hidden_states, encoder_hidden_states, temb, rope, eps, head_dim, norm, proj,
                                   mlp, out, width)
        return FluxSingleTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                                  joint_attention_kwargs)

    def _fused(self, hidden_states, encoder_hidden_states, temb, rope, eps, head_dim, norm, proj, mlp, out, width):
        o = torch_ops.ops_for(hidden_states, encoder_hidden_states, temb)
        s_txt = encoder_hidden_states.shape[1]
        x = c.joined(encoder_hidden_states, hidden_states)  # no copy where the previous block's halves come back
        shift, scale, gate = self.norm.linear(self.norm.silu(temb)).chunk(3, dim=1)
        b, s, _ = x.shape
        # proj_mlp writes its output straight into the buffer proj_out reads (no torch.cat). Where
        # it and the q / k / v layers quantize their input alike, the norm pass writes those codes
        # and every layer reads them; else the modulated activations are written once in the
        # model's dtype and the q / k / v layers share one quantization of them. proj_mlp runs
        # beside the attention's exchange under context parallelism (c.attention), else first.
        layers, kinds = proj
        buf = torch.empty((b, s, width + mlp[0].out_features), dtype=x.dtype, device=x.device)
        fmt = c.codes_format([*layers, mlp[0]], [*kinds, mlp[1]], x.shape[-1])
        n, n_scale = o.norm_modulate(x, scale, shift, ops.NORM_LAYER, eps, fmt)
        if fmt != c.NONE:
            def mlp_in():
                c.linear_codes_into(o, mlp[0], n, n_scale, buf[..., width:], c.GELU_TANH)

            qkv = [c.linear_codes(o, layer, n, n_scale, x.dtype) for layer in layers]
        else:
            def mlp_in():
                c.linear_into(o, *mlp, n, buf[..., width:], c.GELU_TANH)

            fmt = c.codes_format(layers, kinds, n.shape[-1]) if len(layers) > 1 else c.NONE
            if fmt != c.NONE:
                codes, codes_scale = o.quantize(n, fmt, c._ROW)
                codes = codes.view(*n.shape[:-1], codes.shape[-1])
                qkv = [c.linear_codes(o, layer, codes, codes_scale, n.dtype) for layer in layers]
                del codes, codes_scale
            else:
                qkv = [c.linear(o, layer, kind, n) for layer, kind in zip(layers, kinds)]
        q, k, v = c.split_qkv(qkv, head_dim)
        # v goes to the attention as its projection wrote it: one stream, nothing to join
        bufs = c.joint_buffers(x, b, s, q.shape[2], head_dim, count=2)
        c.write_heads(o, (q, k, None), norm, rope, bufs + [None], 0)
        del qkv, q, k
        c.copy_into(buf[..., :width], c.attention((*bufs, v), self.attn.processor, beside=mlp_in))
        del bufs, v, n, n_scale, mlp_in
        x = c.clip_fp16(c.gated(o, *out, buf, gate, x))
        return x[:, :s_txt], x[:, s_txt:]
