"""cquant bench: model registry, grid cells and skip reasons, runner (JSONL, resume), report, CLI."""

import json
import os

import pytest
import torch

pytest.importorskip("diffusers")

from cquant.bench import grid as G  # noqa: E402
from cquant.bench import models as M  # noqa: E402
from cquant.bench.results import read_results  # noqa: E402

FAST = dict(repeats=1, iters=1, warmup=0, tiny=True, progress=False, device="cpu")


# ---------------------------------------------------------------- models


@pytest.mark.pure_python
@pytest.mark.parametrize("name", M.MODEL_NAMES)
def test_full_size_parameter_count_matches_the_published_size(name):
    info = M.model_info(name)
    assert abs(M.param_count(name) / 1e9 / info["params_b"] - 1) < 0.01


@pytest.mark.pure_python
@pytest.mark.parametrize("name", M.MODEL_NAMES)
def test_tiny_model_runs_forward_on_its_inputs(name):
    model = M.build_transformer(name, tiny=True, dtype=torch.float32)
    assert type(model).__name__ == M.model_info(name)["class"]
    inputs = M.make_inputs(name, model, tiny=True, dtype=torch.float32, batch=2)
    with torch.no_grad():
        out = model(**inputs)[0]
    assert out.shape[0] == 2 and torch.isfinite(out).all() and out.abs().sum() > 0
    again = M.build_transformer(name, tiny=True, dtype=torch.float32)  # seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_model_names_and_errors():
    assert M.model_info("pixart-sigma")["key"] == M.model_info("pixart-sigma-xl-1024")["key"]
    assert M.model_info("pixart-sigma-xl-1024")["name"] == "pixart-sigma"
    with pytest.raises(ValueError, match="model 'nope'.*flux-dev"):
        M.model_info("nope")
    with pytest.raises(ValueError, match="no 'bogus'"):
        M.load_config("flux-dev", ["bogus=1"])


def test_weights_bytes_are_what_diffusers_counts():
    import cquant
    from cquant.bench.measure import model_bytes

    model = M.build_transformer("sd3-medium", tiny=True)
    before = model_bytes(model)
    assert before == model.get_memory_footprint()
    cquant.quantize_(model, "int4wo_g32", progress=False)
    assert model_bytes(model) == model.get_memory_footprint() < before / 2


class _Packed(torch.Tensor):
    """A wrapper tensor subclass like torchao's quantized weights: int8 data and a scale inside."""

    @staticmethod
    def __new__(cls, q, scale):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=torch.bfloat16, device=q.device)

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    def __tensor_flatten__(self):
        return ["q", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(func)


def test_weights_bytes_of_wrapper_subclasses_count_each_weight():
    from cquant.bench.measure import model_bytes

    model = torch.nn.Module()
    for i in range(3):  # same shape, own storage each; wrapper tensors all report data_ptr() 0
        w = _Packed(torch.zeros(64, 32, dtype=torch.int8), torch.ones(64))
        model.register_parameter(f"w{i}", torch.nn.Parameter(w, requires_grad=False))
    assert model_bytes(model) == 3 * (64 * 32 + 64 * 4)


@pytest.mark.pure_python
def test_full_size_inputs_have_the_pipelines_token_counts():
    with torch.device("meta"):
        import diffusers

        flux = diffusers.FluxTransformer2DModel(**M.load_config("flux-dev"))
        sd3 = diffusers.SD3Transformer2DModel(**M.load_config("sd3-medium"))
    x = M.make_inputs("flux-dev", flux, dtype=torch.float32)
    assert x["hidden_states"].shape == (1, 4096, 64) and x["encoder_hidden_states"].shape == (1, 512, 4096)
    y = M.make_inputs("sd3-medium", sd3, dtype=torch.float32, batch=2)
    assert y["hidden_states"].shape == (2, 16, 128, 128) and y["encoder_hidden_states"].shape == (2, 333, 4096)


@pytest.mark.pure_python
def test_batch_timesteps_are_exact_in_half_precision():
    # the float32 reference must see the timesteps the bf16 / fp16 model embeds, or a sample's
    # embedding differs and its SQNR measures the input's rounding, not the model's
    steps = M.timesteps(8)
    assert len(set(steps.tolist())) == 4 and steps[0] == 500  # batch 1 keeps the middle of the schedule
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(steps.to(dtype).float(), steps)
        t = (steps / 1000).to(dtype)  # Flux and Qwen-Image take t / 1000 and multiply back
        assert torch.equal((t * 1000).float(), steps)
    with torch.device("meta"):
        import diffusers

        flux = diffusers.FluxTransformer2DModel(**M.load_config("flux-dev"))
    x = M.make_inputs("flux-dev", flux, dtype=torch.bfloat16, batch=4)
    assert torch.equal(x["timestep"].float() * 1000, M.timesteps(4))


# ---------------------------------------------------------------- grid


def test_cell_keys_are_stable():
    cell = G.Cell(model="flux-dev", scheme="int4wo_g64", batch=4, optimize=True)
    assert cell.key == ("model=flux-dev|mode=step|scheme=int4wo_g64|quantize_text_encoder=off|fuse_qkv=off|"
                        "dtype=bf16|batch=4|attention=sdpa|optimize=on|compile=off|cache=off")
    assert G.Cell.from_dict(json.loads(json.dumps(cell.as_dict()))) == cell
    assert cell.baseline == G.Cell(model="flux-dev", batch=4) and cell.baseline.is_baseline
    assert cell.build_key == G.Cell(model="flux-dev", scheme="int4wo_g64", attention="cquant").build_key


def test_grid_is_the_product_of_the_axes_plus_baselines():
    grid = G.make_grid([dict(scheme="int8wo,fp8dqrow", batch="1,4", attention="sdpa,cquant")])
    cells = [c for c, _ in grid]
    assert len(cells) == len(set(cells)) == 2 * 2 * 2 + 2  # + the baseline of each batch
    assert cells[0].is_baseline and cells[1].is_baseline
    # cells sharing a built model are neighbours
    keys = [c.build_key for c in cells[2:]]
    assert keys == sorted(keys, key=keys.index) and len(set(keys)) == 2
    # overrides replace an axis in every block
    assert {c.scheme for c, _ in G.default_grid("default", scheme="none,int8dq")} == {"none", "int8dq"}


def test_default_preset_covers_every_cquant_scheme():
    from cquant.schemes import SCHEME_NAMES

    cells = [c for c, _ in G.default_grid("default")]
    assert set(SCHEME_NAMES) <= {c.scheme for c in cells}
    assert any(c.compile and c.scheme == "fp8dqrow" for c in cells)
    assert any(c.fuse_qkv and c.attention == "cquant" and c.optimize and c.scheme == "int8dq" for c in cells)
    # torchao's configs are the comparison point where torchao imports, skipped with why elsewhere
    assert set(G.TORCHAO_SCHEMES) <= {c.scheme for c in cells}
    no_ao = dict((c.label, r) for c, r in G.default_grid("default", env=G.GridEnv(torchao=False)))
    assert "torchao" in no_ao["torchao:int8wo"]


def test_skip_reasons():
    env = G.GridEnv(device="cuda", capability=80, torchao=False)
    reason = dict((c.label, r) for c, r in G.make_grid(
        [dict(scheme="none,fp8dqrow,int8wo,torchao:int8wo", cache="off,on", quantize_text_encoder="off,on")], env=env))
    assert "denoising loop" in reason["int8wo +cache"]
    assert "no text encoder" in reason["int8wo +te"]
    assert "8.9" in reason["fp8dqrow"]
    assert "torchao" in reason["torchao:int8wo"]
    assert reason["int8wo"] is None and reason["none"] is None
    no_kernels = G.GridEnv(device="cuda", capability=90, cquant_refusal="built CPU-only")
    off = dict((c.label, r) for c, r in G.make_grid([dict(scheme="none,int8wo", optimize="off,on")], env=no_kernels))
    assert "built CPU-only" in off["int8wo"] and "built CPU-only" in off["none +opt"] and off["none"] is None
    pixart = G.make_grid([dict(model="pixart-sigma", optimize="on")])
    assert "PixArtTransformer2DModel" in pixart[-1][1] and pixart[-1][0].optimize
    assert G.make_grid([dict(model="flux-dev", optimize="on")])[-1][1] is None
    ao = {(c.label, c.dtype): r for c, r in G.make_grid([dict(scheme="torchao:int4wo,torchao:fp8dqrow",
                                                              dtype="bf16,fp16")],
                                                        env=G.GridEnv(device="cuda", capability=90, torchao=True))}
    assert ao[("torchao:fp8dqrow", "fp16")] is None and ao[("torchao:int4wo", "bf16")] is None
    assert "bfloat16" in ao[("torchao:int4wo", "fp16")]


@pytest.mark.parametrize("axis,value,match", [("scheme", "bogus", "scheme 'bogus'"), ("batch", "0", "batch"),
                                              ("dtype", "fp8", "dtype"), ("attention", "flash", "attention"),
                                              ("optimize", "maybe", "optimize"), ("model", "nope", "model 'nope'")])
def test_bad_axis_values_name_the_axis(axis, value, match):
    with pytest.raises(ValueError, match=match):
        G.parse_axis(axis, value)


@pytest.mark.parametrize("value", ["int8wo,int8wo", "int8wo,int8_weight_only",
                                   ["none", "fp8dqrow", "float8dq_e4m3_row"], "torchao:int8wo,none,torchao:int8wo"])
def test_a_scheme_named_twice_is_refused_not_run_once(value):
    """As cquant verify refuses it: one rule for every front end (cquant.schemes.scheme_names)."""
    with pytest.raises(ValueError, match=r"^scheme .* names (int8wo|fp8dqrow|torchao:int8wo) twice"):
        G.parse_axis("scheme", value)
    assert G.parse_axis("batch", "1,1") == [1]  # other axes: a value named twice runs once


@pytest.mark.parametrize("value", ["int8wo,,fp8dqrow", "int8wo,", ",int8wo", ["int8wo", ""]])
def test_an_empty_axis_value_is_refused_not_dropped(value):
    with pytest.raises(ValueError, match="^scheme"):
        G.parse_axis("scheme", value)
    with pytest.raises(ValueError, match="^model"):
        G.default_grid("quick", model=",".join(["flux-dev", ""]))


# ---------------------------------------------------------------- runner, results, report


def _sub_grid(*blocks, **axes):
    return G.make_grid([dict(model="flux-dev", **b) for b in blocks or [axes]])


def test_runner_writes_jsonl_and_resumes(tmp_path, monkeypatch):
    from cquant.bench import measure
    from cquant.bench.runner import run_grid

    out = str(tmp_path / "r.jsonl")
    grid = _sub_grid(dict(scheme="none,int8wo,int8dq", optimize="off,on"), dict(scheme="int8wo", cache="on"))
    first = run_grid(grid, out=out, stop_after=2, **FAST)  # an interrupted grid
    assert [r["status"] for r in first] == ["skipped", "ok"]  # the skipped cell is written at once
    real = measure.quantize_model

    def failing(model, scheme, device, **kw):
        if scheme == "int8dq":
            raise RuntimeError("int8dq broke")
        return real(model, scheme, device, **kw)

    monkeypatch.setattr(measure, "quantize_model", failing)
    records = run_grid(grid, out=out, **FAST)
    by = {r["label"]: r for r in records}
    assert len(records) == len(grid) == 7
    assert "denoising loop" in by["int8wo +cache"]["reason"]
    assert by["int8dq"]["status"] == by["int8dq +opt"]["status"] == "error" and "int8dq broke" in by["int8dq"]["error"]
    ok = by["int8wo +opt"]
    assert ok["status"] == "ok" and len(ok["runs_ms"]) == 1 and ok["interleaved"] and ok["speedup"] > 0
    assert 20 < ok["sqnr_db"] < by["none"]["sqnr_db"] + 1 and ok["weights_gb"] < by["none"]["weights_gb"]
    assert "fused" in ok["optimize_report"] and ok["env"]["torch"] == torch.__version__
    assert set(ok["latency_ms"]) == {"mean", "min", "p50", "p90", "p99", "n"}
    lines = open(out).read().splitlines()
    assert len(lines) == 7  # resumed: the first run's two cells were not measured again
    with open(out, "a") as f:
        f.write('{"key": "cut sho')  # a write interrupted mid-line
    assert len(read_results(out)) == 7

    monkeypatch.setattr(measure, "quantize_model", real)
    run_grid(grid, out=out, **FAST)
    assert len(open(out).read().splitlines()) == 7  # errors stay without retry_errors
    again = {r["label"]: r for r in run_grid(grid, out=out, retry_errors=True, **FAST)}
    assert again["int8dq"]["status"] == again["int8dq +opt"]["status"] == "ok"
    assert {r["label"]: r["status"] for r in read_results(out)}["int8dq"] == "ok"


@pytest.mark.parametrize("name", ["flux-dev", "pixart-sigma"])  # backends set / processors swapped
def test_toggles_are_undone(name):
    from cquant.bench import measure

    model = M.build_transformer(name, tiny=True)
    fused = name == "flux-dev"
    kinds = [type(m) for m in model.modules()]
    procs = [getattr(m, "processor", None) for m in model.modules()]

    def backends():
        return [str(vars(p).get("_attention_backend", "own: none")).lower() for p in procs if p is not None]

    def now():
        return [(type(getattr(m, "processor", None)).__name__ +
                 str(getattr(getattr(m, "processor", None), "_attention_backend", ""))).lower() for m in model.modules()]

    before, before_now = backends(), now()
    with measure.Toggles(model, G.Cell(model=name, attention="cquant", optimize=fused, compile=True)) as t:
        assert ([type(m) for m in model.modules()] != kinds) == fused
        assert fused == ("fused" in t.notes.get("optimize_report", ""))
        assert model._compiled_call_impl is not None
        assert any("cquant" in x for x in now())  # the attention runs through cquant
    assert [type(m) for m in model.modules()] == kinds  # cquant.optimize undone
    assert [getattr(m, "processor", None) for m in model.modules()] == procs  # attention processors restored
    assert backends() == before and now() == before_now
    assert model._compiled_call_impl is None


def test_no_interleave_times_the_baseline_first_and_says_so(tmp_path):
    from cquant.bench.runner import run_grid

    out = str(tmp_path / "n.jsonl")
    grid = _sub_grid(scheme="none,int8wo")
    run_grid(grid[:1], out=out, interleave_baseline=False, **FAST)
    by = {r["label"]: r for r in run_grid(grid, out=out, interleave_baseline=False, **FAST)}  # resumed
    q = by["int8wo"]
    assert q["interleaved"] is False and "baseline_runs_ms" not in q and q["settings"]["interleaved"] is False
    assert q["speedup"] == pytest.approx(by["none"]["median_ms"] / q["median_ms"]) and q["speedup_min"] is None


def test_a_local_checkpoint_directory_is_a_model(tmp_path):
    from cquant.bench.runner import run_grid

    M.build_transformer("flux-dev", tiny=True).save_pretrained(str(tmp_path / "ckpt"))
    grid = G.make_grid([dict(model=str(tmp_path / "ckpt"), scheme="int8wo")])
    assert [r for _, r in grid] == [None, None]
    by = {r["label"]: r for r in run_grid(grid, **FAST)}
    assert by["int8wo"]["status"] == "ok", by["int8wo"].get("error")
    assert by["int8wo"]["sqnr_db"] > 20 and by["none"]["sqnr_db"] > by["int8wo"]["sqnr_db"]
    with pytest.raises(ValueError, match="model"):
        M.load_pretrained(str(tmp_path / "missing"))


def test_pipeline_mode_measures_image_quality(tmp_path):
    from cquant.bench.runner import run_grid

    grid = G.make_grid([dict(model="flux-dev", mode="pipeline", scheme="none,int8wo", cache="off,on")])
    records = run_grid([(c, r) for c, r in grid if not c.cache], steps=1, out=str(tmp_path / "p.jsonl"), **FAST)
    by = {r["label"]: r for r in records}
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("error") for r in records]
    assert by["none"]["psnr_db"] == "inf" and by["none"]["ssim"] == 1.0  # the baseline against itself
    assert 10 < by["int8wo"]["psnr_db"] < 200 and 0 < by["int8wo"]["ssim"] <= 1
    assert by["int8wo"]["weights_gb"] < by["none"]["weights_gb"] and "sqnr_db" not in by["int8wo"]
    from cquant.bench.report import markdown

    text = markdown(records)  # the transformer's weights and the whole pipeline's, PSNR / SSIM for quality
    cols = _columns(text)  # each size column names its unit; a tiny transformer's is MB, the cells plain numbers
    assert list(cols)[:2] == ["scheme + toggles", "transformer MB"] and list(cols)[2] in ("pipeline GB", "pipeline MB")
    assert float(cols["transformer MB"][0]) == pytest.approx(by["int8wo"]["weights_gb"] * 1e3, abs=1e-3)
    assert "PSNR dB / SSIM vs none" in text


def _record(label, scheme, weights, p50, **extra):
    cell = G.Cell(model="flux-dev", scheme=scheme)
    lat = dict(mean=p50, min=p50 * 0.9, p50=p50, p90=p50 * 1.1, p99=p50 * 1.2, n=3)
    return dict(key=cell.key, label=label, **cell.as_dict(), status="ok", weights_gb=weights, latency_ms=lat,
                speedup=20.0 / p50, speedup_min=19.0 / p50, speedup_max=21.0 / p50, sqnr_db=30.0 + weights, **extra)


def test_report_from_jsonl_alone(tmp_path):
    pytest.importorskip("matplotlib")
    from cquant.bench.report import write_report

    path = tmp_path / "r.jsonl"
    skipped = G.Cell(model="flux-dev", scheme="int8wo", cache=True)
    usual, short = (dict(repeats=3, iters=5, warmup=2, interleaved=True), dict(repeats=3, iters=3, warmup=1,
                                                                              interleaved=True))
    recs = [_record("none", "none", 2.0, 20.0, settings=usual),
            _record("int8wo", "int8wo", 1.0, 25.0, compile_s=float("nan"), settings=usual),
            _record("fp8dqrow", "fp8dqrow", 1.1, 12.0, settings=short),
            dict(key=skipped.key, label=skipped.label, **skipped.as_dict(), status="skipped", reason="needs a loop")]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    result = write_report(str(path), str(tmp_path / "rep"))
    text = open(result["markdown"]).read()
    by_mem, by_lat = text.split("### By latency")
    assert by_mem.index("| int8wo |") < by_mem.index("| fp8dqrow |") < by_mem.index("| none |")
    assert by_lat.index("| fp8dqrow |") < by_lat.index("| none |") < by_lat.index("| int8wo |")
    assert "1.67x (1.58-1.75)" in text and "int8wo +cache: needs a loop" in text
    # a file appended to by runs with other timing settings says which cells each applies to
    assert "Timing: 3 repeats x 5 timed calls after 2 warm-up calls, baseline interleaved unless listed" in text
    assert "- 3 repeats x 3 timed calls after 1 warm-up call, baseline interleaved: fp8dqrow (step, batch 1)" in text
    assert len(result["plots"]) == 3 and all(os.path.getsize(p) > 1000 for p in result["plots"])


def _columns(text, first="| scheme + toggles |"):
    """{header: [cells]} of the first markdown table whose header row starts with `first`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    head, _, *rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines[start:end])
    return {h: [r[j] for r in rows] for j, h in enumerate(head)}


def test_report_memory_columns_hold_one_unit_each():
    """A tiny model's sizes read as plain numbers under an MB header (they were "0.290 MB" under
    "weights GB"); a column with a size of 0.01 GB or more stays in GB, each column on its own."""
    from cquant.bench.report import markdown

    tiny = [_record("none", "none", 0.00058, 2.0, load_peak_gb=0.0012, infer_peak_gb=0.02),
            _record("int8wo", "int8wo", 0.00029, 2.5, load_peak_gb=0.0009, infer_peak_gb=0.015)]
    cols = _columns(markdown(tiny))
    assert cols["weights MB"] == ["0.290", "0.580"]  # sorted by weights memory
    assert cols["load peak MB"] == ["0.900", "1.200"] and cols["inference peak GB"] == ["0.015", "0.020"]
    assert not any(h.startswith("weights GB") or h.startswith("load peak GB") for h in cols)
    full = _columns(markdown([_record("none", "none", 23.8, 20.0), _record("int8wo", "int8wo", 12.0, 15.0)]))
    assert full["weights GB"] == ["12.000", "23.800"] and full["load peak GB"] == ["-", "-"]
    for header, cells in {**cols, **full}.items():
        if header.endswith((" GB", " MB")):
            assert all(c == "-" or float(c) >= 0 for c in cells), (header, cells)  # plain numbers, no unit


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("argv,option", [
    (["--schemes", "bogus"], "--schemes"), (["--batch", "0"], "--batch"), (["--model", "nope"], "--model"),
    (["--dtype", "fp8"], "--dtype"), (["--optimize", "maybe"], "--optimize"), (["--repeats", "0"], "--repeats"),
    (["--height", "100"], "--height"), (["--mode", "text-encoder", "--fuse-qkv", "on"], "--fuse-qkv"),
    (["--mode", "text-encoder", "--batch", "1,4"], "--batch"), (["--mode", "step,text-encoder"], "--mode"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "bogus"], "--device"),
    # an empty entry of a comma list: refused, not dropped
    (["--schemes", "int8wo,,fp8dqrow"], "--schemes 'int8wo,,fp8dqrow' has an empty entry; expected comma-separated "
                                        "scheme names"),
    (["--batch", "1,"], "--batch '1,' has an empty entry"), (["--model", ",flux-dev"], "--model ',flux-dev' has an"),
    (["--optimize", "off,,on"], "--optimize 'off,,on' has an empty entry; expected comma-separated off / on values"),
    (["--schemes", ""], "--schemes '' names no value"),
    (["--mode", "text-encoder", "--schemes", "int8wo,"], "--schemes 'int8wo,' has an empty entry"),
    (["--mode", "text-encoder,"], "--mode 'text-encoder,' has an empty entry"),
    # a scheme named twice, an alias and its scheme included: refused, not run once
    (["--schemes", "int8wo,int8wo"], "--schemes: scheme 'int8wo,int8wo' names int8wo twice; expected each scheme once"),
    (["--schemes", "int8wo,int8_weight_only"], "names int8wo twice (as 'int8wo' and 'int8_weight_only')"),
    (["--mode", "text-encoder", "--schemes", "fp8wo,float8wo_e4m3"],
     "--schemes 'fp8wo,float8wo_e4m3' names fp8wo twice"),
])
def test_cli_errors_name_the_argument(argv, option, capsys):
    from cquant.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--list", "--device", "cpu"] if "--device" not in argv else [*argv, "--list"])
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_cli_report_of_a_missing_file_names_it(tmp_path, capsys):
    from cquant.bench.cli import main

    with pytest.raises(SystemExit):
        main(["--report", str(tmp_path / "none.jsonl")])
    assert "--report" in capsys.readouterr().err


def test_cli_list_and_a_quick_run(tmp_path, capsys):
    from cquant.__main__ import main

    assert main(["bench", "--list", "--device", "cpu", "--model", "flux-dev,pixart-sigma", "--optimize", "on"]) == 0
    listed = capsys.readouterr().out
    assert "skipped: cquant.optimize has no fused block for PixArtTransformer2DModel" in listed
    out, rep = str(tmp_path / "q.jsonl"), str(tmp_path / "rep")
    assert main(["bench", "--quick", "--schemes", "none,int8wo", "--optimize", "off", "--repeats", "1", "--iters", "1",
                 "--warmup", "0", "--out", out, "--out-dir", rep]) == 0
    assert [r["status"] for r in read_results(out)] == ["ok", "ok"]
    assert "| int8wo |" in open(os.path.join(rep, "report.md")).read()
    assert main(["bench", "--mode", "text-encoder", "--list", "--device", "cpu", "--schemes", "none,fp8wo"]) == 0
    assert "schemes none, fp8wo" in capsys.readouterr().out


def test_cli_text_encoder_mode_calls_the_study(monkeypatch, tmp_path):
    import sys
    import types

    from cquant.bench.cli import main

    calls = []
    fake = types.ModuleType("cquant.bench.text_encoder")
    fake.run_study = lambda *a, **kw: calls.append((a, kw)) or [{"row": 1}]
    monkeypatch.setitem(sys.modules, "cquant.bench.text_encoder", fake)
    assert main(["--mode", "text-encoder", "--model", "flux-dev,sd3-medium", "--schemes", "none,fp8dqrow,int8wo",
                 "--dtype", "fp16", "--batch", "2", "--repeats", "3", "--device", "cpu", "--out-dir",
                 str(tmp_path)]) == 0
    (args, kw), = calls
    assert not args and kw["models"] == ("flux-dev", "sd3-medium") and kw["schemes"] == ("fp8dqrow", "int8wo")
    assert kw["dtype"] == torch.float16 and kw["batch"] == 2 and kw["repeats"] == 3 and kw["device"] == "cpu"
    assert kw["out_dir"] == str(tmp_path) and kw["quick"] is False


# ---------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_two_cell_grid_on_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cquant.bench import run_grid, write_report

    out = str(tmp_path / "gpu.jsonl")
    records = run_grid(_sub_grid(scheme="none,int8wo"), device="cuda", out=out, repeats=2, iters=3, warmup=1,
                       tiny=True, progress=False)
    by = {r["label"]: r for r in records}
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("error") for r in records]
    q = by["int8wo"]
    assert q["env"]["device"] == torch.cuda.get_device_name() and q["interleaved"]
    assert q["weights_alloc_gb"] > 0 and q["load_peak_gb"] >= q["weights_alloc_gb"]
    assert q["infer_peak_gb"] >= q["weights_alloc_gb"] and q["sqnr_db"] > 20
    assert len(q["baseline_runs_ms"]) == 2 and q["speedup_min"] <= q["speedup"] <= q["speedup_max"]
    assert write_report(out, str(tmp_path / "rep"))["markdown"]


@pytest.mark.cuda
def test_gpu_grid_with_toggles_restores_the_model(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cquant.bench import run_grid

    grid = _sub_grid(scheme="int8dq", optimize="off,on", attention="sdpa,cquant")
    records = run_grid(grid, device="cuda", repeats=2, iters=2, warmup=1, tiny=True, progress=False)
    by = {r["label"]: r for r in records}
    assert all(r["status"] == "ok" for r in records), [(r["label"], r.get("error")) for r in records]
    assert len({r["load_peak_gb"] for r in records if r["scheme"] == "int8dq"}) == 1  # one build, four cells
    assert "fused" in by["int8dq @cquant +opt"]["optimize_report"] and by["int8dq +opt"]["sqnr_db"] > 20
