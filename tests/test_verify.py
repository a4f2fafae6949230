"""cquant.verify: shapes and call counts, per-layer SQNR against an independent computation, the
suggestion round trip through quantize_, hooks gone afterwards, argument errors, the CLI."""

import copy
import json
import math
import re

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cquant  # noqa: E402
from cquant.metrics import sqnr_db  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from cquant.verify import load_mapping, verify  # noqa: E402


class Toy(torch.nn.Module):
    """a and b once each; c three times, on two input shapes ([2, 8, 64] once, [2, 3, 64] twice)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 32)
        self.b = torch.nn.Linear(32, 64)
        self.c = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        h = self.c(self.b(self.a(x)))
        return self.c(self.c(h[:, :3]))


def toy(seed=0):
    torch.manual_seed(seed)
    return Toy().eval(), torch.randn(2, 8, 64)


HAND_COUNT = {
    "a": {((2, 8, 64), (32, 64), (2, 8, 32)): 1},
    "b": {((2, 8, 32), (64, 32), (2, 8, 64)): 1},
    "c": {((2, 8, 64), (64, 64), (2, 8, 64)): 1, ((2, 3, 64), (64, 64), (2, 3, 64)): 2},
}


def shape_counts(row):
    return {(s.input, s.weight, s.output): s.calls for s in row.shapes}


def hooks_of(model):
    return {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}


def independent_sqnr(model, x, weights):
    """{layer: SQNR} of each quantized layer's outputs in one run against float64 F.linear with
    weights[name] = (weight, bias), over all its calls laid end to end (plain torch hooks)."""
    seen = {}

    def hook(name):
        def record(mod, args, out):
            w, b = weights[name]
            ref = F.linear(args[0].double(), w.double(), None if b is None else b.double())
            seen.setdefault(name, []).append((ref.flatten(), out.double().flatten()))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return {n: sqnr_db(torch.cat([r for r, _ in v]), torch.cat([y for _, y in v])) for n, v in seen.items()}


def test_shapes_and_calls_match_the_hand_count():
    model, x = toy()
    result = verify(model, {"x": x})
    assert {r.name for r in result.rows} == set(HAND_COUNT)
    for r in result.rows:
        assert shape_counts(r) == HAND_COUNT[r.name], r.name
        assert r.calls == sum(HAND_COUNT[r.name].values())
        assert r.sqnr_db is None and r.scheme == "float32"  # nothing to measure on float layers


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow"])
def test_sqnr_equals_an_independent_computation(scheme):
    model, x = toy()
    float_model = copy.deepcopy(model)
    cquant.quantize_(model, scheme)
    weights = {n: (m.weight, m.bias) for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear)}
    result = verify(model, (x,), reference=float_model)
    expected = independent_sqnr(model, x, weights)
    assert result.reference.startswith("the reference weights")
    for r in result.rows:
        assert r.scheme == scheme and r.reference == "reference"
        assert r.sqnr_db == pytest.approx(expected[r.name], abs=1e-3), r.name
        assert 0 < r.max_abs_err < 1
        assert shape_counts(r) == HAND_COUNT[r.name]
    sqnrs = [r.sqnr_db for r in result.rows]
    assert sqnrs == sorted(sqnrs)  # worst first
    assert result.overhead > 0 and result.verify_s > 0 and result.normal_s > 0

    # a state_dict as reference measures the same thing
    by_state = verify(model, (x,), reference=float_model.state_dict(), timing=False)
    assert {r.name: r.sqnr_db for r in by_state.rows} == pytest.approx({r.name: r.sqnr_db for r in result.rows})
    assert by_state.overhead is None

    # without a reference: the dequantized stored weight, and the report says so
    dequantized = {n: (m.dequantize(torch.float32), m.bias) for n, m in model.named_modules()
                   if isinstance(m, QuantizedLinear)}
    alone = verify(model, (x,))
    expected = independent_sqnr(model, x, dequantized)
    assert any("only the activation / kernel error" in n for n in alone.notes)
    for r in alone.rows:
        assert r.reference == "dequantized"
        if expected[r.name] > 100:  # float32 rounding alone (our float32 reference vs float64 here)
            assert r.sqnr_db > 100
        else:
            assert r.sqnr_db == pytest.approx(expected[r.name], abs=1e-3)
    if scheme == "int8wo":  # weight-only: the dequantized weight is what the kernel multiplies by
        assert all(r.sqnr_db > 60 for r in alone.rows)


def test_candidates_suggestion_round_trips_through_quantize(tmp_path):
    model, x = toy()
    schemes = ["int8wo", "fp8dqrow", "int4wo_g32"]
    probe = verify(model, {"x": x}, schemes=schemes, timing=False)
    for r in probe.rows:  # candidate SQNR against an independent computation (c: 3 calls)
        assert set(r.candidates) == set(schemes)
        assert r.candidates["int8wo"]["sqnr_db"] > r.candidates["int4wo_g32"]["sqnr_db"]
    int4 = sorted(r.candidates["int4wo_g32"]["sqnr_db"] for r in probe.rows)
    int8 = sorted(r.candidates["int8wo"]["sqnr_db"] for r in probe.rows)
    floor = (int4[0] + int4[1]) / 2  # one layer fails int4 and takes the next cheapest that passes
    assert floor < int8[0]
    result = verify(model, {"x": x}, schemes=schemes, floor_db=floor, timing=False)
    assert sum(r.suggested == "int4wo_g32" for r in result.rows) == 2
    for r in result.rows:
        ok = [s for s in sorted(schemes, key=lambda s: r.candidates[s]["bytes"])
              if r.candidates[s]["sqnr_db"] >= floor]
        assert r.suggested == ok[0]
    assert result.suggestion["_default"] is None
    path = tmp_path / "mapping.json"
    result.save_mapping(path)
    mapping = load_mapping(path)
    assert mapping == result.suggestion
    fresh, _ = toy()
    cquant.quantize_(fresh, mapping)
    for name, want in mapping.items():
        if name != "_default":
            assert fresh.get_submodule(name).scheme.name == want

    # a floor nothing reaches leaves every layer unquantized
    none = verify(model, {"x": x}, schemes=schemes, floor_db=1000.0, timing=False)
    assert all(r.suggested is None for r in none.rows)
    plain, _ = toy()
    cquant.quantize_(plain, none.suggestion)
    assert not any(isinstance(m, QuantizedLinear) for m in plain.modules())


def test_a_candidate_whose_group_size_does_not_divide_a_layer_is_refused_there():
    # b has in_features 32: int4wo_g64 cannot take it (and has no byte count there), a and c can
    model, x = toy()
    result = verify(model, {"x": x}, schemes=["int4wo_g64", "int8wo"], floor_db=0.0, timing=False)
    rows = {r.name: r for r in result.rows}
    assert "in_features=32 is not a multiple of the weight group size 64" in rows["b"].candidates["int4wo_g64"]["refused"]
    assert rows["b"].suggested == "int8wo" and rows["a"].suggested == rows["c"].suggested == "int4wo_g64"
    assert "refused" in str(result)


def test_hooks_are_removed_and_outputs_unchanged_even_when_the_call_raises():
    model, x = toy()
    cquant.quantize_(model, "int8wo")
    before = hooks_of(model)
    with torch.no_grad():
        y0 = model(x)
    verify(model, {"x": x}, schemes=["fp8dqrow"])
    assert hooks_of(model) == before
    with torch.no_grad():
        assert torch.equal(model(x), y0)
    precision = torch.get_float32_matmul_precision()

    def boom():
        model(x)
        raise KeyError("the user's call failed")

    with pytest.raises(KeyError, match="the user's call failed"):
        verify(model, boom, timing=False)
    assert hooks_of(model) == before
    assert torch.get_float32_matmul_precision() == precision
    with torch.no_grad():
        assert torch.equal(model(x), y0)


def test_pipeline_components_are_named_and_the_mapping_is_per_component(tmp_path):
    class Pipe:
        def __init__(self):
            self.components = {"transformer": toy(0)[0], "text_encoder": toy(1)[0], "scheduler": object()}

        def __call__(self, x):
            with torch.no_grad():
                return self.components["transformer"](self.components["text_encoder"](x))

    pipe, (_, x) = Pipe(), toy()
    result = verify(pipe, lambda: pipe(x), schemes=["int8wo"], floor_db=20.0, timing=False)
    assert {r.name for r in result.rows} == {f"{c}.{n}" for c in ("transformer", "text_encoder") for n in "abc"}
    assert shape_counts(result.row("text_encoder.c")) == HAND_COUNT["c"]
    assert set(result.suggestion) == {"transformer", "text_encoder"}
    path = tmp_path / "m.json"
    result.save_mapping(path)
    m = load_mapping(path, component="transformer")
    assert m == {"a": "int8wo", "b": "int8wo", "c": "int8wo", "_default": None}
    with pytest.raises(ValueError, match="component='vae'"):
        load_mapping(path, component="vae")


def test_result_renders_and_serialises():
    model, x = toy()
    cquant.quantize_(model, "fp8dqrow")
    result = verify(model, {"x": x})
    text, md, page = result.table(), result.table("markdown"), result._repr_html_()
    for name in "abc":
        assert name in text and f"| {name} |" in md and f"<td>{name}</td>" in page
    assert "overhead" in text
    d = json.loads(result.to_json())
    assert [r["name"] for r in d["rows"]] == [r.name for r in result.rows]
    assert d["rows"][0]["shapes"][0]["calls"] >= 1
    assert math.isclose(d["overhead"], result.overhead)
    with pytest.raises(ValueError, match="fmt"):
        result.table("latex")
    assert result.table(limit=2).count("\n") < text.count("\n")
    for bad in (-1, 0, 1.5, True):  # -1 dropped the last row, 0 showed none
        with pytest.raises(ValueError, match="limit must be None or an int >= 1"):
            result.table(limit=bad)


@pytest.mark.parametrize("schemes, message", [
    ([], "schemes=[] names no scheme"),  # measured nothing, where the command line refused
    ("", "schemes='' is empty"), (["int8wo", " "], "schemes=['int8wo', ' '] has an empty scheme name (entry 2)"),
    (["fp8dqrow", "float8dq_e4m3_row"], "names fp8dqrow twice (as 'fp8dqrow' and 'float8dq_e4m3_row')")])
def test_scheme_lists_follow_the_rule_of_every_front_end(schemes, message):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match=re.escape(message)):
        verify(model, {"input": torch.randn(2, 64)}, schemes=schemes)


def test_bad_arguments_name_the_argument(tmp_path):
    model, x = toy()
    with pytest.raises(TypeError, match="model"):
        verify(42, lambda: None)
    with pytest.raises(TypeError, match="call"):
        verify(model, 5)
    with pytest.raises(ValueError, match="schemes"):
        verify(model, {"x": x}, schemes=["int9wo"])
    with pytest.raises(TypeError, match=r"schemes must be a scheme name or a list of names .*got 5"):
        verify(model, {"x": x}, schemes=5)
    with pytest.raises(ValueError, match="floor_db"):
        verify(model, {"x": x}, floor_db=30)
    with pytest.raises(TypeError, match="timing"):
        verify(model, {"x": x}, timing="yes")
    with pytest.raises(ValueError, match="warmup"):
        verify(model, {"x": x}, warmup=-1)
    q = copy.deepcopy(model)
    cquant.quantize_(q, "int8wo")
    with pytest.raises(ValueError, match="reference.*quantized"):
        verify(q, {"x": x}, reference=q)
    calls = []
    with pytest.raises(ValueError, match="reference.*'a'"):
        verify(q, lambda: calls.append(1), reference={"a.weight": torch.zeros(3, 3)})
    assert not calls  # refused before running anything
    with pytest.raises(TypeError, match="reference"):
        verify(q, {"x": x}, reference={"a.weight": "not a tensor"})
    # a reference naming none of the quantized layers (a prefixed state_dict, another model) is refused,
    # not silently replaced by the dequantized weights
    prefixed = {"transformer." + k: v for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="reference: none of its weights is named like a quantized layer"):
        verify(q, lambda: calls.append(1), reference=prefixed)
    with pytest.raises(ValueError, match="reference: none"):
        verify(q, lambda: calls.append(1), reference=torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert not calls
    with pytest.raises(FileNotFoundError, match="path"):
        load_mapping(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": "int9wo"}))
    with pytest.raises(ValueError, match="bad.json"):
        load_mapping(bad)
    assert hooks_of(model) == hooks_of(toy()[0])


@pytest.mark.filterwarnings("ignore::cquant.SkippedLayersWarning")
def test_fused_qkv_and_optimized_blocks_are_measured_through_their_layers():
    pytest.importorskip("diffusers")
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=[8, 12, 12]).eval()
    b, hw, t = 1, 16, 7
    inputs = dict(hidden_states=torch.randn(b, hw, 8), encoder_hidden_states=torch.randn(b, t, 32),
                  pooled_projections=torch.randn(b, 16), timestep=torch.rand(b), img_ids=torch.randn(hw, 3),
                  txt_ids=torch.randn(t, 3), return_dict=False)
    float_model = copy.deepcopy(model)
    cquant.quantize_(model, "fp8dqrow")
    cquant.fuse_qkv_(model)
    plain = verify(model, inputs, reference=float_model, timing=False)
    cquant.optimize(model)
    fused = verify(model, inputs, reference=float_model, timing=False)
    assert any("fused forwards" in n for n in fused.notes)
    calls = {r.name: r.calls for r in plain.rows}
    assert {r.name: r.calls for r in fused.rows} == calls  # every layer call seen with the blocks fused too
    assert all(r.sqnr_db > 20 for r in fused.rows if r.calls and r.scheme == "fp8dqrow")  # fused GELUs included
    assert "fused layer" in fused.row("transformer_blocks.0.attn.to_q").note
    qkv = fused.row("transformer_blocks.0.attn.to_qkv")
    assert qkv.calls == 1 and qkv.reference == "reference" and qkv.sqnr_db > 20
    assert {r.name: r.sqnr_db for r in fused.rows} == pytest.approx({r.name: r.sqnr_db for r in plain.rows})
    assert type(model.transformer_blocks[0]).__module__.startswith("cquant")  # still optimized afterwards
    cquant.unoptimize(model)

    # the suggestion names the fused layer and its parts: it quantizes the model before fusion too
    picked = verify(model, inputs, reference=float_model, schemes=["int8wo"], floor_db=20.0, timing=False)
    mapping = picked.suggestion
    assert mapping["transformer_blocks.0.attn.to_qkv"] == mapping["transformer_blocks.0.attn.to_q"] == "int8wo"
    cquant.quantize_(float_model, mapping)
    assert float_model.transformer_blocks[0].attn.to_k.scheme.name == "int8wo"


def test_compiled_models_are_measured_eagerly():
    model, x = toy()
    compiled = torch.compile(model, backend="eager")
    result = verify(compiled, {"x": x}, schemes=["int8wo"], floor_db=10.0)
    assert {r.name for r in result.rows} == set(HAND_COUNT)  # the wrapped model's names, not _orig_mod.*
    for r in result.rows:
        assert shape_counts(r) == HAND_COUNT[r.name]
    assert any("torch.compile" in n for n in result.notes)
    assert result.suggestion == {"a": "int8wo", "b": "int8wo", "c": "int8wo", "_default": None}


def test_sequentially_offloaded_layers_are_counted_and_said_to_be_unmeasured():
    accelerate = pytest.importorskip("accelerate")
    model, x = toy()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))  # weights on meta between calls
    result = verify(model, {"x": x}, schemes=["int8wo"], timing=False)
    for r in result.rows:
        assert shape_counts(r) == HAND_COUNT[r.name]
        assert "offloaded" in r.note and r.candidates["int8wo"]["sqnr_db"] is None
    assert any("offload" in n for n in result.notes)


def test_cli_errors_name_the_option(capsys):
    from cquant.verify.cli import parse_args

    for argv, option in ((["--model", "flux-dev"], "--scheme"),
                         (["--model", "flux-dev", "--scheme", "int8wo", "--floor", "30"], "--floor"),
                         (["--model", "flux-dev", "--candidates", "int8wo", "--mapping-out", "m.json"],
                          "--mapping-out"),
                         (["--model", "flux-dev", "--candidates", "nope"], "--candidates"),
                         (["--model", "flux-dev", "--candidates", "int8wo,,fp8dqrow"],
                          "--candidates 'int8wo,,fp8dqrow' has an empty entry; expected comma-separated scheme names"),
                         (["--model", "flux-dev", "--candidates", "int8wo,"], "--candidates 'int8wo,' has an empty"),
                         (["--model", "flux-dev", "--candidates", ""], "--candidates '' names no scheme"),
                         (["--model", "flux-dev", "--candidates", "int8wo,fp8dqrow,int8wo"],
                          "--candidates 'int8wo,fp8dqrow,int8wo' names int8wo twice"),
                         (["--model", "flux-dev", "--candidates", "int8wo,int8_weight_only"],
                          "names int8wo twice"),  # an alias is the same scheme
                         (["--model", "flux-dev", "--scheme", ""],
                          "--scheme '' is empty; expected a scheme name"),  # was: give --scheme or --candidates
                         (["--model", "flux-dev", "--scheme", "int8wo", "--batch", "0"], "--batch")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert option in capsys.readouterr().err


def test_cli_refuses_a_nan_floor_and_unwritable_outputs_before_running(tmp_path, capsys):
    from cquant.verify.cli import parse_args

    base = ["--model", "flux-dev", "--candidates", "int8wo"]
    for argv, message in ((["--floor", "nan"], "--floor must be a finite number of dB, got nan"),
                          (["--out", str(tmp_path)], "--out '%s' is a directory" % tmp_path),
                          (["--floor", "30", "--mapping-out", str(tmp_path / "no" / "m.json")],
                           "--mapping-out '%s': " % (tmp_path / "no" / "m.json"))):
        with pytest.raises(SystemExit) as e:
            parse_args(base + argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_tiny_registry_model(tmp_path, capsys):
    models = pytest.importorskip("cquant.bench.models")
    from cquant.__main__ import main

    out, mapping = tmp_path / "r.json", tmp_path / "m.json"
    rc = main(["verify", "--model", models.MODEL_NAMES[0], "--tiny", "--device", "cpu", "--dtype", "float32",
               "--candidates", "int8wo,fp8dqrow", "--floor", "20", "--out", str(out), "--mapping-out", str(mapping)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "overhead" in printed
    report = json.loads(out.read_text())
    assert report["rows"] and all(r["calls"] >= 0 for r in report["rows"])
    m = load_mapping(mapping)
    model = models.build_transformer(models.MODEL_NAMES[0], dtype=torch.float32, tiny=True)
    cquant.quantize_(model, m)
    for name, want in m.items():
        if name != "_default" and want is not None:
            assert model.get_submodule(name).scheme.name == want


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow"])
def test_sqnr_on_cuda(scheme):
    model, x = toy()
    model, x = model.to("cuda", torch.bfloat16), x.to("cuda", torch.bfloat16)
    float_model = copy.deepcopy(model)
    cquant.quantize_(model, scheme)
    weights = {n: (m.weight, m.bias) for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear)}
    result = verify(model, (x,), reference=float_model, schemes=["int8wo"], floor_db=20.0)
    expected = independent_sqnr(model, x, weights)
    for r in result.rows:
        assert r.sqnr_db == pytest.approx(expected[r.name], abs=1e-2), r.name
        assert shape_counts(r) == HAND_COUNT[r.name]
        assert r.candidates["int8wo"]["sqnr_db"] > 20
    assert result.overhead > 0


@pytest.mark.cuda
def test_cuda_graph_replay_is_off_for_the_run_and_back_after():
    pytest.importorskip("diffusers")
    from cquant import cuda_graph

    model, x = toy()
    model = model.to("cuda", torch.bfloat16)
    x = x.to("cuda", torch.bfloat16)
    cquant.quantize_(model, "fp8dqrow")
    cuda_graph.install(model)
    result = verify(model, {"x": x})
    assert all(r.calls == sum(HAND_COUNT[r.name].values()) for r in result.rows)
    assert any("CUDA-graph" in n for n in result.notes)
    assert cuda_graph.installed(model) is not None
    cuda_graph.uninstall(model)


def test_cquant_verify_is_callable_however_it_was_imported():
    import importlib

    module = importlib.import_module("cquant.verify")
    model, x = toy()
    assert cquant.verify is module and callable(module) and cquant.verify.load_mapping is load_mapping
    assert {r.name for r in module(model, {"x": x}, timing=False).rows} == set(HAND_COUNT)
    assert cquant.VerifyResult is module.VerifyResult


@pytest.mark.filterwarnings("ignore::cquant.SkippedLayersWarning")
def test_cli_local_diffusers_directory(tmp_path, capsys):
    pytest.importorskip("cquant.bench.models")
    pytest.importorskip("diffusers")
    from diffusers import FluxTransformer2DModel

    from cquant.__main__ import main

    torch.manual_seed(0)
    FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                           num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                           axes_dims_rope=[8, 12, 12]).save_pretrained(tmp_path / "transformer")
    out = tmp_path / "r.json"
    assert main(["verify", "--model", str(tmp_path), "--tiny", "--device", "cpu", "--scheme", "int8wo",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert any(r["name"] == "transformer_blocks.0.attn.to_q" and r["scheme"] == "int8wo" for r in rows)
    assert all(r["sqnr_db"] is None or float(r["sqnr_db"]) > 30 for r in rows)
    with pytest.raises(SystemExit, match="--model"):
        main(["verify", "--model", str(tmp_path / "nowhere"), "--tiny", "--device", "cpu", "--scheme", "int8wo"])


def test_cli_device_errors_name_the_verify_command():
    from cquant.verify.cli import main

    with pytest.raises(SystemExit, match="^cquant verify: --device mps: expected cpu or cuda"):
        main(["--model", "flux-dev", "--tiny", "--scheme", "int8wo", "--device", "mps"])
