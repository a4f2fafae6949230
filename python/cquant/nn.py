"""cquant.nn.QuantizedLinear: a torch.nn.Linear whose weight is stored quantized.

How it passes for a linear layer (a deliberate choice, see README "Use with diffusers"):

* It is a torch.nn.Linear subclass with in_features / out_features, so code that looks for
  linear layers with isinstance(m, torch.nn.Linear) (diffusers' quantizer tests, PEFT's LoRA
  dispatch, QKV fusion) finds it.
* `weight` is a Parameter (requires_grad=False) holding the stored codes themselves, with their
  true shape and dtype: int8 [out, in] for int8, uint8 [out, in] for fp8 (raw e4m3 / e5m2
  bytes), uint8 [out, packed row bytes] for bit-packed fpX. Nothing pretends to be bfloat16, so
  get_memory_footprint() and tensor.nbytes are exact. num_parameters() counts one element per
  weight: the 8-bit codes are one element each, and packed fpX codes sit in a PackedCodes
  Parameter whose numel() is out_features * in_features (nelement() and nbytes stay the bytes). fp8 codes are kept as uint8 so
  that model.dtype (the first floating-point parameter, in diffusers and transformers) stays
  the compute dtype.
* `weight_scale` is a float32 buffer ([out] per output channel, or [1] per tensor), `bias` an
  ordinary Parameter in the compute dtype. All three are plain tensors: state_dict, .to(),
  deepcopy and pickling need nothing special. Two things the tensors alone do not say travel in
  the state_dict's metadata (STATE_DICT_SCHEME) and in the files of cquant.save_quantized /
  save_pretrained, not in a bare dict or safetensors.save_file: the scheme, which tells apart
  schemes of one storage (fp8 e4m3 / e5m2 bytes, fp6_e3m2 / fp6_e2m3 rows), and that the
  tensors are codes (a float model's load_state_dict(strict=False) would copy them as numbers).
* `compute_dtype` is the activation and output dtype (PEFT reads it to place adapters).
  .half() / .bfloat16() / .float() / .to(dtype) change it (and the bias), never the codes or
  the fp32 scales; .to(device) / .cuda() move everything. (diffusers and transformers refuse
  dtype casts of a model they know is quantized: load it in the dtype wanted instead.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import lowrank
from . import shared_activations as shared
from . import torch_ops  # registers torch.ops.cquant.* before any layer runs or is traced
from .configs import as_config
from .device_fallback import kernel_refusal
from .ops import activation_id
from .schemes import Scheme

__all__ = ["QuantizedLinear", "QuantizedLinearSlice", "PackedCodes", "COMPUTE_DTYPES", "finish_layers",
           "stored_tensors", "LOWRANK"]

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The buffers of a layer's low-rank correction (cquant.lowrank), in the compute dtype.
LOWRANK = ("lowrank_up", "lowrank_down")
# Key of the scheme name a QuantizedLinear writes into its state_dict's per-module metadata.
STATE_DICT_SCHEME = "cquant_scheme"


def stored_tensors(scheme, in_features, out_features, dtype=None):
    """{name: (shape, dtype)} of every tensor a quantized layer stores besides its bias: the codes
    ("weight"), the fp32 scales ("weight_scale") and, with a low-rank correction, its factors in
    the compute dtype `dtype` (None: any of COMPUTE_DTYPES, as a checkpoint may hold them)."""
    out = {"weight": ((out_features, scheme.row_bytes(in_features)), getattr(torch, scheme.code_dtype)),
           "weight_scale": (scheme.scale_shape(out_features, in_features), torch.float32)}
    r = scheme.lowrank_rank
    if r:
        out["lowrank_up"] = ((out_features, r), dtype)
        out["lowrank_down"] = ((r, in_features), dtype)
    return out


def unwritten_scales(scheme, scale):
    """None, or what is wrong with stored weight scales that cquant's quantizer never writes: a
    scale <= 0 or +inf (it writes positive finite ones, NaN only for groups of non-finite weights,
    which keeps them visible). Such scales come from an edited or damaged checkpoint and would
    give silently wrong outputs (negated, zero)."""
    s = scale.detach()
    if s.device.type == "meta" or s.dtype != torch.float32:
        return None
    if scheme.weight_format.scales_per_group == 2:
        s = s[..., 0]  # uint4: (scale, zero point) per group; any zero point is valid
    if scheme.weight_granularity == "two_level" and s.dim() == 2:
        s2 = s[:, 1:]  # the quantizer writes integer multipliers 1..16 (also for rows of non-finite weights)
        bad2 = ~((s2 >= 1) & (s2 <= 16) & (s2 == s2.round()))
        if int(bad2.sum()):
            return (f"{int(bad2.sum())} of its {s2.numel()} group multipliers are not integers in [1, 16] (e.g. "
                    f"{float(s2[bad2][0])}); cquant's quantizer writes only those")
        s = s[:, 0]
    bad = (s <= 0) | (s == float("inf"))
    count = int(bad.sum())
    if not count:
        return None
    return (f"{count} of its {s.numel()} scales are <= 0 or +inf (e.g. {float(s[bad][0])}); cquant's quantizer writes "
            "positive finite scales (NaN for groups of non-finite weights)")


def _as_scheme(scheme):
    if isinstance(scheme, Scheme):
        return scheme
    cfg = as_config(scheme, allow_mapping=False, what="scheme")
    return cfg.scheme()


def _check_compute_dtype(dtype, what):
    if dtype not in COMPUTE_DTYPES:
        raise TypeError(f"{what} must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def _fmt_mb(nbytes):
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.1f} kB"


def finish_layers(model):
    """Name each QuantizedLinear of `model` after its place in it (errors then name the layer) and
    give its attention modules the scopes in which layers share quantized activations
    (cquant.shared_activations). cquant.quantize.finish_ calls it on every quantized model."""
    for fqn, mod in model.named_modules():
        if isinstance(mod, QuantizedLinear):
            mod.__dict__["_name"] = fqn
    shared.install_scopes(model)
    return model


def _lowrank_factors(scheme, w, codes, scale, dtype, *, pad=False):
    """(lowrank_up, lowrank_down) of float weight w [N, K] quantized to (codes, scale), or None
    for a scheme without a low-rank correction. pad: a rank above min(N, K) is allowed (that of
    a fused q / k / v layer, the sum of its parts', requantized as one weight by a LoRA merge):
    min(N, K) components hold the whole error, and the factors are padded with zeros."""
    if not scheme.lowrank_rank:
        return None
    wf, wg = scheme.c_args[:2]
    wq = torch_ops.dequantize(codes, scale, wf, wg, int(w.shape[1]), torch.float32, scheme.weight_group_size)
    rank = scheme.lowrank_rank
    held = min(rank, *w.shape) if pad else rank
    up, down = lowrank.factors(w, wq, held, dtype)
    if held < rank:
        up = torch.cat([up, up.new_zeros(up.shape[0], rank - held)], 1)
        down = torch.cat([down, down.new_zeros(rank - held, down.shape[1])])
    return up, down


class PackedCodes(torch.nn.Parameter):
    """The Parameter holding bit-packed fpX codes [out_features, row bytes] (uint8), counting the
    weights it stands for.

    diffusers' and transformers' num_parameters() and PEFT's parameter counts add up
    param.numel() (and count bitsandbytes' 4-bit weights logically), so numel() answers
    out_features * in_features; nelement(), nbytes and get_memory_footprint() stay the stored
    bytes. in_features lives on one subclass per width (packed_codes_class), not on the tensor:
    loaders rebuild parameters as type(param)(data, requires_grad=...) (accelerate's
    set_module_tensor_to_device, Parameter.__deepcopy__), which keeps the class and drops any
    other state. state_dict() holds plain tensors; a pickle rebuilds through packed_codes.
    """

    in_features = None  # set by each per-width subclass

    def numel(self):
        return int(self.shape[0]) * self.in_features

    def __reduce_ex__(self, protocol):
        return (packed_codes, (self.data, self.requires_grad, self.in_features))


_PACKED_CLASSES = {}


def packed_codes_class(in_features):
    """The PackedCodes subclass of rows of in_features codes (made once per width)."""
    cls = _PACKED_CLASSES.get(in_features)
    if cls is None:
        cls = _PACKED_CLASSES[in_features] = type(f"PackedCodes{in_features}", (PackedCodes,),
                                                  {"in_features": in_features, "__module__": __name__})
    return cls


def packed_codes(data, requires_grad, in_features):
    """A PackedCodes parameter of rows of in_features codes (what pickles of one call)."""
    return packed_codes_class(in_features)(data, requires_grad)


class QuantizedLinear(torch.nn.Linear):
    """y = x W^T + b with W stored in a cquant scheme and run by libcquant's kernels.

    Args:
        in_features, out_features: the layer's logical shape (W is [out_features, in_features]).
        scheme: a Scheme, a config (Int8WeightOnlyConfig(), ...) or a name ("fp8dqrow").
        bias: whether the layer has a bias.
        device, dtype: where the (uninitialised) tensors live and the compute dtype
            (float32, float16 or bfloat16). Build from a float layer with `from_float`.
        activation: None, or "gelu_tanh" for y = gelu(x W^T + b, approximate="tanh") computed
            inside the kernel (cquant.fuse_activations_ sets it where a GELU follows the layer).

    Tensors: weight codes [out_features, scheme.row_bytes(in_features)] (int8 or uint8),
    weight_scale float32 [out_features] or [1], bias [out_features] in the compute dtype.
    forward takes x [..., in_features] in any float dtype (cast to the compute dtype) and returns
    [..., out_features] in the compute dtype.
    """

    _group_size = 0  # set per layer; the class default serves layers pickled before groups existed

    def __init__(self, in_features, out_features, scheme, bias=True, device=None, dtype=torch.bfloat16,
                 orig_dtype=None, activation=None):
        torch.nn.Module.__init__(self)
        self.activation = activation
        scheme = _as_scheme(scheme)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self._c_args = scheme.c_args[:4]  # (weight_format, weight_granularity, act_format, act_granularity)
        self._group_size = scheme.weight_group_size  # the linear ops' last argument (0: no groups)
        self.compute_dtype = _check_compute_dtype(dtype, "dtype")
        # dtype of the float layer the codes came from, for byte accounting in cquant.summary
        self.orig_dtype = orig_dtype if orig_dtype is not None else dtype
        self._set_layout(out_features)
        codes = torch.empty(self._code_shape, dtype=self._code_dtype, device=device)
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        for name, (shape, dt) in stored_tensors(scheme, in_features, out_features, dtype).items():
            if name != "weight":
                self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    # ------------------------------------------------------------ construction

    @classmethod
    def from_float(cls, linear, scheme, *, device=None, weight=None):
        """Quantize a torch.nn.Linear (float32 / float16 / bfloat16 weight) into a new QuantizedLinear.

        weight: the float weight to quantize instead of linear.weight (one arriving from a
        checkpoint while linear is still on the meta device). The codes are computed on
        `device` (default: where the weight is); only this layer's float weight is ever copied
        there. The new module's compute dtype is the weight's dtype; a bias still on the meta
        device stays a meta Parameter, to be loaded later.
        """
        scheme = _as_scheme(scheme)
        if not isinstance(linear, torch.nn.Linear) or isinstance(linear, QuantizedLinear):
            raise TypeError(f"from_float takes a float torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight if weight is None else weight
        if not isinstance(w, torch.Tensor) or w.dtype not in COMPUTE_DTYPES:
            raise TypeError(f"the linear layer's weight is {getattr(w, 'dtype', type(w).__name__)}; cquant quantizes "
                            "float32, float16 and bfloat16 layers")
        if w.device.type == "meta":
            raise ValueError("the linear layer's weight is on the meta device (not loaded); load or materialize it first")
        if tuple(w.shape) != (linear.out_features, linear.in_features):
            raise ValueError(f"weight shape {tuple(w.shape)} does not match Linear({linear.in_features}, "
                             f"{linear.out_features})")
        # normal tensors even under torch.inference_mode(): the layer must still run where autograd records
        with torch.inference_mode(False), torch.no_grad():
            src = w.detach().to(device) if device is not None else w.detach()
            codes, scale = torch_ops.quantize(src, *scheme.c_args[:2], scheme.weight_group_size)
            factors = _lowrank_factors(scheme, src, codes, scale, w.dtype)
            del src
        mod = cls.skeleton(linear, scheme, dtype=w.dtype)
        bias = linear.bias
        if bias is not None and bias.device.type != "meta":
            bias = bias.detach().to(codes.device)
        else:
            bias = None
        mod._set_tensors(codes, scale, bias, factors)
        return mod

    @classmethod
    def skeleton(cls, linear, scheme, *, dtype):
        """An empty QuantizedLinear on the meta device with linear's shape and bias presence, for
        stored tensors to be loaded into (compute dtype `dtype`)."""
        return cls(linear.in_features, linear.out_features, _as_scheme(scheme), bias=linear.bias is not None,
                   device="meta", dtype=dtype)

    def _set_layout(self, out_features):
        """What forward checks the stored tensors against, and the per-device state it keeps."""
        self._code_shape = (out_features, self.scheme.row_bytes(self.in_features))
        self._code_dtype = getattr(torch, self.scheme.code_dtype)
        self._forget_device()

    def _forget_device(self):
        # the CUDA device whose kernel support was checked (-1: none yet), whether this layer
        # runs the float fallback there, and that fallback's dequantized weight
        self._kernel_device = -1
        self._fallback = False
        self.__dict__.pop("_fallback_weight", None)

    def _set_tensors(self, codes, scale, bias, factors=None):
        """Install stored tensors (already checked by the caller or by _check_tensors); factors:
        (lowrank_up, lowrank_down) of a scheme with a low-rank correction."""
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.to(self.compute_dtype))
        if factors is not None:
            self.lowrank_up, self.lowrank_down = (f.to(self.compute_dtype) for f in factors)
        self._forget_device()

    def expected_shapes(self):
        """{name: (shape, dtype)} of the stored tensors (cquant.nn.stored_tensors in the compute dtype)."""
        return stored_tensors(self.scheme, self.in_features, self.out_features, self.compute_dtype)

    def __setattr__(self, name, value):
        # every way codes arrive (loaders, load_state_dict(assign=True), _set_tensors) assigns
        # a plain Parameter: packed rows become PackedCodes, which count logical weights
        if name == "weight" and type(value) is torch.nn.Parameter and "scheme" in self.__dict__ \
                and self.scheme.weight_format.packed:
            packed = packed_codes(value.data, value.requires_grad, self.in_features)
            packed.__dict__.update(value.__dict__)  # marks loaders set (transformers' _is_hf_initialized)
            value = packed
        super().__setattr__(name, value)

    # ------------------------------------------------------------ properties

    @property
    def activation(self):
        """The activation applied to the output inside the op: None or "gelu_tanh"."""
        return self.__dict__["_activation"]

    @activation.setter
    def activation(self, value):
        self.__dict__["_activation_id"] = activation_id(value)
        self.__dict__["_activation"] = None if value in (None, "none") else value

    @property
    def qdata(self):
        """The stored codes (the same tensor as `weight`)."""
        return self.weight

    @property
    def scale(self):
        """The fp32 scales (the same tensor as `weight_scale`)."""
        return self.weight_scale

    @property
    def nbytes(self):
        """Bytes the layer stores: codes, scales and bias."""
        n = self.weight.nbytes + self.weight_scale.nbytes
        if self.scheme.lowrank_rank:
            n += self.lowrank_up.nbytes + self.lowrank_down.nbytes
        return n + (self.bias.nbytes if self.bias is not None else 0)

    @property
    def nbytes_float(self):
        """Bytes of the float layer it replaced (weight and bias in the original dtype)."""
        item = torch.empty((), dtype=self.orig_dtype).element_size()
        return item * self.out_features * (self.in_features + (1 if self.bias is not None else 0))

    # ------------------------------------------------------------ compute

    def forward(self, x):
        w, w_scale, bias = self.weight, self.weight_scale, self.bias
        if type(w) is not torch.nn.Parameter and isinstance(w, PackedCodes):
            w = w.data  # a plain alias: every attribute of a Python subclass costs a torch-function check
        # A few attribute reads, so that nothing runs garbage: codes replaced through weight.data
        # (a LoRA merge that does not know the layer) or tensors never loaded (meta).
        if (w.dtype != self._code_dtype or w.shape != self._code_shape or w.is_meta or w_scale.is_meta
                or bias is not None and bias.is_meta):
            self._refuse_stored_tensors(w, w_scale, bias)
        # checked here, not only in libcquant: the error then names the layer and is raised in
        # Python rather than thrown through torch's dispatcher
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"{self._describe()} got x of shape {tuple(x.shape)}; expected [..., in_features = "
                             f"{self.in_features}]")
        if x.is_meta:  # else torch's dispatcher would answer with its fake kernel's meta tensor
            raise ValueError(f"{self._describe()} got x on the meta device; its stored tensors are on {w.device}")
        if x.dtype != self.compute_dtype:
            if not x.is_floating_point():
                raise TypeError(
                    f"{self._describe()} got {x.dtype} activations; it takes float tensors (computing in "
                    f"{self.compute_dtype}). If calling code cast its input to `layer.weight.dtype`: weight holds "
                    "the stored codes, use `layer.compute_dtype` instead.")
            x = x.to(self.compute_dtype)
        if bias is not None and bias.dtype not in (x.dtype, torch.float32):
            bias = bias.to(x.dtype)
        if w.is_cuda:
            device = w.get_device()
            if device != self._kernel_device:
                self._check_kernels(device)
            if self._fallback:
                return self._float_forward(x, w, w_scale, bias)
        wf, wg, af, ag = self._c_args
        ops = torch_ops.ops_for(x, bias)
        # a low-rank correction is added before the activation, so the op then runs without it
        act = 0 if self.scheme.lowrank_rank else self._activation_id
        if af and shared.scope.owners and shared.usable(x, bias) and not self.in_features % 16:
            qx, sx = shared.quantize(x, af, ag, ops.quantize)
            qx = qx.view(*x.shape[:-1], qx.shape[-1])
            y = ops.linear_quantized(qx, sx, w, w_scale, bias, wf, wg, af, ag, self.in_features, x.dtype, act,
                                     self._group_size)
        else:
            y = ops.linear(x, w, w_scale, bias, wf, wg, af, ag, self.in_features, act, self._group_size)
        return self._add_lowrank(x, y) if self.scheme.lowrank_rank else y

    def _add_lowrank(self, x, y):
        y = lowrank.apply(x, y, self.lowrank_up, self.lowrank_down)
        return F.gelu(y, approximate="tanh") if self._activation_id else y

    def _describe(self):
        name = self.__dict__.get("_name")
        where = f" {name!r}" if name else ""
        return f"QuantizedLinear{where} ({self.in_features} -> {self.out_features}, {self.scheme.name})"

    def _refuse_stored_tensors(self, w, w_scale, bias):
        for what, t in (("weight", w), ("weight_scale", w_scale), ("bias", bias)):
            if t is not None and t.is_meta:
                raise RuntimeError(f"{self._describe()}: its {what} is on the meta device (never loaded); load the "
                                   "checkpoint's tensors into the layer (load_state_dict, from_pretrained, "
                                   "cquant.load_quantized) before running it")
        raise RuntimeError(
            f"{self._describe()}: its weight holds {w.dtype} {tuple(w.shape)}, but {self.scheme.name} stores "
            f"{self._code_dtype} {self._code_shape}. Something replaced the stored codes (an assignment to "
            "weight.data, or a LoRA merge that does not know quantized layers); cquant merges PEFT adapters itself "
            "(merge_adapter, merge_and_unload, diffusers' fuse_lora): reload or requantize this layer")

    def _check_kernels(self, device):
        if torch.compiler.is_compiling():
            return  # checked on the first eager call; a trace cannot call libcquant's device queries
        self._fallback = kernel_refusal(device, self.scheme) is not None
        self._kernel_device = device

    def _float_forward(self, x, w, w_scale, bias):
        """The fallback on a device that cannot run this scheme's kernels (cquant.device_fallback):
        F.linear in the compute dtype with the dequantized weight, decoded once on the CPU."""
        key = (w.data_ptr(), w._version, x.dtype)
        cached = self.__dict__.get("_fallback_weight")
        if cached is None or cached[0] != key:
            wf, wg, _, _ = self._c_args
            with torch.no_grad():
                wd = torch_ops.dequantize(w.detach().cpu(), w_scale.detach().cpu(), wf, wg, self.in_features,
                                          torch.float32, self._group_size)
                if self.scheme.lowrank_rank:
                    wd += lowrank.weight(self.lowrank_up.cpu(), self.lowrank_down.cpu())
                wd = wd.to(device=w.device, dtype=x.dtype)
            self.__dict__["_fallback_weight"] = cached = (key, wd)
        y = F.linear(x, cached[1], bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype))
        return F.gelu(y, approximate="tanh") if self._activation_id else y

    @torch.no_grad()
    def dequantize(self, dtype=None):
        """The weight the layer computes with, as a float tensor [out_features, in_features] (dtype:
        the compute dtype by default): the decoded codes, plus the low-rank correction if any."""
        dtype = _check_compute_dtype(dtype or self.compute_dtype, "dtype")
        if not self.scheme.lowrank_rank:
            return self.dequantize_codes(dtype)
        w = self.dequantize_codes(torch.float32) + lowrank.weight(self.lowrank_up, self.lowrank_down)
        return w.to(dtype)

    @torch.no_grad()
    def dequantize_codes(self, dtype=None):
        """The decoded codes alone (no low-rank correction), [out_features, in_features] in dtype."""
        dtype = _check_compute_dtype(dtype or self.compute_dtype, "dtype")
        wf, wg, _, _ = self._c_args
        return torch_ops.dequantize(self.weight, self.weight_scale, wf, wg, self.in_features, dtype, self._group_size)

    @torch.no_grad()
    def to_float(self, dtype=None):
        """A torch.nn.Linear with the dequantized weight (and the bias), on the same device."""
        dtype = dtype or self.compute_dtype
        w = self.dequantize(dtype)
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype)
        lin.weight = torch.nn.Parameter(w)
        if self.bias is not None:
            lin.bias = torch.nn.Parameter(self.bias.detach().to(dtype).clone())
        return lin

    def reset_parameters(self):
        raise TypeError("QuantizedLinear holds quantized codes and cannot be re-initialised; initialise the float "
                        "torch.nn.Linear and quantize it with cquant.quantize_ or QuantizedLinear.from_float")

    # ------------------------------------------------------------ module plumbing

    def _apply(self, fn, recurse=True):
        # Device moves apply to everything; dtype casts (.half(), .to(torch.bfloat16), ...) change
        # the compute dtype and the bias but never the codes (not floating point) or the fp32 scales.
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight.device))
        new_dtype = probe.dtype if probe.is_floating_point() else self.compute_dtype
        if new_dtype != self.compute_dtype:
            _check_compute_dtype(new_dtype, "the new dtype of a QuantizedLinear")
        scale = self._buffers.get("weight_scale")

        def keep_scale_fp32(t):
            out = fn(t)
            if t is scale and out.dtype != torch.float32:
                out = t.to(device=out.device)
            return out

        super()._apply(keep_scale_fp32, recurse)
        weight = self._parameters.get("weight")
        if type(weight) is torch.nn.Parameter:  # a move torch could not make in place (to or from meta)
            self.weight = weight  # wrapped again as PackedCodes where the codes are packed
        self.compute_dtype = new_dtype
        self._forget_device()
        return self

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # codes of schemes with the same storage (fp6_e3m2 and fp6_e2m3, fp8 e4m3 and e5m2) are
        # told apart only by this note, which torch.save keeps and load_state_dict hands back
        meta = getattr(out, "_metadata", None)
        if meta is not None:
            meta.setdefault(prefix[:-1], {})[STATE_DICT_SCHEME] = self.scheme.name
        return out

    def _foreign_codes(self, local_metadata):
        """Why the codes of a state_dict whose metadata says another scheme cannot load here, or None."""
        said = local_metadata.get(STATE_DICT_SCHEME)
        if said is None or said == self.scheme.name:
            return None
        try:
            theirs = _as_scheme(said)
        except (TypeError, ValueError):
            return f"its codes are of scheme {said!r}, which this cquant does not know"
        ours = self.scheme
        if (theirs.weight_format.id, theirs.weight_granularity, theirs.weight_group_size) != \
                (ours.weight_format.id, ours.weight_granularity, ours.weight_group_size):
            return f"its codes are {theirs.name}, which decode differently from this layer's {ours.name}"
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A plain copy_ would convert between int8 / uint8 codes or fp32 / bf16 scales by value;
        # a checkpoint of another scheme must fail instead.
        rejected, converted = [], {}
        for name, (shape, dtype) in self.expected_shapes().items():
            t = state_dict.get(prefix + name)
            if name in LOWRANK and t is not None and t.dtype in COMPUTE_DTYPES and t.dtype != dtype:
                converted[prefix + name] = t = t.to(dtype)  # factors follow the compute dtype, as the bias
            if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != dtype):
                error_msgs.append(
                    f"{prefix}{name}: the checkpoint holds {t.dtype} {tuple(t.shape)}, but this {self.scheme.name} "
                    f"layer ({self.in_features} -> {self.out_features}) stores {dtype} {tuple(shape)}; was it saved "
                    "with another scheme or cquant format version?")
                rejected.append(prefix + name)
        t = state_dict.get(prefix + "weight_scale")
        problem = None if t is None or prefix + "weight_scale" in rejected else unwritten_scales(self.scheme, t)
        if problem:
            error_msgs.append(f"{prefix}weight_scale: {problem}; the checkpoint was edited or damaged")
            rejected.append(prefix + "weight_scale")
        foreign = self._foreign_codes(local_metadata)
        found = [prefix + n for n in self.expected_shapes() if prefix + n in state_dict and prefix + n not in rejected]
        if foreign is not None and found:
            error_msgs.append(f"{prefix}weight: {foreign} ({self.in_features} -> {self.out_features}); quantize the "
                              "float model with the scheme wanted, or load into a model of that scheme")
            rejected.extend(found)
        if rejected or converted:
            state_dict = {k: converted.get(k, v) for k, v in state_dict.items() if k not in rejected}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._forget_device()
        missing_keys[:] = [k for k in missing_keys if k not in rejected]

    def extra_repr(self):
        act = f", {self.activation}" if self.activation else ""
        r, g = self.scheme.lowrank_rank, self.scheme.weight_group_size
        kind = "two-level" if self.scheme.weight_granularity == "two_level" else "group"
        more = (f", {kind} {g}" if g else "") + (f", lowrank rank {r}" if r else "")
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}{more}{act}, {_fmt_mb(self.nbytes)}"


class QuantizedLinearSlice(QuantizedLinear):
    """Output rows [start, stop) of another QuantizedLinear, sharing its storage.

    The unfused q / k / v projections after cquant fuses them into one qkv layer: they still
    work (for unfuse_projections, or code that calls them), cost no memory, and are left out of
    state_dict, parameters() and get_memory_footprint() since the fused layer holds the data.
    """

    def __init__(self, source, start, stop):
        torch.nn.Module.__init__(self)
        if not isinstance(source, QuantizedLinear) or isinstance(source, QuantizedLinearSlice):
            raise TypeError(f"source must be a QuantizedLinear, got {type(source).__name__}")
        if not 0 <= start < stop <= source.out_features:
            raise ValueError(f"rows [{start}, {stop}) are not inside the source's {source.out_features} outputs")
        self.__dict__["_source"] = source  # a reference, not a submodule
        self.activation = None
        self.start, self.stop = start, stop
        self.in_features = source.in_features
        self.out_features = stop - start
        self.scheme = source.scheme
        self._c_args = source._c_args
        self._group_size = source._group_size
        self.orig_dtype = source.orig_dtype
        self._set_layout(self.out_features)

    @property
    def source(self):
        return self.__dict__["_source"]

    @property
    def compute_dtype(self):
        return self.source.compute_dtype

    @property
    def weight(self):
        return self.source.weight[self.start:self.stop]

    @property
    def weight_scale(self):
        s = self.source.weight_scale
        return s if self.scheme.weight_granularity == "tensor" else s[self.start:self.stop]

    @property
    def bias(self):
        b = self.source.bias
        return None if b is None else b[self.start:self.stop]

    @property
    def lowrank_up(self):
        return self.source.lowrank_up[self.start:self.stop]

    @property
    def lowrank_down(self):
        return self.source.lowrank_down

    @property
    def nbytes(self):
        return 0

    def _apply(self, fn, recurse=True):
        self._forget_device()
        return self  # the source layer owns (and moves) the storage

    def _load_from_state_dict(self, *args, **kwargs):
        return None

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}, rows {self.start}:{self.stop} of a fused layer"
