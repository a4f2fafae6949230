"""torch.compile(fullgraph=True) of quantized models on CPU: no graph breaks, same numbers."""

import functools
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from helpers import under_asan  # noqa: E402
from tolerances import COMPILE_REL_L2  # noqa: E402


@functools.lru_cache(maxsize=None)
def inductor_problem():
    """None if inductor can compile C++ kernels on this machine, else why not."""
    if under_asan():
        return "inductor's compile step initialises CUDA, which aborts under an ASan-preloaded interpreter"
    try:
        f = torch.compile(lambda x: (x.sin() * 2 + 1).sum(-1), fullgraph=True)
        f(torch.randn(4, 8))
    except Exception as e:  # no C++ compiler, headers or OpenMP: the local toolchain, not cquant
        return f"inductor cannot compile here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("family, scheme", [("flux", "fp8dqrow"), ("sd3", "int8dq"), ("pixart-sigma", "fp6_e3m2"),
                                            ("cogvideox", "int8wo"), ("qwen-image", "fp8dq")])
def test_fullgraph_traces_every_family(family, scheme):
    # aot_eager traces through dynamo and AOTAutograd like inductor does, without compiling C++:
    # any graph break in the quantized layers would raise here
    model = tm.build(family)
    cquant.quantize_(model, scheme)
    eager = tm.run(model, family)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(tm.run(compiled, family), eager)


def test_inductor_fullgraph_quantized_flux():
    problem = inductor_problem()
    if problem:
        pytest.skip(problem)
    cls, kwargs = tm.CONFIGS["flux"]
    torch.manual_seed(0)
    model = getattr(diffusers, cls)(**dict(kwargs, num_layers=1, num_single_layers=1)).eval()
    cquant.quantize_(model, "int8dq")
    eager = tm.run(model, "flux")
    compiled = torch.compile(model, fullgraph=True)
    assert rel(tm.run(compiled, "flux"), eager) < COMPILE_REL_L2
    # a second, different input reuses the graph
    with torch.no_grad():
        other = tm.inputs("flux", seed=9)
        assert rel(compiled(**other)[0], model(**other)[0]) < COMPILE_REL_L2


def test_compiled_module_graph_has_one_node_per_layer():
    counts = {}

    def backend(gm, example_inputs):
        counts["cquant"] = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "cquant" in str(n.target))
        return gm.forward

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    cquant.quantize_(m, "fp8dqrow")
    with torch.no_grad():
        torch.compile(m, fullgraph=True, backend=backend)(torch.randn(3, 64))
    assert counts["cquant"] == 2


def test_second_call_of_a_compiled_quantized_model_does_not_recompile():
    # the shared-activation hooks cached each processor type on the first call, and dynamo's guard on
    # that cache recompiled the whole model on the second (about 100 s for Flux-dev)
    from cquant import shared_activations

    model = tm.build("flux")
    cquant.quantize_(model, "fp8dqrow")
    shared_activations._allowed_types.clear()  # a fresh process: nothing looked up eagerly yet
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = tm.run(compiled, "flux")
        assert torch.equal(tm.run(compiled, "flux"), first)
