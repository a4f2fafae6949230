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


# ---------------------------------------------------------------- a LoRA loaded after fusing


def _lora_state_dict(seed):
    """A diffusers-format LoRA (transformer.<module>.lora_A / lora_B.weight) of the tiny Flux's q / k / v."""
    from peft.utils import get_peft_model_state_dict

    model = tm.build("flux", seed=seed + 1)
    config = _lora_config()
    model.add_adapter(config)
    # the file carries no alpha (diffusers then takes alpha = r): the scaling goes into lora_B
    scaling = config.lora_alpha / config.r
    return {f"transformer.{k}": v * scaling if ".lora_B." in k else v
            for k, v in get_peft_model_state_dict(model).items()}


def _quantize_and_fuse(pipe, scheme, how):
    if how == "quantize_pipeline":
        cquant.quantize_pipeline(pipe, scheme, fuse_qkv=True)
    else:
        cquant.quantize_(pipe.transformer, scheme)
        pipe.transformer.fuse_qkv_projections()


def _load_after_fusion(lora, scheme, how, seed):
    """{"float" | "quantized": (output fused, output unfused)} of the tiny Flux pipeline fused (diffusers'
    fusion of the float model, or cquant's quantized one), then given `lora` by pipe.load_lora_weights."""
    results = {}
    for kind in ("float", "quantized"):
        pipe = tm.flux_pipeline(with_text_encoders=False, seed=seed)
        t = pipe.transformer
        if kind == "float":
            t.fuse_qkv_projections()  # diffusers' fusion: to_q / to_k / to_v stay, unused
        else:
            _quantize_and_fuse(pipe, scheme, how)
        fused = tm.run(t, "flux")
        pipe.load_lora_weights(dict(lora), adapter_name="style")
        # to_q / to_k / to_v of every block, add_k_proj of the joint ones
        assert len(_lora_layers(t)) == 4 * len(t.transformer_blocks) + 3 * len(t.single_transformer_blocks)
        assert torch.equal(tm.run(t, "flux"), fused)  # the fused forward never calls the adapter's layers
        t.unfuse_qkv_projections()
        results[kind] = (fused, tm.run(t, "flux"))
        if kind == "quantized":
            attn = t.transformer_blocks[0].attn
            assert isinstance(attn.to_k.base_layer, QuantizedLinearSlice)  # the adapter sits on the view
    return results


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("how", ["quantize_pipeline", "quantize_then_fuse_qkv_projections"])
def test_lora_loaded_after_fusion_is_unused_until_unfused(how, scheme, seed):
    """pipe.load_lora_weights raised KeyError: '...attn.to_k.weight' (the views have no state_dict entry)."""
    results = _load_after_fusion(_lora_state_dict(seed), scheme, how, seed)
    (f_fused, f_unfused), (q_fused, q_unfused) = results["float"], results["quantized"]
    _assert_close(f_fused, q_fused, scheme, adapter_ran=False)
    _assert_close(f_unfused, q_unfused, scheme, adapter_ran=True)  # unfused, the adapter runs in both
    _assert_adapter_runs(f_fused, f_unfused, scheme)


def test_lora_narrower_than_a_fused_projection_is_zero_padded(seed):
    """diffusers' Flux loader zero-pads a lora_A with fewer input features than its layer; so does cquant's
    wrapper of it for the views of a fused layer."""
    lora = _lora_state_dict(seed)
    narrowed = [k for k in lora if k.endswith("attn.to_q.lora_A.weight")]
    assert narrowed
    for k in narrowed:
        lora[k] = lora[k][:, :lora[k].shape[1] // 2].contiguous()
    results = _load_after_fusion(lora, "int8dq", "quantize_pipeline", seed)
    (f_fused, f_unfused), (q_fused, q_unfused) = results["float"], results["quantized"]
    _assert_close(f_fused, q_fused, "int8dq", adapter_ran=False)
    _assert_close(f_unfused, q_unfused, "int8dq", adapter_ran=True)
