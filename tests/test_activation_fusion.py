"""GELU fused into the quantized linear layer before it (cquant.fuse_activations_), on CPU.

The fused model must compute what the unfused quantized model computes (the GELU then runs on
the fp32 result instead of the rounded output: differences of an output rounding), keep its
state_dict keys, survive save/load and dequantize_, and train adapters with the right gradient.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import cquant  # noqa: E402
from cquant.activation_fusion import LinearGELU  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402

import tiny_models as tm  # noqa: E402

# Tiny-model output, fused vs unfused, same quantized weights: SQNR floor. The only change is
# where GELU's input is rounded (fp32 inside the op instead of the output dtype), so float32
# models agree to fp32 round-off and bfloat16 ones to a few bf16 roundings per block.
FUSED_VS_UNFUSED_SQNR_DB = {torch.float32: 90.0, torch.bfloat16: 30.0}

# Every family whose MLP is linear -> tanh GELU: (fused layers expected per transformer block)
FAMILIES = ["flux", "sd3", "pixart-sigma", "cogvideox", "qwen-image"]


def quantized(name, scheme="int8wo", dtype=torch.float32, fuse=True):
    model = tm.build(name, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
        cquant.quantize_(model, scheme, fuse_activations=fuse)
    return model


def fused_layers(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and m.activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_computes_the_unfused_model(family, dtype):
    plain = quantized(family, dtype=dtype, fuse=False)
    fused = quantized(family, dtype=dtype)
    assert not fused_layers(plain)
    names = fused_layers(fused)
    assert names, f"{family}: no GELU was fused"
    assert all(n.endswith((".proj", "proj_mlp")) for n in names), names
    assert plain.state_dict().keys() == fused.state_dict().keys()
    db = tm.sqnr_db(tm.run(plain, family), tm.run(fused, family))
    assert db >= FUSED_VS_UNFUSED_SQNR_DB[dtype], f"{family} {dtype}: fused vs unfused {db:.1f} dB"


def test_flux_fuses_every_mlp():
    model = quantized("flux")
    n_double, n_single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    names = fused_layers(model)
    assert len(names) == 2 * n_double + n_single  # ff and ff_context of each double block, proj_mlp of each single
    block = model.single_transformer_blocks[0]
    assert isinstance(block.act_mlp, torch.nn.Identity) and block.proj_mlp.activation == "gelu_tanh"
    assert isinstance(model.transformer_blocks[0].ff.net[0], LinearGELU)
    assert "gelu_tanh" in repr(block.proj_mlp)


def test_fuse_and_unfuse_by_hand():
    model = quantized("flux", fuse=False)
    ref = tm.run(model, "flux")
    fused = cquant.fuse_activations_(model)
    assert fused and cquant.fuse_activations_(model) == []  # idempotent
    cquant.unfuse_activations_(model)
    assert not fused_layers(model)
    assert type(model.transformer_blocks[0].ff.net[0]).__name__ == "GELU"
    assert isinstance(model.single_transformer_blocks[0].act_mlp, torch.nn.GELU)
    assert torch.equal(tm.run(model, "flux"), ref)


def test_dequantize_puts_the_gelu_back():
    float_model = tm.build("flux")
    ref = tm.run(float_model, "flux")
    model = quantized("flux")
    cquant.dequantize_(model)
    assert not any(isinstance(m, (QuantizedLinear, LinearGELU)) for m in model.modules())
    assert isinstance(model.single_transformer_blocks[0].act_mlp, torch.nn.GELU)
    assert tm.sqnr_db(ref, tm.run(model, "flux")) >= 30.0  # int8 weights, GELU applied again


def test_exact_gelu_and_unquantized_layers_are_left_alone():
    model = tm.build("flux")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
        cquant.quantize_(model, "int8wo", filter_fn=lambda mod, fqn: "proj_mlp" not in fqn and "ff." not in fqn)
    assert fused_layers(model) == ["transformer_blocks.0.ff_context.net.0.proj",
                                   "transformer_blocks.1.ff_context.net.0.proj"]
    from diffusers.models.activations import GELU

    exact = torch.nn.Sequential(GELU(32, 64, approximate="none"), GELU(64, 32, approximate="tanh"))
    cquant.quantize_(exact, "int8wo")
    assert type(exact[0]) is GELU and exact[0].proj.activation is None  # erf GELU: not the kernel's
    assert isinstance(exact[1], LinearGELU)


def test_a_block_that_reads_act_mlp_elsewhere_is_not_fused():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_mlp = torch.nn.Linear(32, 64)
            self.act_mlp = torch.nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.act_mlp(self.proj_mlp(x)) + self.act_mlp(x).sum()

    block = Block()
    cquant.quantize_(block, "int8wo")
    assert block.proj_mlp.activation is None and isinstance(block.act_mlp, torch.nn.GELU)


def test_save_and_load_keep_the_fusion(tmp_path):
    import diffusers

    model = quantized("flux", scheme="fp8dqrow")
    ref = tm.run(model, "flux")
    model.save_pretrained(tmp_path)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    assert fused_layers(loaded) == fused_layers(model)
    assert torch.equal(tm.run(loaded, "flux"), ref)


def test_gradient_through_the_fused_gelu():
    """LoRA-style training through a fused layer: dL/dx and dL/db match the unfused layer's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    fused = QuantizedLinear.from_float(lin, "int8wo")
    plain = QuantizedLinear.from_float(lin, "int8wo")
    fused.activation = "gelu_tanh"
    for m in (fused, plain):
        m.bias.requires_grad_(True)
    x = torch.randn(5, 48)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(5, 80)
    fused(x1).backward(g)
    torch.nn.functional.gelu(plain(x2), approximate="tanh").backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad, rtol=1e-4, atol=1e-5)


def test_bad_activation_is_a_clear_error():
    layer = QuantizedLinear.from_float(torch.nn.Linear(32, 16), "int8wo")
    with pytest.raises(ValueError, match="activation = 'silu'"):
        layer.activation = "silu"


def test_compile_fullgraph_with_fused_gelu():
    model = quantized("flux")
    ref = tm.run(model, "flux")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(tm.run(compiled, "flux"), ref, rtol=1e-5, atol=1e-5)


def test_lora_on_fused_layers_goes_inside_the_gelu():
    """PEFT wraps proj_mlp / ff.net.0.proj: the LoRA branch must be added before the GELU, so the
    fusion undoes itself and the result equals LoRA on the unfused model."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    outputs = []
    for fuse in (True, False):
        model = quantized("flux", fuse=fuse)
        before = tm.run(model, "flux")
        torch.manual_seed(3)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["proj_mlp", "ff.net.0.proj", "to_q"],
                                     init_lora_weights=False))
        after = tm.run(model, "flux")
        assert tm.sqnr_db(before, after) < 40.0  # the adapters change the output
        outputs.append(after)
        if fuse:
            # wrapped layers unfused themselves; ff_context (no adapter) keeps its fused GELU
            assert fused_layers(model) and all(".ff_context." in n for n in fused_layers(model))
            assert isinstance(model.single_transformer_blocks[0].act_mlp, torch.nn.GELU)
    assert tm.sqnr_db(outputs[1], outputs[0]) >= FUSED_VS_UNFUSED_SQNR_DB[torch.float32]


@pytest.mark.parametrize("unload", ["unload_lora", "delete_and_unload"])
def test_fuse_activations_after_a_lora_is_unloaded(unload):
    """A LoRA on the fused layers moves each GELU out of its layer; once the adapter is unloaded,
    fuse_activations_ moves every one back in (FeedForward's as well as proj_mlp's)."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = quantized("flux")
    names = fused_layers(model)
    ref = tm.run(model, "flux")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["proj_mlp", "net.0.proj"], init_lora_weights=False))
    tm.run(model, "flux")  # the wrapped layers give their GELU back to a module of its own
    assert not fused_layers(model)
    if unload == "delete_and_unload":
        model.delete_adapters("default")
    model.unload_lora()
    assert sorted(cquant.fuse_activations_(model)) == names
    assert fused_layers(model) == names and cquant.fuse_activations_(model) == []
    assert isinstance(model.transformer_blocks[0].ff_context.net[0], LinearGELU)
    assert torch.equal(tm.run(model, "flux"), ref)
