"""The 4-bit grouped schemes behind QuantizedLinear on CUDA: the same codes as on the CPU, the
layer against its stored weight (decode paths for few rows, GEMMs for many), models in
bfloat16, the low-rank correction, CUDA graphs and loading a checkpoint onto the GPU.

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
from tolerances import GROUP_LINEAR_SQNR_FLOOR_DB, INT4_MODEL_SQNR_FLOOR_DB, QLINEAR_REL_L2, REPLAY_REL_L2  # noqa: E402


def _cuda_usable():
    return torch.cuda.is_available() and cquant._C.built_with_cuda()


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU and cquant built with CUDA")]

SCHEMES = ["int4wo", "int4wo_sym", "int4dq", "int4dq_2l", "fp8da_int4w"]
WIDE = dict(attention_head_dim=64, axes_dims_rope=[16, 24, 24])  # as tests/test_int4_workflow.py


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def runs_here(name):
    """Skip a scheme this GPU has no kernels for (fp8 activations need compute capability 8.9)."""
    major, minor = torch.cuda.get_device_capability()
    need = cquant.schemes.scheme(name).min_compute_capability
    if 10 * major + minor < need:
        pytest.skip(f"{name} needs compute capability {need // 10}.{need % 10}")


def linear(k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype), g


@pytest.mark.parametrize("shape", [(1, 1024, 96), (7, 3072, 48), (16, 256, 1024), (97, 512, 256), (4096, 256, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_on_cuda_matches_the_stored_weight(scheme, dtype, group_size, shape):
    runs_here(scheme)
    m, k, n = shape
    lin, g = linear(k, n, dtype, m * 7 + k + n + group_size)
    config = cquant.config_from_name(scheme, group_size=group_size)
    cpu = QuantizedLinear.from_float(lin, config)
    gpu = QuantizedLinear.from_float(lin.cuda(), config)
    # the same codes and scales on both devices (cq_numerics.h is shared by C and CUDA)
    assert torch.equal(gpu.weight.cpu(), cpu.weight) and torch.equal(gpu.weight_scale.cpu(), cpu.weight_scale)
    x = torch.randn(m, k, generator=g).to(dtype)
    y = gpu(x.cuda())
    assert y.is_cuda and y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    if cpu.scheme.dynamic:
        ref = x.double() @ lin.weight.double().T.cpu() + lin.bias.double().cpu()
        assert sqnr_db(ref, y) > GROUP_LINEAR_SQNR_FLOOR_DB[scheme]
    else:
        # weight-only: x times the stored weight rounded to x's dtype (cquant.h), fp32 sums
        wq = cpu.dequantize(torch.float32).to(dtype).double()
        ref = x.double() @ wq.T + lin.bias.double().cpu()
        rel = float((y.double().cpu() - ref).norm() / ref.norm())
        assert rel < QLINEAR_REL_L2[str(dtype).split(".")[1]], rel


@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_on_cuda_in_bfloat16(scheme):
    pytest.importorskip("diffusers")
    runs_here(scheme)
    with tm.native_attention():
        ref = tm.run(tm.build("flux", **WIDE), "flux")
        model = tm.build("flux", dtype=torch.bfloat16, **WIDE)
        cquant.quantize_(model, cquant.config_from_name(scheme, group_size=64), device="cuda")
        assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, QuantizedLinear))
        y = tm.run(model, "flux", device="cuda")
        assert tm.sqnr_db(ref, y) > INT4_MODEL_SQNR_FLOOR_DB[scheme] - 3  # bfloat16 activations cost a little
        moved = copy.deepcopy(model).to("cpu")
        assert tm.sqnr_db(y.float().cpu(), tm.run(moved, "flux", dtype=torch.bfloat16)) > 25


def test_lowrank_correction_on_cuda():
    lin, g = linear(512, 256, torch.bfloat16, 3)
    cpu = QuantizedLinear.from_float(lin, "int4wo_r16")
    gpu = QuantizedLinear.from_float(lin.cuda(), "int4wo_r16")
    assert gpu.lowrank_up.is_cuda and gpu.lowrank_up.dtype == torch.bfloat16
    # the factors come from an SVD on each device: the same correction up to its round-off
    assert sqnr_db(cpu.dequantize(torch.float32), gpu.dequantize(torch.float32).cpu()) > 40
    x = torch.randn(33, 512, generator=g).to(torch.bfloat16)
    assert sqnr_db(cpu(x).float(), gpu(x.cuda()).float().cpu()) > 35


def test_cuda_graph_replay():
    runs_here("int4dq")
    layer = QuantizedLinear.from_float(linear(256, 128, torch.bfloat16, 5)[0].cuda(), "int4dq_g64")
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = layer(x)
    assert float((y.float() - want.float()).norm() / want.float().norm()) < REPLAY_REL_L2
    assert not torch.equal(y, eager)


def test_from_pretrained_onto_the_gpu(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    with tm.native_attention():
        model = tm.build("flux", dtype=torch.bfloat16, **WIDE)
        cquant.quantize_(model, cquant.Int4WeightOnlyConfig(64), device="cuda")
        y = tm.run(model, "flux", device="cuda")
        model.save_pretrained(tmp_path)
        loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda")
        layers = [m for m in loaded.modules() if isinstance(m, QuantizedLinear)]
        assert layers and all(m.weight.is_cuda and m.weight_scale.is_cuda for m in layers)
        assert torch.equal(tm.run(loaded, "flux", device="cuda"), y)
