"""The benchmarks' and studies' plumbing on the CPU: scheme variants (benchmarks/_variants.py),
the CPU smoke modes of bench_linear / bench_gemv / bench_context_parallel (context and batch
parallel, Flux and CogVideoX), bench_flux_step's stored sizes on meta tensors, int4_quality_study --quick and the
two-level 4-bit study. Timing itself runs on the GPU machine (test_bench_kit.py checks its
arithmetic)."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import _variants  # noqa: E402

from cquant.schemes import SCHEME_NAMES, SCHEMES  # noqa: E402

GROUPED = [n for n in SCHEME_NAMES if _variants.is_grouped(SCHEMES[n])]


def test_variant_names_resolve_through_the_scheme_table():
    for name in SCHEME_NAMES:
        v = _variants.parse(name)
        assert v.scheme is SCHEMES[name] and v.rank == 0 and v.name == name
        assert _variants.config(v).scheme() == v.scheme
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        _variants.parse("int3wo")
    with pytest.raises(ValueError):  # int8wo has per-row scales, no groups
        _variants.parse("int8wo_g64")


@pytest.mark.parametrize("name", GROUPED)
def test_group_size_and_rank_suffixes(name):
    default = _variants.group_size(SCHEMES[name])
    v = _variants.parse(f"{name}_g64_r16")
    assert _variants.group_size(v.scheme) == 64 and v.rank == 16 and v.scheme.name == f"{name}_g64_r16"
    cfg = _variants.config(v)
    assert cfg.scheme() == v.scheme and cfg.lowrank_rank == 16
    assert _variants.with_rank(f"{name}_g64", 8) == f"{name}_g64_r8"
    assert _variants.with_rank(f"{name}_g64_r8", 0) == f"{name}_g64"
    assert _variants.with_rank(name, 0) == name
    assert _variants.with_group_sizes([name, "int8wo"], [32, default]) == [f"{name}_g32", name, "int8wo"]
    kw = _variants.linear_kwargs(v.scheme, 256)
    assert kw["weight_granularity"] == SCHEMES[name].weight_granularity and kw["weight_group_size"] == 64


@pytest.mark.parametrize("name", ["int8wo", "fp6_e3m2", *GROUPED])
def test_quantize_weight_and_linear_kwargs_run_ops_linear(name):
    from cquant import ops
    from cquant.metrics import sqnr_db

    s = _variants.parse(name).scheme
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    q, sc = _variants.quantize_weight(s, w)
    y = ops.linear(x, q, sc, **_variants.linear_kwargs(s, 256))
    assert sqnr_db(x.double() @ w.double().T, y) > 10
    assert _variants.stored_bytes(q, sc) == q.numel() * q.element_size() + sc.numel() * sc.element_size()


def test_module_bytes_counts_stored_tensors_once():
    import cquant

    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    assert _variants.module_bytes(lin) == 2 * (256 * 64 + 64)
    cquant.quantize_(lin, "fp6_e3m2")
    packed = 64 * SCHEMES["fp6_e3m2"].row_bytes(256)
    assert _variants.module_bytes(lin) == packed + 4 * 64 + 2 * 64
    shared = torch.nn.Sequential(lin, lin)
    assert _variants.module_bytes(shared) == _variants.module_bytes(lin)


def test_bench_linear_cpu_smoke(tmp_path, capsys):
    import bench_linear

    out = tmp_path / "linear.json"
    names = ["int8wo", *GROUPED[:1]]
    assert bench_linear.main(["--device", "cpu", "--schemes", ",".join(names), "--repeats", "1", "--iters", "1",
                              "--warmup", "0", "--bf16-only", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["method"] for r in rows} == {"torch_bf16", *names}
    assert all(r["sqnr_db"] > 10 for r in rows)


def test_bench_linear_wo_paths_time_both_large_m_paths(tmp_path):
    """--wo-paths: a per-row weight-only scheme is timed three times (the mixed-input GEMM with and
    without its split of K, and the decoded rows, pinned by CQUANT_WO_DECODE_M and
    CQUANT_WO_SPLIT_K), a grouped one once; the switches are restored after the run."""
    import os

    import bench_linear

    out = tmp_path / "linear.json"
    names = ["int8wo", *GROUPED[:1]]
    before = {key: os.environ.get(key) for key in bench_linear.WO_SWITCHES}
    assert bench_linear.main(["--device", "cpu", "--schemes", ",".join(names), "--repeats", "1", "--iters", "1",
                              "--warmup", "0", "--bf16-only", "--wo-paths", "--out", str(out)]) == 0
    assert {key: os.environ.get(key) for key in bench_linear.WO_SWITCHES} == before
    rows = json.loads(out.read_text())["results"]
    assert {r["method"] for r in rows} == {"torch_bf16", *names, "int8wo" + bench_linear.WHOLE,
                                           "int8wo" + bench_linear.DECODED}


def test_bench_linear_gated_epilogue(tmp_path):
    """--epilogue gated: torch's layer then residual + gate * y against ops.linear_gated, whose SQNR
    is taken against the gated float64 reference (a plain layer's output would score far below)."""
    import bench_linear

    out = tmp_path / "linear.json"
    assert bench_linear.main(["--device", "cpu", "--schemes", "int8wo", "--repeats", "1", "--iters", "1",
                              "--warmup", "0", "--bf16-only", "--epilogue", "gated", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["epilogue"] == "gated"
    rows = data["results"]
    assert {r["method"] for r in rows} == {"torch_bf16", "int8wo"}
    assert all(r["sqnr_db"] > 25 for r in rows)


def test_bench_gemv_cpu_smoke(tmp_path):
    import bench_gemv

    out = tmp_path / "gemv.json"
    names = ["int8wo", *GROUPED[:1]]
    assert bench_gemv.main(["--device", "cpu", "--schemes", ",".join(names), "--repeats", "1", "--iters", "1",
                            "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for shape in data["shapes"]:
        by = {r["scheme"]: r for r in shape["results"]}
        assert set(by) == {"torch_bf16", *names}
        for name in names:
            s = _variants.parse(name).scheme
            q_bytes = shape["N"] * s.row_bytes(shape["K"])
            assert by[name]["code_bytes"] == q_bytes and by[name]["scale_bytes"] > 0
            assert by[name]["weight_bytes"] == q_bytes + by[name]["scale_bytes"]


def test_bench_flux_step_sizes_on_meta_tensors(capsys):
    pytest.importorskip("diffusers")
    import bench_flux_step

    rows = bench_flux_step.main(["--sizes", "--schemes", "int8wo,fp4_e2m1", "--override", "num_layers=1",
                                 "num_single_layers=1"])
    by = {r["variant"]: r for r in rows}
    assert by["bf16"]["layers_quantized"] == 0
    assert by["int8wo"]["layers_quantized"] > 0
    # int8: about half of bf16's bytes (scales and biases on top), fp4 about a quarter
    assert 0.45 < by["int8wo"]["stored_gb"] / by["bf16"]["stored_gb"] < 0.55
    assert 0.2 < by["fp4_e2m1"]["stored_gb"] / by["bf16"]["stored_gb"] < 0.3
    assert "size_ok" not in by["int8wo"]  # no target for a model changed by --override


TINY_FLUX = ["num_layers=1", "num_single_layers=1", "attention_head_dim=32", "num_attention_heads=2",
             "joint_attention_dim=64", "pooled_projection_dim=32", "in_channels=16", "axes_dims_rope=[8,12,12]"]


@pytest.mark.parametrize("parallel, batch", [("ulysses", 1), ("batch", 2)])
def test_bench_context_parallel_cpu_smoke(tmp_path, parallel, batch):
    """bench_context_parallel on 2 gloo processes and a tiny Flux: each variant timed on one device
    and under Ulysses-2 (with diffusers' exchange and cquant's, on the same model) or batch parallel
    at its default CFG batch of 2, the parallel output the one-device output up to summation order."""
    pytest.importorskip("diffusers")
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    import bench_context_parallel

    out = tmp_path / "cp.json"
    exchanges = ["diffusers", "cquant", "cquant:1", "cquant+int8"] if parallel == "ulysses" else ["auto"]
    assert bench_context_parallel.main(["--device", "cpu", "--world", "2", "--parallel", parallel, "--variants",
                                        "bf16@cquant,int8wo@cquant+optimize", "--ulysses", ",".join(exchanges),
                                        "--override", *TINY_FLUX, "--height", "64", "--width", "64", "--text-tokens",
                                        "8", "--repeats", "1", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["info"]["world"] == 2 and data["info"]["parallel"] == parallel and data["info"]["batch"] == batch
    rows = {(r["variant"], r["ulysses"]): r for r in data["results"]}
    assert set(rows) == {(v, u) for v in ("bf16@cquant", "int8wo@cquant+optimize") for u in exchanges}
    if parallel == "ulysses":  # cquant's exchange (in 2 head groups or 1): the same output, so the same SQNR
        for v in ("bf16@cquant", "int8wo@cquant+optimize"):
            assert rows[v, "cquant"]["sqnr_db"] == rows[v, "cquant:1"]["sqnr_db"] == rows[v, "diffusers"]["sqnr_db"]
            # the 8-bit wire: every attention call crossed in 8 bits (its bound held), the output close
            int8 = rows[v, "cquant+int8"]
            assert int8["wire_calls"]["int8"] > 0 and int8["wire_calls"]["full"] == 0, int8
            assert int8["sqnr_db"] != rows[v, "cquant"]["sqnr_db"], int8
        for r in rows.values():
            if r["ulysses"] != "cquant+int8":
                assert r["wire_calls"] == {"int8": 0, "full": 0}, r
    for r in rows.values():
        assert r["single_ms"] > 0 and r["parallel_ms"] > 0 and r["speedup"] == r["single_ms"] / r["parallel_ms"]
        # one repeat: one interleaved round of each side
        assert r["single_ms_repeats"] == [r["single_ms"]] and r["parallel_ms_repeats"] == [r["parallel_ms"]]
        assert r["speedup_range"] == [r["speedup"]] * 2
        assert 0 < r["single_host_ms"] and 0 < r["parallel_host_ms"], r
        assert r["sqnr_db"] > 30, r
        # the census: Ulysses moves q, k, v and the output of each of the 2 attention blocks by all-to-all
        # (4 MB-sized calls a block), batch parallelism only gathers; both add host-side ops
        c = r["census"]
        assert c["parallel_host_ops"] > c["single_host_ops"] > 0, c
        calls = {k: n for k, (n, _) in c["collectives"].items()}
        if parallel == "ulysses":
            assert calls.get("all_to_all_single") == 8 and c["collectives"]["all_to_all_single"][1] > 0, c
        else:
            assert "all_to_all_single" not in calls and sum(calls.values()) >= 1, c


TINY_COGVIDEOX = ["num_layers=1", "num_attention_heads=2", "attention_head_dim=32", "text_embed_dim=64",
                  "time_embed_dim=32", "in_channels=4", "out_channels=4"]


def test_bench_context_parallel_cogvideox_batch_cpu_smoke(tmp_path):
    """bench_context_parallel times a tiny CogVideoX video step (with its rotary embedding) under batch
    parallelism on 2 gloo processes: one CFG branch a rank, the output the one-device output up to
    summation order, the report's tokens those of the latent video (3 latent frames of 4x4 patches)."""
    pytest.importorskip("diffusers")
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    import bench_context_parallel

    out = tmp_path / "cp.json"
    variants = ("bf16@cquant", "int8wo@cquant+optimize")
    assert bench_context_parallel.main(["--device", "cpu", "--world", "2", "--model", "cogvideox-5b", "--parallel",
                                        "batch", "--variants", ",".join(variants), "--override", *TINY_COGVIDEOX,
                                        "--height", "64", "--width", "64", "--frames", "9", "--text-tokens", "8",
                                        "--repeats", "1", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    info = data["info"]
    assert info["model"] == "cogvideox-5b" and info["model_class"] == "CogVideoXTransformer3DModel"
    assert (info["batch"], info["frames"], info["latent_frames"], info["image_tokens"]) == (2, 9, 3, 3 * 4 * 4)
    assert [r["variant"] for r in data["results"]] == list(variants)
    for r in data["results"]:
        assert r["single_ms"] > 0 and r["parallel_ms"] > 0 and r["sqnr_db"] > 30, r
        calls = {k: n for k, (n, _) in r["census"]["collectives"].items()}
        assert "all_to_all_single" not in calls and sum(calls.values()) >= 1, r


def test_bench_context_parallel_model_arguments(capsys):
    """Sizes default to the model's usual step; Ulysses / ring are refused early for a model whose
    diffusers class has no context-parallel plan, naming batch parallelism, which works for it."""
    pytest.importorskip("diffusers")
    import bench_context_parallel

    flux = bench_context_parallel.parse_args([])
    assert (flux.height, flux.width, flux.frames, flux.text_tokens, flux.batch) == (1024, 1024, None, 512, 1)
    video = bench_context_parallel.parse_args(["--model", "cogvideox-5b", "--parallel", "batch"])
    assert (video.height, video.width, video.frames, video.text_tokens, video.batch) == (480, 720, 49, 226, 2)
    for parallel in ("ulysses", "ring"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench_context_parallel.parse_args(["--model", "cogvideox-5b", "--parallel", parallel])
        message = capsys.readouterr().err
        assert e.value.code == 2 and f"--parallel {parallel}: diffusers" in message, message
        assert "no context-parallel plan" in message and "CogVideoXTransformer3DModel" in message, message
        assert "--parallel batch works" in message, message
    for argv in (["--frames", "9"], ["--model", "cogvideox-5b", "--parallel", "batch", "--override", "bogus=1"]):
        with pytest.raises(SystemExit):
            bench_context_parallel.parse_args(argv)


def test_bench_context_parallel_busy_time_is_the_union_of_kernel_spans():
    """The split's busy ms counts time where kernels of several streams overlap once, and gaps not at all."""
    import bench_context_parallel

    busy = bench_context_parallel._busy_ms
    assert busy([]) == 0.0
    assert busy([(0.0, 1000.0)]) == 1.0
    assert busy([(500.0, 1500.0), (0.0, 1000.0), (3000.0, 3500.0)]) == 2.0  # overlap once, the gap not at all
    assert busy([(0.0, 4000.0), (1000.0, 2000.0)]) == 4.0  # one span inside another


def test_bench_context_parallel_variant_and_exchange_arguments():
    """+graph (CUDA graphs holding the parallel step's collectives) is taken on CUDA only, +compile not
    at all; --ulysses names exchanges of Ulysses runs."""
    import bench_context_parallel

    args = bench_context_parallel.parse_args(["--variants", "fp8dqrow@cquant+graph"])
    assert args.variants["fp8dqrow@cquant+graph"]["graph"] and args.variants["fp8dqrow@cquant+graph"]["optimize"]
    assert bench_context_parallel.parse_args(["--ulysses", "cquant,diffusers,cquant:1,auto,cquant:2/nccl+int8"]).ulysses \
        == ["cquant", "diffusers", "cquant:1", "auto", "cquant:2/nccl+int8"]
    assert bench_context_parallel.parse_args([]).ulysses == ["auto"]
    for argv in (["--device", "cpu", "--variants", "bf16+graph"], ["--variants", "bf16+compile"],
                 ["--ulysses", "nccl"], ["--ulysses", "cquant:0"], ["--parallel", "ring", "--ulysses", "cquant"],
                 ["--ulysses", "cquant+fp8"], ["--ulysses", "diffusers+int8"], ["--ulysses", "cquant+int8/nccl"]):
        with pytest.raises(SystemExit):
            bench_context_parallel.parse_args(argv)


def test_two_level_study_format_and_report(tmp_path):
    """The two-level format's integers stay what an int8 mainloop needs (|s2 c| <= 112, s2 in 1..16,
    c in -7..7), its rounding error is within half a step, and the report covers every Flux shape."""
    import w4a8_two_level_study as study

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 512, generator=g, dtype=torch.float64)
    w[3, :128] *= 1e-3  # a group far below its row's largest: s2 = 1
    wq, s1, s2, c = study.two_level(w)
    assert torch.equal(c, c.round()) and c.abs().max() <= 7
    assert torch.equal(s2, s2.round()) and s2.min() == 1 and s2.max() <= 16
    assert (s2 * c).abs().max() <= 112
    assert torch.equal(wq, (s1.unsqueeze(2) * s2 * c).view_as(w))
    assert torch.all((w - wq).abs().view_as(c) <= s1.unsqueeze(2) * s2 / 2 * (1 + 1e-12))
    out = tmp_path / "two_level.md"
    results = study.main(["--rows", "4", "--tokens", "4", "--out", str(out)])
    assert {(r["K"], r["N"]) for r in results} == set(study.flux_shapes())
    assert out.read_text().startswith("# Two-level 4-bit weights")
    assert json.loads((tmp_path / "two_level.json").read_text())["results"] == results


def test_int4_quality_study_quick(tmp_path):
    pytest.importorskip("diffusers")
    import int4_quality_study as study

    schemes = ["int8wo", GROUPED[0]]
    ranks = ["--rank-schemes", GROUPED[0], "--ranks", "0,8"]
    out = tmp_path / "study.json"
    result = study.main(["--quick", "--schemes", ",".join(schemes), *ranks, "--out", str(out)])
    names = result["variants"]
    assert json.loads(out.read_text())["variants"] == names
    assert (tmp_path / "study.md").read_text().startswith("# 4-bit quality study")
    assert {r["variant"] for r in result["end_to_end"]} == {"bf16", *names}
    summary = result["layer_summary"]
    for name in names:
        assert summary[name]["layers"] + summary[name]["skipped"] == summary["bf16"]["layers"]
        assert summary[name]["median_db"] < summary["bf16"]["median_db"]
    gains = {g["rank"]: g for g in result["rank_layers"]}
    assert gains[0]["median_gain_db"] == 0 and gains[0]["extra_bytes"] == 0
    assert gains[8]["extra_bytes"] > 0
    synth = {g["rank"]: g for g in result["rank_synthetic"]}
    assert synth[8]["median_gain_db"] > 0  # structured weights: the correction finds something


def test_meta_sizes_equal_the_quantized_models_footprint():
    """bench_flux_step --sizes (meta tensors) counts what a really quantized model stores, as
    diffusers' get_memory_footprint() does: codes, group scales, low-rank factors, biases and the
    layers a group size leaves in bfloat16 (x_embedder's K = 64 at group 128)."""
    pytest.importorskip("diffusers")
    import copy

    import bench_flux_step
    import cquant

    tiny = ["num_layers=1", "num_single_layers=1", "num_attention_heads=4", "attention_head_dim=32",
            "joint_attention_dim=128", "pooled_projection_dim=64", "axes_dims_rope=[8,12,12]"]
    names = ["int4wo", "int4dq_g32", "int4wo_r8", "fp6_e3m2"]
    args = bench_flux_step.parse_args(["--sizes", "--schemes", ",".join(names), "--override", *tiny])
    rows = bench_flux_step.meta_sizes(args, {v: bench_flux_step.parse_variant(v) for v in names})
    master = bench_flux_step.build_master(bench_flux_step.load_config("flux-dev", tiny), 0, 0.02, torch.device("cpu"))
    for r in rows:
        model = copy.deepcopy(master)
        if r["variant"] != "bf16":
            cquant.quantize_(model, _variants.config(r["variant"]), progress=False)
        assert round(r["stored_gb"] * 1e9) == _variants.module_bytes(model) == model.get_memory_footprint(), r


# every comma-list option of the scripts: an empty entry is refused (it was dropped) before any work
_EMPTY_ENTRIES = [
    ("bench_dequant", ["--schemes", "int8wo,,fp8wo"], "--schemes 'int8wo,,fp8wo' has an empty entry"),
    ("bench_gemv", ["--schemes", "int8wo,"], "--schemes 'int8wo,' has an empty entry"),
    ("bench_gemv", ["--group-sizes", "32,,64"], "--group-sizes '32,,64' has an empty entry"),
    ("bench_gemv", ["--group-sizes", "32,x"], "--group-sizes '32,x': expected comma-separated whole numbers"),
    ("bench_linear", ["--schemes", ",int8wo"], "--schemes ',int8wo' has an empty entry"),
    ("bench_linear", ["--group-sizes", "64,"], "--group-sizes '64,' has an empty entry"),
    ("bench_linear", ["--groups", "flux_dev_1024,"], "--groups 'flux_dev_1024,' has an empty entry"),
    ("bench_linear_gelu", ["--schemes", "int8wo,,fp8dqrow"], "--schemes 'int8wo,,fp8dqrow' has an empty entry"),
    ("bench_fused_ops", ["--ops", ","], "--ops ',' names no op"),
    ("bench_flux_step", ["--sizes", "--schemes", "int8wo,,fp4_e2m1"], "--schemes 'int8wo,,fp4_e2m1' has an empty"),
    ("int4_quality_study", ["--schemes", "int4wo,"], "--schemes 'int4wo,' has an empty entry"),
    ("int4_quality_study", ["--ranks", "0,,8"], "--ranks '0,,8' has an empty entry"),
    ("int4_quality_study", ["--parts", "layers,"], "--parts 'layers,' has an empty entry"),
    ("int4_quality_study", ["--layer-blocks", "first,,last"], "--layer-blocks 'first,,last' has an empty entry"),
]


@pytest.mark.parametrize("script,argv,message", _EMPTY_ENTRIES, ids=[f"{s} {a[-1]}" for s, a, _ in _EMPTY_ENTRIES])
def test_scripts_refuse_an_empty_entry_of_a_comma_list(script, argv, message, capsys):
    if script in ("bench_flux_step", "int4_quality_study"):
        pytest.importorskip("diffusers")
    import importlib

    module = importlib.import_module(script)
    run = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_rank_compute_cpu_smoke(tmp_path):
    """bench_rank_compute times a tiny Flux step whole and as one rank of Ulysses-2: the GEMMs on
    the rank's tokens, the attention kernel on all tokens of half the heads."""
    pytest.importorskip("diffusers")
    import bench_rank_compute

    from cquant import attention_backend

    backends = [attention_backend._backend_fn(mode) for mode in (0, 1)]
    out = tmp_path / "rank.json"
    rows, rank_op = bench_rank_compute.main(["--device", "cpu", "--worlds", "2", "--variant", "bf16@cquant+optimize",
                                             "--override", *TINY_FLUX, "--height", "64", "--width", "64",
                                             "--text-tokens", "8", "--repeats", "1", "--iters", "1", "--warmup", "0",
                                             "--out", str(out)])
    assert [r["world"] for r in rows] == [1, 2] and all(r["ms"] > 0 for r in rows)
    assert rows[0]["one_gpu_over_rank"] == 1.0
    tokens = 8 + (64 // 16) ** 2  # text + image tokens of the whole step
    assert rank_op.shapes == {(1, (1, tokens, 2, 32)), (2, (1, tokens, 1, 32))}
    # the process has its own backends back: later attention calls run whole, not as a rank's
    assert [attention_backend._backend_fn(mode) for mode in (0, 1)] == backends
    assert [r["world"] for r in json.loads(out.read_text())["rows"]] == [1, 2]
    with pytest.raises(SystemExit):
        bench_rank_compute.parse_args(["--worlds", "3"])  # 1024 / 16 = 64 columns do not split in 3
    with pytest.raises(SystemExit):
        bench_rank_compute.parse_args(["--height", "1000"])
    with pytest.raises(SystemExit):
        bench_rank_compute.parse_args(["--variant", "fp8dqrow+graph"])  # SDPA: nothing to emulate
