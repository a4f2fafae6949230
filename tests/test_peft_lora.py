"""PEFT LoRA merged into quantized layers: requantized with the SQNR cost stated, unmerged bit
for bit, refused clearly where cquant cannot do it (DoRA, views of fused layers)."""

import copy
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.integrations.peft_lora import LoraMergeWarning  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from tolerances import MODEL_SQNR_FLOOR_DB, QUANT_SQNR_FLOOR_DB  # noqa: E402

SCHEMES = ["int8wo", "int8dq", "fp8dqrow", "fp8dq", "fp6_e3m2", "fp4_e2m1"]


def _lora_model(scheme, seed, delta_scale=1.0, adapters=("default",), lora_bias=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
    cquant.quantize_(model, scheme)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False,
                                             lora_bias=lora_bias), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, LoraConfig(r=2, lora_alpha=2, target_modules=["0", "2"], init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(delta_scale)
    return model


def _stored(layer):
    return {n: t.detach().clone() for n, t in (("weight", layer.weight), ("weight_scale", layer.weight_scale),
                                               ("bias", layer.bias))}


def _assert_same_tensors(layer, stored):
    for name, t in stored.items():
        now = getattr(layer, name)
        assert now.dtype == t.dtype and torch.equal(now, t), name


def _merged_float_weight(lora_layer, base_codes_layer, names):
    w = base_codes_layer.dequantize(torch.float32)
    for n in names:
        w = w + lora_layer.get_delta_weight(n).float()
    return w


def _float_and_fresh_outputs(model, originals, scheme, x):
    """The fp32 model with every adapter's delta added to its dequantized base weight, and a copy of
    it quantized afresh with `scheme`; both run on x."""
    layers = [model.base_model.model[i] for i in (0, 2)]
    float_model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
    for i, lora_layer, original in zip((0, 2), layers, originals):
        float_model[i].weight.copy_(_merged_float_weight(lora_layer, original, ["default"]))
        float_model[i].bias.copy_(original.bias.float())
    fresh = copy.deepcopy(float_model)
    cquant.quantize_(fresh, scheme, progress=False)
    return float_model(x), fresh(x)


def _sqnr(ref, x):
    return tm.sqnr_db(ref, x)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("safe_merge", [True, False])
@pytest.mark.parametrize("delta_scale", [1.0, 100.0])
def test_merge_requantizes_and_unmerge_restores_bit_for_bit(scheme, safe_merge, delta_scale, seed):
    model = _lora_model(scheme, seed, delta_scale)
    lora = model.base_model.model[0]
    base = lora.get_base_layer()
    before = _stored(base)
    originals = [copy.deepcopy(model.base_model.model[i].get_base_layer()) for i in (0, 2)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y_lora = model(x)
    with pytest.warns(LoraMergeWarning, match=r"SQNR (-?[0-9.]+|inf) dB") as record:
        model.merge_adapter(safe_merge=safe_merge)
    assert lora.merged and lora.merged_adapters == ["default"]
    ref = _merged_float_weight(lora, originals[0], ["default"])
    got = base.dequantize(torch.float32)
    measured = _sqnr(ref, got)
    fmt = base.scheme.weight_format.name
    assert measured > QUANT_SQNR_FLOOR_DB[fmt]  # one rounding of the merged weight, as quantizing it afresh
    stated = [float(re.search(r"SQNR (\S+) dB", str(w.message)).group(1)) for w in record
              if issubclass(w.category, LoraMergeWarning) and "'0'" in str(w.message)]
    assert stated == [pytest.approx(measured, abs=0.05)]
    with torch.no_grad():
        y_float, y_fresh = _float_and_fresh_outputs(model, originals, scheme, x)
        y_merged = model(x)
    # Each merged layer is one rounding of its fp32 merged weight, as quantizing that weight afresh:
    # the merged model is as close to the fp32 merged model as a freshly quantized copy of it. (How
    # close that is depends on the data: a large rank-4 delta leaves most of the input outside the
    # merged weight's row space while its rounding noise sees all of it.)
    assert _sqnr(y_float, y_merged) > _sqnr(y_float, y_fresh) - 0.1
    model.unmerge_adapter()
    assert not lora.merged
    _assert_same_tensors(base, before)
    with torch.no_grad():
        assert torch.equal(model(x), y_lora)


def test_several_adapters_merge_from_the_original_codes(seed):
    model = _lora_model("fp8dqrow", seed, adapters=("one", "two"))
    model.base_model.set_adapter(["one", "two"])
    lora = model.base_model.model[0]
    base = lora.get_base_layer()
    before = _stored(base)
    with pytest.warns(LoraMergeWarning):
        model.merge_adapter(adapter_names=["one", "two"])
    at_once = _stored(base)
    model.unmerge_adapter()
    _assert_same_tensors(base, before)
    with pytest.warns(LoraMergeWarning):
        model.merge_adapter(adapter_names=["one"])
        model.merge_adapter(adapter_names=["two"])  # requantized from the original codes + both deltas
    assert lora.merged_adapters == ["one", "two"]
    _assert_same_tensors(base, at_once)
    model.unmerge_adapter()
    _assert_same_tensors(base, before)


def test_lora_bias_is_merged_and_restored(seed):
    model = _lora_model("int8wo", seed, lora_bias=True)
    lora = model.base_model.model[0]
    base = lora.get_base_layer()
    with torch.no_grad():
        lora.lora_B["default"].bias.normal_()
    before = _stored(base)
    expect_bias = base.bias.float() + lora.lora_B["default"].bias.float() * lora.scaling["default"]
    with pytest.warns(LoraMergeWarning):
        lora.merge()
    assert torch.allclose(base.bias, expect_bias) and base.bias.requires_grad == before["bias"].requires_grad
    lora.unmerge()
    _assert_same_tensors(base, before)


def test_non_finite_deltas_change_nothing(seed):
    model = _lora_model("int8dq", seed)
    lora = model.base_model.model[0]
    base = lora.get_base_layer()
    before = _stored(base)
    with torch.no_grad():
        lora.lora_B["default"].weight[0, 0] = float("nan")
    for safe in (True, False):
        with pytest.raises(ValueError, match="NaNs detected"):
            lora.merge(safe_merge=safe)
        assert not lora.merged
        _assert_same_tensors(base, before)


def test_merge_and_unload_leaves_the_requantized_layer(seed):
    model = _lora_model("fp6_e3m2", seed)
    x = torch.randn(3, 64)
    with torch.no_grad():
        y_lora = model(x)
    with pytest.warns(LoraMergeWarning):
        merged = model.merge_and_unload()
    assert isinstance(merged[0], QuantizedLinear) and isinstance(merged[2], QuantizedLinear)
    with torch.no_grad():
        assert _sqnr(y_lora, merged(x)) > MODEL_SQNR_FLOOR_DB["fp6_e3m2"] - 6.0


def test_float_layers_still_merge_through_peft(seed):
    torch.manual_seed(seed)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 48)),
                           LoraConfig(r=4, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(3, 64)
    with torch.no_grad():
        y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoraMergeWarning)
        model.merge_adapter()
    with torch.no_grad():
        assert torch.allclose(model(x), y, atol=1e-5)


def test_dora_is_refused(seed):
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    cquant.quantize_(model, "int8wo")
    with pytest.raises(NotImplementedError, match="DoRA"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["0"], use_dora=True))


def test_views_of_a_fused_layer_are_refused(seed):
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(seed)
    attn = FluxAttention(query_dim=64, heads=2, dim_head=32, bias=True)
    cquant.quantize_(attn, "int8wo")
    attn.fuse_projections()
    peft.inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights=False), attn)
    before = _stored(attn.to_qkv)
    with pytest.raises(NotImplementedError, match="view of rows of a QKV-fused layer"):
        attn.to_q.merge()
    _assert_same_tensors(attn.to_qkv, before)


def _flux_lora_state_dict(seed):
    """A diffusers-format LoRA of the tiny Flux transformer (attention and fused-GELU MLP layers)."""
    from peft.utils import get_peft_model_state_dict

    model = tm.build("flux", seed=seed)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                 target_modules=["to_q", "to_k", "to_v", "proj_mlp", "ff.net.0.proj"]))
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(model).items()}


def test_diffusers_fuse_lora_and_unfuse_lora(seed):
    """pipe.fuse_lora() on a quantized Flux, including layers whose GELU cquant fused."""
    pipe = tm.flux_pipeline(with_text_encoders=False, seed=seed)
    cquant.quantize_(pipe.transformer, "fp8dqrow")
    block = pipe.transformer.single_transformer_blocks[0]
    assert block.proj_mlp.activation == "gelu_tanh"  # the GELU sits inside the layer
    layers = [m for m in pipe.transformer.modules() if type(m) is QuantizedLinear]
    before = [_stored(m) for m in layers]
    pipe.load_lora_weights(_flux_lora_state_dict(seed), adapter_name="style")
    with tm.native_attention():
        y_lora = tm.run(pipe.transformer, "flux")
        with pytest.warns(LoraMergeWarning):
            pipe.fuse_lora(components=["transformer"])
        y_fused = tm.run(pipe.transformer, "flux")
        assert _sqnr(y_lora, y_fused) > MODEL_SQNR_FLOOR_DB["fp8dqrow"] - 6.0
        pipe.unfuse_lora(components=["transformer"])
        assert torch.equal(tm.run(pipe.transformer, "flux"), y_lora)
        with pytest.warns(LoraMergeWarning):
            pipe.transformer.fuse_lora(safe_fusing=True)  # the model's own entry point
        assert torch.equal(tm.run(pipe.transformer, "flux"), y_fused)
        pipe.transformer.unfuse_lora()
        assert torch.equal(tm.run(pipe.transformer, "flux"), y_lora)
    for layer, stored in zip(layers, before):
        _assert_same_tensors(layer, stored)


def test_saving_with_adapter_layers_is_refused_before_anything_is_written(tmp_path, seed):
    """Their state_dict names the layers "<layer>.base_layer", and from_pretrained then refused the
    file as another model's. The two ways the error names work."""
    diffusers = pytest.importorskip("diffusers")
    model = tm.build("flux", seed=seed)
    cquant.quantize_(model, "int8wo")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "proj_mlp"]),
                      adapter_name="style")
    with tm.native_attention():
        y_lora = tm.run(model, "flux")
    refused = (r"cannot save FluxTransformer2DModel.*: the layers of PEFT adapter 'style' still wrap "
               r"transformer_blocks\.0\.attn\.to_q, .*\.base_layer\.weight.*Nothing was written\. .*fuse_lora\(\) or "
               r"merge_adapter\(\), then unload_lora\(\).*save_lora_weights\(\)")
    with pytest.raises(ValueError, match=refused) as e:
        model.save_pretrained(tmp_path / "saved")
    assert "(unmerged)" in str(e.value) and not (tmp_path / "saved").exists()
    with pytest.raises(ValueError, match=refused):
        cquant.save_quantized(model, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
    diffusers.FluxPipeline.save_lora_weights(tmp_path / "adapter", transformer_lora_layers=get_peft_model_state_dict(
        model, adapter_name="style"))
    with pytest.warns(LoraMergeWarning):
        model.fuse_lora()
    with pytest.raises(ValueError, match=refused) as e:  # merged, the adapter layers still wrap the layers
        model.save_pretrained(tmp_path / "saved")
    assert "(merged into them ('style'))" in str(e.value)
    with tm.native_attention():
        model.unload_lora()  # the merged, requantized layers stay
        cquant.fuse_activations_(model)  # their GELUs, moved out for the adapter, back in, as loading does
        y_merged = tm.run(model, "flux")
        model.save_pretrained(tmp_path / "merged")
        assert torch.equal(tm.run(diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "merged"), "flux"),
                           y_merged)
        unmerged = tm.build("flux", seed=seed)  # the other way: the quantized model and the adapter apart
        cquant.quantize_(unmerged, "int8wo")
        unmerged.save_pretrained(tmp_path / "base")
        loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "base")
        loaded.load_lora_adapter(tmp_path / "adapter", weight_name="pytorch_lora_weights.safetensors",
                                 adapter_name="style")
        assert torch.equal(tm.run(loaded, "flux"), y_lora)


def test_transformers_save_pretrained_with_adapter_layers_is_refused(tmp_path, seed):
    pytest.importorskip("transformers")
    from peft import inject_adapter_in_model

    model = tm.t5_text_encoder(seed)
    cquant.quantize_(model, "int8wo")
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q", "v"]), model)
    with pytest.raises(ValueError, match=r"cannot save T5EncoderModel: the layers of PEFT adapter 'default' still "
                                         r"wrap encoder\.block\.0\.layer\.0\.SelfAttention\.q, "):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow", "fp6_e3m2"])
def test_merge_and_unmerge_on_cuda(scheme, seed):
    """The kept codes wait on the CPU and come back to the layer's device, bit for bit."""
    model = _lora_model(scheme, seed).to("cuda", torch.bfloat16)
    lora = model.base_model.model[0]
    base = lora.get_base_layer()
    before = _stored(base)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        y_lora = model(x)
    with pytest.warns(LoraMergeWarning):
        model.merge_adapter()
    assert base.weight.is_cuda and lora.__dict__["_cquant_unmerged"][0].device.type == "cpu"
    with torch.no_grad():
        assert _sqnr(y_lora, model(x)) > MODEL_SQNR_FLOOR_DB[scheme] - 6.0
    model.unmerge_adapter()
    _assert_same_tensors(base, before)
    with torch.no_grad():
        assert torch.equal(model(x), y_lora)
