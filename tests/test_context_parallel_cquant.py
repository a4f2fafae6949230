"""cquant's model changes under diffusers' context parallelism, in either order with
`enable_parallelism`: quantize_ (and dequantize_), fuse_qkv_, optimize and enable_attention.

enable_parallelism registers diffusers hooks on modules of the model (Flux's plan: the split of
the inputs on the model, the gather of the output on proj_out). cquant replaces linear layers by
other modules and block classes by fused ones; a hook left behind on a replaced module would make
each rank return only its own shard of the tokens, with no error. CPU: one spawn of 2 gloo
processes runs every case (ring and Ulysses, each change before and after enable_parallelism) and
each rank's whole output is compared with the one-process model given the same change. The
refusals (hooks that cannot move to the new module) run on one process.
"""

import collections
import os
import warnings

import pytest

import cquant
from attention_oracle import rel_l2
from tolerances import ATTN_MODEL_FULL_REL_L2

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import tiny_models as tm  # noqa: E402
from cquant.bench.models import enable_parallelism  # noqa: E402
from test_attention_context_parallel import WORLD, _cp_config, _spawned_results  # noqa: E402

PARALLELISMS = ("ring", "ulysses")
ORDERS = ("before", "after")  # the change before or after enable_parallelism


def _quantize(model):
    cquant.quantize_(model, "int8wo")


def _dequantize(model):
    cquant.quantize_(model, "int8wo")
    cquant.dequantize_(model)


def _everything(model):
    cquant.quantize_(model, "int8dq")
    cquant.fuse_qkv_(model)
    cquant.optimize(model)
    cquant.enable_attention(model, "bf16")


# name: (the change, whether it installs fused blocks)
CHANGES = {
    "quantize": (_quantize, False),
    "dequantize": (_dequantize, False),
    "fuse_qkv": (cquant.fuse_qkv_, False),
    "optimize": (cquant.optimize, True),
    "attention": (lambda model: cquant.enable_attention(model, "bf16"), False),
    "everything": (_everything, True),
}
CASES = [(c, o, p) for c in CHANGES for o in ORDERS for p in PARALLELISMS]


def _model():
    """The tiny Flux of tiny_models (every linear layer quantizable, no zero weights), with a batch of
    two whose token positions are drawn too (tiny_models' are zeros, which a wrong split would not show)."""
    model = tm.build("flux")
    g = torch.Generator().manual_seed(1)
    b, hw, t = 2, 16, 8
    inputs = dict(hidden_states=torch.randn(b, hw, 16, generator=g),
                  encoder_hidden_states=torch.randn(b, t, 64, generator=g),
                  pooled_projections=torch.randn(b, 32, generator=g), timestep=torch.rand(b, generator=g),
                  img_ids=torch.randn(hw, 3, generator=g), txt_ids=torch.randn(t, 3, generator=g), return_dict=False)
    return model, inputs


def _prepared(change):
    """The model before the change: cquant's attention (ring attention needs a backend that gives the
    log-sum-exp), or diffusers' native attention where the change is enable_attention itself."""
    model, inputs = _model()
    if change == "attention":
        model.set_attention_backend("native")
    else:
        cquant.enable_attention(model, "bf16")
    return model, inputs


def _count_fused_calls():
    """Counter of the fused block forwards that ran (as test_optimize's fused_calls)."""
    from cquant.blocks import fused_classes

    counts = collections.Counter()
    for cls in fused_classes().values():
        if hasattr(cls, "_fused"):
            def fused(self, *args, _orig=cls._fused, **kwargs):
                counts["fused"] += 1
                return _orig(self, *args, **kwargs)

            cls._fused = fused
    return counts


def _worker(rank, init_file, out_dir, seed, world):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("cpu:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cquant.register_attention_backends()
    counts = _count_fused_calls()
    results = {}
    try:
        for change, order, parallelism in CASES:
            model, inputs = _prepared(change)
            apply, _ = CHANGES[change]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if order == "before":
                    apply(model)
                enable_parallelism(model, _cp_config(parallelism))
                if order == "after":
                    apply(model)
                counts.clear()
                with torch.no_grad():
                    out = model(**inputs)[0]
            results[change, order, parallelism] = dict(
                out=out, fused=counts["fused"], proj_out=type(model.proj_out).__name__,
                proj_out_hooks=list(getattr(model.proj_out.__dict__.get("_diffusers_hook"), "_hook_order", [])))
        results["exchange"] = _through_cquant_exchange(counts)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _through_cquant_exchange(counts):
    """The "everything" model after enable_parallelism(ulysses) with cquant's own exchange
    (CQUANT_ULYSSES=cquant: NCCL's all-to-alls, here gloo's): its output, and how many fused
    single-stream blocks had their MLP GEMM run by the exchange, while q, k and v travel."""
    from cquant import ulysses

    model, inputs = _prepared("everything")
    inside, exchange, run_beside = [], ulysses._nccl_attention, ulysses.run_beside

    def nccl_attention(*args, **kwargs):
        inside.append(1)
        try:
            return exchange(*args, **kwargs)
        finally:
            inside.pop()

    def counted_run_beside():
        if inside and getattr(ulysses._beside, "work", None) is not None:
            counts["beside_in_exchange"] += 1
        return run_beside()

    os.environ[ulysses.SETTING] = "cquant"
    ulysses._nccl_attention, ulysses.run_beside = nccl_attention, counted_run_beside
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable_parallelism(model, _cp_config("ulysses"))
            _everything(model)
            counts.clear()
            with torch.no_grad():
                out = model(**inputs)[0]
    finally:
        ulysses._nccl_attention, ulysses.run_beside = exchange, run_beside
        del os.environ[ulysses.SETTING]
    return dict(out=out, fused=counts["fused"], beside_in_exchange=counts["beside_in_exchange"],
                single_blocks=len(model.single_transformer_blocks))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{case: [rank 0's result, rank 1's result]} of one 2-process gloo run of every case."""
    return _spawned_results(tmp_path_factory.mktemp("cp_cquant"), _worker, "gloo context-parallel cquant run",
                            WORLD)[1]


@pytest.fixture(scope="module")
def one_process():
    """{change: the one-process model's output after the change}."""
    refs = {}
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        for change, (apply, _) in CHANGES.items():
            model, inputs = _prepared(change)
            apply(model)
            with torch.no_grad():
                refs[change] = model(**inputs)[0]
    return refs


@pytest.mark.parametrize("change, order, parallelism", CASES)
def test_matches_one_process(results, one_process, change, order, parallelism):
    ref = one_process[change]
    for rank, got in enumerate(results[change, order, parallelism]):
        out = got["out"]
        # each rank gathers the whole output (the plan's proj_out): a lost gather hook leaves its shard
        assert out.shape == ref.shape, f"rank {rank}: {tuple(out.shape)}, one process {tuple(ref.shape)}"
        assert rel_l2(out.double().numpy(), ref.double().numpy()) <= ATTN_MODEL_FULL_REL_L2["float32"]
        assert got["proj_out_hooks"] == ["cp_output---proj_out"]
        if change in ("quantize", "everything"):
            assert got["proj_out"] == "QuantizedLinear"  # the change really happened
        if CHANGES[change][1]:
            assert got["fused"] > 0  # the fused block forwards ran under context parallelism


def test_fused_mlp_runs_beside_cquant_exchange(results, one_process):
    """With cquant's Ulysses exchange, each fused single-stream block's MLP GEMM runs while q, k and v
    travel (blocks.common.attention, ulysses.beside_exchange), and the output is the one process's."""
    ref = one_process["everything"]
    for got in results["exchange"]:
        assert got["fused"] > 0 and got["beside_in_exchange"] == got["single_blocks"] > 0, got
        assert rel_l2(got["out"].double().numpy(), ref.double().numpy()) <= ATTN_MODEL_FULL_REL_L2["float32"]


# ---------------------------------------------------------------- one process: hooks that move, hooks that stop


def _register(module, hook, name):
    from diffusers.hooks.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    return hook


def _gather_nothing():
    """A context-parallel gather hook whose plan gathers none of the outputs (None), so that it
    runs without a process group; it counts its calls."""
    from diffusers.hooks.context_parallel import ContextParallelGatherHook

    hook = ContextParallelGatherHook([None], None)
    hook.calls = 0
    post_forward = hook.post_forward

    def counted(module, output):
        hook.calls += 1
        return post_forward(module, output)

    hook.post_forward = counted  # registration takes the instance's post_forward
    return hook


def _counting_hook():
    """A diffusers hook of another kind than context parallelism's (cquant does not move those)."""
    from diffusers.hooks.hooks import ModelHook

    class Counting(ModelHook):
        calls = 0

        def post_forward(self, module, output):
            self.calls += 1
            return output

    return Counting()


def _hook_names(module):
    return list(getattr(module.__dict__.get("_diffusers_hook"), "_hook_order", []))


def _quantized(model):
    return [n for n, m in model.named_modules() if isinstance(m, cquant.nn.QuantizedLinear)]


@pytest.fixture
def quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def test_the_model_itself_keeps_its_hooks(quiet):
    """quantize_ of a torch.nn.Linear turns that module itself into the QuantizedLinear, and
    dequantize_ back: its context-parallel hook runs on what it became."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    hook = _register(layer, _gather_nothing(), "cp_output---")
    x = torch.randn(3, 64)
    cquant.quantize_(layer, "int8wo")
    assert isinstance(layer, cquant.nn.QuantizedLinear) and _hook_names(layer) == ["cp_output---"]
    with torch.no_grad():
        out = layer(x)
        assert hook.calls == 1 and torch.equal(out, cquant.nn.QuantizedLinear.forward(layer, x))
        cquant.dequantize_(layer)
        assert type(layer) is torch.nn.Linear and _hook_names(layer) == ["cp_output---"]
        layer(x)
    assert hook.calls == 2


def test_a_layer_with_other_diffusers_hooks_stays_float(quiet):
    model, inputs = _model()
    hook = _register(model.proj_out, _counting_hook(), "counting")
    with pytest.warns(cquant.SkippedLayersWarning, match=r"diffusers hooks \(counting\)"):
        cquant.quantize_(model, "int8wo")
    assert type(model.proj_out) is torch.nn.Linear and _hook_names(model.proj_out) == ["counting"]
    assert "proj_out" not in _quantized(model) and len(_quantized(model)) > 10
    assert "counting" in cquant.summary(model).skipped["proj_out"]
    with torch.no_grad():
        model(**inputs)
    assert hook.calls == 1


def test_a_split_hook_naming_an_argument_the_new_forward_lacks(quiet):
    """A split hook finds its argument by its position in the module's forward: torch.nn.Linear's
    `input` is QuantizedLinear's `x`, so such a hook does not move (the layer stays float)."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import ContextParallelSplitHook
    from diffusers.models._modeling_parallel import ContextParallelInput

    model, _ = _model()
    plan = {"input": ContextParallelInput(split_dim=1, expected_dims=3)}
    _register(model.proj_out, ContextParallelSplitHook(plan, ContextParallelConfig(ring_degree=2)), "cp_input---")
    cquant.quantize_(model, "int8wo")
    assert type(model.proj_out) is torch.nn.Linear and _hook_names(model.proj_out) == ["cp_input---"]
    assert "'input'" in cquant.summary(model).skipped["proj_out"]


def test_swap_in_refuses_before_changing_anything():
    from cquant.quantize import plan, swap_in

    model, _ = _model()
    layers = plan(model, "int8wo").layers
    _register(model.proj_out, _counting_hook(), "counting")
    with pytest.raises(ValueError, match=r"proj_out cannot become a QuantizedLinear: .*diffusers hooks \(counting\)"):
        swap_in(model, layers)
    assert not _quantized(model)


def test_dequantize_refuses_before_changing_anything(quiet):
    model, _ = _model()
    cquant.quantize_(model, "int8wo")
    quantized = _quantized(model)
    _register(model.proj_out, _counting_hook(), "counting")
    with pytest.raises(ValueError, match=r"proj_out cannot become a torch.nn.Linear: .*diffusers hooks \(counting\)"):
        cquant.dequantize_(model)
    assert _quantized(model) == quantized and _hook_names(model.proj_out) == ["counting"]


@pytest.mark.parametrize("scheme", [None, "int8wo"])
def test_fuse_qkv_refuses_hooked_projections_before_changing_anything(quiet, scheme):
    """The fused layer computes q, k and v in place of the layers the hooks are on."""
    model, _ = _model()
    if scheme is not None:
        cquant.quantize_(model, scheme)
    to_q = model.transformer_blocks[1].attn.to_q
    _register(to_q, _gather_nothing(), "cp_output---q")
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn\.to_q \(cp_output---q\).*hooks would not run"):
        cquant.fuse_qkv_(model)
    for name, mod in model.named_modules():
        assert not getattr(mod, "fused_projections", False) and getattr(mod, "to_qkv", None) is None, name
    assert model.transformer_blocks[1].attn.to_q is to_q


def test_views_of_a_fused_layer_keep_the_hooks(quiet):
    """quantize_ of a fused model makes the unfused q / k / v views of the fused layer; a hook on
    one (it runs once the projections are unfused again) moves to the view."""
    model, inputs = _model()
    cquant.fuse_qkv_(model)
    hook = _register(model.transformer_blocks[0].attn.to_q, _gather_nothing(), "cp_output---q")
    cquant.quantize_(model, "int8wo")
    to_q = model.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, cquant.nn.QuantizedLinearSlice) and _hook_names(to_q) == ["cp_output---q"]
    model.unfuse_qkv_projections()
    with torch.no_grad():
        model(**inputs)
    assert hook.calls == 1


def test_hooked_gelu_modules_are_not_fused(quiet):
    """The GELU of a quantized layer moves into the layer only where no hook is on its module,
    which the module replacing it (or the identity replacing act_mlp) would not run."""
    model, inputs = _model()
    gelu = model.transformer_blocks[0].ff.net[0]
    act = model.single_transformer_blocks[0].act_mlp
    hooks = [_register(gelu, _gather_nothing(), "cp_output---gelu"),
             _register(act, _gather_nothing(), "cp_output---act")]
    cquant.quantize_(model, "int8wo")
    assert model.transformer_blocks[0].ff.net[0] is gelu and model.single_transformer_blocks[0].act_mlp is act
    assert type(model.transformer_blocks[1].ff.net[0]).__name__ == "LinearGELU"  # the others are fused
    with torch.no_grad():
        model(**inputs)
    assert [h.calls for h in hooks] == [1, 1]


def test_diffusers_fuse_qkv_projections_leaves_hooked_modules_unfused(quiet):
    """diffusers' own fuse_qkv_projections fuses one module after another: the quantized module
    whose projections carry hooks stays unfused, with a warning, and its hooks run."""
    model, inputs = _model()
    cquant.quantize_(model, "int8wo")
    hook = _register(model.transformer_blocks[1].attn.to_q, _gather_nothing(), "cp_output---q")
    with pytest.warns(UserWarning, match=r"left unfused: .*to_q \(cp_output---q\)"):
        model.fuse_qkv_projections()
    assert not model.transformer_blocks[1].attn.fused_projections
    assert model.transformer_blocks[0].attn.fused_projections
    with torch.no_grad():
        model(**inputs)
    assert hook.calls == 1
