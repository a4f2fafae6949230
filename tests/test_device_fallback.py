"""Quantized layers on a CUDA device that cannot run their scheme's kernels: a documented float
fallback with one warning per (device, scheme), and quantize_ refusing such a device. The device
is simulated on the CPU by replacing libcquant's device queries."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
from cquant import device_fallback, ops  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from cquant.quantize import _device_refusal  # noqa: E402
from cquant.schemes import scheme  # noqa: E402


@pytest.fixture
def device(monkeypatch):
    """A simulated CUDA device: set .cc and .image (None, or why the build has no kernel for it)."""

    class Device:
        cc, image, queries = 90, None, 0

    def capability(index):
        Device.queries += 1
        return Device.cc

    monkeypatch.setattr(ops, "built_with_cuda", lambda: True)
    monkeypatch.setattr(ops, "cuda_compute_capability", capability)
    monkeypatch.setattr(ops, "cuda_device_supported", lambda i: (Device.image is None, Device.image or ""))
    monkeypatch.setattr(device_fallback, "_refusals", {})
    monkeypatch.setattr(device_fallback, "_device_refusals", {})
    return Device


def test_old_gpu_is_refused_once_per_device_and_scheme(device):
    device.cc = 75
    with pytest.warns(device_fallback.DeviceFallbackWarning, match=r"fp8dqrow layers on cuda:0 .* 7\.5.* 8\.9"):
        assert "7.5" in device_fallback.kernel_refusal(0, scheme("fp8dqrow"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second query for the same pair
        queries = device.queries
        device_fallback.kernel_refusal(0, scheme("fp8dqrow"))
        assert device.queries == queries
    with pytest.warns(device_fallback.DeviceFallbackWarning, match="fp8dq layers on cuda:0"):
        device_fallback.kernel_refusal(0, scheme("fp8dq"))
    with pytest.warns(device_fallback.DeviceFallbackWarning, match="cuda:1"):
        device_fallback.kernel_refusal(1, scheme("fp8dqrow"))


def test_new_enough_gpu_runs_the_kernels(device):
    device.cc = 90
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in cquant.SCHEME_NAMES:
            assert device_fallback.kernel_refusal(0, scheme(name)) is None


def test_no_kernel_image_is_refused(device):
    device.image = "built for sm_90a only"
    with pytest.warns(device_fallback.DeviceFallbackWarning, match="no kernel image .*sm_90a"):
        assert device_fallback.kernel_refusal(0, scheme("int8wo")) is not None


def test_quantize_refuses_a_device_without_kernel_image(device):
    device.image = "built for sm_90a only"
    reason = _device_refusal(scheme("int8wo"), torch.nn.Linear(64, 32), torch.device("cuda", 0))
    assert "no kernel image" in reason and "sm_90a" in reason


def test_layer_checks_its_device_once(device, monkeypatch):
    layer = QuantizedLinear.from_float(torch.nn.Linear(64, 32), "fp8dqrow")
    calls = []
    monkeypatch.setattr("cquant.nn.kernel_refusal", lambda d, s: calls.append(d) or "too old")
    layer._check_kernels(0)
    assert layer._fallback and layer._kernel_device == 0 and calls == [0]
    layer.to(torch.float16)  # a move or cast forgets the device: asked again on the next CUDA call
    assert not layer._fallback and layer._kernel_device == -1


@pytest.mark.parametrize("name", ["int8wo", "int8dq", "fp8dqrow", "fp8dq", "fp6_e3m2", "fp4_e2m1"])
@pytest.mark.parametrize("gelu", [False, True])
def test_float_fallback_matches_the_dequantized_layer(name, gelu):
    g = torch.Generator().manual_seed(0)
    layer = QuantizedLinear.from_float(torch.nn.Linear(96, 40), name).bfloat16()
    layer.activation = "gelu_tanh" if gelu else None
    x = torch.randn(5, 96, generator=g).bfloat16()
    y = layer._float_forward(x, layer.weight, layer.weight_scale, layer.bias)
    ref = torch.nn.functional.linear(x, layer.dequantize(torch.float32).bfloat16(), layer.bias)
    if gelu:
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    layer._float_forward(x, layer.weight, layer.weight_scale, layer.bias)
    assert layer.__dict__["_fallback_weight"][1].dtype == torch.bfloat16  # decoded once, kept


@pytest.mark.cuda
def test_old_gpu_falls_back_at_the_first_forward(monkeypatch):
    monkeypatch.setattr(device_fallback, "_refusals", {})
    monkeypatch.setattr(ops, "cuda_compute_capability", lambda index: 75)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(48, 32))
    cquant.quantize_(model.bfloat16(), "fp8dqrow")  # on the CPU
    model.cuda()
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(device_fallback.DeviceFallbackWarning, match="fp8dqrow layers on cuda:0"):
        y = model(x)
    ref = x
    for layer in (model[0], model[2]):
        w = copy.deepcopy(layer).cpu().dequantize(torch.float32)  # decoded by the CPU reference, as the fallback does
        ref = torch.nn.functional.linear(ref, w.to(x), layer.bias)
        if layer is model[0]:
            ref = torch.nn.functional.gelu(ref, approximate="tanh")
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
