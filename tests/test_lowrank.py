"""Low-rank correction of the quantization error (cquant.lowrank): what it buys, that rank 0 adds
nothing, and that it survives every way a quantized layer is copied, saved, loaded, fused and merged."""

import copy
import io
import json
import warnings

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant import lowrank  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from tolerances import LOWRANK_FACTOR_REL_L2, LOWRANK_SQNR_GAIN_DB  # noqa: E402


@pytest.fixture
def quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def structured_linear(seed, n=96, k=128):
    """A Linear whose weight is small noise plus a rank-4 part and a few outliers: what a 4-bit
    grid rounds badly and a low-rank correction captures."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(n, k, generator=g) + 0.3 * torch.randn(n, 4, generator=g) @ torch.randn(4, k, generator=g) / 2
    rows, cols = torch.randint(0, n, (6,), generator=g), torch.randint(0, k, (6,), generator=g)
    w[rows, cols] = 4.0 * torch.sign(torch.randn(6, generator=g))
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(0.1 * torch.randn(n, generator=g))
    return lin


def inputs(seed, k=128, m=32):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))


# ---------------------------------------------------------------- the factors


@pytest.mark.pure_python
@pytest.mark.parametrize("n, k, rank", [(40, 56, 3), (1100, 1040, 6)])  # exact SVD, randomized range finder
def test_factors_recover_an_error_of_low_rank(seed, n, k, rank):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, rank, generator=g) @ torch.randn(rank, k, generator=g)
    w = torch.randn(n, k, generator=g)
    up, down = lowrank.factors(w, w - e, rank, torch.float32)
    assert up.shape == (n, rank) and down.shape == (rank, k) and up.dtype == down.dtype == torch.float32
    assert float((up @ down - e).norm() / e.norm()) < LOWRANK_FACTOR_REL_L2


@pytest.mark.pure_python
def test_factors_are_deterministic_and_balanced():
    g = torch.Generator().manual_seed(3)
    w, wq = torch.randn(1100, 1030, generator=g), torch.randn(1100, 1030, generator=g)
    a, b = lowrank.factors(w, wq, 8, torch.bfloat16), lowrank.factors(w, wq, 8, torch.bfloat16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].dtype == torch.bfloat16
    # the singular values are split evenly: both factors carry the same column / row norms
    assert torch.allclose(a[0].float().norm(dim=0), a[1].float().norm(dim=1), rtol=0.02)


def test_factors_refuse_bad_arguments():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="exceeds min"):
        lowrank.factors(w, w, 9, torch.float32)
    with pytest.raises(TypeError, match="rank must be an int"):
        lowrank.factors(w, w, 2.0, torch.float32)
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        lowrank.factors(bad, w, 2, torch.float32)


# ---------------------------------------------------------------- accuracy and rank 0


@pytest.mark.parametrize("scheme", ["fp4_e2m1", "int8wo", "int8dq"])
def test_rank_raises_the_output_sqnr(seed, scheme):
    lin = structured_linear(seed)
    x = inputs(seed)
    ref = lin(x).double()
    sqnr = {}
    for r in (0, 8, 32):
        q = QuantizedLinear.from_float(lin, f"{scheme}_r{r}" if r else scheme)
        sqnr[r] = tm.sqnr_db(ref, q(x))
    assert sqnr[8] > sqnr[0] + LOWRANK_SQNR_GAIN_DB[scheme], sqnr
    assert sqnr[32] > sqnr[8], sqnr


def test_rank_zero_adds_nothing(seed):
    lin = structured_linear(seed)
    x = inputs(seed)
    plain = QuantizedLinear.from_float(lin, "fp4_e2m1")
    zero = QuantizedLinear.from_float(lin, cquant.FPXWeightOnlyConfig(2, 1, lowrank_rank=0))
    assert zero.scheme == plain.scheme and zero.scheme.name == "fp4_e2m1"
    assert list(zero.state_dict()) == list(plain.state_dict()) == ["weight", "bias", "weight_scale"]
    assert zero.nbytes == plain.nbytes
    assert torch.equal(zero(x), plain(x))
    assert cquant.config_from_name("fp4_e2m1_r0").scheme() == plain.scheme


def test_layer_state_repr_and_bytes():
    lin = structured_linear(0)
    q = QuantizedLinear.from_float(lin.to(torch.bfloat16), "int8wo_r16")
    assert q.lowrank_up.shape == (96, 16) and q.lowrank_down.shape == (16, 128)
    assert q.lowrank_up.dtype == q.lowrank_down.dtype == torch.bfloat16
    plain = QuantizedLinear.from_float(lin.to(torch.bfloat16), "int8wo")
    assert q.nbytes - plain.nbytes == 16 * (96 + 128) * 2 == q.scheme.lowrank_bytes(128, 96)
    assert "lowrank rank 16" in repr(q)
    row = cquant.summary(torch.nn.Sequential(q)).rows[0]
    assert row.bytes_after == q.nbytes


def test_config_names_and_validation():
    cfg = cquant.Int8WeightOnlyConfig(lowrank_rank=8)
    assert cfg.name == "int8wo_r8" and cquant.config_from_name("int8wo_r8") == cfg
    assert cquant.config_from_dict(cfg.to_dict()) == cfg
    assert cquant.config_from_name("float8dq_e4m3_row_r4").name == "fp8dqrow_r4"
    assert cfg.scheme().base_name == "int8wo" and cfg.scheme().with_lowrank(0).name == "int8wo"
    for bad, err in ((-1, ValueError), (lowrank.MAX_RANK + 1, ValueError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(err, match="lowrank_rank"):
            cquant.Int8WeightOnlyConfig(lowrank_rank=bad)


def test_a_rank_above_the_layer_is_skipped_with_the_reason():
    m = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 64), torch.nn.Linear(64, 64))
    with pytest.warns(cquant.SkippedLayersWarning):
        cquant.quantize_(m, "int8wo_r16")
    s = cquant.summary(m)
    assert "lowrank rank 16 exceeds min(in_features, out_features) = 8" in s.skipped["0"]
    assert isinstance(m[2], QuantizedLinear) and m[2].scheme.lowrank_rank == 16


# ---------------------------------------------------------------- module plumbing


def test_copies_dtypes_and_inference_mode(seed):
    lin = structured_linear(seed)
    x = inputs(seed)
    q = QuantizedLinear.from_float(lin, "int8dq_r8")
    y = q(x)
    assert torch.equal(copy.deepcopy(q)(x), y)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), y)
    with torch.inference_mode():
        assert torch.equal(q(x), y)
    half = copy.deepcopy(q).to(torch.bfloat16)
    assert half.lowrank_up.dtype == torch.bfloat16 and half.weight_scale.dtype == torch.float32
    assert tm.sqnr_db(y, half(x).float()) > 30
    sk = QuantizedLinear(128, 96, "int8dq_r8", dtype=torch.float32)
    sk.load_state_dict({k: (v.to(torch.bfloat16) if k.startswith("lowrank") else v) for k, v in q.state_dict().items()})
    assert sk.lowrank_up.dtype == torch.float32  # factors follow the compute dtype on load, as the bias
    with pytest.raises(RuntimeError, match="lowrank_up: the checkpoint holds"):
        sk.load_state_dict({**q.state_dict(), "lowrank_up": torch.zeros(96, 4)})


def test_gradient_reaches_the_input(seed):
    q = QuantizedLinear.from_float(structured_linear(seed), "int8wo_r4")
    x = inputs(seed).requires_grad_()
    q(x).sum().backward()
    w = q.dequantize(torch.float32)
    assert torch.allclose(x.grad, torch.ones(32, 96) @ w, rtol=1e-4, atol=1e-4)


def test_dequantize_and_gelu_fusion_include_the_correction(quiet):
    model = tm.build("flux")
    cquant.quantize_(model, "fp4_e2m1_r4")
    fused = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.activation == "gelu_tanh"]
    assert fused and all(m.scheme.lowrank_rank == 4 for m in fused)  # the correction goes before the GELU
    y = tm.run(model, "flux")
    unfused = copy.deepcopy(model)
    cquant.unfuse_activations_(unfused)
    assert torch.allclose(tm.run(unfused, "flux"), y, rtol=1e-4, atol=1e-5)
    f = cquant.dequantize_(copy.deepcopy(model))
    assert tm.sqnr_db(y, tm.run(f, "flux")) > 60  # the float layers hold codes plus correction


# ---------------------------------------------------------------- models: save, load, fuse, merge


def test_diffusers_model_round_trips(quiet, tmp_path):
    model = tm.build("flux")
    ref = tm.run(model, "flux")
    cquant.quantize_(model, "fp4_e2m1_r4")
    y = tm.run(model, "flux")
    plain = tm.build("flux")
    cquant.quantize_(plain, "fp4_e2m1")
    assert tm.sqnr_db(ref, y) > tm.sqnr_db(ref, tm.run(plain, "flux"))
    model.save_pretrained(tmp_path)
    layers = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert set(layers.values()) == {"fp4_e2m1_r4"}
    loaded = type(model).from_pretrained(tmp_path)
    assert torch.equal(tm.run(loaded, "flux"), y)
    cquant.save_quantized(model, tmp_path / "m.safetensors")
    again = cquant.load_quantized(tm.build("flux"), tmp_path / "m.safetensors")
    assert torch.equal(tm.run(again, "flux"), y)


def test_tampered_factors_are_refused(quiet, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    model = tm.build("flux")
    cquant.quantize_(model, "int8wo_r4")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    layer = "proj_out"
    bad = dict(tensors, **{f"{layer}.lowrank_up": tensors[f"{layer}.lowrank_up"][:, :2].contiguous()})
    save_file(bad, str(path), metadata=meta)
    with pytest.raises(ValueError, match=rf"{layer}.lowrank_up is .* in the file, but its metadata says"):
        cquant.load_quantized(tm.build("flux"), path)
    # factors stored for a layer whose scheme has none, with metadata to match the rest
    plain = tm.build("flux")
    cquant.quantize_(plain, "int8wo")
    cquant.save_quantized(plain, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    extra = dict(load_file(str(path)), **{f"{layer}.lowrank_up": tensors[f"{layer}.lowrank_up"]})
    save_file(extra, str(path), metadata=meta)
    with pytest.raises(ValueError, match=rf"{layer}.lowrank_up is in the file, but a int8wo layer has no low-rank"):
        cquant.load_quantized(tm.build("flux"), path)


def test_transformers_model_round_trips(quiet, tmp_path):
    model = tm.clip_text_encoder()
    ids = torch.arange(2, 14).view(1, 12)
    cquant.quantize_(model, "int8dq_r4")
    with torch.no_grad():
        y = model(ids).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, y)


def test_fusing_a_quantized_model_keeps_the_correction_exact(quiet):
    model = tm.build("flux")
    cquant.quantize_(model, "int8wo_r4")
    y = tm.run(model, "flux")
    cquant.fuse_qkv_(model)
    fused = model.transformer_blocks[0].attn.to_qkv
    assert fused.scheme.name == "int8wo_r12" and fused.lowrank_up.shape == (fused.out_features, 12)
    assert torch.allclose(tm.run(model, "flux"), y, rtol=1e-4, atol=1e-4)


def test_fusing_layers_whose_ranks_add_up_beyond_a_configs_limit(quiet, tmp_path):
    # rank 100 on each of q / k / v is a valid config; the fused layer carries 300 > MAX_RANK
    diffusers = pytest.importorskip("diffusers")
    model = tm.build("flux", attention_head_dim=64, axes_dims_rope=[16, 24, 24])
    cquant.quantize_(model, "int4wo_g32_r100")
    y = tm.run(model, "flux")
    cquant.fuse_qkv_(model)
    fused = model.transformer_blocks[0].attn.to_qkv
    assert fused.scheme.name == "int4wo_g32_r300" and fused.lowrank_up.shape == (384, 300)
    y_fused = tm.run(model, "flux")
    assert torch.allclose(y_fused, y, rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    assert loaded.transformer_blocks[0].attn.to_qkv.scheme.name == "int4wo_g32_r300"
    assert torch.allclose(tm.run(loaded, "flux"), y_fused, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lowrank_rank = 300"):  # what a user asks for stays bounded
        cquant.quantize_(tm.build("flux"), "int4wo_r300")
    with pytest.raises(ValueError, match=r"lowrank_rank = 999; expected 0 \(off\) to 256 \(a fused"):
        cquant.config_from_name("int4wo_r999")


def test_projections_of_different_ranks_fuse_quantized(quiet, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    model = tm.build("flux", attention_head_dim=64, axes_dims_rope=[16, 24, 24])
    cquant.quantize_(model, cquant.FqnToConfig({"re:.*attn.to_q$": "int4wo_g32_r4", "re:.*attn.to_k$": "int4wo_g32",
                                                "_default": "int4wo_g32_r8"}))
    y = tm.run(model, "flux")
    cquant.fuse_qkv_(model)
    fused = model.transformer_blocks[0].attn.to_qkv
    assert isinstance(fused, QuantizedLinear) and fused.scheme.name == "int4wo_g32_r12"
    assert not fused.lowrank_up[128:256].any()  # to_k's rows: no correction
    assert torch.allclose(tm.run(model, "flux"), y, rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    assert torch.allclose(tm.run(loaded, "flux"), y, rtol=1e-4, atol=1e-4)


def test_lora_merge_requantizes_with_the_correction_and_unmerge_restores_it(seed):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(structured_linear(seed), torch.nn.Linear(96, 32))
    cquant.quantize_(model, "fp4_e2m1_r8")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"],
                                                       init_lora_weights=False))
    base = model.base_model.model[0].get_base_layer()
    before = {n: t.clone() for n, t in base.state_dict().items()}
    x = inputs(seed)
    with torch.no_grad():
        y = model(x)
    with pytest.warns(cquant.integrations.peft_lora.LoraMergeWarning):
        model.merge_adapter()
    assert base.scheme.lowrank_rank == 8 and not torch.equal(base.lowrank_up, before["lowrank_up"])
    with torch.no_grad():
        assert tm.sqnr_db(y, model(x)) > 15
    model.unmerge_adapter()
    for n, t in base.state_dict().items():
        assert torch.equal(t, before[n]), n
    with torch.no_grad():
        assert torch.equal(model(x), y)


def test_lora_merge_into_a_fused_layer_whose_rank_exceeds_its_width(quiet):
    # q / k / v at rank 64 fuse into a [384, 128] layer of rank 192 > K: a merge requantizes it as
    # one weight, whose whole error min(N, K) = 128 components hold
    peft = pytest.importorskip("peft")
    model = tm.build("flux", attention_head_dim=64, axes_dims_rope=[16, 24, 24])
    cquant.quantize_(model, "int4wo_g32_r64")
    cquant.fuse_qkv_(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["transformer_blocks.0.attn.to_qkv"],
                                                       init_lora_weights=False))
    lora = model.base_model.model.transformer_blocks[0].attn.to_qkv
    base = lora.get_base_layer()
    assert base.scheme.lowrank_rank == 192 and base.in_features == 128
    before = {n: t.clone() for n, t in base.state_dict().items()}
    merged = base.dequantize(torch.float32) + lora.get_delta_weight("default").float()
    with pytest.warns(cquant.integrations.peft_lora.LoraMergeWarning):
        model.merge_adapter()
    assert base.lowrank_up.shape == (384, 192) and base.lowrank_down.shape == (192, 128)
    err = (base.dequantize(torch.float32) - merged).norm() / merged.norm()
    assert err < LOWRANK_FACTOR_REL_L2
    model.unmerge_adapter()
    for n, t in base.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_a_weight_with_no_finite_error_is_refused_naming_its_layer():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^2 \(int8wo_r4\): the weight's quantization error is not finite"):
        cquant.quantize_(model, "int8wo_r4")
