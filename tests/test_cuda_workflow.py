"""The quantize_ workflow on CUDA: kernels behind QuantizedLinear, layer-by-layer quantization
onto the GPU, CUDA graphs, torch.compile, from_pretrained with device_map, streams.

Marked `cuda`; skipped without a GPU or a CUDA build of cquant.
"""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.metrics import sqnr_db  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from helpers import ungrouped_schemes  # noqa: E402
from tolerances import (COMPILE_CUDA_REL_L2, COMPILE_CUDA_SQNR_LOSS_DB, MODEL_SQNR_FLOOR_BF16_DB, QLINEAR_DYNAMIC_SQNR_FLOOR_DB,  # noqa: E402
                        QLINEAR_REL_L2, REPLAY_REL_L2)


def _cuda_usable():
    return torch.cuda.is_available() and cquant._C.built_with_cuda()


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU and cquant built with CUDA")]

SCHEMES = ungrouped_schemes(cquant.SCHEME_NAMES)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def diffusers():
    return pytest.importorskip("diffusers")


@pytest.fixture
def poison():
    """torch.empty fills new memory with NaN: an output element a kernel forgets to write shows."""
    import torch.utils.deterministic as det

    old = det.fill_uninitialized_memory, torch.are_deterministic_algorithms_enabled()
    det.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    det.fill_uninitialized_memory = old[0]
    torch.use_deterministic_algorithms(old[1])


def rel(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())




@pytest.mark.parametrize("shape", [(1, 1040, 97), (7, 3072, 33), (97, 64, 1024), (4096, 256, 48)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES + ["fp8wo_e5m2", "fp3_e1m1"])
def test_layer_on_cuda_matches_the_stored_weight(scheme, dtype, shape, poison):
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 7 + k + n)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=g))
    lin = lin.to(dtype)
    cpu = QuantizedLinear.from_float(lin, scheme)
    gpu = QuantizedLinear.from_float(lin.cuda(), scheme)
    # the same codes and scales on both devices (cq_numerics.h is shared by C and CUDA)
    assert torch.equal(gpu.weight.cpu(), cpu.weight) and torch.equal(gpu.weight_scale.cpu(), cpu.weight_scale)
    x = torch.randn(m, k, generator=g).to(dtype)
    y = gpu(x.cuda())
    assert y.is_cuda and y.dtype == dtype and torch.isfinite(y).all()
    ref = x.double() @ cpu.dequantize(torch.float32).double().T + lin.bias.double().cpu()
    if cpu.scheme.dynamic:
        assert sqnr_db(ref, y) > QLINEAR_DYNAMIC_SQNR_FLOOR_DB[scheme]
    else:
        rel = float((y.double().cpu() - ref).norm() / ref.norm())
        assert rel < QLINEAR_REL_L2[str(dtype).split(".")[1]], rel


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["flux", "qwen-image", "sd3"])
def test_model_on_cuda(family, scheme, diffusers):
    ref = tm.run(tm.build(family), family)
    model = tm.build(family, dtype=torch.bfloat16).cuda()
    cquant.quantize_(model, scheme)
    assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, QuantizedLinear))
    y = tm.run(model, family, device="cuda")
    assert tm.sqnr_db(ref, y) > MODEL_SQNR_FLOOR_BF16_DB[scheme]


def test_quantize_onto_the_gpu_layer_by_layer():
    n_layers, width = 24, 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n_layers)]).to(torch.bfloat16)
    float_layer = width * width * 2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cquant.quantize_(model, "int8wo", device="cuda")
    torch.cuda.synchronize()
    quantized = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    assert quantized < n_layers * (width * width + 6 * width) + (1 << 20)
    # never more than the quantized layers so far plus one float layer (and its codes) in flight
    assert peak < quantized + 2 * float_layer + (8 << 20), (peak, quantized)


def test_quantize_diffusers_model_onto_the_gpu(diffusers):
    model = tm.build("flux", dtype=torch.bfloat16)
    cquant.quantize_(model, "fp8dqrow", device="cuda")
    assert all(p.is_cuda for p in model.parameters())
    assert torch.isfinite(tm.run(model, "flux", device="cuda")).all()


def _captured(model, name):
    inputs = tm.inputs(name, dtype=torch.bfloat16, device="cuda")
    static = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(2):  # warm-up: caches, cuBLASLt heuristics, lazy initialisation
            model(**static, **rest)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(**static, **rest)[0]
    return graph, static, out


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp6_e3m2"])
def test_cuda_graph_capture_and_replay(scheme, diffusers):
    model = tm.build("flux", dtype=torch.bfloat16).cuda()
    cquant.quantize_(model, scheme)
    graph, static, out = _captured(model, "flux")
    for seed in (3, 4):
        fresh = tm.inputs("flux", dtype=torch.bfloat16, seed=seed, device="cuda")
        for k, v in static.items():
            v.copy_(fresh[k])
        graph.replay()
        with torch.no_grad():
            eager = model(**fresh)[0]
        torch.cuda.synchronize()
        # the same kernels replayed: equal unless a GEMM picks a split-K reduction order per launch
        assert rel(out, eager) < REPLAY_REL_L2


def test_compile_reduce_overhead(diffusers):
    model = tm.build("flux", dtype=torch.bfloat16).cuda()
    seeds = (1, 2, 3)

    def outputs(m, dtype=torch.bfloat16):
        with torch.no_grad():
            return [m(**tm.inputs("flux", dtype=dtype, seed=s, device="cuda"))[0].clone() for s in seeds]

    refs = outputs(copy.deepcopy(model).float(), torch.float32)
    cquant.quantize_(model, "fp8dqrow")
    eager = outputs(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):  # record, then replay the CUDA graph
        got = outputs(compiled)
    # inductor rounds the elementwise ops around the layers differently, and fp8 activation
    # rounding amplifies that: compiled and eager are two equally good approximations, so
    # their accuracy is compared on average over several inputs
    for y, e in zip(got, eager):
        assert rel(y, e) < COMPILE_CUDA_REL_L2
    mean = lambda ys: sum(sqnr_db(r, y) for r, y in zip(refs, ys)) / len(ys)  # noqa: E731
    assert mean(got) > mean(eager) - COMPILE_CUDA_SQNR_LOSS_DB


@pytest.mark.parametrize("scheme", ["int8dq", "fp6_e3m2"])
def test_compile_inductor_fullgraph(scheme, diffusers):
    model = tm.build("sd3", dtype=torch.bfloat16).cuda()
    cquant.quantize_(model, scheme)
    eager = tm.run(model, "sd3", device="cuda")
    y = tm.run(torch.compile(model, fullgraph=True), "sd3", device="cuda")
    assert rel(y, eager) < COMPILE_CUDA_REL_L2


# GPU clock cycles torch.cuda._sleep spins for before each quantized layer: about 25 ms at H100
# clocks, far longer than the host takes to enqueue one layer's ops.
LAYER_SLEEP_CYCLES = 50_000_000


def test_side_stream_gives_the_same_result(diffusers):
    """A forward on a side stream where each quantized layer's input is copied behind a long
    sleep kernel there: a cquant kernel enqueued on any other stream would read the copy
    before it is written (memory that held another forward's values: the decoy run). After
    each layer the side stream must still be sleeping, so its kernels were enqueued without
    waiting for it (a hidden synchronization would show there too)."""
    model = tm.build("qwen-image", dtype=torch.bfloat16).cuda()
    cquant.quantize_(model, "fp8dqrow")
    a = tm.run(model, "qwen-image", device="cuda")
    s = torch.cuda.Stream()
    busy = []

    def late_input(module, args):
        torch.cuda._sleep(LAYER_SLEEP_CYCLES)
        return (args[0].clone(), *args[1:])

    def still_sleeping(module, args, out):
        busy.append(not s.query())

    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model(**tm.inputs("qwen-image", dtype=torch.bfloat16, seed=2, device="cuda"))  # decoy
        hooks = [h for m in layers for h in (m.register_forward_pre_hook(late_input),
                                              m.register_forward_hook(still_sleeping))]
        try:
            b = tm.run(model, "qwen-image", device="cuda")
        finally:
            for h in hooks:
                h.remove()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert busy and all(busy), f"the side stream was idle after {busy.count(False)} of {len(busy)} layers"
    assert rel(b, a) < REPLAY_REL_L2


def test_from_pretrained_onto_the_gpu(tmp_path, diffusers):
    tm.build("flux").save_pretrained(tmp_path / "float")
    model = diffusers.FluxTransformer2DModel.from_pretrained(
        tmp_path / "float", quantization_config=cquant.CQuantConfig("fp8dqrow"), dtype=torch.bfloat16,
        device_map="cuda")
    assert all(p.is_cuda for p in model.parameters())
    ref = copy.deepcopy(tm.build("flux")).to(torch.bfloat16).cuda()
    cquant.quantize_(ref, "fp8dqrow")
    assert torch.equal(model.proj_out.weight, ref.proj_out.weight)
    y = tm.run(model, "flux", device="cuda")
    model.save_pretrained(tmp_path / "q")
    again = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "q", dtype=torch.bfloat16,
                                                             device_map="cuda")
    assert again.proj_out.weight.is_cuda
    assert torch.equal(tm.run(again, "flux", device="cuda"), y)
