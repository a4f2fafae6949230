"""The text-encoder study of cquant bench: rows, files and argument errors with tiny encoders."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
# transformers' text encoders ask torch whether a CUDA stream is capturing, and on a machine without
# a GPU torch answers through a C++ exception, which aborts the ASan run (scripts/sanitize.sh)
pytestmark = pytest.mark.raises_in_torch_op
pytest.importorskip("transformers")

from cquant.bench.text_encoder import run_study  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread (two OpenMP threads spinning on a busy machine make each op 10 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_quick_study_rows_and_files(tmp_path):
    rows = run_study(("flux-schnell",), ("int8wo",), quick=True, repeats=2, iters=2, out_dir=str(tmp_path))
    assert [(r["text_encoder"], r["scheme"]) for r in rows] == [
        ("text_encoder", "none"), ("text_encoder", "int8wo"), ("text_encoder_2", "none"), ("text_encoder_2", "int8wo")]
    by = {(r["encoder"], r["scheme"]): r for r in rows}
    for kind, output, tokens in (("clip-l", "pooled", 77), ("t5-v1.1-xxl", "embeds", 256)):
        ref, q = by[kind, "none"], by[kind, "int8wo"]
        assert ref["tokens"] == q["tokens"] == tokens and ref["output"] == q["output"] == output
        assert ref["mse"] == 0 and ref["sqnr_db"] == math.inf and "speedup" not in ref
        assert 0 < q["mse"] and 20 < q["sqnr_db"] < 80  # int8 weights: close, not equal
        assert q["weights_gb"] < ref["weights_gb"]
        assert ref["load_peak_gb"] is None  # measured on CUDA devices only
        for r in (ref, q):
            assert r["calls"] == 4 and r["repeats"] == 2
            assert 0 < r["min_ms"] <= r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
            assert r["spread_ms"][0] <= r["median_ms"] <= r["spread_ms"][1]
        assert set(q["speedup"]) == {"median", "min", "max"}
    assert "(wo) kept" in by["t5-v1.1-xxl", "int8wo"]["note"] and "note" not in by["clip-l", "int8wo"]
    saved = json.loads((tmp_path / "text_encoder_study.json").read_text())
    assert len(saved["rows"]) == 4 and saved["rows"][0]["sqnr_db"] == "inf" and saved["environment"]["quick"]
    table = (tmp_path / "text_encoder_study.md").read_text()
    assert table.count("| flux-schnell |") == 4 and "int8wo" in table


def test_quick_study_of_qwen_image_compares_the_prompt_part():
    rows = run_study(("qwen-image",), ("int8wo",), quick=True, repeats=1, iters=1)
    assert [(r["encoder"], r["scheme"], r["tokens"], r["output"]) for r in rows] == [
        ("qwen2.5-vl-7b", "none", 546, "embeds"), ("qwen2.5-vl-7b", "int8wo", 546, "embeds")]
    assert 20 < rows[1]["sqnr_db"] < 80 and rows[1]["weights_gb"] < rows[0]["weights_gb"]


def test_float16_study_keeps_t5_unquantized_with_the_reason(tmp_path):
    rows = run_study(("flux-schnell",), ("int8wo",), dtype=torch.float16, quick=True, repeats=1, iters=1,
                     out_dir=str(tmp_path))
    by = {(r["encoder"], r["scheme"]): r for r in rows}
    assert "overflow float16" in by["t5-v1.1-xxl", "int8wo"]["error"]
    assert "error" not in by["t5-v1.1-xxl", "none"] and "error" not in by["clip-l", "int8wo"]
    assert "overflow float16" in (tmp_path / "text_encoder_study.md").read_text()


def test_study_argument_errors():
    with pytest.raises(ValueError, match="models: 'flux-dve'"):
        run_study(("flux-dve",), quick=True)
    with pytest.raises(ValueError, match="schemes: unknown scheme 'int3'"):
        run_study(("flux-dev",), ("int3",), quick=True)
    with pytest.raises(ValueError, match="repeats"):
        run_study(("flux-dev",), quick=True, repeats=0)


def test_study_table_sizes_in_one_unit_per_column():
    """Tiny encoders' sizes read as plain numbers under an MB header, not as 0.00029 under GB."""
    from cquant.bench.text_encoder import markdown_table

    def row(scheme, gb, **extra):
        return dict(model="flux-dev", text_encoder="text_encoder", encoder="clip-l", scheme=scheme, weights_gb=gb,
                    load_peak_gb=None, median_ms=1.0, spread_ms=[0.9, 1.1], p90_ms=1.2, p99_ms=1.3, mse=0.0,
                    sqnr_db=math.inf, **extra)

    rows = [row("none", 0.00058), dict(row("int8wo", None), error="RuntimeError: boom"), row("fp8dqrow", 0.00029)]
    head, _, none, failed, fp8 = markdown_table(rows).splitlines()
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    assert cells(head)[3:5] == ["weights MB", "load peak GB"]  # nothing measured: the column stays in GB
    assert cells(none)[3:5] == ["0.580", "-"] and cells(fp8)[3:5] == ["0.290", "-"] and "boom" in failed
    full = markdown_table([row("none", 9.52), row("fp8dqrow", 4.9)])
    assert cells(full.splitlines()[0])[3] == "weights GB" and cells(full.splitlines()[3])[3] == "4.900"


@pytest.mark.cuda
def test_full_size_study_on_the_gpu(tmp_path):
    rows = run_study(("flux-schnell",), ("fp8dqrow",), device="cuda", repeats=2, iters=3, out_dir=str(tmp_path))
    t5 = {r["scheme"]: r for r in rows if r["encoder"] == "t5-v1.1-xxl"}
    assert t5["none"]["weights_gb"] == pytest.approx(9.52, rel=0.01)  # 4.76 B bfloat16 parameters
    assert t5["fp8dqrow"]["weights_gb"] < 0.7 * t5["none"]["weights_gb"]
    assert t5["fp8dqrow"]["load_peak_gb"] < t5["none"]["load_peak_gb"]
    assert math.isfinite(t5["fp8dqrow"]["sqnr_db"]) and t5["fp8dqrow"]["sqnr_db"] > 15
