"""A quantized model is freed when its last reference goes, without the garbage collector: nothing
cquant installs on a model (QKV fusion's fuse_projections, fused GELUs, activation-sharing scopes,
fused block forwards, the CUDA-graph forward) refers back to the module that holds it. On CUDA the
same is checked against torch.cuda.memory_allocated in test_model_free_cuda.py."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import tiny_models as tm  # noqa: E402
from model_release import FEATURES, prepare, release  # noqa: E402

VARIANTS = {"plain": (), "fused qkv": ("fuse_qkv",), "attention": ("attention",), "optimize": ("optimize",),
            "cuda graph": ("optimize", "cuda_graph"), "everything": FEATURES}


@pytest.fixture(autouse=True)
def _quiet():
    import warnings

    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scheme", ["fp8dqrow", "int8dq", "int8wo"])
def test_deleted_model_is_freed_without_gc(scheme, variant):
    model, x = prepare(scheme, VARIANTS[variant])
    with torch.no_grad():
        model(**x)
    box = [model]
    del model
    survivors = release(box)
    assert not survivors, survivors


def test_fuse_projections_holds_no_strong_reference():
    """The attention module's fuse_projections reaches it weakly, and says so once it is gone."""
    model, _ = prepare("int8dq")
    fuse = model.transformer_blocks[0].attn.fuse_projections
    assert fuse.module is model.transformer_blocks[0].attn
    box = [model]
    del model
    assert not release(box)
    assert fuse.module is None
    with pytest.raises(ReferenceError, match="freed"):
        fuse()


def test_rotary_tables_live_only_while_their_forward_runs():
    """The fused blocks of one call share one (cos, sin) table pair; it goes with the call's own
    rotary embedding, so no table (on the model's device) outlives the forward or the model."""
    from cquant.blocks import common

    model, x = prepare("int8dq", ("optimize",))
    during = []
    model.proj_out.register_forward_pre_hook(lambda mod, args: during.append(common._rope_cache))
    with torch.no_grad():
        model(**x)
    assert during[0] is not None  # made by the first block, still there after the last
    del during
    assert common._rope_cache is None
