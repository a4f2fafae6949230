"""Activations quantized once for layers that read the same tensor (cq_linear_quantized and the
QuantizedLinear path on top of it): results identical to quantizing in each layer."""

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
import cquant.nn as cnn  # noqa: E402
from cquant import _C, ops  # noqa: E402

# (weight format, act format, act granularity, weight granularity)
DYNAMIC = {
    "int8dq": ("int8", "int8", "row", "row"),
    "fp8dqrow": ("fp8_e4m3", "fp8_e4m3", "row", "row"),
    "fp8dq_tensor": ("fp8_e4m3", "fp8_e4m3", "tensor", "tensor"),
}
CONFIG_NAMES = {"int8dq": "int8dq", "fp8dqrow": "fp8dqrow", "fp8dq_tensor": "float8dq_e4m3_tensor"}


def _c_args(scheme):
    wfmt, afmt, ag, wg = DYNAMIC[scheme]
    return (ops.format_info(wfmt).id, ops.GRANULARITIES[wg], ops.format_info(afmt).id, ops.GRANULARITIES[ag])


def _both_paths(scheme, x, w, bias):
    """y through cq_linear, and through cq_quantize + cq_linear_quantized."""
    wfmt, afmt, ag, wg = DYNAMIC[scheme]
    wf, wgi, af, agi = _c_args(scheme)
    qw, sw = ops.quantize(w, wfmt, wg)
    k = int(x.shape[-1])
    fused = ops.linear(x, qw, sw, weight_format=wfmt, act_format=afmt, act_granularity=ag, weight_granularity=wg,
                       bias=bias)
    qx, sx = ops.quantize(x, afmt, ag)
    qx = qx.view(*x.shape[:-1], k)
    y = torch.full_like(fused, float("nan"))
    nbytes = _C.linear_workspace_size(wf, wgi, af, agi, k, qx.numel() // k, int(w.shape[0]), x.is_cuda)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes else None
    _C.linear_quantized(qx, sx, qw, sw, bias, y, wf, wgi, af, agi, k, workspace=ws)
    return fused, y


@pytest.mark.parametrize("scheme", list(DYNAMIC))
@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 7, 97), (2, 33, 64)], ids=lambda s: "x".join(map(str, s)))
def test_prequantized_equals_fused_cpu(scheme, shape, seed):
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    x = torch.randn(*lead, k, generator=g).bfloat16()
    w = torch.randn(45, k, generator=g)
    bias = torch.randn(45, generator=g).bfloat16()
    fused, y = _both_paths(scheme, x, w, bias)
    assert torch.equal(fused, y)


def test_prequantized_argument_errors():
    x = torch.randn(4, 32)
    qw, sw = ops.quantize(torch.randn(8, 32), "int8")
    qx, sx = ops.quantize(x, "int8")
    y = torch.empty(4, 8)
    wf, wg, af, ag = _c_args("int8dq")
    with pytest.raises(ValueError, match="act_format"):
        _C.linear_quantized(qx, sx, qw, sw, None, y, wf, wg, 0, ag, 32)
    with pytest.raises(TypeError, match="x_codes"):
        _C.linear_quantized(x, sx, qw, sw, None, y, wf, wg, af, ag, 32)
    with pytest.raises(ValueError, match="x_scale"):
        _C.linear_quantized(qx, sx[:2], qw, sw, None, y, wf, wg, af, ag, 32)
    with pytest.raises(TypeError, match="y"):
        _C.linear_quantized(qx, sx, qw, sw, None, torch.empty(4, 8, dtype=torch.int32), wf, wg, af, ag, 32)


def _layers(scheme, device, seed, k=64):
    g = torch.Generator().manual_seed(seed)
    layers = torch.nn.ModuleDict({name: torch.nn.Linear(k, n) for name, n in (("q", 48), ("k", 48), ("mlp", 96))})
    with torch.no_grad():
        for lin in layers.values():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / k ** 0.5)
    layers = layers.to(device=device, dtype=torch.bfloat16)
    cquant.quantize_(layers, CONFIG_NAMES[scheme])
    return layers


def _run(layers, x):
    with torch.no_grad():
        return [layers[name](x) for name in ("q", "k", "mlp")]


def _without_sharing(layers, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(cnn._SharedActivations, "enabled", False)
        return _run(layers, x)


def _count_quantize_calls(monkeypatch):
    calls = []
    real = cnn._SharedActivations.quantize

    def counting(self, x, af, ag, direct=False):
        hit = self.key is not None and self.key[0]() is x and self.key[1:] == (x._version, af, ag)
        calls.append(hit)
        return real(self, x, af, ag, direct)

    monkeypatch.setattr(cnn._SharedActivations, "quantize", counting)
    return calls


@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_layers_share_one_quantization_cpu(scheme, seed, monkeypatch):
    layers = _layers(scheme, "cpu", seed)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    expect = _without_sharing(layers, x, monkeypatch)
    calls = _count_quantize_calls(monkeypatch)
    got = _run(layers, x)
    assert calls == [False, True, True]  # quantized once, reused twice
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


def test_modified_or_new_input_is_quantized_again(seed, monkeypatch):
    layers = _layers("fp8dqrow", "cpu", seed)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    calls = _count_quantize_calls(monkeypatch)
    with torch.no_grad():
        layers["q"](x)
        x.mul_(2)  # in place: the version counter moves
        y_after = layers["k"](x)
        same_values = x.clone()  # equal data, another tensor
        layers["k"](same_values)
    assert calls == [False, False, False]
    expect = _without_sharing(layers, x, monkeypatch)[1]
    assert torch.equal(y_after, expect)


def test_codes_are_dropped_with_their_input(seed):
    layers = _layers("int8dq", "cpu", seed)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        layers["q"](x)
    assert cnn._shared_activations.value is not None
    del x  # the last reference: the remembered codes go with it
    assert cnn._shared_activations.key is None and cnn._shared_activations.value is None


def test_no_sharing_when_x_needs_grad(seed, monkeypatch):
    layers = _layers("int8dq", "cpu", seed)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16().requires_grad_()
    calls = _count_quantize_calls(monkeypatch)
    y = layers["q"](x)
    y.float().sum().backward()  # the fused op carries the gradient
    assert calls == [] and x.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", list(DYNAMIC))
@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 7, 96), (4608, 256)], ids=lambda s: "x".join(map(str, s)))
def test_prequantized_equals_fused_cuda(scheme, shape, seed):
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    x = torch.randn(*lead, k, generator=g).bfloat16().cuda()
    w = torch.randn(272, k, generator=g).cuda()
    bias = torch.randn(272, generator=g).bfloat16().cuda()
    fused, y = _both_paths(scheme, x, w, bias)
    torch.cuda.synchronize()
    assert torch.equal(fused, y)


@pytest.mark.cuda
def test_prequantized_needs_aligned_k_on_cuda():
    x = torch.randn(4, 40, device="cuda", dtype=torch.bfloat16)
    qw, sw = ops.quantize(torch.randn(16, 40, device="cuda"), "int8")
    qx, sx = ops.quantize(x, "int8")
    wf, wg, af, ag = _c_args("int8dq")
    nbytes = _C.linear_workspace_size(wf, wg, af, ag, 40, 4, 16, True)
    ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    with pytest.raises(NotImplementedError, match="16"):
        _C.linear_quantized(qx, sx, qw, sw, None, torch.empty(4, 16, device="cuda", dtype=torch.bfloat16),
                            wf, wg, af, ag, 40, workspace=ws)


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_layers_share_one_quantization_cuda(scheme, seed, monkeypatch):
    layers = _layers(scheme, "cuda", seed, k=256)
    x = torch.randn(2, 300, 256, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    expect = _without_sharing(layers, x, monkeypatch)
    calls = _count_quantize_calls(monkeypatch)
    got = _run(layers, x)
    torch.cuda.synchronize()
    assert calls == [False, True, True]
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_no_sharing_while_capturing(seed, monkeypatch):
    layers = _layers("fp8dqrow", "cuda", seed, k=256)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    _run(layers, x)  # warm up outside the capture
    torch.cuda.synchronize()
    calls = _count_quantize_calls(monkeypatch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(layers, x)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == []
    expect = _without_sharing(layers, x, monkeypatch)
    for a, b in zip(out, expect):
        assert torch.equal(a, b)
