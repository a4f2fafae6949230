"""cquant with diffusers (CPU): every scheme on five model families, from_pretrained / save_pretrained,
pipelines, QKV fusion, LoRA, cache hooks, dequantize, and bad checkpoints."""

import copy
import json
import os
import site
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.nn import QuantizedLinear, QuantizedLinearSlice  # noqa: E402
from helpers import ungrouped_schemes  # noqa: E402
from tolerances import FUSED_REQUANT_SQNR_FLOOR_DB, MODEL_SQNR_FLOOR_BF16_DB, MODEL_SQNR_FLOOR_DB  # noqa: E402

FAMILIES = list(tm.CONFIGS)
SCHEMES = ungrouped_schemes(cquant.SCHEME_NAMES) + ["fp8wo_e5m2"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def quantized(name, scheme, dtype=torch.float32, seed=0):
    m = tm.build(name, dtype=dtype, seed=seed)
    cquant.quantize_(m, scheme)
    return m


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_scheme_on_every_family(family, scheme):
    model = tm.build(family)
    ref = tm.run(model, family)
    cquant.quantize_(model, scheme)
    assert all(isinstance(m, QuantizedLinear) for m in linears(model).values()), cquant.summary(model).skipped
    y = tm.run(model, family)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert tm.sqnr_db(ref, y) > MODEL_SQNR_FLOOR_DB[scheme]


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp6_e3m2"])
def test_bfloat16_model(scheme):
    ref = tm.run(tm.build("flux"), "flux")
    model = quantized("flux", scheme, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16  # the stored codes never become the model's dtype
    y = tm.run(model, "flux")
    assert y.dtype == torch.bfloat16
    assert tm.sqnr_db(ref, y) > MODEL_SQNR_FLOOR_BF16_DB[scheme]


def test_counts_footprint_and_dtype_as_diffusers_sees_them():
    base = tm.build("flux", dtype=torch.bfloat16)
    for scheme in ("int8wo", "fp8dqrow"):
        q = quantized("flux", scheme, dtype=torch.bfloat16)
        assert q.num_parameters() == base.num_parameters()  # one stored element per weight
        assert base.get_memory_footprint() / q.get_memory_footprint() > 1.7
        assert q.dtype == torch.bfloat16
    q6 = quantized("flux", "fp6_e3m2", dtype=torch.bfloat16)
    assert base.get_memory_footprint() / q6.get_memory_footprint() > 2.2
    for name, m in linears(q6).items():  # what diffusers' quantizer tests read
        assert isinstance(m, torch.nn.Linear) and m.in_features > 0 and m.out_features > 0
        assert m.weight.dtype == torch.uint8 and m.weight.shape[0] == m.out_features


# ---------------------------------------------------------------- save / load


def saved_files(path):
    return sorted(os.listdir(path))


@pytest.mark.parametrize("family, scheme", [("flux", "fp8dqrow"), ("sd3", "fp6_e3m2"), ("pixart-sigma", "int8dq"),
                                            ("cogvideox", "fp8dq"), ("qwen-image", "int8wo")])
def test_save_and_load_round_trip(family, scheme, tmp_path, monkeypatch):
    from safetensors import safe_open

    # a bfloat16 model as from_pretrained makes it (some buffers stay float32 that way)
    tm.build(family).save_pretrained(tmp_path / "float")
    cls = getattr(diffusers, tm.CONFIGS[family][0])
    model = cls.from_pretrained(tmp_path / "float", dtype=torch.bfloat16)
    cquant.quantize_(model, scheme)
    y = tm.run(model, family)
    tmp_path = tmp_path / "quantized"
    model.save_pretrained(tmp_path)
    assert saved_files(tmp_path) == ["config.json", "diffusion_pytorch_model.safetensors"]  # no pickle
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "cquant" and config["format_version"] == cquant.FORMAT_VERSION
    assert len(config["quantized_layers"]) == len(linears(model))
    with safe_open(str(tmp_path / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.metadata()["cquant_format_version"] == str(cquant.FORMAT_VERSION)

    # loading never quantizes (and so never holds float weights of quantized layers)
    from cquant import torch_ops

    def no_quantize(*args, **kwargs):
        raise AssertionError("loading a quantized checkpoint quantized a float weight")

    monkeypatch.setattr(torch_ops, "quantize", no_quantize)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    for name, m in linears(loaded).items():
        assert isinstance(m, QuantizedLinear) and m.scheme.name == scheme
        assert torch.equal(m.weight, linears(model)[name].weight)
    assert torch.equal(tm.run(loaded, family), y)


def test_from_pretrained_with_quantization_config(tmp_path):
    float_model = tm.build("flux", dtype=torch.bfloat16)
    float_model.save_pretrained(tmp_path)
    expected = copy.deepcopy(float_model)
    cquant.quantize_(expected, "fp8dqrow")
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(
        tmp_path, quantization_config=cquant.CQuantConfig("fp8dqrow"), dtype=torch.bfloat16)
    assert loaded.is_quantized and loaded.dtype == torch.bfloat16
    assert torch.equal(tm.run(loaded, "flux"), tm.run(expected, "flux"))
    # the loaded model saves and loads again like one quantized with quantize_
    loaded.save_pretrained(tmp_path / "q")
    again = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    assert torch.equal(tm.run(again, "flux"), tm.run(expected, "flux"))


def test_from_pretrained_mapping_and_modules_to_not_convert(tmp_path):
    tm.build("sd3").save_pretrained(tmp_path)
    cfg = cquant.CQuantConfig({r"re:.*attn\..*": "fp8dqrow", "_default": "int8wo"},
                              modules_to_not_convert=["proj_out", "transformer_blocks.1"])
    loaded = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path, quantization_config=cfg)
    assert type(loaded.proj_out) is torch.nn.Linear
    assert type(loaded.transformer_blocks[1].ff.net[2]) is torch.nn.Linear
    assert loaded.transformer_blocks[0].attn.to_q.scheme.name == "fp8dqrow"
    assert loaded.transformer_blocks[0].ff.net[2].scheme.name == "int8wo"
    rows = {r.name: r for r in cquant.summary(loaded).rows}
    assert rows["proj_out"].status == "excluded" and "modules_to_not_convert" in rows["proj_out"].note


def test_cquant_config_round_trip_and_errors():
    cfg = cquant.CQuantConfig(cquant.Float8DynamicActivationFloat8WeightConfig(cquant.PerTensor()),
                              modules_to_not_convert="proj_out")
    d = cfg.to_dict()
    assert d["quant_type"] == "fp8dq" and d["modules_to_not_convert"] == ["proj_out"]
    assert cquant.CQuantConfig.from_dict(json.loads(json.dumps(d))) == cfg
    mapping = cquant.CQuantConfig({"re:.*": cquant.FPXWeightOnlyConfig(2, 2)})
    assert cquant.CQuantConfig.from_dict(mapping.to_dict()).quant_type == mapping.quant_type
    with pytest.raises(ValueError, match="format version 99"):
        cquant.CQuantConfig.from_dict(dict(d, format_version=99))
    with pytest.raises(ValueError, match="unknown CQuantConfig field"):
        cquant.CQuantConfig.from_dict(dict(d, bits=4))
    with pytest.raises(ValueError, match="quant_method"):
        cquant.CQuantConfig.from_dict(dict(d, quant_method="torchao"))
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        cquant.CQuantConfig("int3")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int5'"):
        cquant.CQuantConfig("int8wo", quantized_layers={"proj_out": "int5"})
    with pytest.raises(TypeError, match="modules_to_not_convert"):
        cquant.CQuantConfig("int8wo", modules_to_not_convert=[1])


# ---------------------------------------------------------------- bad checkpoints


@pytest.fixture
def saved_quantized(tmp_path):
    model = quantized("flux", "int8wo")
    model.save_pretrained(tmp_path)
    return tmp_path


def rewrite(path, edit_tensors=None, metadata=None):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    f = str(path / "diffusion_pytorch_model.safetensors")
    with safe_open(f, "pt") as h:
        meta = h.metadata()
    tensors = load_file(f)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, f, metadata=dict(meta, **(metadata or {})))


def test_truncated_file(saved_quantized):
    f = saved_quantized / "diffusion_pytorch_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises((OSError, ValueError), match="safetensors|load weights|checkpoint"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_format_version_mismatch_in_file(saved_quantized):
    rewrite(saved_quantized, metadata={"cquant_format_version": "99"})
    with pytest.raises(ValueError, match="cquant format version 99"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_format_version_mismatch_in_config(saved_quantized):
    p = saved_quantized / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["format_version"] = 0
    p.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="format version 0"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_scheme_mismatch(saved_quantized):
    # int8 codes under a config that says fp8: same shapes, different code dtype
    p = saved_quantized / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["quantized_layers"]["proj_out"] = "fp8wo"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="proj_out is fp8wo in the list but int8wo in the files"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_missing_tensor(saved_quantized):
    rewrite(saved_quantized, edit_tensors=lambda t: t.pop("proj_out.weight_scale"))
    with pytest.raises(ValueError, match="proj_out.weight_scale"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_config_without_layer_list(saved_quantized):
    p = saved_quantized / "config.json"
    cfg = json.loads(p.read_text())
    del cfg["quantization_config"]["quantized_layers"]
    p.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no quantized_layers"):
        diffusers.FluxTransformer2DModel.from_pretrained(saved_quantized)


def test_quantizer_arguments_are_checked():
    from cquant.integrations.diffusers_quantizer import CQuantDiffusersQuantizer

    with pytest.raises(TypeError, match="expected a CQuantConfig, got str"):
        CQuantDiffusersQuantizer("int8wo")
    q = CQuantDiffusersQuantizer({"quant_method": "cquant", "quant_type": "int8wo"})
    assert q.quantization_config == cquant.CQuantConfig("int8wo")
    with pytest.raises(ValueError, match="disk offload"):
        q.validate_environment(device_map={"": "cpu", "proj_out": "disk"})


def test_loading_before_import_cquant(saved_quantized):
    # a checkpoint whose config names cquant, loaded where cquant was never imported: an installed
    # cquant's start-up hook (cquant-autoload.pth) imports it and the load succeeds; without the
    # hook (a source tree on PYTHONPATH, an editable install) diffusers' error names cquant
    code = ("import diffusers, sys\n"
            f"try:\n    diffusers.FluxTransformer2DModel.from_pretrained({str(saved_quantized)!r})\n"
            "except ValueError as e:\n    print('ERR', e)\n"
            "else:\n    print('LOADED', 'cquant' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    hooked = any(os.path.exists(os.path.join(d, "cquant-autoload.pth")) for d in site.getsitepackages())
    if hooked:
        assert "LOADED True" in out.stdout, out.stdout + out.stderr
    else:
        assert "ERR" in out.stdout and "cquant" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------- standalone safetensors files


def test_save_and_load_quantized_plain_file(tmp_path):
    model = quantized("pixart-sigma", "fp6_e2m3")
    y = tm.run(model, "pixart-sigma")
    path = tmp_path / "pixart.safetensors"
    cquant.save_quantized(model, path)
    loaded = cquant.load_quantized(tm.build("pixart-sigma", seed=5), path)
    assert torch.equal(tm.run(loaded, "pixart-sigma"), y)
    with torch.device("meta"):  # its positional embedding is a non-persistent buffer, not in the file
        skeleton = diffusers.PixArtTransformer2DModel(**tm.CONFIGS["pixart-sigma"][1])
    with pytest.raises(ValueError, match="pos_embed.pos_embed.*meta device"):
        cquant.load_quantized(skeleton, path)
    with pytest.raises(ValueError, match="no cquant metadata"):
        from safetensors.torch import save_file

        save_file({"a": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
        cquant.load_quantized(tm.build("pixart-sigma"), tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
        cquant.load_quantized(tm.build("pixart-sigma"), tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match="layers this model does not have"):
        cquant.load_quantized(tm.build("flux"), path)
    other = tm.build("pixart-sigma")
    other.proj_out = torch.nn.Linear(64, 48)  # same layers, one of another shape
    with pytest.raises(ValueError, match="proj_out is 64 -> 32 in the file but 64 -> 48 in this model"):
        cquant.load_quantized(other, path)


# ---------------------------------------------------------------- registration


def test_registered_in_both_libraries():
    from diffusers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["cquant"] is cquant.CQuantConfig
    assert AUTO_QUANTIZER_MAPPING["cquant"].__name__ == "CQuantDiffusersQuantizer"
    assert cquant.integrations.registered() == {"diffusers": True, "transformers": True}


@pytest.mark.parametrize("order", ["diffusers first", "cquant first"])
def test_registration_in_either_import_order(order):
    imports = ["import diffusers.quantizers.auto as d", "import transformers.quantizers.auto as t", "import cquant"]
    if order == "cquant first":
        imports = imports[::-1]
    code = "\n".join(imports + ["print(d.AUTO_QUANTIZER_MAPPING['cquant'].__name__, "
                                "t.AUTO_QUANTIZER_MAPPING['cquant'].__name__, cquant.integrations.registered())"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "CQuantDiffusersQuantizer CQuantHfQuantizer {'diffusers': True, 'transformers': True}" in out.stdout


def test_import_cquant_does_not_import_diffusers():
    out = subprocess.run([sys.executable, "-c", "import sys, cquant; print('diffusers' in sys.modules, "
                          "'transformers' in sys.modules, 'torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


def test_registration_of_an_unknown_layout_warns():
    import types

    from cquant import integrations

    bogus = types.ModuleType("diffusers.quantizers.auto")
    with pytest.warns(integrations.RegistrationWarning, match="could not register"):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            integrations._run("diffusers.quantizers.auto", bogus)


# ---------------------------------------------------------------- pipelines


def test_pipeline_quantization_config(tmp_path):
    pipe = tm.flux_pipeline()
    pipe.save_pretrained(tmp_path)
    q = diffusers.PipelineQuantizationConfig(quant_mapping={
        "transformer": cquant.CQuantConfig("fp8dqrow"),
        "text_encoder": cquant.CQuantConfig("int8wo"),
        "text_encoder_2": cquant.CQuantConfig("int8dq"),
    })
    loaded = diffusers.FluxPipeline.from_pretrained(tmp_path, quantization_config=q, tokenizer=None, tokenizer_2=None)
    assert loaded.transformer.proj_out.scheme.name == "fp8dqrow"
    assert loaded.text_encoder.encoder.layers[0].mlp.fc1.scheme.name == "int8wo"
    ffn = loaded.text_encoder_2.encoder.block[0].layer[1].DenseReluDense
    assert ffn.wi.scheme.name == "int8dq" and type(ffn.wo) is torch.nn.Linear  # T5 keeps wo (_keep_in_fp32_modules)
    g = torch.Generator().manual_seed(0)
    images = loaded(prompt_embeds=torch.randn(1, 8, 64, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    num_inference_steps=2, height=32, width=32, generator=g, output_type="pt").images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


def test_quantize_pipeline_fuses_without_unfused_copies():
    pipe = tm.flux_pipeline(with_text_encoders=False)
    ref = copy.deepcopy(pipe.transformer)
    cquant.quantize_(ref, "int8wo")
    cquant.quantize_pipeline(pipe, "int8wo", components=["transformer"], fuse_qkv=True)
    t = pipe.transformer
    attn = t.transformer_blocks[0].attn
    assert attn.fused_projections and isinstance(attn.to_qkv, QuantizedLinear)
    assert all(isinstance(getattr(attn, n), QuantizedLinearSlice) for n in ("to_q", "to_k", "to_v", "add_q_proj"))
    assert not any(type(m) is torch.nn.Linear for m in t.modules())  # no float projection left
    assert not any(".to_q." in k for k in t.state_dict())
    assert torch.equal(tm.run(t, "flux"), tm.run(ref, "flux"))  # per-row codes concatenate exactly
    with pytest.raises(ValueError, match="no component 'unet'"):
        cquant.quantize_pipeline(pipe, "int8wo", components=["unet"])


@pytest.mark.parametrize("bad", ["typo", "scheduler"])
def test_quantize_pipeline_checks_every_name_before_quantizing(bad):
    """A bad name after a good one left the good component quantized, so calling again with a
    fixed list failed as 'already quantized'."""
    pipe = tm.flux_pipeline(with_text_encoders=False)
    with pytest.raises((ValueError, TypeError), match=repr(bad)):
        cquant.quantize_pipeline(pipe, "int8wo", components=["transformer", bad])
    assert not any(isinstance(m, QuantizedLinear) for m in pipe.transformer.modules())
    cquant.quantize_pipeline(pipe, "int8wo", components=["transformer"])


# ---------------------------------------------------------------- QKV fusion


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart-sigma", "cogvideox"])
def test_fuse_then_quantize(family):
    unfused = quantized(family, "int8dq")
    model = tm.build(family)
    model.fuse_qkv_projections()
    cquant.quantize_(model, "int8dq")
    views = [m for m in model.modules() if isinstance(m, QuantizedLinearSlice)]
    assert views, "the unfused projections should be views of the fused layer"
    assert torch.equal(tm.run(model, family), tm.run(unfused, family))
    assert cquant.summary(model).count("view") == len(views)


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2", "fp8dq"])
def test_quantize_then_fuse(scheme):
    model = quantized("flux", scheme)
    y = tm.run(model, "flux")
    model.fuse_qkv_projections()  # diffusers' own call
    attn = model.single_transformer_blocks[0].attn
    assert attn.fused_projections and isinstance(attn.to_qkv, QuantizedLinear)
    assert isinstance(attn.to_q, QuantizedLinearSlice)
    yf = tm.run(model, "flux")
    if model.single_transformer_blocks[0].attn.to_qkv.scheme.weight_granularity == "row":
        assert torch.equal(yf, y)
    else:
        assert tm.sqnr_db(y, yf) > FUSED_REQUANT_SQNR_FLOOR_DB
    model.unfuse_qkv_projections()
    assert torch.equal(tm.run(model, "flux"), yf)  # the views compute the fused rows
    model.fuse_qkv_projections()  # the fused layer the views share comes back
    assert isinstance(model.single_transformer_blocks[0].attn.to_qkv, QuantizedLinear)
    assert torch.equal(tm.run(model, "flux"), yf)


# torch's hook kinds (with their kwargs and always-called variants): (kind as errors name it, register(layer))
TORCH_HOOKS = {
    "forward": ("forward hook", lambda m: m.register_forward_hook(lambda *a: None)),
    "forward always_call": ("forward hook", lambda m: m.register_forward_hook(lambda *a: None, always_call=True)),
    "forward with_kwargs": ("forward hook", lambda m: m.register_forward_hook(lambda *a: None, with_kwargs=True)),
    "forward pre": ("forward pre-hook", lambda m: m.register_forward_pre_hook(lambda *a: None)),
    "forward pre with_kwargs": ("forward pre-hook",
                                lambda m: m.register_forward_pre_hook(lambda *a: None, with_kwargs=True)),
    "full backward": ("backward hook", lambda m: m.register_full_backward_hook(lambda *a: None)),
    "full backward pre": ("backward pre-hook", lambda m: m.register_full_backward_pre_hook(lambda *a: None)),
}


def _not_fused(model):
    return not any(getattr(m, "fused_projections", False) or getattr(m, "to_qkv", None) is not None
                   for m in model.modules())


@pytest.mark.parametrize("hook", list(TORCH_HOOKS))
@pytest.mark.parametrize("scheme", [None, "int8wo"])
def test_fuse_qkv_refuses_projections_with_torch_hooks(scheme, hook):
    """The fused layer computes q, k and v in place of the layer the hook is on, which would never
    run again: refused before anything changes, float or quantized, as diffusers' hooks are."""
    kind, register = TORCH_HOOKS[hook]
    model = tm.build("flux") if scheme is None else quantized("flux", scheme)
    to_q = model.transformer_blocks[1].attn.to_q
    register(to_q)
    with pytest.raises(ValueError, match=rf"transformer_blocks\.1\.attn\.to_q \(torch {kind}\).*hooks would not run"):
        cquant.fuse_qkv_(model)
    assert _not_fused(model) and model.transformer_blocks[1].attn.to_q is to_q


def test_hooks_on_the_base_layer_of_an_adapter_are_refused_too():
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = quantized("flux", "int8wo")
    model.add_adapter(LoraConfig(r=4, target_modules=["to_k"]))
    model.transformer_blocks[0].attn.to_k.base_layer.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn\.to_k\.base_layer \(torch forward pre-hook\)"):
        cquant.fuse_qkv_(model)
    assert _not_fused(model)


def test_quantize_pipeline_refuses_hooked_projections_before_quantizing():
    pipe = tm.flux_pipeline(with_text_encoders=False)
    calls = []
    pipe.transformer.single_transformer_blocks[0].attn.to_v.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"quantize_pipeline\(fuse_qkv=True\) of 'transformer'.*"
                                         r"single_transformer_blocks\.0\.attn\.to_v \(torch forward hook\)"):
        cquant.quantize_pipeline(pipe, "int8wo", fuse_qkv=True)
    assert not any(isinstance(m, QuantizedLinear) for m in pipe.transformer.modules()) and _not_fused(pipe.transformer)
    tm.run(pipe.transformer, "flux")
    assert calls == [1]


def test_diffusers_fuse_qkv_projections_leaves_modules_with_torch_hooks_unfused():
    """diffusers' own call fuses module after module: a quantized one whose projection carries a
    torch hook stays unfused, with a warning, and the hook keeps running."""
    model = quantized("flux", "int8wo")
    calls = []
    model.transformer_blocks[1].attn.add_k_proj.register_forward_hook(lambda *a: calls.append(1))
    with pytest.warns(UserWarning, match=r"left unfused: .*add_k_proj \(torch forward hook\)"):
        model.fuse_qkv_projections()
    assert model.transformer_blocks[0].attn.fused_projections and not model.transformer_blocks[1].attn.fused_projections
    tm.run(model, "flux")
    assert calls == [1]


def test_projections_of_different_schemes_fuse_float_with_a_warning():
    model = tm.build("flux")
    cquant.quantize_(model, cquant.FqnToConfig({"re:.*attn.to_q$": "fp8wo", "_default": "int8wo"}))
    y = tm.run(model, "flux")
    with pytest.warns(UserWarning, match=r"fusing to_q fp8wo, to_k int8wo, to_v int8wo into one float to_qkv"):
        cquant.fuse_qkv_(model)
    fused = model.transformer_blocks[0].attn.to_qkv
    assert type(fused) is torch.nn.Linear  # the dequantized weights: weight-only parts compute the same
    assert torch.allclose(tm.run(model, "flux"), y, rtol=1e-4, atol=1e-4)


def test_fused_quantized_model_round_trip(tmp_path):
    model = quantized("sd3", "fp8dqrow")
    model.fuse_qkv_projections()
    y = tm.run(model, "sd3")
    model.save_pretrained(tmp_path)
    layers = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert any(k.endswith("to_qkv") for k in layers) and not any(k.endswith("to_q") for k in layers)
    loaded = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path)
    assert loaded.transformer_blocks[0].attn.fused_projections
    assert torch.equal(tm.run(loaded, "sd3"), y)


# ---------------------------------------------------------------- LoRA, cache hooks, dequantize


def test_peft_lora_on_a_quantized_model():
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = quantized("flux", "fp8dqrow")
    y = tm.run(model, "flux")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    to_q = model.transformer_blocks[0].attn.to_q
    assert isinstance(to_q.base_layer, QuantizedLinear)
    assert to_q.lora_A["default"].weight.dtype == torch.float32  # placed by the compute dtype, not the codes'
    y_lora = tm.run(model, "flux")
    assert torch.isfinite(y_lora).all() and not torch.equal(y_lora, y)
    # one training step: gradients reach the adapters through the quantized layers
    model.train()
    out = model(**tm.inputs("flux"))[0]
    out.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.set_adapters([])


def test_first_block_cache_hook():
    from diffusers import FirstBlockCacheConfig

    model = quantized("flux", "int8wo")
    plain = tm.run(model, "flux")
    other_inputs = tm.inputs("flux", seed=7)
    with torch.no_grad():
        plain_other = model(**other_inputs)[0]
    model.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # always reuse after the first call
    with torch.no_grad(), model.cache_context("cond"):
        first = model(**tm.inputs("flux"))[0]
        cached = model(**other_inputs)[0]
    assert torch.equal(first, plain)
    assert torch.isfinite(cached).all() and not torch.equal(cached, plain_other)  # the cache short-circuited
    model.disable_cache()
    assert torch.equal(tm.run(model, "flux"), plain)


def test_dequantize_through_diffusers(tmp_path):
    tm.build("flux").save_pretrained(tmp_path)
    model = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path, quantization_config=cquant.CQuantConfig("int8wo"),
                                                             dtype=torch.float32)
    y = tm.run(model, "flux")
    model.dequantize()
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert not getattr(model, "is_quantized", False)
    assert torch.allclose(tm.run(model, "flux"), y, rtol=1e-3, atol=1e-3)


def test_quantized_model_rejects_dtype_casts_like_other_quantizers():
    model = quantized("flux", "int8wo", dtype=torch.bfloat16)
    for cast in (lambda m: m.to(torch.float16), lambda m: m.half(), lambda m: m.float()):
        with pytest.raises(ValueError):
            cast(model)
    model.to("cpu")
