"""Activations quantized once for layers that read the same tensor (cq_linear_quantized and the
QuantizedLinear path on top of it): results identical to quantizing in each layer."""

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant import _C, ops, torch_ops  # noqa: E402
from cquant import shared_activations as shared  # noqa: E402

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


def _attention(scheme, device, seed, dim=64):
    """A Flux joint attention (to_q/k/v on x, add_q/k/v_proj on the context), quantized."""
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(seed)
    attn = FluxAttention(query_dim=dim, heads=2, dim_head=dim // 2, added_kv_proj_dim=dim, bias=True).eval()
    attn = attn.to(device=device, dtype=torch.bfloat16)
    cquant.quantize_(attn, CONFIG_NAMES[scheme])
    return attn


def _call_attention(attn, x, c):
    with tm.native_attention():
        return attn(hidden_states=x, encoder_hidden_states=c)


class Counter:
    """Counts what the linear layers run: activation quantizations done for sharing ("quantize"),
    layers fed shared codes ("linear_quantized") and layers that quantize their own input ("linear")."""

    def __init__(self, monkeypatch):
        self.calls = {"quantize": 0, "linear_quantized": 0, "linear": 0}
        for table in (torch_ops.DIRECT, torch_ops.DISPATCHED):
            for name in self.calls:
                monkeypatch.setattr(table, name, self._counting(name, getattr(table, name)))

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def _without_sharing(fn, monkeypatch):
    """fn() with CQUANT_SHARE_ACTIVATIONS=0 (libcquant's settings, read again around it)."""
    with monkeypatch.context() as m:
        m.setenv("CQUANT_SHARE_ACTIVATIONS", "0")
        ops.reload_settings()
        try:
            assert ops.settings()["share_activations"] is False
            return fn()
        finally:
            m.undo()
            ops.reload_settings()


def _inputs(seed, dim=64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, dim, generator=g).bfloat16().to(device)
    c = torch.randn(2, 5, dim, generator=g).bfloat16().to(device)
    return x, c


def test_the_switch_turns_sharing_off(seed, monkeypatch):
    attn = _attention("fp8dqrow", "cpu", seed)
    x, c = _inputs(seed)
    with torch.no_grad():
        counter = Counter(monkeypatch)
        _without_sharing(lambda: _call_attention(attn, x, c), monkeypatch)
    assert counter.calls == {"quantize": 0, "linear_quantized": 0, "linear": 8}


@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_layers_share_one_quantization_inside_attention(scheme, seed, monkeypatch):
    attn = _attention(scheme, "cpu", seed)
    x, c = _inputs(seed)
    with torch.no_grad():
        expect = _without_sharing(lambda: _call_attention(attn, x, c), monkeypatch)
        counter = Counter(monkeypatch)
        got = _call_attention(attn, x, c)
    # x and the context quantized once each, read by three projections each; to_out and
    # to_add_out read tensors of their own
    assert counter.calls == {"quantize": 4, "linear_quantized": 8, "linear": 0}
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert shared.scope.owners == [] and shared.scope.entry is None  # nothing outlives the forward


def test_sharing_with_inference_tensors(seed, monkeypatch):
    attn = _attention("fp8dqrow", "cpu", seed)
    x, c = _inputs(seed)
    with torch.no_grad():
        expect = _call_attention(attn, x, c)
    counter = Counter(monkeypatch)
    with torch.inference_mode():
        got = _call_attention(attn, x.clone(), c.clone())  # inference tensors: no version counter
    assert counter.calls["quantize"] == 4 and counter.calls["linear_quantized"] == 8
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_outside_a_scope_every_layer_quantizes_its_input(scheme, seed, monkeypatch):
    layers = _layers(scheme, "cpu", seed)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    counter = Counter(monkeypatch)
    _run(layers, x)
    assert counter.calls == {"quantize": 0, "linear_quantized": 0, "linear": 3}


@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_inference_mode_on_a_layer(scheme, seed):
    q = _layers(scheme, "cpu", seed)["q"]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    with torch.no_grad():
        expect = q(x)
    with torch.inference_mode():
        got = q(x.clone())
    assert torch.equal(got, expect)


@pytest.mark.parametrize("scheme", list(DYNAMIC))
def test_inference_mode_flux_pipeline(scheme):
    pipe = tm.flux_pipeline(with_text_encoders=False)
    cquant.quantize_(pipe.transformer, CONFIG_NAMES[scheme])

    def images(mode):
        g = torch.Generator().manual_seed(0)
        with mode(), tm.native_attention():
            return pipe(prompt_embeds=torch.randn(1, 8, 64, generator=g),
                        pooled_prompt_embeds=torch.randn(1, 32, generator=g), num_inference_steps=2, height=32,
                        width=32, generator=g, output_type="pt").images

    got = images(torch.inference_mode)
    assert torch.isfinite(got).all()
    assert torch.equal(got, images(torch.no_grad))


def test_flux_blocks_share_inside_their_scopes(seed, monkeypatch):
    model = tm.build("flux")
    cquant.quantize_(model, "fp8dqrow")
    with tm.native_attention():  # whatever backend an earlier test left active
        expect = _without_sharing(lambda: tm.run(model, "flux"), monkeypatch)
        counter = Counter(monkeypatch)
        got = tm.run(model, "flux")
    assert torch.equal(got, expect)
    # 2 double-stream blocks: x and the context once each, and to_out / to_add_out; 2
    # single-stream blocks: proj_mlp and q / k / v read one normalized input, and the norm's
    # linear and proj_out read their own
    assert counter.calls["quantize"] == 2 * 4 + 2 * 3
    assert counter.calls["linear_quantized"] == 2 * 8 + 2 * 6


def test_writes_that_bypass_the_version_counter_give_fresh_codes(seed):
    layers = _layers("int8dq", "cpu", seed).float()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        layers["q"](x)
        x.data.mul_(2)  # .data: the version counter of x does not move
        after_data = layers["k"](x)
        assert torch.equal(after_data, layers["k"](x.clone()))
        x.numpy()[:] *= -1  # through NumPy: neither does it here
        after_numpy = layers["k"](x)
        assert torch.equal(after_numpy, layers["k"](x.clone()))


def test_modified_or_new_input_is_quantized_again_inside_a_scope(seed, monkeypatch):
    attn = _attention("fp8dqrow", "cpu", seed)
    x, c = _inputs(seed)
    counter = Counter(monkeypatch)

    def scale_x(module, args):
        args[0].mul_(2)  # an in-place write between to_q and to_k moves the version counter

    handle = attn.to_k.register_forward_pre_hook(scale_x)
    with torch.no_grad():
        _call_attention(attn, x, c)
    handle.remove()
    assert counter.calls["quantize"] == 5  # x, x again after the write, the context, to_out, to_add_out


def test_scope_closes_when_forward_raises(seed):
    attn = _attention("int8dq", "cpu", seed)
    x, c = _inputs(seed)

    def fail(module, args):
        raise RuntimeError("boom")

    handle = attn.to_v.register_forward_pre_hook(fail)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        _call_attention(attn, x, c)
    handle.remove()
    assert shared.scope.owners == [] and shared.scope.entry is None


def test_interrupted_scope_is_reset_on_the_next_call(seed, monkeypatch):
    attn = _attention("int8dq", "cpu", seed)
    x, c = _inputs(seed)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = attn.to_v.register_forward_pre_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        _call_attention(attn, x, c)
    handle.remove()
    assert shared.scope.owners == [attn]  # torch runs no closing hook for a BaseException
    counter = Counter(monkeypatch)
    with torch.no_grad():
        _call_attention(attn, x, c)
    assert counter.calls["quantize"] == 4
    assert shared.scope.owners == [] and shared.scope.entry is None


@pytest.mark.parametrize("processor", ["diffusers", "cquant"])
def test_cogvideox_attention_shares_its_joint_input(processor, seed, monkeypatch):
    """CogVideoX's processor projects the text and video tokens, concatenated, with to_q/k/v:
    quantized once, under diffusers' processor and under cquant's."""
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

    torch.manual_seed(seed)
    attn = Attention(query_dim=64, dim_head=32, heads=2, qk_norm="layer_norm", eps=1e-6, bias=True,
                     processor=CogVideoXAttnProcessor2_0()).eval().to(torch.bfloat16)
    cquant.quantize_(attn, "int8dq")
    if processor == "cquant":
        attn.set_processor(cquant.attention_backend.CQuantCogVideoXAttnProcessor("bf16"))
    x, c = _inputs(seed)
    with torch.no_grad():
        expect = _without_sharing(lambda: attn(hidden_states=x, encoder_hidden_states=c), monkeypatch)
        counter = Counter(monkeypatch)
        got = attn(hidden_states=x, encoder_hidden_states=c)
    # the joint tokens quantized once, read by three projections; to_out reads a tensor of its own
    assert counter.calls == {"quantize": 2, "linear_quantized": 4, "linear": 0}
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


def test_no_sharing_under_an_unknown_processor(seed, monkeypatch):
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class MyProcessor(FluxAttnProcessor):  # could write to its inputs: cquant has not read it
        pass

    attn = _attention("int8dq", "cpu", seed)
    attn.set_processor(MyProcessor())
    x, c = _inputs(seed)
    counter = Counter(monkeypatch)
    with torch.no_grad():
        _call_attention(attn, x, c)
    assert counter.calls == {"quantize": 0, "linear_quantized": 0, "linear": 8}


def test_no_sharing_when_x_needs_grad(seed, monkeypatch):
    attn = _attention("int8dq", "cpu", seed)
    x, c = _inputs(seed)
    x.requires_grad_()
    counter = Counter(monkeypatch)
    out, _ = _call_attention(attn, x, c)
    out.float().sum().backward()  # the fused op carries the gradient
    assert counter.calls["linear_quantized"] == 0 and x.grad is not None


def test_codes_are_dropped_with_their_input(seed):
    attn = _attention("int8dq", "cpu", seed)
    x = torch.randn(3, 64).bfloat16()
    shared._open_attention(attn, ())
    try:
        with torch.no_grad():
            attn.to_q(x)
        assert shared.scope.entry is not None
        del x  # the last reference: the remembered codes go with it
        assert shared.scope.entry is None
    finally:
        shared._close(attn, (), None)


def test_scopes_are_installed_once(seed):
    attn = _attention("int8dq", "cpu", seed)
    assert shared.install_scopes(attn) == 0  # quantize_ installed them already
    assert sum(h is shared._open_attention for h in attn._forward_pre_hooks.values()) == 1


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
    attn = _attention(scheme, "cuda", seed, dim=256)
    x, c = _inputs(seed, dim=256, device="cuda")
    with torch.no_grad():
        expect = _without_sharing(lambda: _call_attention(attn, x, c), monkeypatch)
        counter = Counter(monkeypatch)
        got = _call_attention(attn, x, c)
    torch.cuda.synchronize()
    assert counter.calls == {"quantize": 4, "linear_quantized": 8, "linear": 0}
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_no_sharing_while_capturing(seed, monkeypatch):
    attn = _attention("fp8dqrow", "cuda", seed, dim=256)
    x, c = _inputs(seed, dim=256, device="cuda")
    with torch.no_grad():
        _call_attention(attn, x, c)  # warm up outside the capture
        torch.cuda.synchronize()
        counter = Counter(monkeypatch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _call_attention(attn, x, c)
        graph.replay()
        torch.cuda.synchronize()
        assert counter.calls["quantize"] == 0 and counter.calls["linear_quantized"] == 0
        expect = _without_sharing(lambda: _call_attention(attn, x, c), monkeypatch)
    for a, b in zip(out, expect):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", list(DYNAMIC))
@pytest.mark.parametrize("tokens", [1, 300], ids=["gemv", "gemm"])  # both sides of the GEMV / GEMM dispatch
def test_inference_mode_inside_attention_cuda(scheme, tokens, seed, monkeypatch):
    attn = _attention(scheme, "cuda", seed, dim=256)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, 256, generator=g).bfloat16().cuda()
    c = torch.randn(1, 7, 256, generator=g).bfloat16().cuda()
    with torch.no_grad():
        expect = _call_attention(attn, x, c)
    counter = Counter(monkeypatch)
    with torch.inference_mode():
        got = _call_attention(attn, x.clone(), c.clone())
    torch.cuda.synchronize()
    assert counter.calls["quantize"] == 4 and counter.calls["linear_quantized"] == 8
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
