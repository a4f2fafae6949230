"""State a quantized diffusers / transformers model must not share by mistake: copies (deepcopy,
torch.save / pickle) get their own quantizer, quantize_ does not write into a config other
models share, and dequantize() leaves a model that saves and loads as a float model."""

import copy
import io
import json
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from tolerances import MODEL_SQNR_FLOOR_DB  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def ids():
    return torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def run(model):
    if isinstance(model, diffusers.ModelMixin):
        return tm.run(model, "flux")
    return model(ids()).last_hidden_state


def flux_quantize_():
    model = tm.build("flux")
    cquant.quantize_(model, "int8wo")
    return model


def flux_from_pretrained(tmp_path):
    tm.build("flux").save_pretrained(tmp_path / "float")
    return diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "float",
                                                            quantization_config=cquant.CQuantConfig("int8wo"))


def t5_quantize_():
    model = tm.t5_text_encoder()
    cquant.quantize_(model, "int8wo")
    return model


def t5_from_pretrained(tmp_path):
    tm.t5_text_encoder().save_pretrained(tmp_path / "float")
    return transformers.T5EncoderModel.from_pretrained(tmp_path / "float",
                                                       quantization_config=cquant.CQuantConfig("int8wo"))


MODELS = {"flux-quantize_": lambda tmp: flux_quantize_(), "flux-from_pretrained": flux_from_pretrained,
          "t5-quantize_": lambda tmp: t5_quantize_(), "t5-from_pretrained": t5_from_pretrained}


@pytest.fixture(params=list(MODELS))
def quantized(request, tmp_path):
    return MODELS[request.param](tmp_path)


def saved_layers(path):
    return json.loads((path / "config.json").read_text())["quantization_config"]["quantized_layers"]


def reload(model, path):
    model.save_pretrained(path)
    return type(model).from_pretrained(path)


# ---------------------------------------------------------------- copies


def test_deepcopy_gets_its_own_quantizer(quantized, tmp_path):
    clone = copy.deepcopy(quantized)
    assert clone.hf_quantizer is not quantized.hf_quantizer
    assert clone.hf_quantizer.bound_model is clone and quantized.hf_quantizer.bound_model is quantized
    y = run(clone)
    cquant.dequantize_(quantized)  # the original's layer list empties; the copy's must not
    again = reload(clone, tmp_path / "clone")
    assert set(saved_layers(tmp_path / "clone")) == set(cquant.quantize.quantized_layers(clone))
    assert torch.equal(run(again), y)


def test_a_quantizer_copied_alone_stays_bound_to_its_model(quantized):
    q = copy.deepcopy(quantized.hf_quantizer)
    assert q is not quantized.hf_quantizer and q.bound_model is quantized


@pytest.mark.parametrize("save", ["torch.save", "pickle"])
def test_torch_save_and_pickle(quantized, save, tmp_path):
    y = run(quantized)
    if save == "torch.save":
        buf = io.BytesIO()
        torch.save(quantized, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(quantized))
    assert torch.equal(run(loaded), y)
    assert loaded.hf_quantizer.bound_model is loaded
    assert torch.equal(run(reload(loaded, tmp_path / "loaded")), y)


def test_torch_save_of_a_fused_model(tmp_path):
    model = flux_quantize_()
    model.fuse_qkv_projections()
    y = run(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(run(loaded), y)
    loaded.unfuse_qkv_projections()
    loaded.fuse_qkv_projections()  # cquant's fusion came along with the module
    assert torch.equal(run(loaded), y)


# ---------------------------------------------------------------- shared config


@pytest.mark.parametrize("encoder", [tm.t5_text_encoder, tm.clip_text_encoder])
def test_quantize_does_not_write_into_a_shared_config(encoder, tmp_path):
    a = encoder()
    config = a.config
    b = type(a)(config).eval()  # a float model built later from the same config object
    cquant.quantize_(a, "int8wo")
    assert getattr(config, "quantization_config", None) is None and a.config is not config
    # within the model, every module reads the one copy (set_attn_implementation must reach them all)
    readers = [m for m in a.modules() if "config" in m.__dict__ and m.config.__class__ is config.__class__]
    assert len(readers) > 1 and all(m.config is a.config for m in readers)
    assert getattr(b.config, "quantization_config", None) is None
    y = run(b)
    again = reload(b, tmp_path / "b")
    assert not any(isinstance(m, QuantizedLinear) for m in again.modules())
    assert torch.equal(run(again), y)
    assert torch.equal(run(reload(a, tmp_path / "a")), run(a))
    a.set_attn_implementation("eager")
    assert all(m.config._attn_implementation == "eager" for m in readers)


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("dequantize", ["model.dequantize()", "cquant.dequantize_"])
def test_dequantized_model_saves_and_loads_as_float(quantized, dequantize, tmp_path):
    if dequantize == "model.dequantize()":
        quantized.dequantize()
    else:
        cquant.dequantize_(quantized)
    assert not getattr(quantized, "is_quantized", False) and getattr(quantized, "hf_quantizer", None) is None
    y = run(quantized)
    quantized.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = type(quantized).from_pretrained(tmp_path)
    assert not any(isinstance(m, QuantizedLinear) for m in again.modules())
    assert torch.equal(run(again), y)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pre_quantization_dtype(dtype, tmp_path):
    # what from_pretrained loads the float layers in: dtype=, else torch's default (never None)
    tm.build("flux").save_pretrained(tmp_path / "float")
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = diffusers.FluxTransformer2DModel.from_pretrained(
        tmp_path / "float", quantization_config=cquant.CQuantConfig("int8wo"), **kwargs)
    expected = dtype or torch.get_default_dtype()
    assert model.config["_pre_quantization_dtype"] == expected
    assert model.proj_out.compute_dtype == expected
    model.save_pretrained(tmp_path / "q")
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "q", **kwargs)
    assert loaded.config["_pre_quantization_dtype"] == expected
    quantized_ = flux_quantize_()
    assert quantized_.config["_pre_quantization_dtype"] == torch.float32


def test_dequantize_returns_to_the_pre_quantization_dtype():
    model = flux_quantize_()
    ref = run(model)
    model.register_to_config(_pre_quantization_dtype=torch.bfloat16)
    model.dequantize()
    assert {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)} == {torch.bfloat16}
    model.to(torch.float32)
    assert tm.sqnr_db(ref, run(model)) > MODEL_SQNR_FLOOR_DB["int8wo"] - 10
