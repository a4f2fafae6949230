"""On CUDA, a deleted quantized model gives its GPU memory back at once: with the garbage collector
off, `del model` brings torch.cuda.memory_allocated() back to what it was before the model was
built, for fp8dqrow and int8dq, plain and with every feature (fused QKV, cquant's int8 attention,
fused blocks, CUDA graphs). cquant keeps no GPU memory between calls (README, "Memory after a
model is freed"). Marked `cuda`; test_model_free.py checks the same references on the CPU.
"""

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from model_release import FEATURES, prepare, release  # noqa: E402
from tolerances import MODEL_FREE_CUDA_LEFTOVER_BYTES  # noqa: E402


def _cuda_usable():
    return torch.cuda.is_available() and cquant._C.built_with_cuda()


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU and cquant built with CUDA")]

VARIANTS = {"plain": (), "everything": FEATURES}
# A tiny Flux made wider (inner dim 512) so that its attention layers, which the former
# fuse_projections cycle kept, hold megabytes: well above MODEL_FREE_CUDA_LEFTOVER_BYTES.
WIDER = dict(num_attention_heads=4, attention_head_dim=128, axes_dims_rope=[16, 56, 56])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def _settled_allocated():
    """torch.cuda.memory_allocated() once the GPU is idle, with torch's per-stream cuBLAS
    workspaces dropped (a CUDA-graph capture runs on a new side stream each time)."""
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _build_run_delete(scheme, features):
    """Build the model on CUDA, run it twice (with CUDA graphs: capture, then replay), delete it:
    what release() finds still alive, and the bytes of the attention layers."""
    model, x = prepare(scheme, features, device="cuda", dtype=torch.bfloat16, **WIDER)
    attention_bytes = sum(t.nbytes for name, mod in model.named_modules() if name.endswith(".attn")
                          for t in list(mod.parameters()) + list(mod.buffers()))
    with torch.no_grad():
        for _ in range(2):
            out = model(**x)[0]
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    del out, x
    box = [model]
    del model
    return release(box), attention_bytes


def _cuda_tensors_alive():
    """The largest CUDA tensors the garbage collector can see, described (for failure messages)."""
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found.append((obj.nbytes, f"{tuple(obj.shape)} {obj.dtype}"))
        except Exception:  # noqa: BLE001 - objects half torn down, lazy modules: not what is looked for
            continue
    found.sort(reverse=True)
    return ", ".join(f"{d} ({n} B)" for n, d in found[:8]) or "none the collector tracks"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scheme", ["fp8dqrow", "int8dq"])
def test_deleted_model_gives_its_gpu_memory_back_without_gc(scheme, variant):
    features = VARIANTS[variant]
    _build_run_delete(scheme, features)  # a first round: what torch and cquant make once per process
    gc.collect()
    before = _settled_allocated()
    gc.disable()
    try:
        survivors, attention_bytes = _build_run_delete(scheme, features)
        after = _settled_allocated()
        alive = _cuda_tensors_alive() if after - before > MODEL_FREE_CUDA_LEFTOVER_BYTES else ""
    finally:
        gc.enable()
    assert attention_bytes > 4 * MODEL_FREE_CUDA_LEFTOVER_BYTES  # the check below would see them kept
    assert not survivors, survivors
    assert after - before <= MODEL_FREE_CUDA_LEFTOVER_BYTES, (
        f"{after - before} bytes of GPU memory stayed allocated after `del model` (before the build: {before}, "
        f"after the delete: {after}); CUDA tensors still alive: {alive}")
