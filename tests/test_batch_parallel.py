"""cquant.enable_batch_parallel: each rank runs its slice of a (CFG) batch, and every rank gets the
whole output.

CPU: one spawn of 2 gloo processes runs every case that needs a process group (tiny SD3, Flux,
CogVideoX, PixArt-Sigma and Qwen-Image at batch 2, as a CFG pipeline calls them; batch 4; the
odd-batch fallback; quantize_ and optimize in either order; inference_mode; deepcopy; the
refusals). Each rank saves its results and the tests here compare each rank's whole output with
the one-process model's output on the whole batch. The refusals that need no process group run
here, on one process.
"""

import copy
import os
import pickle
import warnings

import pytest

import cquant
from attention_oracle import rel_l2

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import tiny_models as tm  # noqa: E402
from cquant.bench.models import enable_parallelism  # noqa: E402
from test_attention_context_parallel import WORLD, _spawned_results  # noqa: E402

from tolerances import BATCH_PARALLEL_REL_L2  # noqa: E402
# name: (tiny_models name, batch, return_dict)
MODEL_CASES = {
    "sd3": ("sd3", 2, False),
    "flux": ("flux", 2, True),
    "cogvideox": ("cogvideox", 2, False),
    "pixart": ("pixart-sigma", 2, False),
    "qwen": ("qwen-image", 2, False),
    "sd3_batch4": ("sd3", 4, False),
}
ORDERS = ("before", "after")  # quantize_ + optimize before or after enable_batch_parallel


def _inputs(name, batch, return_dict=False):
    """A batch of `batch` different samples (latents, text, timesteps, masks: every per-sample
    argument differs between rows, so a row given to the wrong rank shows)."""
    g = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def mask():  # the first sample's prompt padded after 5 of its 8 tokens, as a pipeline pads it
        m = torch.ones(batch, 8)
        m[0, 5:] = 0
        return m

    t = torch.rand(batch, generator=g)
    if name == "flux":
        ins = dict(hidden_states=randn(batch, 16, 16), encoder_hidden_states=randn(batch, 8, 64),
                   pooled_projections=randn(batch, 32), timestep=t, img_ids=randn(16, 3), txt_ids=randn(8, 3))
    elif name == "sd3":
        ins = dict(hidden_states=randn(batch, 4, 16, 16), encoder_hidden_states=randn(batch, 8, 64),
                   pooled_projections=randn(batch, 32), timestep=t * 1000)
    elif name == "pixart-sigma":
        ins = dict(hidden_states=randn(batch, 4, 8, 8), encoder_hidden_states=randn(batch, 8, 64),
                   timestep=(t * 1000).long(), encoder_attention_mask=mask(),
                   added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    elif name == "cogvideox":
        ins = dict(hidden_states=randn(batch, 3, 4, 8, 8), encoder_hidden_states=randn(batch, 8, 64),
                   timestep=(t * 1000).long())
    elif name == "qwen-image":
        ins = dict(hidden_states=randn(batch, 16, 16), encoder_hidden_states=randn(batch, 8, 64),
                   encoder_hidden_states_mask=mask(), timestep=t, img_shapes=[[(1, 4, 4)]] * batch)
    else:
        raise KeyError(name)
    ins["return_dict"] = return_dict
    return ins


def _sample(out):
    return out.sample if hasattr(out, "sample") else out[0]


def _quantize_optimize(model):
    cquant.quantize_(model, "int8wo")
    # cuda_graph: its forward replaces the model's own (on the CPU it runs eagerly); the split and
    # the gather must stay outside it in either order
    return len(cquant.optimize(model, cuda_graph=True).installed)


def _seen(model):
    """The hidden_states each forward call of model receives after the split (a pre-hook
    registered after enable_batch_parallel runs after its own)."""
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].clone()), with_kwargs=True)
    return seen


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the type and message are what the tests check)
        return type(e).__name__, str(e)
    return None


# ---------------------------------------------------------------- the 2-process run


def _model_cases(results):
    for case, (name, batch, return_dict) in MODEL_CASES.items():
        model = tm.build(name)
        cquant.enable_batch_parallel(model)
        seen = _seen(model)
        ins = _inputs(name, batch, return_dict)
        with torch.no_grad():
            if case == "sd3_batch4":  # hidden_states by position, as well
                out = model(ins.pop("hidden_states"), **ins)
            else:
                out = model(**ins)
        results[case] = dict(out=_sample(out), type=type(out).__name__, seen=seen)


def _odd_batch(results):
    model = tm.build("sd3")
    cquant.enable_batch_parallel(model)
    seen = _seen(model)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        outs = [model(**_inputs("sd3", 3))[0] for _ in range(2)]
    results["odd"] = dict(out=outs, seen=[s.shape[0] for s in seen],
                          warnings=[str(w.message) for w in caught if "batch parallelism" in str(w.message)])


def _quantized(results):
    for order in ORDERS:
        model = tm.build("flux")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CUDA-graph forward's "no CUDA tensors": it runs eagerly
            if order == "before":
                fused = _quantize_optimize(model)
            cquant.enable_batch_parallel(model)
            if order == "after":
                fused = _quantize_optimize(model)
            seen = _seen(model)
            with torch.inference_mode():
                out = model(**_inputs("flux", 2))[0]
        results[f"quantized_{order}"] = dict(out=out, fused=fused, seen=[s.shape[0] for s in seen],
                                             graph_forward=type(model.__dict__.get("forward")).__name__)


def _inference_mode_and_copies(results):
    model = tm.build("flux")
    cquant.enable_batch_parallel(model)
    ins = _inputs("flux", 2)
    with torch.inference_mode():
        results["inference_mode"] = dict(out=model(**ins)[0])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin_out = twin(**ins)[0]
    cquant.disable_batch_parallel(twin)
    seen = _seen(model)
    with torch.no_grad():
        out = model(**ins)[0]  # still on: disabling the copy left the original alone
    results["deepcopy"] = dict(out=twin_out, original=out, original_seen=[s.shape[0] for s in seen],
                               pickle=_error(lambda: pickle.dumps(model)))
    cquant.disable_batch_parallel(model)
    seen.clear()
    with torch.no_grad():
        out = model(**ins)[0]
    results["disabled"] = dict(out=out, seen=[s.shape[0] for s in seen])


def _groups(results, rank):
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(WORLD)]  # every rank makes every group
    only_1 = dist.new_group([1])
    model = tm.build("sd3")
    ins = _inputs("sd3", 2)
    with torch.no_grad():
        plain = model(**ins)[0]
        cquant.enable_batch_parallel(model, group=singles[rank])
        seen = _seen(model)
        out = model(**ins)[0]
    results["group_of_one"] = dict(equal=torch.equal(out, plain), seen=[s.shape[0] for s in seen])
    results["twice_same_group"] = _error(lambda: cquant.enable_batch_parallel(model, group=singles[rank]))
    results["hooks_after_twice"] = len(model._forward_pre_hooks)
    results["twice_other_group"] = _error(lambda: cquant.enable_batch_parallel(model))
    results["not_a_member"] = _error(lambda: cquant.enable_batch_parallel(tm.build("sd3"), group=only_1))
    results["not_a_group"] = _error(lambda: cquant.enable_batch_parallel(tm.build("sd3"), group="world"))


def _refusals(results):
    from diffusers import ContextParallelConfig

    cp = ContextParallelConfig(ulysses_degree=WORLD)
    ins = _inputs("flux", 2)
    model = cquant.enable_attention(tm.build("flux"), "bf16")  # a backend context parallelism takes
    enable_parallelism(model, cp)
    results["context_parallel_first"] = _error(lambda: cquant.enable_batch_parallel(model))

    model = cquant.enable_batch_parallel(cquant.enable_attention(tm.build("flux"), "bf16"))
    enable_parallelism(model, cp)
    with torch.no_grad():
        results["context_parallel_after"] = _error(lambda: model(**ins))

    model = cquant.enable_batch_parallel(tm.build("flux"))
    bad = dict(ins, pooled_projections=torch.randn(3, 32))
    with torch.no_grad():
        results["rows_mismatch"] = _error(lambda: model(**bad))
        # the hooks keep no state from a call that raised: the next one splits and gathers
        results["after_an_error"] = dict(out=model(**ins)[0])


def _worker(rank, init_file, out_dir, seed, world):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("cpu:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cquant.register_attention_backends()
    results = {}
    try:
        with tm.native_attention():
            _model_cases(results)
            _odd_batch(results)
            _quantized(results)
            _inference_mode_and_copies(results)
            _groups(results, rank)
            _refusals(results)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{case: [rank 0's result, rank 1's result]} of one 2-process gloo run of every case."""
    return _spawned_results(tmp_path_factory.mktemp("batch_parallel"), _worker, "gloo batch-parallel run", WORLD)[1]


@pytest.fixture(scope="module")
def one_process():
    """{case: the one-process model's output on the whole batch}."""
    refs = {}
    with warnings.catch_warnings(), tm.native_attention(), torch.no_grad():
        warnings.simplefilter("ignore")
        for case, (name, batch, _) in MODEL_CASES.items():
            refs[case] = tm.build(name)(**_inputs(name, batch))[0]
        refs["odd"] = tm.build("sd3")(**_inputs("sd3", 3))[0]
        refs["flux"] = tm.build("flux")(**_inputs("flux", 2))[0]
        model = tm.build("flux")
        _quantize_optimize(model)
        refs["quantized"] = model(**_inputs("flux", 2))[0]
    return refs


def _close(out, ref):
    assert out.shape == ref.shape, f"{tuple(out.shape)}, one process {tuple(ref.shape)}"
    err = rel_l2(out.double().numpy(), ref.double().numpy())
    assert err <= BATCH_PARALLEL_REL_L2, f"rel. L2 {err:.3g}"


# ---------------------------------------------------------------- each rank's output


def test_the_samples_differ(one_process):
    """The tolerance can fail: the two samples of each CFG batch are far apart."""
    for case in MODEL_CASES:
        ref = one_process[case]
        assert rel_l2(ref[:1].double().numpy(), ref[1:2].double().numpy()) > 1000 * BATCH_PARALLEL_REL_L2, case


@pytest.mark.parametrize("case", MODEL_CASES)
def test_every_rank_gets_the_whole_batch(results, one_process, case):
    name, batch, return_dict = MODEL_CASES[case]
    ranks = results[case]
    ins = _inputs(name, batch)
    rows = batch // WORLD
    for rank, got in enumerate(ranks):
        _close(got["out"], one_process[case])
        assert got["type"] == ("Transformer2DModelOutput" if return_dict else "tuple")
        # rank r ran rows [r * B / W, (r + 1) * B / W) and nothing else
        assert len(got["seen"]) == 1 and torch.equal(got["seen"][0], ins["hidden_states"][rank * rows:(rank + 1) * rows])
    assert torch.equal(ranks[0]["out"], ranks[1]["out"])  # gathered: the same bits on every rank


def test_an_odd_batch_runs_whole_on_every_rank_and_warns_once(results, one_process):
    for got in results["odd"]:
        assert got["seen"] == [3, 3]
        for out in got["out"]:
            _close(out, one_process["odd"])
        assert len(got["warnings"]) == 1 and "batch of 3" in got["warnings"][0] and "2 ranks" in got["warnings"][0]


@pytest.mark.parametrize("order", ORDERS)
def test_quantize_and_optimize_in_either_order(results, one_process, order):
    """int8wo and the fused blocks (with the CUDA-graph forward), under inference_mode: bit for
    bit, as libcquant's CPU reference computes each row on its own whatever the row count."""
    for got in results[f"quantized_{order}"]:
        assert torch.equal(got["out"], one_process["quantized"])
        assert got["fused"] > 0 and got["graph_forward"] == "CUDAGraphForward"
        assert got["seen"] == [1]


def test_inference_mode(results, one_process):
    for got in results["inference_mode"]:
        _close(got["out"], one_process["flux"])


def test_deepcopy_is_enabled_on_the_same_group_and_disable_undoes(results, one_process):
    for got in results["deepcopy"]:
        _close(got["out"], one_process["flux"])
        _close(got["original"], one_process["flux"])
        assert got["original_seen"] == [1]
        assert got["pickle"][0] == "TypeError" and "disable_batch_parallel" in got["pickle"][1]
    for got in results["disabled"]:
        _close(got["out"], one_process["flux"])
        assert got["seen"] == [2]  # the whole batch again


def test_a_group_of_one_changes_nothing(results):
    for got in results["group_of_one"]:
        assert got["equal"] and got["seen"] == [2]


def test_enabling_twice(results):
    for rank in range(WORLD):
        assert results["twice_same_group"][rank] is None
        assert results["hooks_after_twice"][rank] == 2  # its own pre-hook and _seen's: none added
        kind, message = results["twice_other_group"][rank]
        assert kind == "ValueError" and "another group" in message and "disable_batch_parallel" in message


def test_group_refusals(results):
    kind, message = results["not_a_member"][0]
    assert kind == "ValueError" and "not a member" in message
    assert results["not_a_member"][1] is None
    for kind, message in results["not_a_group"]:
        assert kind == "TypeError" and "ProcessGroup" in message and "str" in message


def test_context_parallelism_in_either_order(results):
    for kind, message in results["context_parallel_first"]:
        assert kind == "ValueError" and "enable_parallelism" in message
    for kind, message in results["context_parallel_after"]:
        assert kind == "RuntimeError" and "enable_parallelism was called after" in message


def test_a_per_sample_argument_of_another_batch(results, one_process):
    for (kind, message), after in zip(results["rows_mismatch"], results["after_an_error"]):
        assert kind == "ValueError" and "pooled_projections has 3 rows, expected 2" in message
        _close(after["out"], one_process["flux"])


# ---------------------------------------------------------------- one process


def test_without_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match=r"torch.distributed initialized.*init_process_group"):
        cquant.enable_batch_parallel(tm.build("sd3"))


def test_a_model_it_does_not_know():
    with pytest.raises(TypeError, match=r"per sample for FluxTransformer2DModel, .*got a Linear"):
        cquant.enable_batch_parallel(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"a diffusers transformer .* or a pipeline .* got str"):
        cquant.enable_batch_parallel("transformer")


def test_a_subclass_with_its_own_forward():
    from diffusers import SD3Transformer2DModel

    class Custom(SD3Transformer2DModel):
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs)

    model = Custom(**tm.CONFIGS["sd3"][1])
    with pytest.raises(TypeError, match=r"Custom is a SD3Transformer2DModel with a forward of its own"):
        cquant.enable_batch_parallel(model)


def test_an_argument_it_does_not_know(monkeypatch):
    from cquant import batch_parallel

    spec = dict(batch_parallel.FAMILIES["FluxTransformer2DModel"])
    del spec["guidance"]
    monkeypatch.setitem(batch_parallel.FAMILIES, "FluxTransformer2DModel", spec)
    with pytest.raises(TypeError, match=r"takes 'guidance', not known to batch parallelism"):
        cquant.enable_batch_parallel(tm.build("flux"))


def test_every_argument_of_every_family_is_described():
    """The descriptions name exactly the arguments of the installed diffusers' forwards."""
    import inspect

    import diffusers
    from cquant.batch_parallel import FAMILIES

    for name, spec in FAMILIES.items():
        params = list(inspect.signature(getattr(diffusers, name).forward).parameters)[1:]
        assert sorted(params) == sorted(spec), name


def test_disable_of_a_model_never_enabled():
    assert cquant.disable_batch_parallel(tm.build("sd3")) is False


def test_the_split_of_each_kind_of_argument():
    """Rank 1 of 2 at batch 4 (rows 2 and 3): tensors and lists of tensors by rows, per-sample
    lists by entries, the described entries of a dict argument; one row, a scalar and what is
    not per sample stay whole."""
    from cquant.batch_parallel import FAMILIES, _split

    spec = FAMILIES["FluxTransformer2DModel"]
    x, ids, one = torch.randn(4, 3), torch.randn(4, 3), torch.randn(1, 3)
    ip = [torch.randn(4, 2), torch.randn(4, 5)]
    call = dict(hidden_states=x, img_ids=ids, timestep=torch.tensor(0.5), guidance=one,
                controlnet_block_samples=[x, x + 1], joint_attention_kwargs={"ip_adapter_image_embeds": ip, "scale": 2})
    got = {n: _split(v, spec[n], n, 2, 2, 4) for n, v in call.items()}
    assert torch.equal(got["hidden_states"], x[2:]) and got["img_ids"] is ids
    assert got["timestep"] is call["timestep"] and got["guidance"] is one
    assert all(torch.equal(a, b[2:]) for a, b in zip(got["controlnet_block_samples"], [x, x + 1]))
    kwargs = got["joint_attention_kwargs"]
    assert kwargs["scale"] == 2 and all(torch.equal(a, b[2:]) for a, b in zip(kwargs["ip_adapter_image_embeds"], ip))
    lora_only = {"scale": 2}
    assert _split(lora_only, spec["joint_attention_kwargs"], "joint_attention_kwargs", 2, 2, 4) is lora_only
    shapes = [[(1, h, 4)] for h in range(4)]
    assert _split(shapes, FAMILIES["QwenImageTransformer2DModel"]["img_shapes"], "img_shapes", 2, 2, 4) == shapes[2:]
    assert _split(shapes[:1], FAMILIES["QwenImageTransformer2DModel"]["img_shapes"], "img_shapes", 2, 2, 4) == shapes[:1]
    with pytest.raises(ValueError, match=r"controlnet_block_samples\[1\] has 3 rows, expected 4"):
        _split([x, x[:3]], spec["controlnet_block_samples"], "controlnet_block_samples", 2, 2, 4)
