"""cquant with transformers text encoders (T5, CLIP) on CPU: quantize_, from_pretrained, save_pretrained."""

import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from tolerances import TEXT_ENCODER_SQNR_FLOOR_DB  # noqa: E402

ENCODERS = {"t5": tm.t5_text_encoder, "clip": tm.clip_text_encoder}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def ids(seed=3):
    return torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def encode(model):
    return model(ids()).last_hidden_state


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp8wo", "fp6_e3m2"])
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_quantize_text_encoders(encoder, scheme):
    model = ENCODERS[encoder]()
    ref = encode(model)
    cquant.quantize_(model, scheme)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {n for n, m in layers.items() if isinstance(m, QuantizedLinear)}
    if encoder == "t5":  # T5 lists its FFN output projections in _keep_in_fp32_modules
        assert set(layers) - quantized == {n for n in layers if n.endswith(".wo")}
    else:
        assert quantized == set(layers)
    assert model.dtype == torch.float32
    assert tm.sqnr_db(ref, encode(model)) > TEXT_ENCODER_SQNR_FLOOR_DB[scheme]


@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_from_pretrained_and_round_trip(encoder, tmp_path):
    model = ENCODERS[encoder]()
    model.save_pretrained(tmp_path / "float")
    expected = ENCODERS[encoder]()
    cquant.quantize_(expected, "int8dq")
    cls = type(model)
    loaded = cls.from_pretrained(tmp_path / "float", quantization_config=cquant.CQuantConfig("int8dq"))
    assert any(isinstance(m, QuantizedLinear) for m in loaded.modules())
    y = encode(loaded)
    assert torch.equal(y, encode(expected))
    loaded.save_pretrained(tmp_path / "q")
    files = sorted(os.listdir(tmp_path / "q"))
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "cquant" and qc["format_version"] == cquant.FORMAT_VERSION
    again = cls.from_pretrained(tmp_path / "q")
    assert torch.equal(encode(again), y)
    for name, m in again.named_modules():
        if isinstance(m, QuantizedLinear):
            assert m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32


def test_a_linear_layer_tied_to_the_embeddings_loads_float_and_tied(tmp_path):
    """T5ForConditionalGeneration ties lm_head to the shared embedding: the checkpoint holds no
    weight of its own for it, so planning it for quantization failed the load."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(tm.t5_text_encoder().config).save_pretrained(tmp_path)
    float_model = T5ForConditionalGeneration.from_pretrained(tmp_path)
    model = T5ForConditionalGeneration.from_pretrained(tmp_path, quantization_config=cquant.CQuantConfig("int8wo"))
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.shared.weight
    assert isinstance(model.encoder.block[0].layer[0].SelfAttention.q, QuantizedLinear)
    with torch.no_grad():
        y, ref = (m(input_ids=ids(), decoder_input_ids=ids(4)).logits for m in (model, float_model))
    assert tm.sqnr_db(ref, y) > TEXT_ENCODER_SQNR_FLOOR_DB["int8wo"]


def test_quantize_then_save_pretrained(tmp_path):
    model = tm.clip_text_encoder()
    cquant.quantize_(model, cquant.FqnToConfig({r"re:.*mlp.*": "fp6_e3m2", "_default": "fp8dqrow"}))
    y = encode(model)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path)
    assert again.encoder.layers[0].mlp.fc1.scheme.name == "fp6_e3m2"
    assert again.encoder.layers[0].self_attn.q_proj.scheme.name == "fp8dqrow"
    assert torch.equal(encode(again), y)


def save_with_edited_config(tmp_path, edit):
    """A quantized CLIP encoder saved to tmp_path, its config.json's quantization_config edited."""
    model = tm.clip_text_encoder()
    cquant.quantize_(model, "int8wo")
    model.save_pretrained(tmp_path)
    p = tmp_path / "config.json"
    cfg = json.loads(p.read_text())
    edit(cfg["quantization_config"])
    p.write_text(json.dumps(cfg))
    return type(model)


def test_bad_checkpoint(tmp_path):
    cls = save_with_edited_config(tmp_path, lambda q: q.update(format_version=7))
    with pytest.raises(ValueError, match="format version 7"):
        cls.from_pretrained(tmp_path)


def test_config_without_layer_list(tmp_path):
    cls = save_with_edited_config(tmp_path, lambda q: q.pop("quantized_layers"))
    with pytest.raises(ValueError, match="no quantized_layers"):
        cls.from_pretrained(tmp_path)


def test_quantizer_arguments_are_checked():
    from cquant.integrations.transformers_quantizer import CQuantHfQuantizer

    with pytest.raises(TypeError, match="expected a CQuantConfig, got int"):
        CQuantHfQuantizer(8)
    with pytest.raises(ValueError, match="disk offload"):
        CQuantHfQuantizer(cquant.CQuantConfig("int8dq")).validate_environment(device_map={"lm": "disk"})


def test_dequantize_through_transformers(tmp_path):
    tm.t5_text_encoder().save_pretrained(tmp_path)
    model = transformers.T5EncoderModel.from_pretrained(tmp_path, quantization_config=cquant.CQuantConfig("int8wo"))
    y = encode(model)
    model.dequantize()
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert torch.allclose(encode(model), y, rtol=1e-3, atol=1e-3)
