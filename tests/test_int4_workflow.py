"""The 4-bit grouped schemes (int4wo, int4wo_sym, int4dq, int4dq_2l, fp8da_int4w) through the Python layer
on the CPU: configs and names, quantize_ on a diffusers model with group sizes 32 / 64 / 128,
inference_mode, copies, dtypes, save / load (torch.save, save_pretrained, from_pretrained,
save_quantized), QKV fusion, PEFT merges, and checkpoints edited or damaged."""

import copy
import io
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant import checkpoint, ops  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from tolerances import (INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB, INT4_MODEL_SQNR_FLOOR_DB,  # noqa: E402
                        INT4_TEXT_ENCODER_SQNR_FLOOR_DB, LOWRANK_SQNR_GAIN_DB)

SCHEMES = ["int4wo", "int4wo_sym", "int4dq", "int4dq_2l", "fp8da_int4w"]
GROUP_SIZES = [32, 64, 128]
# the tiny Flux at a width where every group size divides most layers (128); its x_embedder
# (16 inputs) and the 64-wide time projection leave some layers to each group size's refusal
WIDE = dict(attention_head_dim=64, axes_dims_rope=[16, 24, 24])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def build(seed=0, dtype=torch.float32):
    return tm.build("flux", dtype=dtype, seed=seed, **WIDE)


def quantized(scheme, group_size=128, seed=0, dtype=torch.float32, **kw):
    model = build(seed, dtype)
    cquant.quantize_(model, cquant.config_from_name(scheme, group_size=group_size, **kw))
    return model


def qlayers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


# ---------------------------------------------------------------- configs and names


def test_configs_names_and_torchao_spellings():
    cfg = cquant.Int4WeightOnlyConfig()
    assert cfg.group_size == 128 and cfg.name == "int4wo" and cfg.scheme().weight_format.name == "uint4"
    assert cquant.Int4WeightOnlyConfig(64).name == "int4wo_g64"
    assert cquant.Int4WeightOnlyConfig(64, symmetric=True).name == "int4wo_sym_g64"
    assert cquant.Int8DynamicActivationInt4WeightConfig(32).name == "int4dq_g32"
    assert cquant.Float8DynamicActivationInt4WeightConfig().name == "fp8da_int4w"
    assert cquant.config_from_name("int4_weight_only") == cfg
    assert cquant.config_from_name("int4wo", group_size=64) == cquant.Int4WeightOnlyConfig(64)
    assert cquant.config_from_name("int4wo_g64") == cquant.Int4WeightOnlyConfig(64)
    assert cquant.config_from_name("int4wo_g128") == cfg
    assert cquant.config_from_name("int4dq_g32_r8") == cquant.Int8DynamicActivationInt4WeightConfig(32, lowrank_rank=8)
    for c in (cquant.Int4WeightOnlyConfig(256, symmetric=True), cquant.Int8DynamicActivationInt4WeightConfig(1024),
              cquant.Float8DynamicActivationInt4WeightConfig(32, lowrank_rank=4)):
        assert cquant.config_from_name(c.name) == c
        assert cquant.config_from_dict(json.loads(c.to_json())) == c
        assert c.scheme().weight_group_size == c.group_size


def test_cquant_config_keywords_fold_into_the_scheme():
    c = cquant.CQuantConfig("int4wo", group_size=64, lowrank_rank=8)
    assert c.quant_type == cquant.Int4WeightOnlyConfig(64, lowrank_rank=8)
    assert c.to_dict()["quant_type"] == "int4wo_g64_r8" and cquant.CQuantConfig.from_dict(c.to_dict()) == c
    assert cquant.CQuantConfig(cquant.Int4WeightOnlyConfig(), group_size=32).quant_type.group_size == 32
    assert cquant.CQuantConfig({"type": "Int4WeightOnlyConfig"}, group_size=32).quant_type.group_size == 32
    with pytest.raises(TypeError, match="set the fields of one scheme"):
        cquant.CQuantConfig({"re:.*": "int4wo"}, group_size=32)
    with pytest.raises(TypeError, match="Int4WeightOnlyConfig.*takes no bits"):
        cquant.CQuantConfig("int4wo", bits=4)


@pytest.mark.parametrize("cls", [cquant.Int4WeightOnlyConfig, cquant.Int8DynamicActivationInt4WeightConfig,
                                 cquant.Int8DynamicActivationInt4TwoLevelWeightConfig,
                                 cquant.Float8DynamicActivationInt4WeightConfig])
def test_group_size_is_validated(cls):
    for bad in (16, 48, 100, 2048, 0, -128):
        with pytest.raises(ValueError, match=r"group_size = -?\d+; expected a power of two from 32 to 1024"):
            cls(bad)
    for bad in (128.0, "128", True, None):
        with pytest.raises(TypeError, match="group_size must be an int"):
            cls(bad)


def test_a_group_size_for_a_scheme_without_groups_is_refused():
    with pytest.raises(TypeError, match="Int8WeightOnlyConfig.*takes no group_size"):
        cquant.config_from_name("int8wo", group_size=64)
    with pytest.raises(ValueError, match="has no weight groups"):
        cquant.config_from_name("int8wo_g64")


# ---------------------------------------------------------------- quantize_ and forward


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_a_diffusers_model(scheme, group_size):
    model = build()
    ref = tm.run(model, "flux")
    cquant.quantize_(model, cquant.config_from_name(scheme, group_size=group_size))
    layers = qlayers(model)
    s = cquant.summary(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, m in linears.items():
        if m.in_features % group_size == 0 and m.in_features >= 16:
            assert name in layers, (name, s.skipped.get(name))
        else:  # left as it is, with the reason in the summary
            assert name not in layers and f"not a multiple of the weight group size {group_size}" in s.skipped[name]
    for m in layers.values():
        assert m.scheme.weight_group_size == group_size
        g = m.in_features // group_size
        assert m.weight.dtype == torch.uint8 and m.weight.shape == (m.out_features, m.scheme.row_bytes(m.in_features))
        want = {"int4wo": (m.out_features, g, 2), "int4dq_2l": (m.out_features, 1 + g)}
        assert m.weight_scale.shape == want.get(scheme, (m.out_features, g))
    with torch.inference_mode():
        y = tm.run(model, "flux")
    assert tm.sqnr_db(ref, y) > INT4_MODEL_SQNR_FLOOR_DB[scheme]
    assert torch.equal(tm.run(copy.deepcopy(model), "flux"), y)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(tm.run(torch.load(buf, weights_only=False), "flux"), y)


def test_gaussian_layer_sqnr():
    # a 4-bit grid over a group's range: about 6 dB a bit plus the Gaussian's peak-to-rms (int4wo
    # measures 19.5 dB on N(0, 1) weights; the floor is what 4 bits must give in any case)
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(1024, 256)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 1024, generator=g))
    x = torch.randn(64, 1024, generator=g)
    ref = lin(x).double()
    for scheme in SCHEMES:
        q = QuantizedLinear.from_float(lin, scheme)
        assert tm.sqnr_db(ref, q(x)) > INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB[scheme], scheme


def test_layer_state_repr_bytes_and_dtypes():
    lin = torch.nn.Linear(256, 96, dtype=torch.bfloat16)
    q = QuantizedLinear.from_float(lin, "int4wo_g64")
    assert q.weight.shape == (96, 128) and q.weight_scale.shape == (96, 4, 2)
    assert q.nbytes == 96 * 128 + 96 * 4 * 2 * 4 + 96 * 2
    assert "int4wo_g64" in repr(q) and "group 64" in repr(q)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y = q(x)
    f = copy.deepcopy(q).float()
    assert f.compute_dtype == torch.float32 and f.weight_scale.dtype == torch.float32 and torch.equal(f.weight, q.weight)
    assert tm.sqnr_db(y.float(), f(x.float())) > 35
    row = cquant.summary(torch.nn.Sequential(q)).rows[0]
    assert row.group_size == 64 and row.bytes_after == q.nbytes
    assert row.scales == "group 64" and "group 64" in str(cquant.summary(torch.nn.Sequential(q)))
    sd = q.state_dict()
    sk = QuantizedLinear(256, 96, "int4wo_g64", dtype=torch.bfloat16)
    sk.load_state_dict(sd)
    assert torch.equal(sk(x), y)
    with pytest.raises(RuntimeError, match=r"weight_scale: the checkpoint holds torch.float32 \(96, 4, 2\), but this "
                                           r"int4wo layer \(256 -> 96\) stores torch.float32 \(96, 2, 2\)"):
        QuantizedLinear(256, 96, "int4wo_g128").load_state_dict(sd)


def test_bfloat16_model_and_device_moves():
    ref = tm.run(build(), "flux")
    model = quantized("int4dq", 64, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    y = tm.run(model, "flux")
    assert y.dtype == torch.bfloat16 and tm.sqnr_db(ref, y) > INT4_MODEL_SQNR_FLOOR_DB["int4dq"] - 3
    model.to("cpu")
    assert torch.equal(tm.run(model, "flux"), y)


def test_quantize_then_fuse_is_exact():
    model = quantized("int4wo", 64)
    y = tm.run(model, "flux")
    cquant.fuse_qkv_(model)
    fused = model.transformer_blocks[0].attn.to_qkv
    assert isinstance(fused, QuantizedLinear) and fused.scheme.name == "int4wo_g64"
    assert torch.allclose(tm.run(model, "flux"), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int4wo_g64", "int4dq_g64", "int4dq_2l_g64", "fp8da_int4w_g32", "int4wo_g64_r8"])
def test_fused_blocks_compute_what_the_layers_do(scheme):
    # cquant.optimize's block forwards call the linear ops themselves (with the group size);
    # layers with a low-rank correction send their block back to diffusers' forward
    model = build()
    cquant.quantize_(model, scheme)
    ref = tm.run(model, "flux")
    report = cquant.optimize(model)
    assert report.installed and not report.skipped
    assert tm.sqnr_db(ref, tm.run(model, "flux")) > 60  # the same math, other rounding orders at most


def test_dequantize_gives_the_stored_weights_back():
    model = quantized("int4wo_sym", 32)
    y = tm.run(model, "flux")
    cquant.dequantize_(model)
    assert not qlayers(model)
    assert tm.sqnr_db(y, tm.run(model, "flux")) > 60


# ---------------------------------------------------------------- save and load


@pytest.mark.parametrize("scheme, group_size", [("int4wo", 64), ("int4dq", 32), ("fp8da_int4w", 128),
                                                ("int4wo_sym", 128), ("int4dq_2l", 64)])
def test_save_pretrained_round_trip(scheme, group_size, tmp_path):
    model = quantized(scheme, group_size)
    y = tm.run(model, "flux")
    model.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == cquant.FORMAT_VERSION == 3
    name = scheme if group_size == 128 else f"{scheme}_g{group_size}"
    assert set(qc["quantized_layers"].values()) == {name}
    meta = checkpoint.read_metadata(tmp_path / "diffusion_pytorch_model.safetensors")
    assert meta[checkpoint.META_FORMAT_VERSION] == "3"
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    assert torch.equal(tm.run(loaded, "flux"), y)
    cquant.save_quantized(model, tmp_path / "m.safetensors")
    again = cquant.load_quantized(build(), tmp_path / "m.safetensors")
    for name, layer in qlayers(again).items():
        assert torch.equal(layer.weight, model.get_submodule(name).weight)
    # the float layers a group size leaves (x_embedder, ...) keep the file's buffers, whose
    # alignment can change the CPU GEMM's summation order: equal up to fp32 round-off
    assert torch.allclose(tm.run(again, "flux"), y, rtol=1e-5, atol=1e-6)


def test_from_pretrained_with_a_quantization_config(tmp_path):
    build().save_pretrained(tmp_path / "float")
    expected = tm.run(quantized("int4wo", 64), "flux")
    for qc in (cquant.CQuantConfig("int4wo", group_size=64), cquant.CQuantConfig(cquant.Int4WeightOnlyConfig(64)),
               cquant.CQuantConfig.from_dict(cquant.CQuantConfig("int4wo_g64").to_dict())):
        loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "float", quantization_config=qc)
        assert {m.scheme.name for m in qlayers(loaded).values()} == {"int4wo_g64"}
        assert torch.equal(tm.run(loaded, "flux"), expected)
    with pytest.raises(TypeError, match="takes no group_size"):
        cquant.CQuantConfig("fp8dqrow", group_size=64)
    with pytest.raises(ValueError, match="group_size = 96"):
        cquant.CQuantConfig("int4wo", group_size=96)


def test_pipeline_quantization_config(tmp_path):
    pipe = tm.flux_pipeline(with_text_encoders=False)
    pipe.transformer = build()
    pipe.save_pretrained(tmp_path)
    pq = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig("int4dq", group_size=32)})
    loaded = diffusers.FluxPipeline.from_pretrained(tmp_path, quantization_config=pq, text_encoder=None,
                                                    text_encoder_2=None, tokenizer=None, tokenizer_2=None)
    assert {m.scheme.name for m in qlayers(loaded.transformer).values()} == {"int4dq_g32"}


def test_transformers_text_encoder_round_trip(tmp_path):
    model = tm.clip_text_encoder()  # hidden 32, MLP 64: group sizes 32 and 64
    ids = torch.arange(2, 14).view(1, 12)
    with torch.no_grad():
        ref = model(ids).last_hidden_state
    cquant.quantize_(model, cquant.Int8DynamicActivationInt4WeightConfig(32))
    with torch.no_grad():
        y = model(ids).last_hidden_state
    assert tm.sqnr_db(ref, y) > INT4_TEXT_ENCODER_SQNR_FLOOR_DB
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, y)


def test_transformers_from_pretrained_with_a_quantization_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tm.clip_text_encoder()
    model.save_pretrained(tmp_path / "float")
    ids = torch.arange(2, 14).view(1, 12)
    cquant.quantize_(model, cquant.config_from_name("int4wo", group_size=32, lowrank_rank=4))
    loaded = transformers.CLIPTextModel.from_pretrained(
        tmp_path / "float", quantization_config=cquant.CQuantConfig("int4wo", group_size=32, lowrank_rank=4))
    assert {m.scheme.name for m in qlayers(loaded).values()} == {"int4wo_g32_r4"}
    with torch.no_grad():
        assert torch.allclose(loaded(ids).last_hidden_state, model(ids).last_hidden_state, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- checkpoints edited or damaged


@pytest.fixture
def saved(tmp_path):
    model = quantized("int4wo", 64)
    model.save_pretrained(tmp_path)
    return tmp_path


def rewrite(path, tensors=None, meta=None):
    f = str(path / "diffusion_pytorch_model.safetensors")
    with safe_open(f, "pt") as h:
        m = dict(h.metadata())
    t = load_file(f)
    if tensors:
        tensors(t)
    if meta:
        meta(m)
    save_file(t, f, metadata=m)


def edit_described(layer, name, shape):
    def edit(m):
        d = json.loads(m[checkpoint.META_TENSORS])
        d[layer][name]["shape"] = list(shape)
        m[checkpoint.META_TENSORS] = json.dumps(d)
    return edit


LAYER = "transformer_blocks.0.attn.to_q"


def load_flux(path):
    return diffusers.FluxTransformer2DModel.from_pretrained(path)


@pytest.mark.parametrize("scheme", ["int4wo", "int4wo_sym"])
def test_checkpoint_with_scales_of_any_fp32_value_loads_and_computes_with_them(scheme, tmp_path):
    """Checkpoints written before the quantizer rounded 4-bit scales to 8 significant bits hold
    arbitrary fp32 scales: they load unchanged, and the layers compute (code - zp) * scale with
    them exactly as cquant.h says (dequantize_ gives those fp32 products bit for bit)."""
    import numpy as np
    import reference as ref

    quantized(scheme, 64).save_pretrained(tmp_path)
    edited = {}

    def unround(t):
        for key in [k for k in t if k.endswith(".weight_scale")]:
            s = t[key].clone()
            (s if scheme == "int4wo_sym" else s[..., 0]).mul_(1 + 2.0**-20)  # no bfloat16 value any more
            t[key] = edited[key] = s
    rewrite(tmp_path, tensors=unround)
    model = load_flux(tmp_path)
    layer = model.get_submodule(LAYER)
    s = edited[f"{LAYER}.weight_scale"]
    assert torch.equal(layer.weight_scale.view(torch.int32), s.view(torch.int32))
    assert ((s if scheme == "int4wo_sym" else s[..., 0]).view(torch.int32) & 0xFFFF).ne(0).any()
    fmt = "int4" if scheme == "int4wo_sym" else "uint4"
    codes = ref.codes_of_stored_group(layer.weight.numpy(), fmt, layer.in_features)
    wd = ref.dequantize_group(codes, s.numpy(), fmt, 64)
    x = torch.randn(3, layer.in_features)
    y = layer(x)
    y64 = x.double().numpy() @ wd.astype(np.float64).T + layer.bias.double().detach().numpy()
    assert np.allclose(y.detach().double().numpy(), y64, rtol=1e-5, atol=1e-5)
    cquant.dequantize_(model)
    w = model.get_submodule(LAYER).weight.detach().numpy()
    np.testing.assert_array_equal(w.view(np.uint32), wd.view(np.uint32))


def test_wrong_scale_shape_is_refused(saved):
    def drop_groups(t):
        t[f"{LAYER}.weight_scale"] = t[f"{LAYER}.weight_scale"][:, :1].contiguous()
    rewrite(saved, tensors=drop_groups)
    with pytest.raises(ValueError, match=rf"{LAYER}.weight_scale is float32 \[128, 1, 2\] in the file"):
        load_flux(saved)
    # and with the metadata edited to match: the scheme's group size decides
    rewrite(saved, meta=edit_described(LAYER, "weight_scale", (128, 1, 2)))
    with pytest.raises(ValueError, match=rf"{LAYER}.weight_scale is described as float32 \[128, 1, 2\], which a "
                                         "int4wo_g64 layer"):
        load_flux(saved)


def test_group_size_in_the_lists_not_matching_the_tensors_is_refused(saved):
    # config.json and both metadata lists say group 128, the tensors hold groups of 64
    cfg = json.loads((saved / "config.json").read_text())
    cfg["quantization_config"]["quantized_layers"][LAYER] = "int4wo"
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{LAYER} is int4wo in the list but int4wo_g64 in the files"):
        load_flux(saved)

    def relabel(m):
        for key in (checkpoint.META_LAYERS, checkpoint.META_TENSORS):
            d = json.loads(m[key])
            d[LAYER] = "int4wo" if key == checkpoint.META_LAYERS else dict(d[LAYER], scheme="int4wo")
            m[key] = json.dumps(d)
    rewrite(saved, meta=relabel)
    with pytest.raises(ValueError, match=rf"{LAYER}.weight_scale is described as float32 \[128, 2, 2\], which a "
                                         "int4wo layer of 128 -> 128 does not store"):
        load_flux(saved)
    rewrite(saved, meta=lambda m: m.pop(checkpoint.META_TENSORS))  # an undescribed file: the tensors decide
    with pytest.raises(ValueError, match=rf"{LAYER}.weight_scale is float32 \[128, 2, 2\], but a int4wo layer"):
        load_flux(saved)


def test_packed_row_bytes_wrong_is_refused(saved):
    def pad(t):
        w = t[f"{LAYER}.weight"]
        t[f"{LAYER}.weight"] = torch.cat([w, torch.zeros(w.shape[0], 16, dtype=w.dtype)], 1)
    rewrite(saved, tensors=pad, meta=edit_described(LAYER, "weight", (128, 80)))
    with pytest.raises(ValueError, match=rf"{LAYER}.weight is described as uint8 \[128, 80\]"):
        load_flux(saved)


def test_truncated_file_is_refused(saved):
    f = saved / "diffusion_pytorch_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(Exception, match=r"(?i)safetensors|truncat|incomplete|invalid|damaged"):
        load_flux(saved)


def test_zero_points_out_of_range_load_and_are_used_as_the_math_says(saved):
    model = load_flux(saved)
    layer = model.get_submodule(LAYER)
    codes = ops.unpack(layer.weight, 4, layer.in_features).to(torch.float32)
    scale = layer.weight_scale.clone()
    scale[:, :, 1] = 20.0  # beyond [0, 15]: the quantizer never writes it, the math still defines it

    def set_zp(t):
        t[f"{LAYER}.weight_scale"] = scale
    rewrite(saved, tensors=set_zp)
    loaded = load_flux(saved).get_submodule(LAYER)
    want = (codes - 20.0) * scale[:, :, :1].repeat_interleave(64, 1).squeeze(-1)
    assert torch.equal(loaded.dequantize(torch.float32), want)
    x = torch.randn(3, 128)
    assert torch.allclose(loaded(x), x @ want.T + loaded.bias, rtol=1e-5, atol=1e-5)


def test_version_1_checkpoint_listing_4_bit_layers_is_refused(saved):
    rewrite(saved, meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "1"}))
    with pytest.raises(ValueError, match="format version 1, which has no group-wise .* lists .*int4wo_g64"):
        load_flux(saved)
    cfg = json.loads((saved / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 1
    with pytest.raises(ValueError, match="format version 1, which has no group-wise"):
        cquant.CQuantConfig.from_dict(cfg["quantization_config"])
    with pytest.raises(ValueError, match=r"format version 1, which has no .*low-rank corrections.*int8wo_r4"):
        cquant.CQuantConfig("int8wo", quantized_layers={"proj_out": "int8wo_r4"}, format_version=1)
    assert cquant.CQuantConfig("int8wo", quantized_layers={"proj_out": "fp6_e3m2"}, format_version=1)


def test_version_2_checkpoints_load_but_cannot_hold_two_level_layers(tmp_path):
    # a version 2 file of int4dq is what version 3 writes for it: it loads as it is
    model = quantized("int4dq", 64)
    y = tm.run(model, "flux")
    model.save_pretrained(tmp_path / "dq")
    rewrite(tmp_path / "dq", meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "2"}))
    assert torch.equal(tm.run(load_flux(tmp_path / "dq"), "flux"), y)
    quantized("int4dq_2l", 64).save_pretrained(tmp_path / "tl")
    rewrite(tmp_path / "tl", meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "2"}))
    with pytest.raises(ValueError, match="format version 2, which has no two-level .* lists .*int4dq_2l_g64"):
        load_flux(tmp_path / "tl")
    with pytest.raises(ValueError, match="format version 2, which has no two-level"):
        cquant.CQuantConfig("int8wo", quantized_layers={"proj_out": "int4dq_2l"}, format_version=2)
    assert cquant.CQuantConfig("int8wo", quantized_layers={"proj_out": "int4dq_g64"}, format_version=2)


# ---------------------------------------------------------------- PEFT


@pytest.mark.parametrize("config, name, scale_shape", [
    (cquant.Int4WeightOnlyConfig(32), "int4wo_g32", (64, 4, 2)),
    (cquant.Int8DynamicActivationInt4TwoLevelWeightConfig(32), "int4dq_2l_g32", (64, 1 + 4)),
])
def test_lora_merge_requantizes_with_the_same_group_size_and_unmerge_restores(seed, config, name, scale_shape):
    peft = pytest.importorskip("peft")
    from cquant.integrations.peft_lora import LoraMergeWarning

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    cquant.quantize_(model, config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"],
                                                       init_lora_weights=False))
    base = model.base_model.model[0].get_base_layer()
    before = {n: t.clone() for n, t in base.state_dict().items()}
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = model(x)
    with pytest.warns(LoraMergeWarning, match="SQNR"):
        model.merge_adapter()
    assert base.scheme.name == name and tuple(base.weight_scale.shape) == scale_shape
    assert not torch.equal(base.weight, before["weight"])
    with torch.no_grad():
        assert tm.sqnr_db(y, model(x)) > 12
    model.unmerge_adapter()
    for n, t in base.state_dict().items():
        assert torch.equal(t, before[n]), n
    with torch.no_grad():
        assert torch.equal(model(x), y)
    merged = model.merge_and_unload()
    assert isinstance(merged[0], QuantizedLinear) and merged[0].scheme.weight_group_size == 32


def test_lowrank_correction_helps_int4(seed):
    g = torch.Generator().manual_seed(seed)
    n, k = 96, 256
    w = 0.02 * torch.randn(n, k, generator=g) + 0.2 * torch.randn(n, 4, generator=g) @ torch.randn(4, k, generator=g)
    w[torch.randint(0, n, (8,), generator=g), torch.randint(0, k, (8,), generator=g)] = 3.0
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(16, k, generator=g)
    ref = lin(x).double()
    plain = tm.sqnr_db(ref, QuantizedLinear.from_float(lin, "int4wo")(x))
    corrected = tm.sqnr_db(ref, QuantizedLinear.from_float(lin, "int4wo_r16")(x))
    assert corrected > plain + LOWRANK_SQNR_GAIN_DB["int4wo"], (plain, corrected)


@pytest.mark.parametrize("scheme", ["int4dq_g64", "int4wo", "int4wo_r8"])
def test_torch_compile_and_gradients(scheme):
    q = QuantizedLinear.from_float(torch.nn.Linear(256, 64), scheme)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), q(x), rtol=1e-5, atol=1e-6)
    xg = x.clone().requires_grad_()
    q(xg).sum().backward()  # adapters train on a frozen 4-bit base: dL/dx = dL/dy W
    assert torch.allclose(xg.grad, torch.ones(4, 64) @ q.dequantize(torch.float32), rtol=1e-4, atol=1e-5)
