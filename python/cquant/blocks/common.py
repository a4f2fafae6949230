"""The pieces the fused block forwards are made of, and the checks that say when they apply.

A fused forward first asks, per call, whether every module it would step over is one whose
forward it reproduces (a plain torch.nn.Linear or cquant QuantizedLinear with no hooks, the
stock norms, the stock attention processor), whether the inputs are on a device libcquant runs
(the CPU, or a CUDA device its kernels support) in a float dtype, and whether no gradient is
wanted. Any "no" sends the call to the block's original forward, so results are never wrong.

Then it runs, per stream:
  modulate     norm + adaLN modulation in one pass (cquant::norm_modulate), writing the
               activation codes of the layers that read the result when they are dynamic-scheme
               QuantizedLinears sharing one per-row activation format (they then skip their own
               quantization pass), else the modulated activations in the model's dtype;
  project      the Q/K/V (or MLP) layers on those codes or activations;
  write_heads  Q/K norm + rotary embedding, writing each stream's rows of the joint
               [B, S_total, H, D] q / k / v tensors (cquant::qk_norm_rope): no torch.cat;
  attention    diffusers' dispatch_attention_fn with the processor's backend;
  gated        residual + gate * layer(x) in the layer's epilogue (cquant::linear_gated), or
               torch.addcmul for a float layer (one kernel either way).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.normalization import RMSNorm

from .. import ops, torch_ops, ulysses
from ..activation_fusion import LinearGELU
from ..device_fallback import device_refusal
from ..nn import PackedCodes, QuantizedLinear, QuantizedLinearSlice
from ..shared_activations import SCOPE_HOOKS

FLOAT = 1  # a torch.nn.Linear: F.linear
QUANT = 2  # a cquant QuantizedLinear: libcquant's linear ops
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GELU_TANH = ops.activation_id("gelu_tanh")
NONE = ops.FORMAT_NONE
_ROW = ops.GRANULARITIES["row"]
# Rows of activation codes fed to cq_linear_quantized: its CUDA kernels read them in 16-byte
# vectors (the same rule QuantizedLinear follows before it shares codes).
CODES_ALIGN = 16
_QUANT_TYPES = (QuantizedLinear, QuantizedLinearSlice)
_module_hooks = torch.nn.modules.module


def keep_name(cls):
    """Give a fused class its diffusers class's __name__ (see cquant/blocks/__init__.py) and its
    diffusers class's entry in diffusers' registry of transformer blocks."""
    cls.__name__ = cls._cquant_unfused.__name__
    _register_block_metadata(cls)
    return cls


def _register_block_metadata(cls):
    """Copy the entry of cls's diffusers class in diffusers' registry of transformer blocks, which
    its caching hooks (FirstBlockCache, ...) look up by exact class. Done as the class is made, so
    that a model whose blocks have it works with them in a process that unpickled it without
    calling cquant.optimize."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:
        return
    try:
        meta = TransformerBlockRegistry.get(cls._cquant_unfused)
    except ValueError:
        return
    try:
        TransformerBlockRegistry.get(cls)
    except ValueError:
        TransformerBlockRegistry.register(cls, dataclasses.replace(meta, _cls=None, _cached_parameter_indices=None))


def qk_norm_refusal(attn):
    """Why the Q/K norms of `attn` are not fused (only RMSNorm over the head dim, or none), or None."""
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(attn, name, None)
        if norm is not None and type(norm) not in (torch.nn.RMSNorm, RMSNorm):
            return f"its attention's {name} is {type(norm).__name__}; only RMSNorm (or none) is fused"
    return None


def layer_norm_refusal(**norms):
    """Why one of the named norms is not a LayerNorm without affine parameters, or None."""
    for name, norm in norms.items():
        if layer_norm_eps(norm) is None:
            return f"{name} is {type(norm).__name__} with affine parameters or of another kind; only LayerNorm " \
                   "without affine parameters is fused"
    return None


def sub(module, name):
    """module's submodule `name` or None, without nn.Module.__getattr__'s fallbacks (these checks
    run for every block of every call)."""
    return module._modules.get(name)


def global_hooks():
    """Whether torch has module hooks registered for every module (which a fused forward would skip)."""
    return bool(_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks)


def plain_module(mod):
    """No hooks on mod and no forward of its own instance (diffusers' hook registry sets one):
    calling its pieces directly is what calling it does."""
    return not (mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


def attention_module(attn):
    """Like plain_module, but the scope hooks of cquant.shared_activations are allowed (they only
    let the layers inside share codes, which the fused forward does itself)."""
    if "forward" in attn.__dict__:
        return False
    for hooks in (attn._forward_pre_hooks, attn._forward_hooks):
        for h in hooks.values():
            if h not in SCOPE_HOOKS:
                return False
    return True


_device_ok = {}  # torch.device -> bool
_BUILT_WITH_CUDA = ops.built_with_cuda()


def device_ok(device):
    """Whether libcquant's ops run on `device`: the CPU (its C references), or a CUDA device its
    kernels support (asked once per device). A trace cannot ask libcquant: while torch.compile
    traces, a CUDA device not asked yet counts as supported by a CUDA build, as QuantizedLinear
    assumes (optimize asks for the devices the model is on)."""
    ok = _device_ok.get(device)
    if ok is None:
        if device.type == "cpu":
            ok = True
        elif device.type != "cuda":
            ok = False
        elif torch.compiler.is_compiling():
            return _BUILT_WITH_CUDA
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            ok = device_refusal(index) is None
        _device_ok[device] = ok
    return ok


def inputs_ok(tensors, dtype, device):
    """The block's inputs (hidden states, text states, temb) have one batch size, `dtype` (a float
    dtype libcquant takes) and live on `device`, where libcquant runs."""
    if dtype not in DTYPES or not device_ok(device):
        return False
    batch = tensors[0].shape[0]
    for t in tensors:
        if t.dtype != dtype or t.device != device or t.shape[0] != batch:
            return False
    return True


def stream_inputs(block, fused_cls, kwargs, hidden_states, encoder_hidden_states, temb):
    """(dtype, device) where a two-stream block's call can take the fused path as far as its
    arguments tell: the block is exactly fused_cls (not a subclass), no extra attention kwargs
    and no global hooks, 3-D streams and a 2-D temb in one supported dtype on one device, no
    gradient to record; else None."""
    if type(block) is not fused_cls or kwargs or global_hooks():
        return None
    tensors = (hidden_states, encoder_hidden_states, temb)
    if hidden_states.ndim != 3 or encoder_hidden_states.ndim != 3 or temb.ndim != 2:
        return None
    dtype, device = hidden_states.dtype, hidden_states.device
    if not inputs_ok(tensors, dtype, device) or not no_grad_needed(block, tensors):
        return None
    return dtype, device


def no_grad_needed(module, tensors):
    """True unless autograd would record this call (the fused ops record no gradient)."""
    if not torch.is_grad_enabled():
        return True
    if any(t.requires_grad for t in tensors):
        return False
    return not any(p.requires_grad for p in module.parameters())


def dropout_off(mod):
    return type(mod) is torch.nn.Dropout and plain_module(mod) and (mod.p == 0 or not mod.training)


def linear_kind(layer, dtype, device, activation=None):
    """FLOAT or QUANT when `layer` is a plain torch.nn.Linear or QuantizedLinear (a view of a fused
    one included) computing in `dtype` on `device` with no hooks and, for QuantizedLinear, the
    fused activation `activation` (None or "gelu_tanh"); else 0 (the caller falls back)."""
    cls = type(layer)
    if cls is torch.nn.Linear:
        if activation is None and plain_module(layer):
            w = layer._parameters["weight"]
            if w.dtype == dtype and w.device == device:
                return FLOAT
        return 0
    if cls not in _QUANT_TYPES or layer.compute_dtype != dtype or layer.activation != activation:
        return 0
    if layer.scheme.lowrank_rank:
        return 0  # the ops below run the stored codes alone: the layer's forward adds the correction
    if not plain_module(layer):
        return 0
    w = layer._parameters["weight"] if cls is QuantizedLinear else layer.weight
    if w.device != device or w.dtype != layer._code_dtype or w.shape != layer._code_shape:
        return 0
    if w.is_cuda:
        index = w.get_device()
        if index != layer._kernel_device:
            layer._check_kernels(index)
        if layer._fallback:
            return 0
    return QUANT


def _quant_args(layer, dtype):
    w = layer.weight
    if type(w) is not torch.nn.Parameter and isinstance(w, PackedCodes):
        w = w.data  # a plain alias: every attribute of a Python subclass costs a torch-function check
    bias = layer.bias
    if bias is not None and bias.dtype not in (dtype, torch.float32):
        bias = bias.to(dtype)
    return w, layer.weight_scale, bias


def linear(o, layer, kind, x, act=0):
    """layer(x), with GELU (tanh) applied to its result when act is GELU_TANH."""
    if kind == QUANT:
        w, ws, b = _quant_args(layer, x.dtype)
        return o.linear(x, w, ws, b, *layer._c_args, layer.in_features, act, layer._group_size)
    y = F.linear(x, layer.weight, layer.bias)
    return F.gelu(y, approximate="tanh") if act else y


def linear_codes(o, layer, codes, scale, dtype, act=0):
    """layer(x) from the activation codes and per-row scales of x (cquant::linear_quantized)."""
    w, ws, b = _quant_args(layer, dtype)
    return o.linear_quantized(codes, scale, w, ws, b, *layer._c_args, layer.in_features, dtype, act, layer._group_size)


def linear_codes_into(o, layer, codes, scale, y, act=0):
    """Write layer(x) into y (a column slice) from the activation codes and per-row scales of x."""
    w, ws, b = _quant_args(layer, y.dtype)
    o.linear_quantized_out(codes, scale, w, ws, b, y, *layer._c_args, layer.in_features, act, layer._group_size)


def linear_into(o, layer, kind, x, y, act=0):
    """Write layer(x) (GELU'd if act) into y, a column slice of a wider contiguous tensor."""
    if kind == QUANT:
        w, ws, b = _quant_args(layer, x.dtype)
        o.linear_out(x, w, ws, b, y, *layer._c_args, layer.in_features, act, layer._group_size)
        return
    if torch.compiler.is_compiling():  # dynamo refuses non-contiguous out=; inductor fuses the copy anyway
        y.copy_(linear(o, layer, kind, x, act))
        return
    y2 = y.view(-1, y.shape[-1])  # rows one stride apart: a view, never a copy
    x2 = x.reshape(-1, x.shape[-1])
    if layer.bias is None:
        torch.mm(x2, layer.weight.t(), out=y2)
    else:
        torch.addmm(layer.bias, x2, layer.weight.t(), out=y2)
    if act:
        torch._C._nn.gelu_(y2, approximate="tanh")


def gated(o, layer, kind, x, gate, residual):
    """residual + gate[:, None, :] * layer(x): x [B, S, K] contiguous, gate [B, N] (a chunk of
    the modulation vector), residual [B, S, N]."""
    if kind == QUANT:
        w, ws, b = _quant_args(layer, x.dtype)
        return o.linear_gated(x, w, ws, b, gate, residual, *layer._c_args, layer.in_features, 0, layer._group_size)
    return torch.addcmul(residual, gate.unsqueeze(1), F.linear(x, layer.weight, layer.bias))


def codes_format(layers, kinds, width):
    """The activation format the `layers` (which all read one input of `width` features) can take
    as codes from norm_modulate: their shared per-row dynamic format, else FORMAT_NONE."""
    fmt = None
    for layer, kind in zip(layers, kinds):
        if kind != QUANT:
            return NONE
        _, _, af, ag = layer._c_args
        if af == NONE or ag != _ROW or (fmt is not None and af != fmt):
            return NONE
        fmt = af
    return NONE if fmt is None or width % CODES_ALIGN else fmt


def modulate(o, x, scale, shift, norm, eps, layers, kinds, act=0):
    """[layer(n) for layer in layers] with n = norm(x) * (1 + scale) + shift, rounded to x's
    dtype; n is made once, as the layers' codes where they take them (see codes_format)."""
    fmt = codes_format(layers, kinds, x.shape[-1])
    out, out_scale = o.norm_modulate(x, scale, shift, norm, eps, fmt)
    if fmt != NONE:
        return [linear_codes(o, layer, out, out_scale, x.dtype, act) for layer in layers]
    return [linear(o, layer, kind, out, act) for layer, kind in zip(layers, kinds)]


def joined(first, second):
    """torch.cat([first, second], dim=1) of [B, S1, D] and [B, S2, D]; where they are the two
    halves of one contiguous [B, S1 + S2, D] tensor (a fused Flux single block's outputs, handed
    unchanged to the next block), that tensor itself, without a copy. Only read from. Under
    torch.compile, torch.cat (the compiler plans the memory itself)."""
    if torch.compiler.is_compiling():
        return torch.cat([first, second], dim=1)
    b, s1, d = first.shape
    s = s1 + second.shape[1]
    if (second.shape[0] == b and second.shape[2] == d and first.dtype == second.dtype
            and first.device == second.device and first.stride() == (s * d, d, 1) == second.stride()
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and second.data_ptr() == first.data_ptr() + s1 * d * first.element_size()):
        return first.as_strided((b, s, d), (s * d, d, 1))
    return torch.cat([first, second], dim=1)


def _word_view(t, word):
    """t's bits as `word` integers (a view), or None where t's layout does not take them."""
    r = word.itemsize // t.element_size()
    if r <= 1 or t.stride(-1) != 1 or t.shape[-1] % r or t.storage_offset() % r:
        return None
    if any(st % r for st in t.stride()[:-1]):
        return None
    return t.view(word)


def copy_into(dst, src):
    """dst.copy_(src) where dst is a column slice of a wider tensor: bit for bit through 8- or
    4-byte integer views where both take them (torch's copy into a strided tensor moves one
    element a lane, so 16-bit rows move 4 or 2 elements a lane this way), a plain copy otherwise."""
    if dst.dtype == src.dtype and dst.shape == src.shape and not torch.compiler.is_compiling():
        for word in (torch.int64, torch.int32):
            d, s = _word_view(dst, word), _word_view(src, word)
            if d is not None and s is not None:
                d.copy_(s)
                return
    dst.copy_(src)


def split_qkv(outputs, head_dim):
    """q, k, v [B, S, H, head_dim] (views) from the outputs of a fused QKV layer or of three layers."""
    if len(outputs) == 1:
        outputs = outputs[0].chunk(3, dim=-1)
    return [t.unflatten(-1, (-1, head_dim)) for t in outputs]


def head_dim_ok(head_dim, device):
    return head_dim >= 1 and (device.type != "cuda" or head_dim <= ops.ATTENTION_MAX_HEAD_DIM)


def qk_norm(norm_q, norm_k, head_dim, dtype):
    """(rms_norm, q_weight, k_weight, eps) doing what norm_q / norm_k do to q / k [.., head_dim]:
    none, or RMSNorm over the head dim (torch's or diffusers', no bias, weights in `dtype` or
    none); None for any other pair."""
    if norm_q is None and norm_k is None:
        return False, None, None, 0.0
    q, k = _rms_args(norm_q, head_dim, dtype), _rms_args(norm_k, head_dim, dtype)
    if q is None or k is None or q[1] != k[1]:
        return None
    return True, q[0], k[0], q[1]


def _rms_args(norm, head_dim, dtype):
    cls = type(norm)
    if cls is torch.nn.RMSNorm:
        if tuple(norm.normalized_shape) != (head_dim,):
            return None
        eps = norm.eps if norm.eps is not None else torch.finfo(dtype).eps
    elif cls is RMSNorm:
        if tuple(norm.dim) != (head_dim,) or norm.bias is not None:
            return None
        eps = norm.eps
    else:
        return None
    w = norm.weight
    if not plain_module(norm) or w is not None and w.dtype != dtype:
        return None
    return w, float(eps)


def layer_norm_eps(norm):
    """eps of a torch.nn.LayerNorm without affine parameters (what norm_modulate computes), else None."""
    if type(norm) is not torch.nn.LayerNorm or norm.weight is not None or norm.bias is not None:
        return None
    if len(norm.normalized_shape) != 1 or not plain_module(norm):
        return None
    return float(norm.eps)


def continuous_norm(norm):
    """(norm kind, eps) of the norm of an AdaLayerNormContinuous (LayerNorm or diffusers' RMSNorm,
    without affine parameters), else None."""
    eps = layer_norm_eps(norm)
    if eps is not None:
        return ops.NORM_LAYER, eps
    if type(norm) is RMSNorm and norm.weight is None and norm.bias is None and plain_module(norm):
        return ops.NORM_RMS, float(norm.eps)
    return None


def adaln_zero(norm):
    """The LayerNorm eps of a diffusers AdaLayerNormZero-style module (silu -> linear -> chunk, then
    a LayerNorm without affine) the fused forward may split into its pieces, else None."""
    if not plain_module(norm) or sub(norm, "emb") is not None or type(sub(norm, "silu")) is not torch.nn.SiLU:
        return None
    return layer_norm_eps(sub(norm, "norm"))


def feed_forward(ff, dtype, device):
    """((first layer, kind), (second layer, kind)) of a diffusers FeedForward computing
    second(gelu_tanh(first(x))) with nothing else in between (dropout off), else None."""
    if type(ff) is not FeedForward or not plain_module(ff):
        return None
    net = sub(ff, "net")._modules
    if len(net) != 3 or not dropout_off(net["1"]):
        return None
    act = net["0"]
    proj = sub(act, "proj")
    if not plain_module(act) or proj is None:
        return None
    if type(act) is GELU:
        if act.approximate != "tanh":
            return None
        fused = None
    elif type(act) is LinearGELU:
        fused = act.__dict__["_fused"]
        if fused is not None and fused is not proj:
            return None  # replaced since fusion: its own forward unfuses first
        fused = "gelu_tanh" if fused is not None else None
    else:
        return None
    second = net["2"]
    k1 = linear_kind(proj, dtype, device, fused)
    k2 = linear_kind(second, dtype, device)
    if not (k1 and k2):
        return None
    return (proj, k1), (second, k2)


def mlp(o, ff, x, scale, shift, eps, gate, residual):
    """residual + gate * ff(norm(x) * (1 + scale) + shift), ff = feed_forward(...)'s layers."""
    (first, k1), (second, k2) = ff
    (h,) = modulate(o, x, scale, shift, ops.NORM_LAYER, eps, [first], [k1], GELU_TANH)
    return gated(o, second, k2, h, gate, residual)


# ---------------------------------------------------------------- rotary tables

_rope_cache = None  # (weak refs to the source tensors, key, (cos, sin))


def _tensor_key(t):
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.device, None if t.is_inference() else t._version)


def rope_tables(kind, sources):
    """(cos, sin) f32 [S, D / 2] for qk_norm_rope from diffusers' rotary embedding.

    kind "interleaved": sources = (cos, sin), each [S, D] with every value repeated twice (Flux's
    FluxPosEmbed, repeat_interleave_real): every other column. kind "complex": sources = complex
    frequencies [S, D / 2] (Qwen-Image's text, then image table), concatenated along S. Made
    once per forward: the blocks of one call share the last result, found again while the very
    same source tensors live unchanged (and never across the edge of a CUDA-graph capture). The
    result is dropped when a source tensor is freed, so no table outlives the call that made it
    (nor the model, on its device)."""
    global _rope_cache
    # Not cached while tracing, nor while a CUDA graph is captured: tables made in one graph's
    # memory pool must not be read by eager calls or other graphs.
    uncached = torch.compiler.is_compiling() or sources[0].is_cuda and torch.cuda.is_current_stream_capturing()
    if not uncached:
        key = (kind, tuple(_tensor_key(t) for t in sources))
        entry = _rope_cache
        if entry is not None and entry[1] == key and all(r() is t for r, t in zip(entry[0], sources)):
            return entry[2]
    if kind == "interleaved":
        cos, sin = (t[:, 0::2].float().contiguous() for t in sources)
    else:
        freqs = torch.cat(sources, dim=0) if len(sources) > 1 else sources[0]
        cos, sin = freqs.real.float().contiguous(), freqs.imag.float().contiguous()
    if not uncached:
        _rope_cache = None  # drop the old tables first
        refs = tuple(weakref.ref(t, _source_freed) for t in sources)
        _rope_cache = (refs, key, (cos, sin))
    return cos, sin


def _source_freed(ref):
    """Weak-reference callback: a source tensor of the cached tables is gone, and so are they."""
    global _rope_cache
    entry = _rope_cache
    if entry is not None and any(r is ref for r in entry[0]):
        _rope_cache = None


def clear_rope_cache():
    global _rope_cache
    _rope_cache = None


# ---------------------------------------------------------------- attention

def joint_buffers(like, batch, seq, heads, head_dim, count=3):
    """`count` empty tensors [B, S_total, H, D] (q, k, v) in like's dtype and device."""
    shape = (batch, seq, heads, head_dim)
    return [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(count)]


def write_heads(o, qkv, norm, rope, bufs, offset):
    """Rows [offset, offset + S) of the joint q, k, v buffers from one stream's q, k, v
    [B, S, H, D], Q/K-normed (norm = qk_norm(...)) and rotated (rope = (cos, sin) or None)."""
    q, k, v = qkv
    rms, wq, wk, eps = norm
    cos, sin = rope if rope is not None else (None, None)
    o.qk_norm_rope(q, k, v, wq, wk, cos, sin, bufs[0], bufs[1], bufs[2], rms, eps, offset)


def attention_backend(processor):
    """The backend diffusers' dispatcher gets for `processor`: its own where it has the attribute
    (the processors that go through the dispatcher), else native SDPA (what JointAttnProcessor2_0
    calls directly)."""
    if hasattr(type(processor), "_attention_backend"):
        return processor._attention_backend
    return AttentionBackendName.NATIVE


def attention(bufs, processor, mask=None, beside=None):
    """Attention over the joint q, k, v [B, S, H, D] through diffusers' dispatcher; returns
    [B, S, H * D] in q's dtype. beside(): work that does not need the attention (a block's MLP
    GEMM), run first, or under context parallelism while cquant's exchange moves q, k and v
    (ulysses.beside_exchange)."""
    q, k, v = bufs
    parallel_config = getattr(processor, "_parallel_config", None)
    if beside is not None and parallel_config is None:
        beside()
        beside = None
    with ulysses.beside_exchange(beside):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                    backend=attention_backend(processor), parallel_config=parallel_config)
    return out.flatten(2, 3).to(q.dtype)


def clip_fp16(t):
    """diffusers' guard against fp16 overflow at the end of a block."""
    return t.clip(-65504, 65504) if t.dtype == torch.float16 else t
