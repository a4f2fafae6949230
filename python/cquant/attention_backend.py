"""cquant's fused attention as a backend of diffusers' attention dispatcher.

After ``register_attention_backends()`` (done on ``import cquant`` once diffusers'
attention_dispatch is imported, and by ``enable_attention``)::

    transformer.set_attention_backend("cquant")        # full precision (bf16/fp16)
    transformer.set_attention_backend("cquant_int8")   # int8 QK^T, u8 x int8 PV
    cquant.enable_attention(transformer, "int8")       # the same, in one call

Calls the kernels do not take (an attention mask, dropout, causal masking, grouped-query
heads, float32 on CUDA, head dims that are not a multiple of 8 or above 256 on CUDA, 8-bit
on GPUs older than sm_89, a CPU-only build with CUDA tensors, and any other shape libcquant
refuses with NotImplementedError) go to diffusers' native SDPA backend instead, with a
warning once per reason. Empty batches and sequences give an empty result (out 0 where
there are queries but no keys, as SDPA does).

Context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(...))``):
both backends are registered with ``supports_context_parallel=True``. A call with
``_parallel_config`` runs diffusers' templated ring / Ulysses attention with cquant's op as
the attention of each shard; it returns the natural-log log-sum-exp ring attention merges
shards with. Under ring attention each shard of the 8-bit mode quantizes (and smooths) its
own block of keys and values. Under context parallelism:

- calls the kernels do not take (the list above) fall back to native attention under
  Ulysses; under ring attention they raise NotImplementedError, since diffusers' native
  backend gives no log-sum-exp and cannot run ring attention;
- a shard the kernels refuse at run time is computed by SDPA under Ulysses (with a
  warning) and raises NotImplementedError under ring attention;
- the backends are inference-only: the kernels have no backward pass, so backward through
  them (with or without context parallelism) raises an error naming cquant.

Pure Ulysses calls run cquant's own exchange (cquant.ulysses: fewer copies than the template,
through symmetric memory where the GPUs can map each other's memory, else NCCL all-to-alls in
head groups whose attention overlaps them; CQUANT_ULYSSES=auto, the default, takes the NCCL one
only under CUDA graph capture); everything else runs diffusers' templates.
"""

import functools
import inspect
import sys
import warnings

from . import ops, ulysses
from .attention import register_torch_op

BACKENDS = {"cquant": ("CQUANT", 0), "cquant_int8": ("CQUANT_INT8", 1)}
MAX_CUDA_HEAD_DIM = 256
INT8_ATTENTION_MIN_CC = 89

_warned = set()
_capability = {}


def _dispatch_module():
    loaded = sys.modules.get("diffusers.models.attention_dispatch")
    if loaded is not None and hasattr(loaded, "_AttentionBackendRegistry"):
        return loaded
    try:
        from diffusers.models import attention_dispatch
    except ImportError as e:
        raise RuntimeError("cquant's attention backend needs diffusers with models.attention_dispatch "
                           "(diffusers >= 0.35)") from e
    return attention_dispatch


def _enum_member(enum_cls, name, value):
    """The member `value` of diffusers' AttentionBackendName, added if missing (the enum is closed
    to subclassing, so the new member is entered in its tables the way Enum creates members)."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if hasattr(enum_cls, "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    # pickled as a call that registers cquant's backends first: by value, as Enum pickles its
    # members, it would not load in a process that has not imported cquant
    member.__reduce_ex__ = functools.partial(_reduce_member, value)
    return member


def _reduce_member(value, protocol):
    return _registered_member, (value,)


def _registered_member(value):
    """diffusers' AttentionBackendName member `value` ("cquant" or "cquant_int8"), registered."""
    register_attention_backends()
    return _dispatch_module().AttentionBackendName(value)


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"cquant attention: {reason}; using diffusers' native attention for these calls",
                      RuntimeWarning, stacklevel=3)


def _cuda_capability(torch, device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _capability.get(index)
    if cc is None:
        major, minor = torch.cuda.get_device_capability(index)
        cc = _capability[index] = major * 10 + minor
    return cc


def _unsupported(torch, mode, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """Why the kernels cannot take this call, or None."""
    if attn_mask is not None:
        return "attention masks are not supported"
    if dropout_p:
        return "dropout is not supported"
    if is_causal:
        return "causal attention is not supported"
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return "only [batch, seq, heads, head_dim] inputs are supported"
    if enable_gqa or key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        return "grouped-query attention (fewer key/value heads) is not supported"
    if value.shape[-1] != query.shape[-1]:
        return "a value head dim different from the query head dim is not supported"
    if not (query.dtype == key.dtype == value.dtype):
        return "q, k, v of different dtypes are not supported"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype} is not supported"
    if query.device.type == "cuda":
        d = query.shape[-1]
        if not ops.built_with_cuda():
            return "this cquant build has no CUDA kernels"
        if query.dtype == torch.float32:
            return "float32 on CUDA is not supported (bf16/fp16 only)"
        if d % 8 or d > MAX_CUDA_HEAD_DIM:
            return f"head dim {d} is not supported on CUDA (a multiple of 8 up to {MAX_CUDA_HEAD_DIM})"
        if mode == 1 and _cuda_capability(torch, query.device) < INT8_ATTENTION_MIN_CC:
            return "8-bit attention needs compute capability 8.9 or newer"
        if ("int8" if mode == 1 else "mma") in ops.settings()["attn_disabled"]:
            return f"the {'8-bit' if mode == 1 else 'mma.sync'} attention kernel is disabled by CQUANT_ATTN_DISABLE"
    elif query.device.type != "cpu":
        return f"device {query.device.type} is not supported"
    return None


def _templated_context_parallel(dispatch):
    """diffusers' templated ring / Ulysses attention, or None where this diffusers has none (or no
    `supports_context_parallel` keyword in its backend registry)."""
    templated = getattr(dispatch, "_templated_context_parallel_attention", None)
    registry = dispatch._AttentionBackendRegistry
    if templated is None or "supports_context_parallel" not in inspect.signature(registry.register).parameters:
        return None
    return templated


def _ring_degree(parallel_config):
    cp = getattr(parallel_config, "context_parallel_config", None)
    return getattr(cp, "ring_degree", 1) or 1


def _backward_op(ctx, grad_out, *args, **kwargs):
    """The templates' backward op: the kernels are forward-only."""
    raise NotImplementedError("cquant attention has no backward pass: the 'cquant' and 'cquant_int8' attention "
                              "backends are inference-only (with or without context parallelism); train with "
                              "another attention backend")


def _runner(op, mode):
    """cquant's torch op on [B, S, H, D] query, key, value in `mode`, the scale defaulting to
    1/sqrt(head_dim): (out, lse [B, H, Sq] when return_lse)."""

    def run(query, key, value, scale, return_lse):
        op_scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
        return op(query, key, value, op_scale, mode, bool(return_lse), 0, 0)

    return run


def _shard_forward_op(torch, op, mode):
    """The forward op diffusers' context-parallel templates call on each shard: (out [B, S, H, D],
    lse [B, S, H] fp32, natural log) with return_lse, else out. The backend function hands the
    templates no mask, no dropout, no causal masking and no GQA, so those arguments are unused."""
    run = _runner(op, mode)

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if _save_ctx and ctx is not None:
            # the ring template's backward unpacks these before it calls the backward op; without
            # them training would stop at an unrelated unpacking error instead of _backward_op's
            ctx.save_for_backward(query, key, value)
        if torch.compiler.is_compiling():  # no try under tracing: the kernels take what reaches here
            out, lse = run(query, key, value, scale, return_lse)
        else:
            try:
                out, lse = run(query, key, value, scale, return_lse)
            except NotImplementedError as e:
                reason = f"the kernels refuse a context-parallel shard ({str(e).splitlines()[0]})"
                if return_lse:  # ring attention merges shards by their log-sum-exp, which SDPA does not give
                    raise NotImplementedError(f"cquant attention: {reason}, and no fallback gives the log-sum-exp "
                                              f"asked for (ring attention merges shards with it)") from e
                _warn_once(reason)
                q, k, v = (t.transpose(1, 2) for t in (query, key, value))
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
        # the templates take lse in the model layout [batch, seq_q, heads]
        return (out, lse.transpose(1, 2)) if return_lse else out

    return forward_op


def _make_backend(mode, native, templated):
    import torch

    op = register_torch_op()
    native_args = set(inspect.signature(native).parameters)
    forward_op = _shard_forward_op(torch, op, mode)
    run = _runner(op, mode)

    def shard(q, k, v, scale, return_lse):
        return forward_op(None, q, k, v, scale=scale, return_lse=return_lse, _save_ctx=False)

    def cquant_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False, return_lse=False, _parallel_config=None):
        def fall_back(reason):
            if _parallel_config is not None and _ring_degree(_parallel_config) > 1:
                # diffusers' native forward op refuses return_lse, which every ring step asks for
                raise NotImplementedError(f"cquant attention: {reason}, and ring attention cannot fall back to "
                                          f"diffusers' native backend (it gives no log-sum-exp); use Ulysses "
                                          f"(ulysses_degree) or another attention backend for these calls")
            _warn_once(reason)
            kwargs = dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                          _parallel_config=_parallel_config)
            return native(**{k: v for k, v in kwargs.items() if k in native_args})

        reason = _unsupported(torch, mode, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if reason is None and _parallel_config is not None and templated is None:
            reason = "this diffusers has no templated context-parallel attention"
        if reason is not None:
            return fall_back(reason)
        if _parallel_config is not None:
            if ulysses.selected(torch):  # CQUANT_ULYSSES: the exchange without diffusers' copies
                u = ulysses.group_of(torch, _parallel_config, query, key)
                taken = None if u is None else ulysses.attention(shard, query, key, value, scale, bool(return_lse), *u)
                if taken is not None:
                    return taken
            return templated(query, key, value, None, 0.0, False, scale, False, bool(return_lse),
                             forward_op=forward_op, backward_op=_backward_op, _parallel_config=_parallel_config)
        if torch.compiler.is_compiling():
            out, lse = run(query, key, value, scale, return_lse)
        else:
            try:
                out, lse = run(query, key, value, scale, return_lse)
            except NotImplementedError as e:  # the kernels refuse this call (libcquant says why)
                return fall_back(f"the kernels refuse it ({str(e).splitlines()[0]})")
        # diffusers' backends give lse as [batch, seq_q, heads]
        return (out, lse.transpose(1, 2)) if return_lse else out

    cquant_attention.__name__ = "cquant_attention" if mode == 0 else "cquant_int8_attention"
    return cquant_attention


def register_attention_backends():
    """Register "cquant" and "cquant_int8" with diffusers' attention dispatcher (idempotent)."""
    dispatch = _dispatch_module()
    names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
    native = registry._backends[names.NATIVE]
    templated = _templated_context_parallel(dispatch)
    cp = {"supports_context_parallel": True} if templated is not None else {}
    for value, (name, mode) in BACKENDS.items():
        member = _enum_member(names, name, value)
        if member not in registry._backends:
            registry.register(member, constraints=[], **cp)(_make_backend(mode, native, templated))
    return [names(v) for v in BACKENDS]


def _backend_member(mode):
    """diffusers' AttentionBackendName member of cquant's backend in libcquant mode `mode`."""
    dispatch = _dispatch_module()
    register_attention_backends()
    return dispatch.AttentionBackendName("cquant_int8" if mode == 1 else "cquant")


def _backend_fn(mode):
    return _dispatch_module()._AttentionBackendRegistry._backends[_backend_member(mode)]


class _CQuantProcessor:
    """What cquant's attention processors share: attention of q, k, v in [batch, seq, heads,
    head_dim] (the layout the kernels read, so no transposes) by cquant's backend function, which
    sends calls the kernels do not take (a mask) to diffusers' native attention.

    Like diffusers' own processors they carry `_attention_backend`, which the model's
    set_attention_backend / reset_attention_backend change: "cquant" or "cquant_int8" picks the
    mode; any other backend (or none) runs the diffusers processor this one replaces, which is
    what that layer computes without cquant."""

    def __init__(self, mode="bf16"):
        from .attention import mode_id

        self._attention_backend = _backend_member(mode_id(mode))

    @property
    def mode(self):
        """"bf16" or "int8" while a cquant backend is set, else None (the diffusers processor runs)."""
        value = getattr(self._attention_backend, "value", None)
        return {"cquant": "bf16", "cquant_int8": "int8"}.get(value)

    def _stock(self):
        """The diffusers processor this one replaces, made when a backend other than cquant's is set."""
        if self.mode is not None:
            return None
        from diffusers.models import attention_processor

        return getattr(attention_processor, self.replaces)()

    @staticmethod
    def _mask(attn, attention_mask, sequence_length, batch_size):
        if attention_mask is None:
            return None
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        return attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

    @staticmethod
    def _heads(attn, batch_size, query, key, value):
        """[batch, seq, heads * head_dim] projections -> [batch, seq, heads, head_dim], norm_q and
        norm_k applied (they normalize the last dim, so the layout does not change them)."""
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch_size, -1, attn.heads, head_dim) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        return query, key, value

    def _attend(self, attn, query, key, value, attention_mask):
        """Attention, heads merged back, output projection and its dropout."""
        batch_size, _, heads, head_dim = query.shape
        # the member is registered (by __init__ / __setstate__): a lookup, no registration per call
        backend = _dispatch_module()._AttentionBackendRegistry._backends[self._attention_backend]
        hidden_states = backend(query, key, value, attn_mask=attention_mask)
        hidden_states = hidden_states.reshape(batch_size, -1, heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class CQuantAttnProcessor(_CQuantProcessor):
    """diffusers' AttnProcessor2_0 with its scaled_dot_product_attention replaced by cquant's
    attention, for models whose Attention layers do not go through the dispatcher (PixArt and
    other BasicTransformerBlock models)."""

    replaces = "AttnProcessor2_0"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        stock = self._stock()
        if stock is not None:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (hidden_states.shape if encoder_hidden_states is None
                                          else encoder_hidden_states.shape)
        attention_mask = self._mask(attn, attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        query, key, value = self._heads(attn, batch_size, query, key, value)
        hidden_states = self._attend(attn, query, key, value, attention_mask)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class CQuantCogVideoXAttnProcessor(_CQuantProcessor):
    """diffusers' CogVideoXAttnProcessor2_0 (CogVideoX, CogView3Plus, ConsisID) with cquant's
    attention: joint attention over the text tokens followed by the video tokens, the rotary
    embedding on the video tokens only. fused=True stands for FusedCogVideoXAttnProcessor2_0,
    the same processor with one to_qkv projection (fuse_qkv_projections)."""

    def __init__(self, mode="bf16", fused=False):
        super().__init__(mode)
        self.fused = bool(fused)

    @property
    def replaces(self):
        return "FusedCogVideoXAttnProcessor2_0" if self.fused else "CogVideoXAttnProcessor2_0"

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        import torch

        stock = self._stock()
        if stock is not None:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch_size, sequence_length, _ = hidden_states.shape
        # diffusers' fused processor prepares masks for the text length (only masks see it): copied,
        # so that each processor computes what the one it replaces does
        attention_mask = self._mask(attn, attention_mask, text_seq_length if self.fused else sequence_length,
                                    batch_size)
        if self.fused:
            qkv = attn.to_qkv(hidden_states)
            query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = self._heads(attn, batch_size, query, key, value)
        if image_rotary_emb is not None:  # on the video tokens, which follow the text tokens
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, text_seq_length:] = apply_rotary_emb(query[:, text_seq_length:], image_rotary_emb,
                                                          sequence_dim=1)
            if not attn.is_cross_attention:
                key[:, text_seq_length:] = apply_rotary_emb(key[:, text_seq_length:], image_rotary_emb,
                                                            sequence_dim=1)
        hidden_states = self._attend(attn, query, key, value, attention_mask)
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1)
        return hidden_states, encoder_hidden_states


# diffusers' processors (attention_processor.<name>) that call SDPA themselves -> cquant's counterpart
_ROUTES = {
    "AttnProcessor2_0": lambda mode: CQuantAttnProcessor(mode),
    "CogVideoXAttnProcessor2_0": lambda mode: CQuantCogVideoXAttnProcessor(mode),
    "FusedCogVideoXAttnProcessor2_0": lambda mode: CQuantCogVideoXAttnProcessor(mode, fused=True),
}


def enable_attention(model, mode="bf16"):
    """Route the attention of a diffusers model through cquant: mode "bf16" (full precision in
    the model's dtype) or "int8". Layers that use diffusers' dispatcher get the "cquant" /
    "cquant_int8" backend (set_attention_backend); Attention layers with diffusers'
    AttnProcessor2_0 get CQuantAttnProcessor, those with CogVideoXAttnProcessor2_0 or its fused
    variant CQuantCogVideoXAttnProcessor; cquant's own processors are made again in the new mode.
    Only this model changes: diffusers' process-wide default backend stays as it was. Warns about
    layers left as they were. `model` may also be a pipeline: its .transformer is routed, as
    cquant.optimize takes one. Returns what it was given."""
    from .attention import mode_id

    m = mode_id(mode)
    given = model
    if not hasattr(model, "set_attention_backend"):
        model = getattr(model, "transformer", None)
    if not hasattr(model, "set_attention_backend"):
        raise TypeError(f"enable_attention needs a diffusers model with set_attention_backend or a pipeline "
                        f"with such a .transformer, got {type(given).__name__}")
    register_attention_backends()
    # diffusers' set_attention_backend also makes the backend the process-wide default, which every
    # other model's layers without a backend of their own would then run: keep the default as it was
    registry = _dispatch_module()._AttentionBackendRegistry
    default = registry._active_backend
    try:
        model.set_attention_backend("cquant_int8" if m == 1 else "cquant")
    finally:
        registry.set_active_backend(default)
    from diffusers.models import attention_processor

    stock = {getattr(attention_processor, name): name for name in _ROUTES}
    made, kept = {}, {}
    for module in model.modules():
        if not isinstance(module, attention_processor.Attention):
            continue
        current = module.processor
        ours = type(current) in (CQuantAttnProcessor, CQuantCogVideoXAttnProcessor)  # a new mode
        name = current.replaces if ours else stock.get(type(current))
        if name is not None:
            if name not in made:
                made[name] = _ROUTES[name](mode)  # one processor per kind, shared by its layers
            module.set_processor(made[name])
        elif not hasattr(current, "_attention_backend"):
            kept[type(current).__name__] = kept.get(type(current).__name__, 0) + 1
    if kept:
        warnings.warn("cquant attention: layers with these processors keep their own attention: "
                      + ", ".join(f"{name} ({n})" for name, n in kept.items()), RuntimeWarning, stacklevel=2)
    if not any(hasattr(module, "processor") and hasattr(module, "set_processor") for module in model.modules()):
        warnings.warn(f"cquant.enable_attention: {type(model).__name__} has no attention layer; nothing was changed",
                      RuntimeWarning, stacklevel=2)
    return given


def routed_layers(model):
    """{attention module: mode} of the layers whose cquant processor runs a cquant mode now."""
    routed = {}
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, _CQuantProcessor) and processor.mode is not None:
            routed[module] = processor.mode
    return routed


def reroute(routed):
    """Give the layers of routed_layers(...) whose processor diffusers has since replaced (its
    fuse_qkv_projections sets fused ones) cquant's counterpart of the new processor, in the
    mode they had; warn about those whose new processor has none."""
    from diffusers.models import attention_processor

    stock = {getattr(attention_processor, name): name for name in _ROUTES}
    made, kept = {}, {}
    for module, mode in routed.items():
        current = module.processor
        if isinstance(current, _CQuantProcessor):
            continue
        name = stock.get(type(current))
        if name is None:
            kept[type(current).__name__] = kept.get(type(current).__name__, 0) + 1
            continue
        if (name, mode) not in made:
            made[name, mode] = _ROUTES[name](mode)
        module.set_processor(made[name, mode])
    if kept:
        warnings.warn("cquant attention: diffusers gave layers that ran cquant's attention processors cquant has "
                      "no counterpart of; they run their own attention now: "
                      + ", ".join(f"{name} ({n})" for name, n in kept.items()), RuntimeWarning, stacklevel=3)


def install_import_hooks():
    """Register the torch op once torch is imported and the diffusers backends once diffusers'
    dispatcher is, whichever of them and cquant comes first."""
    from ._import_hooks import after_import

    after_import("torch", register_torch_op)
    after_import("diffusers.models.attention_dispatch", register_attention_backends)
