"""pipe.load_lora_weights on a tiny Flux whose layers cquant quantized, for every storage: int8 and
fp8 codes of the layer's shape, and packed fpX rows narrower than in_features, which diffusers'
Flux loader took for a narrower layer (it rebuilt a float nn.Linear from the codes and raised)."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

SCHEMES = ["int8wo", "fp8dqrow", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1"]
TARGETS = ["to_q", "to_k", "to_v", "proj_out"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def _lora(seed):
    """A diffusers-format LoRA of the tiny Flux transformer; random lora_B so that it changes the output."""
    model = tm.build("flux", seed=seed + 1)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=TARGETS))
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(model).items()}


def _quantized_pipe(scheme, seed):
    pipe = tm.flux_pipeline(with_text_encoders=False, seed=seed)
    cquant.quantize_(pipe.transformer, scheme)
    return pipe


def _lora_a(transformer, name):
    return transformer.get_submodule(name).lora_A["style"].weight


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_lora_loads_into_quantized_layers_as_peft_would_load_it(scheme, seed):
    lora = _lora(seed)
    pipe = _quantized_pipe(scheme, seed)
    t = pipe.transformer
    packed = [m for m in t.modules() if type(m) is QuantizedLinear and m.weight.shape[1] != m.in_features]
    assert bool(packed) == (scheme.startswith("fp") and not scheme.startswith("fp8"))
    plain = tm.run(t, "flux")
    pipe.load_lora_weights(dict(lora), adapter_name="style")
    y = tm.run(t, "flux")
    assert not torch.equal(y, plain)  # the adapter runs
    for key, value in lora.items():  # every entry loaded as given: nothing padded to a packed width
        name, _, which = key[len("transformer."):].partition(".lora_")
        loaded = t.get_submodule(name).lora_A["style"] if which.startswith("A") else t.get_submodule(name).lora_B["style"]
        assert torch.equal(loaded.weight, value.to(loaded.weight.dtype)), key
    assert all(type(m.base_layer) is QuantizedLinear for n, m in t.named_modules() if n.endswith(".to_q"))

    # diffusers' loader without the Flux reshaping (load_lora_adapter) gives the same model, bit for bit
    other = _quantized_pipe(scheme, seed).transformer
    other.load_lora_adapter(dict(lora), adapter_name="style", prefix="transformer")
    assert torch.equal(tm.run(other, "flux"), y)


def test_a_lora_narrower_than_a_packed_layer_is_zero_padded_to_in_features(seed):
    lora = _lora(seed)
    key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
    narrow = lora[key][:, :lora[key].shape[1] // 2].clone()
    lora[key] = narrow
    pipe = _quantized_pipe("fp6_e3m2", seed)
    pipe.load_lora_weights(lora, adapter_name="style")
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    a = _lora_a(pipe.transformer, "transformer_blocks.0.attn.to_q")
    assert a.shape == (narrow.shape[0], layer.in_features)
    assert torch.equal(a[:, :narrow.shape[1]], narrow) and not a[:, narrow.shape[1]:].any()


def _widening_lora(seed):
    """A LoRA that also widens x_embedder's input features 16 -> 32, as Flux Control LoRAs do (64 -> 128)."""
    lora = _lora(seed)
    model = tm.build("flux", seed=seed + 2)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["x_embedder"]))
    for k, v in get_peft_model_state_dict(model).items():
        lora[f"transformer.{k}"] = torch.cat([v, torch.randn_like(v)], dim=1) if ".lora_A." in k else v
    return lora


def _run_widened(transformer):
    """The tiny Flux forward with 32 input channels (the latents and a control image's, as Flux Control does)."""
    inputs = tm.inputs("flux")
    h = inputs["hidden_states"]
    inputs["hidden_states"] = torch.cat([h, h.flip(-1)], dim=-1)
    return transformer(**inputs)[0]


@pytest.mark.parametrize("scheme", ["int8wo", "fp6_e3m2", "fp8dqrow"])
def test_a_lora_wider_than_a_quantized_layer_widens_its_dequantized_float_layer(scheme, seed):
    """diffusers widens a layer a LoRA is wider than by rebuilding it as a wider float nn.Linear from
    its weight (bnb and GGUF layers dequantized first); from cquant's codes it raised. The layer now
    becomes float first, with a warning: the result is bit for bit what dequantizing it by hand
    before loading gives, and the other layers stay quantized."""
    from cquant.integrations.diffusers_lora import LoraWideningWarning

    lora = _widening_lora(seed)
    pipe = _quantized_pipe(scheme, seed)
    w = pipe.transformer.x_embedder.dequantize(torch.float32)
    with pytest.warns(LoraWideningWarning, match=rf"x_embedder \({scheme}\) became a float32 layer.*"
                                                 r"input features 16 -> 32"):
        pipe.load_lora_weights(dict(lora), adapter_name="style")
    t = pipe.transformer
    widened = t.x_embedder.base_layer
    assert type(widened) is torch.nn.Linear and widened.in_features == 32 and t.config.in_channels == 32
    assert torch.equal(widened.weight[:, :16], w) and not widened.weight[:, 16:].any()
    assert type(t.transformer_blocks[0].attn.to_q.base_layer) is QuantizedLinear
    y = _run_widened(t)

    by_hand = _quantized_pipe(scheme, seed)
    cquant.dequantize_(by_hand.transformer.x_embedder)
    by_hand.load_lora_weights(dict(lora), adapter_name="style")
    assert torch.equal(_run_widened(by_hand.transformer), y)


def test_a_lora_wider_than_a_view_of_a_fused_layer_is_refused_before_anything_changes(seed):
    lora = _lora(seed)
    key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
    lora[key] = torch.cat([lora[key], lora[key]], dim=1)
    pipe = tm.flux_pipeline(with_text_encoders=False, seed=seed)
    cquant.quantize_pipeline(pipe, "int8wo", fuse_qkv=True)
    before = tm.run(pipe.transformer, "flux")
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    n = layer.in_features
    with pytest.raises(NotImplementedError, match=rf"to_q is wider than its quantized layer \(input features {n} -> "
                                                  rf"{2 * n}\), and it is a view of the rows of a QKV-fused layer"):
        pipe.load_lora_weights(lora, adapter_name="style")
    assert pipe.transformer.transformer_blocks[0].attn.to_q is layer
    assert not getattr(pipe.transformer, "peft_config", None)
    assert torch.equal(tm.run(pipe.transformer, "flux"), before)
