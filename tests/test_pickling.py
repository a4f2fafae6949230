"""torch.save / torch.load(weights_only=False) and copy.deepcopy of quantized models: nothing
cquant puts on a module (layers, fused GELUs, activation-sharing hooks, the device-fallback
state, a merged LoRA's kept codes) holds state that cannot be pickled or copied."""

import copy
import io

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
import cquant.schemes  # noqa: E402
import tiny_models as tm  # noqa: E402


def _round_trip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp6_e3m2"])
def test_plain_sequential(scheme, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(96, 32))
    cquant.quantize_(model, scheme)
    x = torch.randn(5, 64)
    with torch.no_grad():
        y = model(x)
        for other in (_round_trip(model), copy.deepcopy(model)):
            assert torch.equal(other(x), y)
            assert other[0].weight.data_ptr() != model[0].weight.data_ptr()


@pytest.mark.parametrize("scheme", ["fp8dqrow", "fp6_e3m2"])
def test_flux_with_fused_gelu_and_sharing_scopes(scheme):
    diffusers = pytest.importorskip("diffusers")  # noqa: F841
    model = tm.build("flux")
    cquant.quantize_(model, scheme)
    # the diffusers integration's quantizer object and QKV fusion's fuse_projections are
    # pickled by their owners' tests; this one checks the state of the layers and their hooks
    model.__dict__.pop("hf_quantizer", None)
    for mod in model.modules():
        mod.__dict__.pop("fuse_projections", None)
    with tm.native_attention():
        y = tm.run(model, "flux")
        for other in (_round_trip(model), copy.deepcopy(model)):
            assert torch.equal(tm.run(other, "flux"), y)
            block = other.single_transformer_blocks[0]
            assert block.proj_mlp.activation == "gelu_tanh"  # the fusion survived
            dynamic = cquant.schemes.scheme(scheme).dynamic
            assert len(block.attn._forward_pre_hooks) == dynamic  # so did the sharing scope


def test_qkv_fusion_of_a_copy_fuses_the_copy():
    """fuse_projections holds its attention module weakly (a strong reference would be a cycle);
    torch.save and deepcopy still give each copy one bound to the copy's module."""
    pytest.importorskip("diffusers")
    model = tm.build("flux")
    cquant.quantize_(model, "int8dq")
    model.__dict__.pop("hf_quantizer", None)
    with tm.native_attention():
        y = tm.run(model, "flux")
        for other in (_round_trip(model), copy.deepcopy(model)):
            attn = other.transformer_blocks[0].attn
            assert attn.fuse_projections.module is attn
            other.fuse_qkv_projections()
            assert attn.fused_projections and isinstance(attn.to_qkv, cquant.QuantizedLinear)
            assert torch.equal(tm.run(other, "flux"), y)
    assert not model.transformer_blocks[0].attn.fused_projections  # the original is left as it was


def test_merged_lora_survives_and_unmerges():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    cquant.quantize_(model, "int8dq")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(3, 64)
    with torch.no_grad():
        y_lora = model(x)
    with pytest.warns(UserWarning):
        model.merge_adapter()
    for other in (_round_trip(model), copy.deepcopy(model)):
        other.unmerge_adapter()
        with torch.no_grad():
            assert torch.equal(other(x), y_lora)
