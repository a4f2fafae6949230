"""cquant.nn.QuantizedLinear and the torch custom ops under it (CPU)."""

import copy
import os
import secrets

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
from cquant.nn import QuantizedLinear, QuantizedLinearSlice  # noqa: E402
from helpers import ungrouped_schemes  # noqa: E402
from tolerances import QLINEAR_REL_L2, dynamic_linear_abs_bound  # noqa: E402

SCHEMES = ungrouped_schemes(cquant.SCHEME_NAMES) + ["fp8wo_e5m2", "fp3_e1m1", "fp7_e3m3"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1025, 97), (7, 97, 33), (16, 64, 1)]  # (M, K, N)


@pytest.fixture
def gen():
    seed = int(os.environ.get("CQUANT_TEST_SEED", secrets.randbits(32)))
    print(f"random seed: {seed} (repeat with CQUANT_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


def make_linear(k, n, gen, dtype=torch.float32, bias=True):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin.to(dtype)




@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_forward_matches_float64_of_the_stored_weight(scheme, dtype, shape, gen):
    m, k, n = shape
    lin = make_linear(k, n, gen, dtype)
    q = QuantizedLinear.from_float(lin, scheme)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.double() @ q.dequantize(torch.float32).double().T + lin.bias.double()
    if q.scheme.dynamic:
        x64, w64 = x.double().numpy(), q.dequantize(torch.float32).double().numpy()
        bound = dynamic_linear_abs_bound(x64, w64, lin.bias.double().detach().numpy(), q.scheme.act_format.name,
                                         q.scheme.act_granularity, ref.detach().numpy(), str(dtype).split(".")[1])
        err = np.abs(y.detach().double().numpy() - ref.detach().numpy())
        assert np.all(err <= bound), f"{scheme}: |y - y64| = {err.max():.3g} > its bound at {np.argmax(err - bound)}"
    else:
        rel = float((y.detach().double() - ref.detach()).norm() / ref.detach().norm())
        assert rel < QLINEAR_REL_L2[str(dtype).split(".")[1]], rel


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stored_tensors(scheme, gen):
    lin = make_linear(97, 33, gen, torch.bfloat16)
    q = QuantizedLinear.from_float(lin, scheme)
    s = q.scheme
    assert isinstance(q, torch.nn.Linear) and (q.in_features, q.out_features) == (97, 33)
    assert isinstance(q.weight, torch.nn.Parameter) and not q.weight.requires_grad
    assert q.weight.dtype == (torch.int8 if s.weight_format.name == "int8" else torch.uint8)
    assert tuple(q.weight.shape) == (33, s.row_bytes(97))
    assert q.weight_scale.dtype == torch.float32
    assert tuple(q.weight_scale.shape) == ((33,) if s.weight_granularity == "row" else (1,))
    assert q.bias.dtype == torch.bfloat16 and torch.equal(q.bias, lin.bias)
    assert q.qdata is q.weight and q.scale is q.weight_scale
    sd = q.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert q.nbytes == sum(t.nbytes for t in sd.values())
    assert q.compute_dtype == torch.bfloat16 and q.nbytes_float == (97 * 33 + 33) * 2


def test_repr():
    q = QuantizedLinear(3072, 12288, "fp8dqrow", device="meta")
    assert repr(q) == "QuantizedLinear(3072 -> 12288, fp8dqrow, 37.8 MB)"
    assert "fp6_e3m2" in repr(QuantizedLinear(64, 32, "fp6_e3m2", bias=False, device="meta"))


def test_dtype_casts_change_activations_never_codes(gen):
    q = QuantizedLinear.from_float(make_linear(64, 32, gen, torch.bfloat16), "fp8dqrow")
    codes, scale = q.weight.clone(), q.weight_scale.clone()
    x = torch.randn(3, 64, generator=gen)
    for cast, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.float(), torch.float32),
                        (lambda m: m.bfloat16(), torch.bfloat16), (lambda m: m.to(torch.float16), torch.float16),
                        (lambda m: m.to("cpu", torch.float32), torch.float32)):
        assert cast(q) is q
        assert q.compute_dtype == dtype and q.bias.dtype == dtype
        assert torch.equal(q.weight, codes) and q.weight.dtype == torch.uint8
        assert torch.equal(q.weight_scale, scale) and q.weight_scale.dtype == torch.float32
        assert q(x).dtype == dtype  # float32 input cast to the compute dtype
    with pytest.raises(TypeError, match="float32, torch.float16 or torch.bfloat16"):
        q.double()
    assert q.compute_dtype == torch.float32


def test_deepcopy_and_state_dict_round_trip(gen):
    q = QuantizedLinear.from_float(make_linear(64, 48, gen), "fp6_e3m2")
    x = torch.randn(5, 64, generator=gen)
    c = copy.deepcopy(q)
    assert torch.equal(c(x), q(x)) and c.weight.data_ptr() != q.weight.data_ptr()
    with torch.no_grad():
        c.weight_scale.mul_(2)
    assert not torch.equal(c(x), q(x))
    fresh = QuantizedLinear(64, 48, "fp6_e3m2", dtype=torch.float32)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh(x), q(x))


def test_loading_another_schemes_tensors_fails(gen):
    a = QuantizedLinear.from_float(make_linear(64, 48, gen), "int8wo")
    b = QuantizedLinear(64, 48, "fp8wo", dtype=torch.float32)  # same shapes, uint8 codes
    with pytest.raises(RuntimeError, match="weight: the checkpoint holds torch.int8 .* fp8wo"):
        b.load_state_dict(a.state_dict())
    t = QuantizedLinear(64, 48, "fp8dq", dtype=torch.float32)  # one scale, not 48
    with pytest.raises(RuntimeError, match="weight_scale"):
        t.load_state_dict(QuantizedLinear.from_float(make_linear(64, 48, gen), "fp8dqrow").state_dict())


@pytest.mark.parametrize("saved,target", [("fp6_e3m2", "fp6_e2m3"), ("fp8wo_e5m2", "fp8wo"), ("fp8wo", "fp8wo_e5m2"),
                                          ("int4dq_g32", "int4dq_2l_g64"), ("int4dq_2l_g64", "int4dq_g32")])
def test_loading_codes_of_a_scheme_with_the_same_storage_fails(gen, saved, target, tmp_path):
    # same dtypes and shapes, other decoding: only the state_dict's note of the scheme tells them apart
    k = 64
    lin = make_linear(k, 48, gen)
    a = torch.nn.Sequential(QuantizedLinear.from_float(lin, saved))
    b = torch.nn.Sequential(QuantizedLinear.from_float(lin, target))
    x = torch.randn(5, k, generator=gen)
    before = b(x)
    torch.save(a.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt")
    with pytest.raises(RuntimeError, match=f"0.weight: its codes are {saved}, which decode differently from this "
                                           f"layer's {target}"):
        b.load_state_dict(state)
    assert torch.equal(b(x), before)


def test_codes_of_schemes_that_decode_alike_load(gen):
    for saved, target in (("int8wo", "int8dq"), ("fp8wo", "fp8dqrow"), ("fp8dqrow", "fp8wo"), ("int4wo_sym", "int4dq")):
        k = 256 if "int4" in saved else 64
        lin = make_linear(k, 48, gen)
        x = torch.randn(5, k, generator=gen)
        a, b = QuantizedLinear.from_float(lin, saved), QuantizedLinear(k, 48, target, dtype=torch.float32)
        b.load_state_dict(a.state_dict())
        assert torch.equal(b(x), QuantizedLinear.from_float(lin, target)(x))


def test_fp16_activations_do_not_overflow(gen):
    # |x| up to 60000 and |w| = 4: each product (2.4e5) and any fp16 partial sum would overflow
    # float16, but the terms cancel pairwise and y fits comfortably: only the first 8 pairs of
    # weights differ (by at most 1%, two int8 steps after quantization), the others are equal and
    # opposite, so |y| <= 60000 * 8 * 2 * 4.04 / 127 = 30500 for every draw (with all 128 pairs
    # differing, int8 rounding pushed |y| past 6e4 for 3 in 2000 draws).
    k, n = 256, 32
    lin = torch.nn.Linear(k, n, bias=False)
    sign = torch.tensor([1.0, -1.0]).repeat(k // 2)
    spread = torch.rand(n, k, generator=gen)
    spread[:, 17::2] = spread[:, 16::2]
    with torch.no_grad():
        lin.weight.copy_(4.0 * sign * (1 + 0.01 * spread))
    lin = lin.half()
    x = (60000.0 * torch.ones(4, k)).half()
    for scheme in ("int8wo", "fp8wo", "fp6_e2m3", "int8dq", "fp8dqrow", "fp8dq"):
        q = QuantizedLinear.from_float(lin, scheme)
        y = q(x)
        ref = x.double() @ q.dequantize(torch.float32).double().T
        assert bool(ref.abs().max() < 6e4)  # the exact result is representable
        assert torch.isfinite(y).all(), scheme
        assert float((y.double() - ref).abs().max()) <= 2e-3 * float(ref.abs().max()) + 1.0, scheme


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_backward_for_adapters(scheme, gen):
    lin = make_linear(64, 32, gen)
    q = QuantizedLinear.from_float(lin, scheme)
    x = torch.randn(6, 64, generator=gen, requires_grad=True)
    g = torch.randn(6, 32, generator=gen)
    q(x).backward(g)
    w = q.dequantize(torch.float32)
    assert torch.allclose(x.grad, g @ w, rtol=1e-5, atol=1e-5)
    assert torch.allclose(q.bias.grad, g.sum(0), rtol=1e-5, atol=1e-5)
    assert q.weight.grad is None


def test_dequantize_and_to_float(gen):
    lin = make_linear(64, 32, gen)
    q = QuantizedLinear.from_float(lin, "int8wo")
    w = q.dequantize()
    assert w.shape == (32, 64) and w.dtype == torch.float32
    assert torch.equal(w, cquant.ops.dequantize(q.weight, q.weight_scale, "int8"))
    f = q.to_float()
    assert type(f) is torch.nn.Linear and torch.equal(f.weight, w)
    x = torch.randn(4, 64, generator=gen)
    assert torch.allclose(f(x), q(x), rtol=1e-5, atol=1e-5)


def test_slices_share_the_fused_storage(gen):
    fused = QuantizedLinear.from_float(make_linear(64, 96, gen), "fp8dqrow")
    x = torch.randn(3, 64, generator=gen)
    y = fused(x)
    parts = [QuantizedLinearSlice(fused, 0, 32), QuantizedLinearSlice(fused, 32, 64), QuantizedLinearSlice(fused, 64, 96)]
    for i, p in enumerate(parts):
        assert isinstance(p, torch.nn.Linear) and p.out_features == 32
        assert p.weight.data_ptr() == fused.weight.data_ptr() + i * 32 * 64
        assert torch.equal(p(x), y[:, 32 * i:32 * (i + 1)])
        assert p.state_dict() == {} and list(p.parameters()) == []
    with pytest.raises(ValueError, match="rows"):
        QuantizedLinearSlice(fused, 90, 100)


def test_bad_inputs_raise(gen):
    q = QuantizedLinear.from_float(make_linear(64, 32, gen), "int8wo")
    with pytest.raises(TypeError, match="compute_dtype"):
        q(torch.ones(2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="in_features = 64"):
        q(torch.ones(2, 48))
    for grad in (False, True):  # with autograd on, the dispatcher answered with a meta tensor
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="got x on the meta device"):
            q(torch.ones(2, 64, device="meta"))
    with pytest.raises(TypeError, match="re-initialised"):
        q.reset_parameters()
    with pytest.raises(TypeError, match="float torch.nn.Linear"):
        QuantizedLinear.from_float(torch.nn.Conv1d(4, 4, 1), "int8wo")
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        QuantizedLinear.from_float(torch.nn.Linear(64, 32).double(), "int8wo")
    with pytest.raises(ValueError, match="meta"):
        QuantizedLinear.from_float(torch.nn.Linear(64, 32, device="meta"), "int8wo")
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        QuantizedLinear(0, 32, "int8wo")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        QuantizedLinear(64, 32, "int3")


def test_empty_batch(gen):
    q = QuantizedLinear.from_float(make_linear(64, 32, gen), "fp8dqrow")
    assert q(torch.empty(0, 64)).shape == (0, 32)
    assert q(torch.empty(2, 0, 64)).shape == (2, 0, 32)


def test_per_tensor_activation_scale_depends_on_the_batch(gen):
    """float8dq scales the activations by the amax of the whole input, so a sample's result depends on the
    samples batched with it (README); fp8dqrow scales each row by its own amax, so it does not."""
    lin = make_linear(64, 48, gen)
    sample = torch.randn(1, 7, 64, generator=gen)
    batch = torch.cat([sample, 100 * torch.randn(1, 7, 64, generator=gen)])  # a large-magnitude other sample
    per_tensor, per_row = (QuantizedLinear.from_float(copy.deepcopy(lin), s) for s in ("float8dq", "fp8dqrow"))
    with torch.no_grad():
        assert not torch.equal(per_tensor(sample), per_tensor(batch)[:1])
        assert torch.equal(per_row(sample), per_row(batch)[:1])


def test_leading_dims(gen):
    q = QuantizedLinear.from_float(make_linear(64, 32, gen), "int8wo")
    x = torch.randn(2, 3, 64, generator=gen)
    assert torch.equal(q(x), q(x.reshape(6, 64)).reshape(2, 3, 32))
    assert torch.equal(q(x.transpose(0, 1)), q(x.transpose(0, 1).contiguous()))  # non-contiguous input


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_custom_ops_pass_opcheck(scheme, gen):
    from cquant import torch_ops

    q = QuantizedLinear.from_float(make_linear(64, 32, gen), scheme)
    wf, wg, af, ag = q.scheme.c_args[:4]
    x = torch.randn(4, 64, generator=gen)
    torch.library.opcheck(torch.ops.cquant.linear.default, (x, q.weight, q.weight_scale, q.bias, wf, wg, af, ag, 64))
    torch.library.opcheck(torch.ops.cquant.dequantize.default, (q.weight, q.weight_scale, wf, wg, 64, torch.bfloat16))
    torch.library.opcheck(torch.ops.cquant.quantize.default, (x, wf, wg))
    codes, scale = torch_ops.quantize(x, wf, wg)
    assert codes.dtype == q.weight.dtype and scale.dtype == torch.float32


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow"])
def test_direct_calls_match_the_dispatcher(scheme, gen, monkeypatch):
    """Eager inference skips torch's dispatcher (torch_ops.*_impl); results are the same bits."""
    from cquant import torch_ops

    layer = QuantizedLinear.from_float(torch.nn.Linear(64, 48), scheme)
    layer.activation = "gelu_tanh"
    x = torch.randn(5, 64, generator=gen)
    real, answers = torch_ops.direct_call_ok, []
    monkeypatch.setattr(torch_ops, "direct_call_ok", lambda *t: answers.append(real(*t)) or answers[-1])
    with torch.no_grad():
        direct = layer(x)
    assert answers == [True], "no_grad inference did not take the direct path"
    monkeypatch.setattr(torch_ops, "direct_call_ok", lambda *t: False)
    with torch.no_grad():
        dispatched = layer(x)
    assert torch.equal(direct, dispatched)


def test_direct_calls_only_without_gradients_or_tracing(gen):
    from cquant import torch_ops

    x = torch.randn(3, 16, generator=gen)
    assert torch_ops.direct_call_ok(x, None)
    xg = x.clone().requires_grad_(True)
    assert not torch_ops.direct_call_ok(xg, None)
    with torch.no_grad():
        assert torch_ops.direct_call_ok(xg, torch.nn.Parameter(torch.zeros(3)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not torch_ops.direct_call_ok(torch.empty(3, 16), None)


@pytest.mark.parametrize("scheme", ["int8wo", "int4wo_g32", "int4dq", "int4dq_2l"])
def test_quantized_under_inference_mode_runs_outside_it(scheme, gen):
    # as a float layer does: the codes are inference tensors, which autograd cannot save, and
    # a bias that takes a gradient needs none of them
    model = torch.nn.Sequential(make_linear(128, 32, gen))
    x = torch.randn(3, 128, generator=gen)
    with torch.inference_mode():
        cquant.quantize_(model, scheme)
        y = model(x)
    out = model(x)
    assert torch.equal(out, y) and out.requires_grad
    out.sum().backward()
    assert torch.equal(model[0].bias.grad, torch.full((32,), 3.0))
    # a fused GELU recomputes its input from the codes for the bias's gradient
    model[0].activation = "gelu_tanh"
    model[0].bias.grad = None
    out = model(x)
    out.sum().backward()
    pre = x @ model[0].dequantize(torch.float32).T + model[0].bias.detach()
    want = torch.ops.aten.gelu_backward(torch.ones_like(pre), pre, approximate="tanh").sum(0)
    assert (model[0].bias.grad - want).norm() <= QLINEAR_REL_L2["float32"] * want.norm()


def test_meta_tensors_raise_naming_the_layer(gen):
    from cquant.quantize import finish_, plan, swap_in

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    swap_in(model, plan(model, "int8wo").layers, empty=True)  # a skeleton whose tensors were never loaded
    finish_(model)
    x = torch.randn(2, 64, generator=gen)
    for grad in (True, False):  # with grad mode on, the dispatcher used to run the meta kernel on CPU input
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="QuantizedLinear '0' .*meta device"):
            model(x)
    layer = QuantizedLinear.from_float(make_linear(64, 32, gen), "int8wo")
    layer.weight_scale = torch.empty(32, device="meta")
    with pytest.raises(RuntimeError, match="weight_scale is on the meta device"):
        layer(x)


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_replaced_codes_are_refused(scheme, gen):
    """What a LoRA merge that does not know the layer does (weight.data += delta): never run it."""
    layer = QuantizedLinear.from_float(make_linear(64, 32, gen), scheme)
    x = torch.randn(2, 64, generator=gen)
    layer.weight.data = layer.dequantize(torch.float32)  # float values where the codes were
    with pytest.raises(RuntimeError, match=f"holds torch.float32 \\(32, 64\\), but {scheme} stores"):
        layer(x)
    layer.weight.data = torch.zeros(32, 64, dtype=layer._code_dtype)
    if scheme.startswith("fp6"):  # packed rows: the right dtype, the wrong shape
        with pytest.raises(RuntimeError, match="weight.data"):
            layer(x)


def test_packed_codes_count_logical_weights(gen):
    """num_parameters() as diffusers counts it (param.numel()): one per weight for packed fpX
    too, while nelement() / nbytes stay the stored bytes; the count survives every way a
    parameter is copied, saved, loaded, moved, traced or wrapped."""
    import io

    from accelerate.utils import set_module_tensor_to_device
    from cquant.nn import PackedCodes

    model = torch.nn.Sequential(make_linear(96, 48, gen), torch.nn.GELU(), make_linear(48, 24, gen))
    float_count = sum(p.numel() for p in model.parameters())
    cquant.quantize_(model, "fp6_e3m2")
    w = model[0].weight
    assert isinstance(w, PackedCodes) and w.numel() == 48 * 96 and w.nelement() == w.nbytes == 48 * w.shape[1] < 48 * 96
    assert sum(p.numel() for p in model.parameters()) == float_count

    def counted(m):
        return all(isinstance(m[i].weight, PackedCodes) and m[i].weight.numel() == m[i].out_features * m[i].in_features
                   for i in (0, 2))

    x = torch.randn(3, 96, generator=gen)
    y = model(x)
    assert counted(copy.deepcopy(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert counted(loaded) and torch.equal(loaded(x), y)
    sd = model.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor  # plain tensors for safetensors and weights_only loads
    fresh = torch.nn.Sequential(QuantizedLinear(96, 48, "fp6_e3m2", dtype=torch.float32), torch.nn.GELU(),
                                QuantizedLinear(48, 24, "fp6_e3m2", dtype=torch.float32))
    fresh.load_state_dict(sd, assign=True)
    assert counted(fresh) and torch.equal(fresh(x), y)
    skeleton = QuantizedLinear(96, 48, "fp6_e3m2", device="meta", dtype=torch.float32)
    set_module_tensor_to_device(skeleton, "weight", "cpu", value=sd["0.weight"])  # how diffusers loads
    assert isinstance(skeleton.weight, PackedCodes) and skeleton.weight.numel() == 48 * 96
    model.to(torch.float16)
    assert counted(model)
    moved = copy.deepcopy(model).to("meta")  # torch swaps the Parameter itself for such moves
    assert counted(moved)
    assert counted(moved.to_empty(device="cpu"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x.half()), model(x.half()))


def test_peft_counts_logical_weights(gen):
    peft = pytest.importorskip("peft")
    model = torch.nn.Sequential(make_linear(96, 40, gen))
    float_count = sum(p.numel() for p in model.parameters())
    cquant.quantize_(model, "fp6_e3m2")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["0"]))
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 4 * (96 + 40) and total == float_count + trainable


@pytest.mark.parametrize("scheme", ["fp6_e3m2", "fp4_e2m1"])
def test_diffusers_num_parameters_of_packed_schemes(scheme):
    pytest.importorskip("diffusers")
    import tiny_models as tm

    base = tm.build("flux", dtype=torch.bfloat16)
    q = tm.build("flux", dtype=torch.bfloat16)
    cquant.quantize_(q, scheme)
    assert q.num_parameters() == base.num_parameters()  # as diffusers counts bitsandbytes' 4-bit weights
    assert q.get_memory_footprint() < base.get_memory_footprint() / 2  # while the bytes are the stored ones
