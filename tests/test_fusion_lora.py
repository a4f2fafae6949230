"""QKV fusion and LoRA adapters on q / k / v of a quantized tiny Flux behave as diffusers' fusion of
the float model does: an adapter there (loaded after fusing, or added before) stays on its unfused
projection, unused while fused and run again once unfused; what cquant cannot fuse is refused
before anything changes."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.integrations.peft_lora import LoraMergeWarning  # noqa: E402
from cquant.nn import QuantizedLinear, QuantizedLinearSlice  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tolerances import MODEL_SQNR_FLOOR_DB, MODEL_WITH_ADAPTER_SQNR_FLOOR_DB  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "add_k_proj"]  # to_qkv and to_added_qkv both take a part with an adapter
SCHEMES = ["int8dq", "fp8dqrow"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", LoraMergeWarning)  # no test here merges an adapter unless it says so
        yield


def _lora_config():
    # init_lora_weights=False: lora_B is random, not zero; alpha / r = 32 makes its change far larger than
    # the quantization error, so the comparisons below see whether it ran
    return LoraConfig(r=4, lora_alpha=128, init_lora_weights=False, target_modules=TARGETS)


def _assert_close(ref, y, scheme, adapter_ran):
    """The quantized model's y within the quantization error of the float model's ref."""
    floor = (MODEL_WITH_ADAPTER_SQNR_FLOOR_DB if adapter_ran else MODEL_SQNR_FLOOR_DB)[scheme]
    assert tm.sqnr_db(ref, y) > floor


def _assert_adapter_runs(without, with_adapter, scheme):
    """The adapter changes the float output by more than the quantization error: had it run in one
    model and not in the other, _assert_close would fail."""
    assert tm.sqnr_db(without, with_adapter) < MODEL_WITH_ADAPTER_SQNR_FLOOR_DB[scheme]


def _lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "lora_A")]


# ---------------------------------------------------------------- an adapter added before fusing


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fuse", ["fuse_qkv_projections", "cquant.fuse_qkv_"])
def test_adapter_added_before_fusion_is_unused_while_fused(fuse, scheme, seed):
    """fuse_qkv_projections() fused nothing under the adapters, set fused_projections anyway, and
    every forward then raised AttributeError: no attribute 'to_qkv'."""
    results = {}
    for kind in ("float", "quantized"):
        model = tm.build("flux", seed=seed)
        if kind == "quantized":
            cquant.quantize_(model, scheme)
        plain = tm.run(model, "flux")
        model.add_adapter(_lora_config())
        adapted = tm.run(model, "flux")
        model.fuse_qkv_projections() if fuse == "fuse_qkv_projections" else cquant.fuse_qkv_(model)
        attn = model.transformer_blocks[0].attn
        assert attn.fused_projections and hasattr(attn, "to_qkv") and hasattr(attn, "to_added_qkv")
        assert hasattr(attn.to_q, "lora_A")  # the adapter stays on the unfused projection
        fused = tm.run(model, "flux")
        if kind == "quantized":
            assert isinstance(attn.to_q.base_layer, QuantizedLinearSlice)
            assert isinstance(model.single_transformer_blocks[0].attn.to_qkv, QuantizedLinear)
            # per-row codes concatenate exactly: fused, the model is the quantized one without adapters
            assert torch.equal(fused, plain)
        model.unfuse_qkv_projections()
        results[kind] = (plain, adapted, fused, tm.run(model, "flux"))
    f_plain, f_adapted, f_fused, f_unfused = results["float"]
    assert torch.allclose(f_fused, f_plain, rtol=1e-5, atol=1e-5)  # diffusers fuses the base layers only
    assert torch.allclose(f_unfused, f_adapted, rtol=1e-5, atol=1e-5)
    for f, q, ran in zip(results["float"], results["quantized"], (False, True, False, True)):
        _assert_close(f, q, scheme, adapter_ran=ran)
    _assert_adapter_runs(f_plain, f_adapted, scheme)


@pytest.mark.parametrize("fuse", ["fuse_qkv_projections", "cquant.fuse_qkv_"])
def test_fusing_merged_adapters_is_refused_before_anything_changes(fuse, seed):
    """Codes with an adapter merged would be copied into the fused layer, where unmerging cannot reach them."""
    model = tm.build("flux", seed=seed)
    cquant.quantize_(model, "int8dq")
    model.add_adapter(_lora_config())
    with pytest.warns(LoraMergeWarning):
        for layer in _lora_layers(model):
            layer.merge()
    y = tm.run(model, "flux")
    with pytest.raises(ValueError, match=r"cannot fuse .*to_q.* merged into to_q .*unmerge them first"):
        model.fuse_qkv_projections() if fuse == "fuse_qkv_projections" else cquant.fuse_qkv_(model)
    attns = [b.attn for b in (*model.transformer_blocks, *model.single_transformer_blocks)]
    assert not any(a.fused_projections or hasattr(a, "to_qkv") or hasattr(a, "to_added_qkv") for a in attns)
    assert torch.equal(tm.run(model, "flux"), y)
    for layer in _lora_layers(model):
        layer.unmerge()
    model.fuse_qkv_projections()
    assert all(a.fused_projections and hasattr(a, "to_qkv") for a in attns)
