"""A quantized checkpoint whose config.json, own metadata or tensors were changed is refused, naming
the layer, in cquant.load_quantized and in diffusers' and transformers' from_pretrained, single
file and sharded; files written before cquant described each tensor still load."""

import json
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant import checkpoint  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from cquant.serialization import META_TIED  # noqa: E402

# the two loaders, each with a model and a layer whose scheme has a twin of the same storage
LIBRARIES = {
    "diffusers": dict(build=lambda: tm.build("flux"), scheme="fp8wo", twin="fp8wo_e5m2", layer="proj_out",
                      cls=lambda: diffusers.FluxTransformer2DModel, run=lambda m: tm.run(m, "flux")),
    "transformers": dict(build=tm.clip_text_encoder, scheme="int8wo", twin="int8dq", layer="encoder.layers.0.mlp.fc1",
                         cls=lambda: transformers.CLIPTextModel,
                         run=lambda m: m(torch.arange(2, 14).view(1, 12)).last_hidden_state),
}
SHARD_SIZE = "20KB"  # a few shards of the tiny models


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(params=[(lib, sharded) for lib in LIBRARIES for sharded in (False, True)],
                ids=lambda p: f"{p[0]}-{'sharded' if p[1] else 'single'}")
def saved(request, tmp_path):
    """(library info, directory) of a quantized model saved with save_pretrained."""
    lib, sharded = request.param
    info = dict(LIBRARIES[lib], name=lib)
    model = info["build"]()
    cquant.quantize_(model, info["scheme"])
    with torch.no_grad():
        info["expected"] = info["run"](model)
    model.save_pretrained(tmp_path, **({"max_shard_size": SHARD_SIZE} if sharded else {}))
    info["files"] = sorted(tmp_path.glob("*.safetensors"))
    assert (len(info["files"]) > 1) == sharded
    return info, tmp_path


def edit_config(path, edit):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    edit(cfg)
    p.write_text(json.dumps(cfg))


def edit_files(path, tensors=None, meta=None):
    """Rewrite every safetensors file of a checkpoint: tensors(dict) and meta(dict) edit them in place."""
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            m = dict(h.metadata() or {})
        t = load_file(str(f))
        if tensors:
            tensors(t)
        if meta:
            meta(m)
        save_file(t, str(f), metadata=m)


def edit_layer_list(cfg, edit):
    edit(cfg["quantization_config"]["quantized_layers"])


def load(info, path, **kwargs):
    model = info["cls"]().from_pretrained(path, **kwargs)
    with torch.no_grad():
        return model, info["run"](model)


def not_listed(info):
    return rf"{info['layer']} holds {info['scheme']} codes in the files but is not listed"


def drop_from_metadata(meta, layer):
    """Leave `layer` out of a file's cquant metadata (both lists)."""
    for key in (checkpoint.META_LAYERS, checkpoint.META_TENSORS):
        meta[key] = json.dumps({f: v for f, v in json.loads(meta[key]).items() if f != layer})


def strip_tensor_descriptions(meta):
    """What a file written before cquant described its tensors holds."""
    meta.pop(checkpoint.META_TENSORS, None)


# ---------------------------------------------------------------- config.json against the files


def test_intact_checkpoint_loads(saved):
    info, path = saved
    _, y = load(info, path)
    assert torch.equal(y, info["expected"])


def test_scheme_edited_in_config(saved):
    # same storage, other meaning: e4m3 codes read as e5m2 (or int8 weights run as int8dq) gave NaN / 2.9 dB
    info, path = saved
    edit_config(path, lambda c: edit_layer_list(c, lambda q: q.update({info["layer"]: info["twin"]})))
    with pytest.raises(ValueError, match=rf"{info['layer']} is {info['twin']} in the list but {info['scheme']} in the "
                                         "files"):
        load(info, path)


def test_layer_removed_from_config(saved):
    # without the check, the layer is built float and loads its codes as weights
    info, path = saved
    edit_config(path, lambda c: edit_layer_list(c, lambda q: q.pop(info["layer"])))
    with pytest.raises(ValueError, match=not_listed(info)):
        load(info, path)


def test_layer_added_to_config(saved):
    info, path = saved
    extra = "encoder.layers.1.mlp.fc2" if info["name"] == "transformers" else "context_embedder"
    edit_files(path, tensors=lambda t: t.pop(extra + ".weight_scale", None),
               meta=lambda m: drop_from_metadata(m, extra))
    with pytest.raises(ValueError, match=rf"{extra} is listed \({info['scheme']}\) but the files hold no quantized"):
        load(info, path)


def test_quantization_config_removed(saved):
    # the quantizer never runs: the guard on the libraries' float loading path refuses the file
    info, path = saved
    edit_config(path, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"holds \d+ cquant-quantized layers .* config.json has no cquant "
                                         "quantization_config"):
        load(info, path)


def test_quantization_config_removed_and_cquant_asked_to_quantize(saved):
    # quantizing the stored codes again as if they were float weights
    info, path = saved
    edit_config(path, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="would be quantized again"):
        load(info, path, quantization_config=cquant.CQuantConfig("int8wo"))


# ---------------------------------------------------------------- tensors against metadata and config


def key_of(info, name):
    return f"{info['layer']}.{name}"


def test_weight_scale_missing(saved):
    # transformers filled a missing scale with uninitialised memory
    info, path = saved
    edit_files(path, tensors=lambda t: t.pop(key_of(info, "weight_scale"), None))
    with pytest.raises(ValueError, match=rf"does not hold {key_of(info, 'weight_scale')}"):
        load(info, path)


def test_float_weight_where_codes_belong(saved):
    info, path = saved

    def replace(t):
        k = key_of(info, "weight")
        if k in t:
            t[k] = torch.randn(t[k].shape)

    edit_files(path, tensors=replace)
    with pytest.raises(ValueError, match=rf"{key_of(info, 'weight')} is float32 .* in the file, but its metadata says"):
        load(info, path)


@pytest.mark.parametrize("value", [-1.0, 0.0, float("inf")])
def test_scales_the_quantizer_never_writes_are_refused(saved, value):
    """A scale edited to <= 0 or +inf keeps the file's dtypes and shapes, yet negates, zeroes or
    blows up a row of outputs: refused, naming the tensor (NaN, which the quantizer writes for
    non-finite weights, stays allowed and visible)."""
    info, path = saved

    def edit(t):
        k = key_of(info, "weight_scale")
        if k in t:
            t[k][1] = value

    edit_files(path, tensors=edit)
    with pytest.raises(ValueError, match=rf"{key_of(info, 'weight_scale')}: 1 of its \d+ scales are <= 0 or \+inf"):
        load(info, path)


def test_a_bias_stored_as_integers_is_refused(saved):
    info, path = saved

    def edit(t):
        k = key_of(info, "bias")
        if k in t:
            t[k] = t[k].to(torch.int32)

    edit_files(path, tensors=edit)
    with pytest.raises(ValueError, match=rf"{key_of(info, 'bias')} is int32 .* has a float bias"):
        load(info, path)


def test_files_written_before_tensor_descriptions_load_and_are_checked(saved):
    info, path = saved
    edit_files(path, meta=strip_tensor_descriptions)
    _, y = load(info, path)
    assert torch.equal(y, info["expected"])
    # the checks the older metadata allows: tensors against the layers the config and file list
    edit_config(path, lambda c: edit_layer_list(c, lambda q: q.pop(info["layer"])))
    with pytest.raises(ValueError, match=not_listed(info)):
        load(info, path)


def test_files_stripped_of_cquant_metadata_are_refused(saved):
    # config.json's scheme names alone cannot tell fp6_e3m2 codes from fp6_e2m3 ones
    info, path = saved
    edit_files(path, meta=lambda m: [m.pop(k) for k in list(m) if k.startswith("cquant_")])
    with pytest.raises(ValueError, match=f"has no cquant metadata \\({checkpoint.META_LAYERS}\\), but its config.json"):
        load(info, path)


def test_a_dtype_quantized_layers_cannot_compute_in_is_refused(saved, tmp_path):
    # the quantized layers used to compute in bfloat16 in a model asked for in float64
    info, path = saved
    with pytest.raises(TypeError, match="compute in torch.float32, torch.float16 or torch.bfloat16, not torch.float64"):
        load(info, path, dtype=torch.float64)
    model = plain_model()
    cquant.quantize_(model, "int8wo")
    cquant.save_quantized(model, tmp_path / "m.safetensors")
    target = plain_model().double()
    with pytest.raises(TypeError, match="not torch.float64"):
        cquant.load_quantized(target, tmp_path / "m.safetensors")
    assert type(target[0]) is torch.nn.Linear


def test_old_file_with_float_weight_where_codes_belong(saved):
    info, path = saved

    def replace(t):
        k = key_of(info, "weight")
        if k in t:
            t[k] = torch.randn(t[k].shape)

    edit_files(path, tensors=replace, meta=strip_tensor_descriptions)
    with pytest.raises(ValueError, match=rf"{key_of(info, 'weight')} is float32 .*, but a {info['scheme']} layer of "
                                         r"\d+ -> \d+ stores"):
        load(info, path)


def test_layer_left_out_of_every_list(saved):
    # config.json and the files' metadata both edited: the stored scale still gives the layer away
    info, path = saved
    layer = info["layer"]
    edit_config(path, lambda c: edit_layer_list(c, lambda q: q.pop(layer)))
    edit_files(path, meta=lambda m: drop_from_metadata(m, layer))
    with pytest.raises(ValueError, match=rf"stores quantized codes and scales for {layer}, which config.json's "
                                         "quantization_config.quantized_layers does not list"):
        load(info, path)


def test_metadata_edited_against_its_tensors(saved):
    info, path = saved
    layer = info["layer"]
    edit_files(path, meta=lambda m: m.update({checkpoint.META_LAYERS: json.dumps(
        dict(json.loads(m[checkpoint.META_LAYERS]), **{layer: info["twin"]}))}))
    with pytest.raises(ValueError, match=rf"{layer} is {info['twin']} in {checkpoint.META_LAYERS} but "
                                         rf"{info['scheme']} in {checkpoint.META_TENSORS}"):
        load(info, path)


def test_shards_from_different_saves(saved):
    info, path = saved
    if len(info["files"]) < 2:
        pytest.skip("one file")
    first = str(info["files"][0])
    with safe_open(first, "pt") as h:
        meta = dict(h.metadata())
    tensors = load_file(first)
    layers = json.loads(meta[checkpoint.META_LAYERS])
    layers.pop(next(iter(layers)))
    save_file(tensors, first, metadata=dict(meta, **{checkpoint.META_LAYERS: json.dumps(layers)}))
    with pytest.raises(ValueError, match="list different quantized layers in their cquant metadata"):
        load(info, path)
    save_file(tensors, first, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no cquant metadata but .* has"):
        load(info, path)


def test_metadata_describes_every_stored_tensor(saved):
    info, path = saved
    with safe_open(str(info["files"][0]), "pt") as h:
        described = json.loads(h.metadata()[checkpoint.META_TENSORS])
    entry = described[info["layer"]]
    assert entry["scheme"] == info["scheme"]
    stored = {}
    for f in info["files"]:
        stored.update(load_file(str(f)))
    for name in ("weight", "weight_scale"):
        t = stored[key_of(info, name)]
        assert entry[name] == {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


# ---------------------------------------------------------------- cquant.load_quantized


def plain_model(in_features=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(in_features, 32), torch.nn.GELU(), torch.nn.Linear(32, 48))


def test_load_quantized_refuses_a_layer_of_another_width_with_the_same_storage(tmp_path):
    # fp6 rows of 48 and 64 inputs both pack into 48 bytes: only the described shape tells them apart
    model = plain_model(64)
    cquant.quantize_(model, "fp6_e3m2")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    with pytest.raises(ValueError, match="0 is 64 -> 32 in the file but 48 -> 32 in this model"):
        cquant.load_quantized(plain_model(48), path)
    x = torch.randn(3, 64)
    assert torch.equal(cquant.load_quantized(plain_model(64, seed=1), path)(x), model(x))


def test_load_quantized_checks_tensors_and_lists(tmp_path):
    model = plain_model()
    cquant.quantize_(model, "int8wo")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    meta = checkpoint.read_metadata(path)
    tensors = load_file(str(path))

    save_file(dict(tensors, **{"2.weight": torch.randn(48, 32)}), str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"2.weight is float32 \[48, 32\] in the file, but its metadata says int8"):
        cquant.load_quantized(plain_model(), path)

    save_file({k: v for k, v in tensors.items() if k != "0.weight_scale"}, str(path), metadata=meta)
    with pytest.raises(ValueError, match="does not hold 0.weight_scale"):
        cquant.load_quantized(plain_model(), path, strict=False)

    layers = json.dumps({"0": "int8wo"})
    old = {k: v for k, v in meta.items() if k != checkpoint.META_TENSORS}
    save_file(tensors, str(path), metadata=dict(old, **{checkpoint.META_LAYERS: layers}))
    with pytest.raises(ValueError, match="stores quantized codes and scales for 2, which its cquant metadata does not"):
        cquant.load_quantized(plain_model(), path)

    save_file(tensors, str(path), metadata=dict(meta, **{checkpoint.META_LAYERS: layers}))
    with pytest.raises(ValueError, match=f"{checkpoint.META_LAYERS} and {checkpoint.META_TENSORS} list different"):
        cquant.load_quantized(plain_model(), path)

    save_file(tensors, str(path), metadata=old)  # a file from before the descriptions
    x = torch.randn(3, 64)
    assert torch.equal(cquant.load_quantized(plain_model(seed=1), path)(x), model(x))
    assert all(isinstance(model[i], QuantizedLinear) for i in (0, 2))


def test_scales_the_quantizer_never_writes_are_refused_by_every_loader(tmp_path):
    model = plain_model()
    cquant.quantize_(model, "int8wo")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    meta, tensors = checkpoint.read_metadata(path), load_file(str(path))
    tensors["0.weight_scale"][3] *= -1
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"0.weight_scale: 1 of its 32 scales are <= 0 or \+inf"):
        cquant.load_quantized(plain_model(), path)
    fresh = plain_model()
    cquant.quantize_(fresh, "int8wo")
    before = fresh.state_dict()
    with pytest.raises(RuntimeError, match=r"0.weight_scale: 1 of its 32 scales are <= 0 or \+inf"):
        fresh.load_state_dict(dict(tensors, **{k: v for k, v in model.state_dict().items() if k.endswith("bias")}))
    assert torch.equal(fresh.state_dict()["0.weight_scale"], before["0.weight_scale"])


def test_uint4_zero_points_of_any_sign_load():
    """Only the scale of a uint4 group's (scale, zero point) pair must be positive."""
    model = plain_model()
    cquant.quantize_(model, "int4wo_g32")
    state = model.state_dict()
    state["0.weight_scale"][..., 1] = -3.0
    fresh = plain_model()
    cquant.quantize_(fresh, "int4wo_g32")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.state_dict()["0.weight_scale"], state["0.weight_scale"])


# ---------------------------------------------------------------- the guard itself


def test_guard_names_another_quantizer(saved):
    from cquant.integrations import float_loading

    info, path = saved
    torchao = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="torchao"))
    with pytest.raises(ValueError, match="loaded with the torchao quantizer"):
        float_loading.check_files([str(f) for f in info["files"]], torchao, info["build"]())
    cquant_quantizer = types.SimpleNamespace(quantization_config=cquant.CQuantConfig("int8wo"))
    float_loading.check_files([str(f) for f in info["files"]], cquant_quantizer, None)  # cquant checks them itself


def test_guard_is_installed_once_and_leaves_float_checkpoints_alone(tmp_path):
    from cquant.integrations import float_loading

    for owner in (diffusers.ModelMixin, transformers.PreTrainedModel):
        f = owner.__dict__["_load_pretrained_model"].__func__
        assert getattr(f, float_loading.WRAPPED_MARK, False) and not getattr(f.__wrapped__, float_loading.WRAPPED_MARK,
                                                                             False)
    float_loading.install("diffusers.models.modeling_utils", diffusers.models.modeling_utils)
    assert not getattr(diffusers.ModelMixin.__dict__["_load_pretrained_model"].__func__.__wrapped__,
                       float_loading.WRAPPED_MARK, False)
    model = tm.build("flux")
    model.save_pretrained(tmp_path, max_shard_size=SHARD_SIZE)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(t, loaded[k]) for k, t in model.state_dict().items())


def test_guard_warns_when_the_library_moved_its_loader():
    from cquant.integrations import RegistrationWarning, _guard_float_loading

    moved = types.ModuleType("diffusers.models.modeling_utils")
    moved.ModelMixin = type("ModelMixin", (), {})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with pytest.warns(RegistrationWarning, match="could not guard diffusers"):
            _guard_float_loading(moved)


# ---------------------------------------------------------------- format version 1


def as_version_1(path):
    """Make a saved checkpoint what cquant wrote with format version 1: the same layouts (version
    2 only added the 4-bit grouped formats), the version in every file's metadata and in config.json."""
    edit_files(path, meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "1", checkpoint.META_VERSION: "0.9.0"}))
    edit_config(path, lambda c: c["quantization_config"].update(format_version=1))


def test_version_1_checkpoints_load_and_save_again_as_the_current_version(saved, tmp_path):
    info, path = saved
    as_version_1(path)
    model, y = load(info, path)
    assert torch.equal(y, info["expected"])
    model.save_pretrained(tmp_path / "again")
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert cfg["format_version"] == cquant.FORMAT_VERSION == 3
    for f in (tmp_path / "again").glob("*.safetensors"):
        assert checkpoint.read_metadata(f)[checkpoint.META_FORMAT_VERSION] == "3"
    _, y2 = load(info, tmp_path / "again")
    assert torch.equal(y2, info["expected"])


def test_version_1_file_written_by_hand_loads(tmp_path):
    # what save_quantized wrote with format version 1, built from its parts: the state_dict and
    # the string metadata, without cquant_layer_tensors (older still) and with it
    model = tm.build("flux")
    cquant.quantize_(model, "fp6_e3m2")
    expected = tm.run(model, "flux")
    layers = cquant.quantize.quantized_layers(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for described in (False, True):
        meta = {checkpoint.META_FORMAT_VERSION: "1", checkpoint.META_VERSION: "0.9.0",
                checkpoint.META_LAYERS: json.dumps(layers, sort_keys=True)}
        if described:
            meta[checkpoint.META_TENSORS] = checkpoint.metadata(model)[checkpoint.META_TENSORS]
        f = tmp_path / f"v1_{described}.safetensors"
        save_file(state, str(f), metadata=meta)
        loaded = cquant.load_quantized(tm.build("flux"), f)
        assert torch.equal(tm.run(loaded, "flux"), expected)


def test_format_versions_this_cquant_does_not_read_are_refused(saved):
    info, path = saved
    edit_files(path, meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "4"}))
    with pytest.raises(ValueError, match=r"format version 4; this cquant .* reads format versions 1, 2, 3"):
        load(info, path)
    edit_files(path, meta=lambda m: m.update({checkpoint.META_FORMAT_VERSION: "two"}))
    with pytest.raises(ValueError, match="format version two"):
        load(info, path)


def test_shards_of_different_format_versions_are_refused(tmp_path):
    model = tm.build("flux")
    cquant.quantize_(model, "int8wo")
    model.save_pretrained(tmp_path, max_shard_size=SHARD_SIZE)
    first = sorted(tmp_path.glob("*.safetensors"))[0]
    with safe_open(str(first), "pt") as h:
        m = dict(h.metadata())
    save_file(load_file(str(first)), str(first), metadata=dict(m, **{checkpoint.META_FORMAT_VERSION: "1"}))
    with pytest.raises(ValueError, match="shards say different cquant format versions"):
        diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)


def _float_state(model):
    return {k: (type(m), v) for k, v in model.state_dict(keep_vars=True).items()
            for m in [model.get_submodule(k.rpartition(".")[0])]}


@pytest.mark.parametrize("edit", ["scale_renamed", "bias_removed", "extra_tensor", "scale_float64_in_old_file"])
def test_load_quantized_that_fails_leaves_the_model_as_it_was(tmp_path, edit):
    model = plain_model()
    cquant.quantize_(model, "int8wo")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    meta, tensors = checkpoint.read_metadata(path), load_file(str(path))
    if edit == "scale_renamed":
        tensors["0.scale"] = tensors.pop("0.weight_scale")
    elif edit == "bias_removed":
        del tensors["2.bias"]
    elif edit == "extra_tensor":
        tensors["head.weight"] = torch.randn(4, 4)
    else:
        tensors["0.weight_scale"] = tensors["0.weight_scale"].double()
        del meta[checkpoint.META_TENSORS]
    save_file(tensors, str(path), metadata=meta)

    target = plain_model(seed=1)
    x = torch.randn(3, 64)
    expected, before = target(x), _float_state(target)
    with pytest.raises(ValueError, match=r"0\.weight_scale|2\.bias|head\.weight"):
        cquant.load_quantized(target, path)
    after = _float_state(target)
    assert after.keys() == before.keys()
    assert all(after[k][0] is before[k][0] and after[k][1] is before[k][1] for k in before)
    assert not any(isinstance(m, QuantizedLinear) for m in target.modules())
    assert torch.equal(target(x), expected)


@pytest.mark.raises_in_torch_op  # torch.device("bogus") throws through torch's C++ (aborts under ASan)
def test_load_quantized_names_a_device_torch_cannot_use(tmp_path):
    model = plain_model()
    cquant.quantize_(model, "int8wo")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    target = plain_model(seed=1)
    with pytest.raises(RuntimeError) as err:
        cquant.load_quantized(target, path, device="bogus")
    assert "damaged" not in str(err.value) and "bogus" in str(err.value)
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)) as err:
            cquant.load_quantized(target, path, device="cuda")
        assert "damaged" not in str(err.value)
    assert not any(isinstance(m, QuantizedLinear) for m in target.modules())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cquant.load_quantized(str(path), path)


class TiedHead(torch.nn.Module):
    """An embedding whose weight the output head shares, as language models tie them."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


def test_save_quantized_stores_tied_tensors_once_and_loads_them_under_each_name(tmp_path):
    model = TiedHead()
    cquant.quantize_(model, "int8wo", filter_fn=lambda mod, fqn: fqn == "mid")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    assert set(load_file(str(path))) == {"emb.weight", "mid.weight", "mid.weight_scale", "mid.bias"}
    ids = torch.arange(7)
    for target in (TiedHead(seed=1), TiedHead(seed=1).to("meta")):
        cquant.load_quantized(target, path)
        assert torch.equal(target(ids), model(ids))
        assert target.head.weight.data_ptr() == target.emb.weight.data_ptr()

    meta = checkpoint.read_metadata(path)
    save_file(load_file(str(path)), str(path), metadata=dict(meta, **{META_TIED: '{"head.weight": "lm.weight"}'}))
    target = TiedHead(seed=1)
    with pytest.raises(ValueError, match="names tensors the file does not hold"):
        cquant.load_quantized(target, path)
    assert not isinstance(target.mid, QuantizedLinear)


def test_diffusers_save_pretrained_refuses_a_pickle(tmp_path):
    # a .bin has no cquant metadata, so a config.json edited from fp6_e3m2 to fp6_e2m3 would load
    # its codes as the other format unchecked
    model = tm.build("flux")
    cquant.quantize_(model, "fp6_e3m2")
    with pytest.raises(ValueError, match="safe_serialization=True"):
        model.save_pretrained(tmp_path, safe_serialization=False)
    assert not list(tmp_path.glob("*.bin"))
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))


def test_load_quantized_gives_the_file_the_dtypes_of_the_model(tmp_path):
    # as load_state_dict copies into the model's dtypes: a float32 file loaded into a bfloat16
    # model is the bfloat16 model, not float32 float layers around bfloat16 quantized ones
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 48))

    model = build(0)
    cquant.quantize_(model, "int8wo_r16")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    expected = model.to(torch.bfloat16)
    for target in (build(1).to(torch.bfloat16), build(1).to(torch.bfloat16).to("meta")):
        cquant.load_quantized(target, path)
        assert {k: v.dtype for k, v in target.state_dict().items()} == \
            {k: v.dtype for k, v in expected.state_dict().items()}
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        assert torch.equal(target(x), expected(x))


def test_load_quantized_that_fails_leaves_no_hooks_behind(tmp_path):
    # finishing the quantized diffusers model registers hooks on its attention and MLP blocks
    model = tm.build("flux")
    cquant.quantize_(model, "int8wo")
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(model, path)
    meta, tensors = checkpoint.read_metadata(path), load_file(str(path))
    tensors["proj_out.bias"] = tensors["proj_out.bias"][:3]
    save_file(tensors, str(path), metadata=meta)
    target = tm.build("flux", seed=1)
    expected = tm.run(target, "flux")
    with pytest.raises(ValueError, match="proj_out.bias"):
        cquant.load_quantized(target, path)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in target.modules())
    assert torch.equal(tm.run(target, "flux"), expected)


@pytest.mark.parametrize("scheme", ["fp6_e3m2", "int4wo", "int8wo_r16"])
def test_a_bare_quantized_layer_saves_and_loads(tmp_path, scheme):
    # quantize_ turns a bare torch.nn.Linear into the QuantizedLinear itself: its tensors have no prefix
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 32)
    cquant.quantize_(layer, scheme)
    path = tmp_path / "m.safetensors"
    cquant.save_quantized(layer, path)
    x = torch.randn(3, 256)
    for target in (torch.nn.Linear(256, 32), torch.nn.Linear(256, 32, device="meta")):
        cquant.load_quantized(target, path)
        assert isinstance(target, QuantizedLinear) and torch.equal(target(x), layer(x))
    meta, tensors = checkpoint.read_metadata(path), load_file(str(path))
    save_file({k: v for k, v in tensors.items() if k != "weight_scale"},
              str(path), metadata={k: v for k, v in meta.items() if k != checkpoint.META_TENSORS})
    target = torch.nn.Linear(256, 32)
    with pytest.raises(ValueError, match=r"does not hold weight_scale \("):
        cquant.load_quantized(target, path)
    assert type(target) is torch.nn.Linear
