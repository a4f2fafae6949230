"""cquant.optimize / unoptimize: fused block forwards for Flux, SD3 and Qwen-Image, on CPU (C references).

Every fused block must compute what diffusers' block computes (named floors in tolerances.py), take
the fused path where it applies and fall back to diffusers' forward where it does not (LoRA, hooks,
autograd, dtypes libcquant does not take), and leave the model as diffusers and torch know it:
state_dict keys, pickling, deepcopy, torch.compile, diffusers' cache hooks, and unoptimize.
"""

import collections
import copy
import io
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant import cuda_graph  # noqa: E402
from cquant.blocks import fused_classes  # noqa: E402
from cquant.shared_activations import unfused_class  # noqa: E402
from helpers import run_fresh_python  # noqa: E402
from tolerances import (COMPILE_REL_L2, OPTIMIZE_BLOCK_SQNR_FLOOR_DB, OPTIMIZE_MODEL_SQNR_FLOOR_DB,  # noqa: E402
                        OPTIMIZE_NORM_OUT_SQNR_FLOOR_DB, OPTIMIZE_SQNR_LOSS_DB, REPLAY_REL_L2)

# family -> (tiny_models name, config overrides); "sd3.5": Q/K RMSNorm and dual attention in block 0
FAMILIES = {
    "flux": ("flux", {}),
    "sd3": ("sd3", {}),
    "sd3.5": ("sd3", dict(qk_norm="rms_norm", dual_attention_layers=(0,))),
    "qwen-image": ("qwen-image", {}),
}
SCHEMES = [None, "int8dq", "fp8dqrow", "int8wo"]
DYNAMIC = {"int8dq", "fp8dqrow"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the fused classes by the diffusers name they keep, and how many of each a tiny model has
BLOCKS = {"flux": {"FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 2},
          "sd3": {"JointTransformerBlock": 2}, "sd3.5": {"JointTransformerBlock": 2},
          "qwen-image": {"QwenImageTransformerBlock": 2}}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def build(family, dtype=torch.float32, scheme=None, seed=0, **config):
    name, overrides = FAMILIES[family]
    model = tm.build(name, dtype=dtype, seed=seed, **{**overrides, **config})
    if scheme is not None:
        cquant.quantize_(model, scheme)
    return model


def inputs(family, dtype=torch.float32, seed=1):
    return tm.inputs(FAMILIES[family][0], dtype=dtype, seed=seed)


@torch.no_grad()
def run(model, kwargs):
    return model(**kwargs)[0]


def dtype_name(dtype):
    return str(dtype).rpartition(".")[2]


@pytest.fixture
def fused_calls(monkeypatch):
    """Counter of fused-path calls per fused class (named as its diffusers class)."""
    counts = collections.Counter()
    for cls in fused_classes().values():
        if hasattr(cls, "_fused"):
            def fused(self, *args, _orig=cls._fused, _name=cls.__name__, **kwargs):
                counts[_name] += 1
                return _orig(self, *args, **kwargs)

            monkeypatch.setattr(cls, "_fused", fused)
        else:
            def fused_norm(self, *args, _orig=cls._fused_norm, _name=cls.__name__):
                found = _orig(self, *args)
                if found is not None:
                    counts[_name] += 1
                return found

            monkeypatch.setattr(cls, "_fused_norm", fused_norm)
    return counts


def record_calls(model):
    """Forward pre-hooks recording (module, args, kwargs) of every module optimize fuses."""
    calls, handles = [], []
    known = tuple(fused_classes())
    for name, mod in model.named_modules():
        # the blocks and the final norm_out (SD3's last block has an AdaLayerNormContinuous of its own)
        if type(mod) in known and (name == "norm_out" or type(mod).__name__ != "AdaLayerNormContinuous"):
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, k: calls.append((m, a, dict(k))), with_kwargs=True))
    return calls, handles


def graph_warnings(caught):
    return [w for w in caught if "CUDA graphs" in str(w.message)]


def expected_calls(family):
    return {**BLOCKS[family], "AdaLayerNormContinuous": 1}


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s or "float")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_blocks_and_model_match_diffusers(family, dtype, scheme, fused_calls):
    model = build(family, dtype, scheme)
    x = inputs(family, dtype)
    calls, handles = record_calls(model)
    ref = run(model, x)
    for h in handles:
        h.remove()
    assert len(calls) == sum(expected_calls(family).values())
    report = cquant.optimize(model)
    assert len(report.installed) == len(calls) and not report.skipped, str(report)
    out = run(model, x)
    assert dict(fused_calls) == expected_calls(family)  # every block took the fused path

    kind = "dynamic" if scheme in DYNAMIC else "float"
    with torch.no_grad():
        for mod, args, kwargs in calls:
            if type(mod).__name__ == "AdaLayerNormContinuous":
                block_floor = OPTIMIZE_NORM_OUT_SQNR_FLOOR_DB[dtype_name(dtype)]
            else:
                block_floor = OPTIMIZE_BLOCK_SQNR_FLOOR_DB[(dtype_name(dtype), kind)]
            expected = unfused_class(type(mod)).forward(mod, *args, **kwargs)
            got = mod(*args, **kwargs)
            pairs = zip(expected, got) if isinstance(expected, tuple) else [(expected, got)]
            for e, g in pairs:
                assert (e is None) == (g is None)
                if e is not None:
                    assert g.dtype == e.dtype and g.shape == e.shape
                    db = tm.sqnr_db(e, g)
                    assert db >= block_floor, f"{type(mod).__name__}: {db:.1f} dB"

    db = tm.sqnr_db(ref, out)
    assert db >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[(dtype_name(dtype), scheme)], f"model: {db:.1f} dB"
    if dtype != torch.float32 or scheme is not None:  # both as close to the float32 model
        ref32 = run(build(family), inputs(family))
        loss = tm.sqnr_db(ref32, ref) - tm.sqnr_db(ref32, out)
        assert loss <= OPTIMIZE_SQNR_LOSS_DB, f"{loss:.2f} dB less accurate than diffusers' forward"


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image"])
def test_float16_model_matches_diffusers(family, fused_calls):
    model = build(family, torch.float16)
    x = inputs(family, torch.float16)
    ref = run(model, x)
    cquant.optimize(model)
    out = run(model, x)
    assert dict(fused_calls) == expected_calls(family)
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float16", None)]


def batch_of_two(family, dtype):
    """Two samples of `family`'s inputs with different timesteps (and texts, latents), and each
    sample's inputs alone."""
    a, b = inputs(family, dtype, seed=1), inputs(family, dtype, seed=2)
    a["timestep"], b["timestep"] = a["timestep"] * 0.4, b["timestep"] * 1.5
    both = {}
    for k, v in a.items():
        if k == "timestep":
            both[k] = torch.cat([v, b[k]])
        elif isinstance(v, torch.Tensor) and k not in ("img_ids", "txt_ids"):
            both[k] = torch.cat([v, b[k]])
        elif k == "img_shapes":
            both[k] = v * 2
        else:
            both[k] = v
    return both, a, b


@pytest.mark.parametrize("scheme", [None, "int8dq"], ids=["float", "int8dq"])
@pytest.mark.parametrize("family", ["flux", "sd3.5", "qwen-image"])
def test_batch_of_two_with_a_timestep_each(family, scheme, fused_calls):
    model = build(family, scheme=scheme)
    both, a, b = batch_of_two(family, torch.float32)
    ref = run(model, both)
    cquant.optimize(model)
    out = run(model, both)
    assert fused_calls[next(iter(BLOCKS[family]))] > 0
    floor = OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", scheme)]
    for i, single in enumerate((a, b)):
        assert tm.sqnr_db(ref[i], out[i]) >= floor  # each sample its own gates and scales
        assert tm.sqnr_db(run(model, single)[0], out[i]) >= floor  # as alone
    assert tm.sqnr_db(out[0], out[1]) < 20  # the samples differ


# ---------------------------------------------------------------- order, projections, attention


def test_optimize_before_or_after_quantize_is_the_same(fused_calls):
    first = build("flux")
    cquant.optimize(first)
    cquant.quantize_(first, "int8dq")
    second = build("flux", scheme="int8dq")
    cquant.optimize(second)
    for m in (first, second):  # the GELU went into the single blocks' proj_mlp either way
        assert all(b.proj_mlp.activation == "gelu_tanh" for b in m.single_transformer_blocks)
    x = inputs("flux")
    assert torch.equal(run(first, x), run(second, x))
    assert fused_calls["FluxSingleTransformerBlock"] == 4


@pytest.mark.parametrize("scheme", [None, "int8dq"], ids=["float", "int8dq"])
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_fused_qkv_projections(family, scheme, fused_calls):
    model = build(family, scheme=scheme)
    model.fuse_qkv_projections()
    x = inputs(family)
    ref = run(model, x)
    cquant.optimize(model)
    out = run(model, x)
    assert dict(fused_calls) == expected_calls(family)
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", scheme)]


def test_joined_halves_of_one_tensor_are_not_copied():
    from cquant.blocks import common
    x = torch.randn(2, 7, 5)
    for first, second in ((x[:, :3], x[:, 3:]), (x[:1, :4], x[:1, 4:])):
        got = common.joined(first, second)
        assert got.data_ptr() == first.data_ptr() and torch.equal(got, torch.cat([first, second], dim=1))
    apart = [(x[:, :3], x[:, 4:]),  # a gap
             (x[:, 3:], x[:, :3]),  # the wrong order
             (x[:, :3, :4], x[:, 3:, :4]),  # not whole rows
             (x[:1, :3], x[1:, 3:]),  # other samples
             (x[:, :3].clone(), x[:, 3:].clone()),
             (x[:, :3], x[:, 3:].double())]  # torch.cat promotes
    for first, second in apart:
        got = common.joined(first, second)
        assert got.data_ptr() != first.data_ptr() and torch.equal(got, torch.cat([first, second], dim=1))


@pytest.mark.parametrize("dtype,cols", [(torch.bfloat16, (0, 8)), (torch.bfloat16, (4, 10)), (torch.float16, (1, 9)),
                                        (torch.bfloat16, (2, 7)), (torch.float32, (2, 8)), (torch.float32, (3, 6))])
def test_copy_into_a_column_slice(dtype, cols):
    """copy_into writes src's bits into the columns [a, b) of a wider tensor and nothing else,
    through integer words where the slice takes them (8-, 4-byte) and element by element where not."""
    from cquant.blocks import common
    a, b = cols
    buf = torch.full((2, 5, 12), 7.0, dtype=dtype)
    src = torch.randn(2, 5, b - a).to(dtype)
    src[0, 0, 0] = float("nan")
    want = buf.clone()
    want[..., a:b] = src
    common.copy_into(buf[..., a:b], src)
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert torch.equal(buf.view(bits), want.view(bits))
    words = [w for w in (torch.int64, torch.int32) if common._word_view(buf[..., a:b], w) is not None]
    assert words == {(torch.bfloat16, (0, 8)): [torch.int64, torch.int32], (torch.bfloat16, (4, 10)): [torch.int32],
                     (torch.float32, (2, 8)): [torch.int64]}.get((dtype, cols), [])
    other = torch.randn(2, 5, b - a, dtype=torch.float64)  # another dtype: converted as torch.copy_ does
    common.copy_into(buf[..., a:b], other)
    assert torch.equal(buf[..., a:b], other.to(dtype))


def test_single_blocks_hand_their_output_on_without_a_copy(monkeypatch, fused_calls):
    """A fused Flux single block reads the previous single block's two halves of its output as the
    one tensor they are (torch.cat only for the first one, whose inputs come apart)."""
    from cquant.blocks import common
    model = build("flux", scheme="int8wo")
    x = inputs("flux")
    ref = run(model, x)
    cquant.optimize(model)
    copied = []
    orig = common.joined
    monkeypatch.setattr(common, "joined", lambda a, b: copied.append(orig(a, b).data_ptr() != a.data_ptr()) or orig(a, b))
    out = run(model, x)
    assert fused_calls["FluxSingleTransformerBlock"] == 2 and copied == [True, False]
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", "int8wo")]


def test_qwen_text_mask(fused_calls):
    model = build("qwen-image")
    x = inputs("qwen-image")
    x["encoder_hidden_states_mask"] = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.float32)
    ref = run(model, x)
    cquant.optimize(model)
    out = run(model, x)
    assert fused_calls["QwenImageTransformerBlock"] == 2
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]


def test_rotary_tables_follow_each_call(fused_calls):
    model = build("flux")
    calls = []
    for shift in (0.0, 3.0, 0.0):
        x = inputs("flux")
        x["img_ids"] = torch.arange(48, dtype=torch.float32).reshape(16, 3) % 4 + shift
        calls.append(x)
    refs = [run(model, x) for x in calls]
    cquant.optimize(model)
    for x, ref in zip(calls, refs):
        assert tm.sqnr_db(ref, run(model, x)) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]
    assert fused_calls["FluxTransformerBlock"] == 6


def test_cquant_attention_backend(fused_calls):
    model = build("flux", scheme="int8wo")
    x = inputs("flux")
    cquant.enable_attention(model, "bf16")
    ref = run(model, x)
    cquant.optimize(model)
    out = run(model, x)
    assert fused_calls["FluxTransformerBlock"] == 2
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", "int8wo")]


# ---------------------------------------------------------------- fallbacks


def test_lora_layers_fall_back_to_diffusers(fused_calls):
    peft = pytest.importorskip("peft")

    def with_lora(scheme):
        model = build("flux", scheme=scheme)
        torch.manual_seed(3)
        model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                          target_modules=["to_out.0", "proj_out"]))
        return model

    x = inputs("flux")
    for scheme in (None, "int8wo"):
        ref = run(with_lora(scheme), x)
        model = with_lora(scheme)
        cquant.optimize(model)
        out = run(model, x)
        assert fused_calls["FluxTransformerBlock"] == fused_calls["FluxSingleTransformerBlock"] == 0
        assert fused_calls["AdaLayerNormContinuous"] >= 1  # norm_out has no LoRA
        assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", scheme)]


def test_inference_mode_and_a_fused_lora_take_the_fused_path(fused_calls):
    """What users run: a pipeline under torch.inference_mode(), and a LoRA fused into a quantized
    model (fuse_lora, then unload_lora) before optimize: every block fused, diffusers' output."""
    peft = pytest.importorskip("peft")
    x = inputs("flux")

    def merged():
        model = build("flux", scheme="int8dq")
        torch.manual_seed(3)
        model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                          target_modules=["to_out.0", "proj_out", "ff.net.2"]))
        model.fuse_lora()
        model.unload_lora()
        return model

    ref = run(merged(), x)
    model = merged()
    cquant.optimize(model)
    with torch.inference_mode():
        out = model(**x)[0]
    assert dict(fused_calls) == expected_calls("flux")
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", "int8dq")]


def test_hooks_autograd_and_other_dtypes_fall_back(fused_calls):
    model = build("flux")
    x = inputs("flux")
    ref = run(model, x)
    cquant.optimize(model)

    seen = []
    handle = model.transformer_blocks[0].attn.to_q.register_forward_hook(lambda *a: seen.append(1))
    assert tm.sqnr_db(ref, run(model, x)) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]
    handle.remove()
    assert seen == [1] and fused_calls["FluxTransformerBlock"] == 1  # the hooked block ran diffusers' forward

    fused_calls.clear()
    with torch.enable_grad():
        out = model(**x)[0]
        out.square().mean().backward()  # parameters require grad: diffusers' forward records the graph
    assert not fused_calls and torch.equal(out.detach(), ref)
    assert model.transformer_blocks[0].attn.to_q.weight.grad is not None

    # calls of one block the fused forward does not cover: an attention mask, a temb shared by the batch
    block = model.transformer_blocks[0]
    h, e, temb = torch.randn(2, 16, 64), torch.randn(2, 8, 64), torch.randn(1, 64)
    rope = model.pos_embed(torch.zeros(24, 3))
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    mask[1, ..., :3] = False
    fused_calls.clear()
    with torch.no_grad():
        for kwargs in (dict(joint_attention_kwargs={"attention_mask": mask}), {}):
            t = temb if not kwargs else temb.expand(2, 64)
            expected = unfused_class(type(block)).forward(block, h, e, t, rope, **kwargs)
            got = block(h, e, t, rope, **kwargs)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert not fused_calls

    model64 = build("flux").double()
    x64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in x.items()}
    ref64 = run(model64, x64)
    cquant.optimize(model64)
    assert torch.equal(run(model64, x64), ref64) and not fused_calls  # float64: libcquant does not take it


# ---------------------------------------------------------------- the model as diffusers and torch see it


def test_state_dict_pickle_and_deepcopy(tmp_path, fused_calls):
    model = build("flux", scheme="int8dq")
    keys = list(model.state_dict())
    cquant.optimize(model)
    assert list(model.state_dict()) == keys
    assert isinstance(model.transformer_blocks[0], diffusers.models.transformers.transformer_flux.FluxTransformerBlock)
    x = inputs("flux")
    out = run(model, x)

    fresh = build("flux", scheme="int8dq", seed=5)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(run(fresh, x), run(build("flux", scheme="int8dq"), x))  # weights, not classes, travel
    cquant.optimize(fresh)
    assert torch.equal(run(fresh, x), out)

    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert type(loaded.transformer_blocks[0]) is type(model.transformer_blocks[0])
    assert torch.equal(run(loaded, x), out)

    clone = copy.deepcopy(model)
    assert type(clone.single_transformer_blocks[0]) is type(model.single_transformer_blocks[0])
    fused_calls.clear()
    assert torch.equal(run(clone, x), out) and fused_calls["FluxTransformerBlock"] == 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend, fused_calls):
    if backend == "inductor":
        from test_compile import inductor_problem

        if inductor_problem():
            pytest.skip(inductor_problem())
    torch._dynamo.reset()
    try:
        model = build("flux", scheme="int8dq")
        cquant.optimize(model)
        x = inputs("flux")
        eager = run(model, x)
        fused_calls.clear()
        # aot_eager traces like inductor (dynamo + AOTAutograd) without a C++ compile
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        out = run(compiled, x)
        assert fused_calls["FluxTransformerBlock"] > 0  # traced through the fused forward
        assert float((out - eager).norm() / eager.norm()) <= COMPILE_REL_L2
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("order", ["cache first", "optimize first"])
def test_first_block_cache(order, fused_calls):
    from diffusers import FirstBlockCacheConfig

    def cached(optimized):
        model = build("flux")
        if optimized and order == "optimize first":
            cquant.optimize(model)
        model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
        if optimized and order == "cache first":
            cquant.optimize(model)
        return model

    plain, fused = cached(False), cached(True)
    calls = [inputs("flux", seed=1), inputs("flux", seed=1), inputs("flux", seed=2)]
    for x in calls:
        with plain.cache_context("cond"), fused.cache_context("cond"):
            ref, out = run(plain, x), run(fused, x)
        assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]
    assert fused_calls["FluxTransformerBlock"] > 0
    # the second call reuses the first's residual: only the first block ran for it
    assert fused_calls["FluxSingleTransformerBlock"] == 4


def _fused_then_unoptimized(model, x, ref, fused_calls):
    """An optimized Flux `model` runs its fused blocks and matches `ref`; unoptimized, it runs
    diffusers' forward again and gives `ref` exactly."""
    fused_calls.clear()
    assert tm.sqnr_db(ref, run(model, x)) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]
    assert dict(fused_calls) == expected_calls("flux")
    cquant.unoptimize(model)
    fused_calls.clear()
    assert torch.equal(run(model, x), ref) and not fused_calls


def test_cache_removed_between_optimize_and_unoptimize(fused_calls):
    """diffusers puts the forward its hooks held back on the block when the cache goes: after
    optimize that is the fused forward, which unoptimize must take back with the class (the
    diffusers forward runs), and a block whose cache went before optimize takes the fused path."""
    from diffusers import FirstBlockCacheConfig

    x = inputs("flux")
    ref = run(build("flux"), x)
    for first in ("cache", "optimize"):
        model = build("flux")
        for step in ((first, "optimize") if first == "cache" else (first, "cache")):
            if step == "cache":
                model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
            else:
                cquant.optimize(model)
        model.disable_cache()
        _fused_then_unoptimized(model, x, ref, fused_calls)

    model = build("flux")
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    model.disable_cache()
    report = cquant.optimize(model)
    fused_calls.clear()
    assert tm.sqnr_db(ref, run(model, x)) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", None)]
    assert dict(fused_calls) == expected_calls("flux") and not report.notes


def test_accelerate_hooks_on_blocks(fused_calls):
    """accelerate's add_hook_to_module keeps the block's bound forward in _old_forward: added after
    optimize it holds the fused forward, which unoptimize must take back (diffusers' forward
    runs); added before, optimize points it at the fused forward, which then runs."""
    hooks = pytest.importorskip("accelerate.hooks")
    x = inputs("flux")
    ref = run(build("flux"), x)
    for hook_first in (False, True):
        model = build("flux")
        if not hook_first:
            cquant.optimize(model)
        for block in model.transformer_blocks:
            hooks.add_hook_to_module(block, hooks.ModelHook())
        if hook_first:
            assert not cquant.optimize(model).notes
        _fused_then_unoptimized(model, x, ref, fused_calls)
        for block in model.transformer_blocks:
            hooks.remove_hook_from_module(block)
        assert torch.equal(run(model, x), ref)


def test_unpickled_optimized_model_takes_a_block_cache(tmp_path):
    """A whole optimized model torch.load-ed in a fresh process (cquant.optimize never called
    there) works with diffusers' FirstBlockCache, which finds blocks by their exact class."""
    model = build("flux")
    cquant.optimize(model)
    x = inputs("flux")
    torch.save((model, x, run(model, x)), tmp_path / "model.pt")
    code = ("import torch\n"
            "from diffusers import FirstBlockCacheConfig\n"
            f"model, x, out = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
            "model.enable_cache(FirstBlockCacheConfig(threshold=0.05))\n"
            "with torch.no_grad(), model.cache_context('cond'):\n"
            "    assert torch.equal(model(**x)[0], out)\n"
            "print('ok')\n")
    assert run_fresh_python(code).split() == ["ok"]


def test_unoptimize_restores_everything(fused_calls):
    model = build("sd3.5", scheme="fp8dqrow")
    x = inputs("sd3.5")
    ref = run(model, x)
    before = {n: (type(m), sorted(m.__dict__)) for n, m in model.named_modules()}
    cquant.optimize(model, cuda_graph=True)
    run(model, x)
    restored = cquant.unoptimize(model)
    assert sorted(restored) == sorted(["transformer_blocks.0", "transformer_blocks.1", "norm_out"])
    assert {n: (type(m), sorted(m.__dict__)) for n, m in model.named_modules()} == before
    fused_calls.clear()
    assert torch.equal(run(model, x), ref) and not fused_calls
    assert cquant.unoptimize(model) == []


def test_unknown_blocks_are_reported_and_left_alone():
    pixart = tm.build("pixart-sigma")
    classes = [type(m) for m in pixart.modules()]
    with pytest.warns(RuntimeWarning, match="no block cquant has a fused forward"):
        report = cquant.optimize(pixart)
    assert not report.installed and [type(m) for m in pixart.modules()] == classes
    skipped = {e.name: e for e in report.skipped}
    assert "transformer_blocks.0" in skipped and "not a block" in skipped["transformer_blocks.0"].reason

    sd3 = build("sd3", qk_norm="layer_norm")
    report = cquant.optimize(sd3)
    assert [e.name for e in report.installed] == ["norm_out"]
    assert {e.name for e in report.skipped} == {"transformer_blocks.0", "transformer_blocks.1"}
    assert all("norm_q is LayerNorm" in e.reason for e in report.skipped)
    assert type(sd3.transformer_blocks[0]) is diffusers.models.attention.JointTransformerBlock

    qwen = build("qwen-image", zero_cond_t=True)
    report = cquant.optimize(qwen)
    assert all("zero_cond_t" in e.reason for e in report.skipped) and len(report.skipped) == 2

    flux = build("flux")
    flux_block = type(flux.transformer_blocks[0])
    flux.transformer_blocks[1].__class__ = type("MyBlock", (flux_block,), {})
    report = cquant.optimize(flux)
    (entry,) = report.skipped
    assert entry.name == "transformer_blocks.1" and "subclass of FluxTransformerBlock" in entry.reason
    text = str(report)
    assert "4 modules fused, 1 skipped" in text and "FluxSingleTransformerBlock" in text


def test_bad_arguments():
    model = build("flux")
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        cquant.optimize(model, cuda_graph="yes")
    for bad in (None, 3, types.SimpleNamespace(transformer="not a module")):
        with pytest.raises(TypeError, match="expected a diffusers transformer"):
            cquant.optimize(bad)
        with pytest.raises(TypeError, match="expected a diffusers transformer"):
            cquant.unoptimize(bad)
    pipe = types.SimpleNamespace(transformer=model)
    assert len(cquant.optimize(pipe).installed) == 5 and len(cquant.unoptimize(pipe)) == 5


# ---------------------------------------------------------------- CUDA graphs


def test_cuda_graph_off_cuda_runs_eagerly():
    model = build("flux", scheme="int8wo")
    x = inputs("flux")
    ref = run(model, x)
    report = cquant.optimize(model, cuda_graph=True)
    assert report.cuda_graph and "CUDA graphs on" in str(report)
    wrapper = cuda_graph.installed(model)
    assert isinstance(wrapper, cuda_graph.CUDAGraphForward)
    with pytest.warns(RuntimeWarning, match="not CUDA tensors"):
        out = run(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(run(model, x), out)
    assert not graph_warnings(caught)  # once per reason
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("float32", "int8wo")]
    clone = copy.deepcopy(model)
    assert cuda_graph.installed(clone).module is clone and torch.equal(run(clone, x), out)
    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert cuda_graph.installed(loaded).module is loaded and torch.equal(run(loaded, x), out)
    cquant.unoptimize(model)
    assert "forward" not in model.__dict__ and not wrapper.enabled


def test_cuda_graph_signatures_and_install():
    def key(*args, **kwargs):
        tensors = []
        return cuda_graph._signature((args, kwargs), tensors), tensors

    x = torch.randn(2, 3)
    k1, t1 = key(x, [1, (2, "a")], flag=True, d={"ids": x, "n": None})
    assert t1 == [x, x] and hash(k1) is not None
    assert key(x.clone(), [1, (2, "a")], flag=True, d={"ids": x, "n": None})[0] == k1  # values of tensors do not count
    for other in (key(x.t(), [1, (2, "a")], flag=True, d={"ids": x, "n": None}),  # strides
                  key(x.half(), [1, (2, "a")], flag=True, d={"ids": x, "n": None}),  # dtype
                  key(x, [1, (3, "a")], flag=True, d={"ids": x, "n": None}),  # a value
                  key(x, [1, (2, "a")], flag=False, d={"ids": x, "n": None})):
        assert other[0] != k1
    rebuilt = cuda_graph._rebuild(((x, [1, (2, "a")]), {"d": {"ids": x}}), iter([x + 1, x + 2]))
    assert torch.equal(rebuilt[0][0], x + 1) and torch.equal(rebuilt[1]["d"]["ids"], x + 2)
    with pytest.raises(cuda_graph._Unkeyable):
        key(x, object())

    class Scaled(torch.nn.Linear):
        def forward(self, x, scale=None):
            return super().forward(x) * (2 if scale is not None else 1)

    lin = Scaled(3, 4)
    wrapper = cuda_graph.install(lin)
    assert cuda_graph.install(lin) is wrapper and lin.forward is wrapper
    expected = torch.nn.functional.linear(x, lin.weight, lin.bias)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="type object cannot be part of a graph's signature"):
            assert torch.equal(lin(x, scale=object()), expected * 2)
        with pytest.warns(RuntimeWarning, match="not CUDA tensors"):
            assert torch.equal(lin(x), expected)
    assert cuda_graph.uninstall(lin) and "forward" not in lin.__dict__ and not cuda_graph.uninstall(lin)


def test_cuda_graph_found_under_hooks_registered_after_it():
    """find() reaches the CUDAGraphForward that diffusers' hooks (enable_parallelism's, for one)
    wrapped after install, and uninstall switches that one off."""
    hooks = pytest.importorskip("diffusers.hooks")
    lin = torch.nn.Linear(3, 4)
    wrapper = cuda_graph.install(lin)
    hooks.HookRegistry.check_if_exists_or_initialize(lin).register_hook(hooks.ModelHook(), "after")
    assert lin.__dict__["forward"] is not wrapper and cuda_graph.installed(lin) is None
    assert cuda_graph.find(lin) is wrapper and wrapper.enabled
    assert cuda_graph.find(torch.nn.Linear(3, 4)) is None
    assert cuda_graph.uninstall(lin) and not wrapper.enabled


def cuda_model(family, scheme, dtype=torch.bfloat16):
    return build(family, dtype, scheme).to("cuda")


def cuda_inputs(family, dtype=torch.bfloat16, seed=1):
    return tm.inputs(FAMILIES[family][0], dtype=dtype, seed=seed, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s or "float")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_blocks_match_diffusers(family, scheme, fused_calls):
    model = cuda_model(family, scheme)
    x = cuda_inputs(family)
    ref = run(model, x)
    cquant.optimize(model)
    out = run(model, x)
    assert dict(fused_calls) == expected_calls(family)
    assert tm.sqnr_db(ref, out) >= OPTIMIZE_MODEL_SQNR_FLOOR_DB[("bfloat16", scheme)]
    ref32 = run(build(family).to("cuda"), cuda_inputs(family, torch.float32))
    assert tm.sqnr_db(ref32, ref) - tm.sqnr_db(ref32, out) <= OPTIMIZE_SQNR_LOSS_DB


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.cuda
def test_cuda_graph_replays_what_eager_computes():
    model = cuda_model("flux", "int8dq")
    cquant.optimize(model)
    calls = [cuda_inputs("flux", seed=s) for s in (1, 2)]
    eager = [run(model, x) for x in calls]
    cquant.optimize(model, cuda_graph=True)
    wrapper = cuda_graph.installed(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, e in zip(calls * 2, eager * 2):  # new inputs are copied in before each replay
            assert rel(run(model, x), e) <= REPLAY_REL_L2
    assert not graph_warnings(caught)
    assert wrapper.num_graphs == 1
    both, _, _ = batch_of_two("flux", torch.bfloat16)
    both = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in both.items()}
    graphed = run(model, both)
    assert wrapper.num_graphs == 2
    cquant.unoptimize(model)
    cquant.optimize(model)
    assert rel(graphed, run(model, both)) <= REPLAY_REL_L2


@pytest.mark.cuda
def test_cuda_graph_limits_and_failures():
    class Syncs(torch.nn.Module):  # .item() cannot be captured
        def forward(self, x):
            return x * float(x.sum().item() > 0)

    m = Syncs()
    f = cuda_graph.install(m)
    x = torch.randn(8, device="cuda")
    with pytest.warns(RuntimeWarning, match="capture failed"), torch.no_grad():
        assert torch.equal(m(x), x * float(x.sum().item() > 0))
    assert f.num_graphs == 0

    model = cuda_model("flux", None)
    cquant.optimize(model, cuda_graph=True)
    wrapper = cuda_graph.installed(model)
    wrapper.max_graphs = 1
    run(model, cuda_inputs("flux"))
    both, _, _ = batch_of_two("flux", torch.bfloat16)
    both = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in both.items()}
    with pytest.warns(RuntimeWarning, match="more than 1 input signatures"):
        run(model, both)
    with pytest.warns(RuntimeWarning, match="autograd is recording"):
        with torch.enable_grad():
            model(**cuda_inputs("flux"))


def test_optimize_and_summary_are_callable_however_they_were_imported():
    """Importing cquant.optimize or cquant.summary as modules first (to reach OptimizeReport, say)
    binds the module where cquant exports the function of the same name: the call still works."""
    out = run_fresh_python(
        "import cquant.optimize, cquant.summary, torch, cquant\n"
        "from cquant.optimize import OptimizeReport\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 32))\n"
        "cquant.quantize_(model, 'int8wo')\n"
        "report = cquant.optimize(model)\n"
        "assert isinstance(report, OptimizeReport) and cquant.unoptimize(model) is not None\n"
        "print(type(cquant.optimize).__name__, len(cquant.summary(model).rows))\n")
    assert out.split() == ["CallableModule", "1"]
