"""`python -m cquant demo` and the command line (CPU, small settings)."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
PIL = pytest.importorskip("PIL")

from cquant import __main__ as cli  # noqa: E402
from cquant import demo  # noqa: E402
from tolerances import INT4_MODEL_SQNR_FLOOR_DB, MODEL_SQNR_FLOOR_DB  # noqa: E402


@pytest.fixture(autouse=True)
def _native_attention():
    import tiny_models

    with tiny_models.native_attention():
        yield


def test_demo_runs_every_requested_scheme(tmp_path):
    out, js = tmp_path / "demo.png", tmp_path / "demo.json"
    results = demo.main(["--steps", "2", "--height", "64", "--width", "96", "--quant", "int8wo,fp8dqrow,fp6_e3m2",
                         "--device", "cpu", "--out", str(out), "--json", str(js)])
    assert [r["variant"] for r in results] == ["float32", "int8wo", "fp8dqrow", "fp6_e3m2"]
    image = PIL.Image.open(out)
    assert image.size[0] == 4 * 96 and image.size[1] > 64
    data = json.loads(js.read_text())
    assert data["device"] == "cpu" and data["reference"] == "float32"
    ref_bytes = results[0]["weight_bytes"]
    for r in results[1:]:
        # the demo's model is deeper and wider than the test models, and does better than their floors
        assert r["sqnr_db"] > MODEL_SQNR_FLOOR_DB[r["scheme"]], r
        assert r["weight_bytes"] < ref_bytes / 3 and r["step_ms"] > 0 and r["skipped"] == 0
    assert results[3]["weight_bytes"] < results[1]["weight_bytes"]  # 6-bit codes are smaller than 8-bit


def test_demo_shows_the_4_bit_schemes_with_their_groups(tmp_path, capsys):
    assert {"int4wo", "int4dq"} <= set(demo.DEMO_SCHEMES) <= set(demo.SCHEME_NAMES)
    results = demo.main(["--steps", "1", "--height", "32", "--width", "32", "--quant", "int4wo,int4dq_g64",
                         "--device", "cpu", "--out", str(tmp_path / "int4.png")])
    assert [r["variant"] for r in results] == ["float32", "int4wo", "int4dq_g64"]
    out = capsys.readouterr().out
    assert "group 128" in out and "group 64" in out
    # the bundled model's 64-wide x_embedder is not a whole number of 128-column groups
    assert results[1]["skipped"] == 1 and results[2]["skipped"] == 0
    for r in results[1:]:
        assert r["sqnr_db"] > INT4_MODEL_SQNR_FLOOR_DB[r["scheme"].partition("_g")[0]]
        assert r["weight_bytes"] < results[0]["weight_bytes"] / 5


def test_demo_with_a_local_checkpoint(tmp_path):
    pipe, _ = demo.build_mini_pipeline(seed=3)
    pipe.save_pretrained(tmp_path / "flux-mini")
    results = demo.main(["--model", str(tmp_path / "flux-mini"), "--steps", "1", "--height", "32", "--width", "32",
                         "--quant", "fp8wo", "--device", "cpu", "--out", str(tmp_path / "local.png")])
    # on the CPU the checkpoint's bfloat16 weights run (and are compared) in float32
    assert [r["variant"] for r in results] == ["float32", "fp8wo"]
    assert results[1]["sqnr_db"] > MODEL_SQNR_FLOOR_DB["fp8wo"]


def test_demo_rejects_bad_arguments(capsys):
    for argv, match in ((["--quant", "int3wo"], "unknown quantization scheme 'int3wo'"),
                        (["--quant", "int4wo_g48"], "group_size = 48"),
                        (["--height", "100"], "multiple of 16"), (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_command_line(capsys):
    assert cli.main(["--help"]) == 0 and "demo" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "cquant", "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--quant" in out.stdout and "--model" in out.stdout


def test_demo_on_cuda_without_a_usable_gpu_says_what_to_do(monkeypatch):
    """`cquant demo --device cuda` where it cannot run exits with a message, not a traceback."""
    import cquant

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="finds no CUDA GPU|built without CUDA.*--device cpu"):
        demo.check_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="there are 1 CUDA devices"):
        demo.check_device(torch.device("cuda:3"))
    monkeypatch.setattr(cquant._C, "built_with_cuda", lambda: False)
    with pytest.raises(SystemExit, match="built CPU-only.*--device cpu"):
        demo.check_device(torch.device("cuda"))
    demo.check_device(torch.device("cpu"))
    with pytest.raises(SystemExit, match="--device mps: expected cpu or cuda"):
        demo.check_device(torch.device("mps"))
