"""Arguments the array ops cannot read from their inputs (K of padded fpX rows) and torch views
whose lazy negation DLPack would drop: checked or resolved, never silently wrong."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
from cquant import _C, ops, torch_ops  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402


def _same_row_bytes(fmt):
    """(k1, k2): two column counts whose packed rows take the same bytes."""
    for k in range(16, 256):
        for k2 in range(k + 1, k + 64):
            if ops.packed_row_bytes(fmt, k) == ops.packed_row_bytes(fmt, k2):
                return k, k2
    raise AssertionError(f"no padding in {fmt}")


def test_packed_linear_requires_in_features():
    k1, k2 = _same_row_bytes("fp6_e3m2")
    qw, sw = ops.quantize(torch.randn(8, k1), "fp6_e3m2")
    x = torch.randn(3, k2)  # K of another layer whose packed rows are as long
    with pytest.raises(ValueError, match="in_features is required"):
        ops.linear(x, qw, sw, weight_format="fp6_e3m2")
    with pytest.raises(ValueError, match="in_features"):
        ops.linear(x, qw, sw, weight_format="fp6_e3m2", in_features=k1)
    for bad, exc in ((0, ValueError), (-3, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(exc, match="in_features"):
            ops.linear(x, qw, sw, weight_format="fp6_e3m2", in_features=bad)
    y = ops.linear(x[:, :k1].contiguous(), qw, sw, weight_format="fp6_e3m2", in_features=np.int64(k1))
    assert y.shape == (3, 8)


def test_dequantize_checks_cols():
    k1, k2 = _same_row_bytes("fp4_e2m1")
    q, s = ops.quantize(torch.randn(5, k1), "fp4_e2m1")
    with pytest.raises(ValueError, match="cols is required"):
        ops.dequantize(q, s, "fp4_e2m1", out=torch.empty(5, k2))  # out's width is not q's
    for bad, exc in ((0, ValueError), (-1, ValueError), (False, TypeError), ("8", TypeError)):
        with pytest.raises(exc, match="cols"):
            ops.dequantize(q, s, "fp4_e2m1", cols=bad)
    with pytest.raises(ValueError, match="q has .* per row"):
        ops.dequantize(q, s, "fp4_e2m1", cols=k1 + 200)
    with pytest.raises(ValueError, match="out has shape"):
        ops.dequantize(q, s, "fp4_e2m1", cols=k1, out=torch.empty(5, k2))
    qi, si = ops.quantize(torch.randn(5, 40), "int8")
    with pytest.raises(ValueError, match="q has 40 codes per row"):
        ops.dequantize(qi, si, "int8", cols=41)
    assert ops.dequantize(q, s, "fp4_e2m1", cols=k1).shape == (5, k1)


@pytest.mark.raises_in_torch_op
def test_dequantize_op_checks_cols():
    q, s = ops.quantize(torch.randn(5, 64), "fp4_e2m1")
    with pytest.raises(ValueError, match="cols"):
        torch_ops.dequantize(q, s, ops.format_info("fp4_e2m1").id, ops.GRANULARITIES["row"], 0, torch.float32)


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("cols", [63, 2**40, 2**62])
def test_dequantize_op_checks_cols_against_q_before_allocating(cols):
    """cols that q's rows do not hold is refused by name before the result is allocated (a
    [rows, 2**62] float32 result was torch's allocation error, [rows, 2**40] terabytes asked for)."""
    q, s = ops.quantize(torch.randn(5, 64), "int8")
    with pytest.raises(ValueError, match="cols"):
        torch_ops.dequantize(q, s, ops.format_info("int8").id, ops.GRANULARITIES["row"], cols, torch.float32)


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("op", ["quantize", "linear", "linear_out", "linear_gated", "linear_quantized", "dequantize",
                                "attention"])
def test_torch_ops_refuse_scalars_by_name(op):
    """A 0-dim tensor where an op reads rows is a ValueError naming it, not an IndexError from
    inside the op (attention: a tensor of another rank than 4)."""
    i8, row = ops.format_info("int8").id, ops.GRANULARITIES["row"]
    x, w = torch.randn(5, 64), ops.quantize(torch.randn(8, 64), "int8")
    scalar, codes = torch.zeros(()), torch.zeros((), dtype=torch.int8)
    calls = {
        "quantize": lambda: torch.ops.cquant.quantize(scalar, i8, row),
        "linear": lambda: torch.ops.cquant.linear(scalar, *w, None, i8, row, 0, row, 64),
        "linear_out": lambda: torch.ops.cquant.linear_out(x, codes, w[1], None, torch.empty(5, 8), i8, row, 0, row, 64),
        "linear_gated": lambda: torch.ops.cquant.linear_gated(x, codes, w[1], None, torch.ones(1, 8), torch.zeros(5, 8),
                                                              i8, row, 0, row, 64),
        "linear_quantized": lambda: torch.ops.cquant.linear_quantized(codes, torch.ones(1), *w, None, i8, row, i8, row,
                                                                      64, torch.float32),
        "dequantize": lambda: torch.ops.cquant.dequantize(codes, torch.ones(1), i8, row, 4, torch.float32),
        "attention": lambda: torch.ops.cquant.attention(torch.randn(5, 2, 16), torch.randn(7, 2, 16),
                                                        torch.randn(7, 2, 16), 0.25, 0, False, 0, 0),
    }
    with pytest.raises(ValueError, match=r"\b(x|w|x_codes|q|k|v) has"):
        calls[op]()


def _neg(t):
    """A view reading as -t through a lazy negative bit (what .conj().imag and friends make)."""
    v = torch._neg_view(-t)
    assert v.is_neg() and torch.equal(v, t)
    return v


def test_negative_views_are_read_as_they_read_in_torch(seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 64, generator=g), torch.randn(48, 64, generator=g)
    q, s = ops.quantize(x, "int8")
    qn, sn = ops.quantize(_neg(x), "int8")
    assert torch.equal(q, qn) and torch.equal(s, sn)
    qw, sw = ops.quantize(w, "fp8_e4m3")
    y = ops.linear(x, qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3", bias=w[:, 0].contiguous())
    assert torch.equal(ops.linear(_neg(x), qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3",
                                  bias=_neg(w[:, 0].contiguous())), y)
    assert torch.equal(ops.dequantize(qw, _neg(sw), "fp8_e4m3"), ops.dequantize(qw, sw, "fp8_e4m3"))


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
@pytest.mark.parametrize("grad", [False, True])
def test_layer_reads_negative_views(scheme, grad, seed):
    """Both ways into the op: the direct call (no_grad) and torch's dispatcher (grad mode)."""
    g = torch.Generator().manual_seed(seed)
    layer = QuantizedLinear.from_float(torch.nn.Linear(64, 32), scheme)
    x = torch.randn(3, 64, generator=g)
    with torch.set_grad_enabled(grad):
        assert torch.equal(layer(_neg(x)), layer(x))


def test_negative_outputs_are_refused():
    x = torch.randn(4, 32)
    q, s = ops.quantize(x, "int8")
    with pytest.raises(ValueError, match="out is a torch view with a lazy negative bit"):
        ops.dequantize(q, s, "int8", out=_neg(torch.zeros(4, 32)))
    with pytest.raises(ValueError, match="scale_out"):
        ops.quantize(x, "int8", scale_out=_neg(torch.ones(4)))
    with pytest.raises(ValueError, match="out is a torch view"):
        ops.linear(x, q[:, :32], s, weight_format="int8", out=_neg(torch.zeros(4, 4)))


def test_attention_reads_negative_views_and_refuses_negative_outputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=g) for _ in range(3))
    ref = cquant.attention(q, k, v)
    assert torch.equal(cquant.attention(_neg(q), _neg(k), _neg(v)), ref)  # the torch op
    out = torch.empty_like(q)
    cquant.attention(_neg(q), _neg(k), _neg(v), out=out)  # the array path
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="out is a torch view"):
        cquant.attention(q, k, v, out=_neg(torch.zeros(1, 5, 2, 16)))


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("op", ["linear", "linear_out", "linear_gated", "linear_quantized"])
@pytest.mark.parametrize("bad", ["weight_format", "activation", "in_features", "no_features", "w_scale", "bias"])
def test_empty_linear_calls_check_their_arguments(op, bad):
    """With no rows nothing is computed, yet a scheme, activation, K, weight scales or bias that
    libcquant refuses is refused as well; x with no features (K = 0) gave rows nothing wrote
    (uninitialised memory)."""
    i8, row = ops.format_info("int8").id, ops.GRANULARITIES["row"]
    w, ws = ops.quantize(torch.randn(8, 64), "int8")
    ws = torch.ones(77) if bad == "w_scale" else ws
    bias = torch.ones(3) if bad == "bias" else None
    rows, k = (5, 0) if bad == "no_features" else (0, 63 if bad == "in_features" else 64)
    x = torch.zeros(rows, k)
    wf, act, k_arg = (9999 if bad == "weight_format" else i8), (7 if bad == "activation" else 0), (
        0 if bad == "no_features" else 64)
    args = (wf, row, i8 if op == "linear_quantized" else 0, row, k_arg)
    calls = {
        "linear": lambda: torch.ops.cquant.linear(x, w, ws, bias, *args, act),
        "linear_out": lambda: torch.ops.cquant.linear_out(x, w, ws, bias, torch.empty(rows, 8), *args, act),
        "linear_gated": lambda: torch.ops.cquant.linear_gated(x, w, ws, bias, torch.ones(1, 8), torch.zeros(rows, 8),
                                                              *args, act),
        "linear_quantized": lambda: torch.ops.cquant.linear_quantized(x.to(torch.int8), torch.ones(max(rows, 1)), w, ws,
                                                                      bias, *args, torch.float32, act),
    }
    with pytest.raises(ValueError, match={"weight_format": "weight_format", "activation": "activation",
                                          "in_features": "in_features", "no_features": "no features",
                                          "w_scale": "w_scale has 77", "bias": "bias has 3"}[bad]):
        calls[op]()


@pytest.mark.raises_in_torch_op
def test_empty_quantize_checks_its_arguments_and_gives_the_documented_tensor_scale():
    """An x with no rows: the per-tensor scale is the documented one of amax 0 (it came back as
    uninitialised memory) and bad arguments are refused as for any batch."""
    i8, tensor = ops.format_info("int8").id, ops.GRANULARITIES["tensor"]
    for _ in range(3):
        torch.full((1 << 16,), 12345.0)  # leave garbage in memory torch may hand out next
        q, s = torch.ops.cquant.quantize(torch.zeros(0, 8), i8, tensor)
        assert q.shape == (0, 8) and s.tolist() == [np.float32(2.0**-90) / np.float32(127.0)]
    with pytest.raises(ValueError, match="granularity = 9"):
        torch.ops.cquant.quantize(torch.zeros(0, 8), i8, 9)
    with pytest.raises(ValueError, match="group_size = 48"):
        torch.ops.cquant.quantize(torch.zeros(0, 96), ops.format_info("int4").id, ops.GRANULARITIES["group"], 48)
    with pytest.raises(TypeError, match="x has dtype int32"):
        torch.ops.cquant.quantize(torch.zeros(0, 8, dtype=torch.int32), i8, tensor)
    with pytest.raises(ValueError, match="no columns"):
        torch.ops.cquant.quantize(torch.zeros(4, 0), i8, tensor)


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("bad", ["norm", "eps", "out_format", "scale"])
def test_empty_norm_modulate_checks_its_arguments(bad):
    x = torch.zeros(2, 0, 8)
    scale = torch.zeros(2, 5) if bad == "scale" else torch.zeros(2, 8)
    args = {"norm": 9 if bad == "norm" else _C.NORM_LAYER, "eps": float("nan") if bad == "eps" else 1e-6,
            "out_format": 77 if bad == "out_format" else _C.FORMAT_INT8}
    with pytest.raises(ValueError, match=bad):
        torch.ops.cquant.norm_modulate(x, scale, None, args["norm"], args["eps"], args["out_format"])
    out, out_scale = torch.ops.cquant.norm_modulate(x, torch.zeros(2, 8), None, _C.NORM_LAYER, 1e-6, _C.FORMAT_INT8)
    assert out.shape == (2, 0, 8) and out_scale.shape == (0,)
