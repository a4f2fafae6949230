"""`cquant info`: the build, the CUDA installation, the GPUs and what runs on each (the text bug
reports ask for), and the library's size budget."""

import json
import os
import subprocess
import sys

import pytest

import cquant
from cquant import info, ops

from test_build_plan import H100, fake_nvidia_smi

# what a build holds and says of itself: run against every build CI makes (tests/test_per_build.py)
pytestmark = pytest.mark.per_build

# Size budgets of libcquant in MB (README, Build), by (arches of the machine code, PTX arch).
LIBRARY_BUDGET_MB = {("", ""): 2, ("90a", ""): 30, ("90a", "90"): 30, ("80;89;90a", "90"): 90}
# Any other CUDA build: this much per arch of machine code or PTX.
LIBRARY_BUDGET_MB_PER_ARCH = 30


def test_the_library_keeps_its_size_budget():
    b = ops.build_info()
    lib = os.path.join(os.path.dirname(cquant.__file__), "libcquant.so")
    archs = b["archs"].split(";") if b["archs"] else []
    budget = LIBRARY_BUDGET_MB.get((b["archs"], b["ptx"]),
                                   LIBRARY_BUDGET_MB_PER_ARCH * (len(archs) + bool(b["ptx"])))
    size_mb = os.path.getsize(lib) / 1e6
    print(f"libcquant: {size_mb:.1f} MB for arches {b['archs'] or 'none'} + PTX {b['ptx'] or 'none'}")
    assert size_mb <= budget, f"{lib} is {size_mb:.1f} MB; the budget of this build ({b}) is {budget} MB"


def test_build_info_says_what_was_built():
    b = ops.build_info()
    assert b["version"] == cquant.__version__
    assert b["cuda"] == ops.built_with_cuda()
    if b["cuda"]:
        assert b["archs"] and all(a.rstrip("af").isdigit() for a in b["archs"].split(";"))
        assert b["cuda_version"] >= 12000
    else:
        assert (b["archs"], b["ptx"], b["cuda_version"]) == ("", "", 0)
        with pytest.raises(NotImplementedError, match="CPU-only"):
            ops.cuda_runtime_info()
        with pytest.raises(NotImplementedError, match="CPU-only"):
            ops.cuda_device(0)


def _run_info(args=(), path_prefix=None):
    env = dict(os.environ)
    if path_prefix:
        env["PATH"] = path_prefix + os.pathsep + env.get("PATH", "")
    r = subprocess.run([sys.executable, "-m", "cquant", "info", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_info_prints_the_build_and_the_versions():
    out = _run_info()
    b = ops.build_info()
    assert out.startswith(f"cquant {cquant.__version__}\n")
    assert ("CPU-only" in out) != b["cuda"]
    assert "Python " in out and "libraries" in out
    import torch

    assert f"torch {torch.__version__.split('+')[0]}" in out


def test_info_json_is_one_object_with_the_same_facts():
    d = json.loads(_run_info(["--json"]))
    assert d["cquant"]["version"] == cquant.__version__
    assert d["cquant"]["cuda"] == ops.built_with_cuda()
    assert set(d) >= {"cquant", "runtime", "gpus", "libraries", "settings", "python"}


@pytest.mark.skipif(ops.built_with_cuda(), reason="a CUDA build asks CUDA, not nvidia-smi, for the GPUs")
def test_a_cpu_only_build_on_a_gpu_machine_says_so(tmp_path):
    out = _run_info(path_prefix=fake_nvidia_smi(str(tmp_path), [H100]))
    assert "GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0)" in out
    assert "CPU-only" in out.split("GPU:")[1]
    assert "none run" in out


def _gpu(name, cc, *, kernels=True, sm90a=False, why_not=""):
    return {"name": name, "cc": cc, "sms": 132, "total_memory": 80 << 30, "kernels": kernels, "sm90a": sm90a,
            "why_not": why_not}


@pytest.fixture
def cuda_build(monkeypatch):
    """info as a CUDA build sees two GPUs: an H100 and an A100."""
    monkeypatch.setattr(ops, "build_info", lambda: {"version": cquant.__version__, "cuda": True,
                                                    "archs": "80;89;90a", "ptx": "90", "cuda_version": 13000})
    monkeypatch.setattr(ops, "cuda_runtime_info", lambda: {
        "runtime_version": 13000, "driver_version": 13000, "device_count": 2, "cublaslt_version": 130100,
        "cublaslt_path": "/x/libcublasLt.so.13", "cublaslt_error": ""})
    gpus = [_gpu("NVIDIA H100 80GB HBM3", 90, sm90a=True), _gpu("NVIDIA A100-SXM4-80GB", 80)]
    monkeypatch.setattr(ops, "cuda_device", lambda i: gpus[i])


def test_per_gpu_schemes_and_attention_follow_the_floors(cuda_build, monkeypatch):
    monkeypatch.setattr(ops, "settings", lambda: {"attn_disabled": (), "attn_sm90": "auto"})
    d = info.collect()
    h100, a100 = d["gpus"]
    assert all(why is None for why in h100["schemes"].values())
    assert h100["attention"]["bf16/fp16"]["runs"] and "sm_90a wgmma" in h100["attention"]["bf16/fp16"]["detail"]
    assert a100["schemes"]["int8wo"] is None and a100["schemes"]["int4wo"] is None
    assert "needs compute capability 8.9" in a100["schemes"]["fp8dqrow"]
    assert not a100["attention"]["int8"]["runs"] and "8.9" in a100["attention"]["int8"]["detail"]
    assert "sm_90a" not in a100["attention"]["bf16/fp16"]["detail"]
    text = info.render(d)
    assert "machine code sm_80, sm_89, sm_90a; PTX compute_90" in text
    assert "cuBLASLt     13.1.0 (/x/libcublasLt.so.13)" in text
    assert "GPU 1: NVIDIA A100-SXM4-80GB (compute capability 8.0" in text
    assert "fp8dqrow: no, needs compute capability 8.9 (sm_89); this GPU is 8.0" in text


def test_switched_off_attention_kernels_are_reported(cuda_build, monkeypatch):
    monkeypatch.setattr(ops, "settings", lambda: {"attn_disabled": ("sm90", "int8"), "attn_sm90": "auto"})
    monkeypatch.setenv("CQUANT_ATTN_DISABLE", "sm90,int8")
    h100 = info.collect()["gpus"][0]
    assert h100["attention"]["bf16/fp16"]["runs"] and "sm_90a" not in h100["attention"]["bf16/fp16"]["detail"]
    assert not h100["attention"]["int8"]["runs"] and "CQUANT_ATTN_DISABLE" in h100["attention"]["int8"]["detail"]


def test_a_gpu_without_kernel_image_runs_nothing(cuda_build, monkeypatch):
    monkeypatch.setattr(ops, "settings", lambda: {"attn_disabled": (), "attn_sm90": "auto"})
    monkeypatch.setattr(ops, "cuda_device", lambda i: _gpu("NVIDIA B200", 100, kernels=False,
                                                           why_not="this cquant build has no kernel image"))
    d = info.collect()
    assert all(g["schemes"]["int8wo"] == "this cquant build has no kernel image" for g in d["gpus"])
    assert "none run here: this cquant build has no kernel image" in info.render(d)


def test_user_settings_are_listed_not_the_ones_cquant_sets_itself():
    code = ("import os; os.environ.pop('CQUANT_CUBLASLT_PATH', None); os.environ['CQUANT_GEMV_PERSISTENT'] = '0';"
            "import cquant.info as i; print(i.collect()['settings'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CQUANT_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'CQUANT_GEMV_PERSISTENT': '0'}"


def test_settings_libcquant_cannot_read_are_said_to_be_invalid_with_what_is_used():
    """An invalid value was listed as if it were in force; libcquant ignores it and keeps its default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CQUANT_")}
    env.update(CQUANT_WO_CHUNK_MB="abc", CQUANT_GEMV_PERSISTENT="yes", CQUANT_ATTN_DISABLE="mma, flash",
               CQUANT_SHARE_ACTIVATIONS="false", CQUANT_GROUP4_DECODE_M="0", CQUANT_ATTN_SM90="1",
               CQUANT_WO_DECODE_M="4k", CQUANT_WO_SPLIT_K="no")
    r = subprocess.run([sys.executable, "-m", "cquant", "info"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.lstrip().startswith("settings"))
    for expected in ("CQUANT_WO_CHUNK_MB=abc (invalid: expected a positive integer; the default, 128 MiB, is used)",
                     "CQUANT_GEMV_PERSISTENT=yes (invalid: expected 0 or 1; the measured choice is used)",
                     "CQUANT_ATTN_DISABLE=mma, flash (invalid: 'flash' names no kernel",
                     "CQUANT_SHARE_ACTIVATIONS=false (invalid: expected 0 or 1; the default, 1 (sharing on), is used)",
                     "CQUANT_GROUP4_DECODE_M=0 (invalid: expected a positive integer; the measured choice is used)",
                     "CQUANT_WO_DECODE_M=4k (invalid: expected a positive integer; the measured choice is used)",
                     "CQUANT_WO_SPLIT_K=no (invalid: expected 0 or 1; the default, 1 (split where SMs would idle), is used)",
                     "CQUANT_ATTN_SM90=1,"):
        assert expected in line, line
    ok = {"CQUANT_WO_CHUNK_MB": "64", "CQUANT_GROUP4_DECODE_M": "512", "CQUANT_ATTN_DISABLE": "mma, int8",
          "CQUANT_GEMV_PERSISTENT": "0", "CQUANT_SHARE_ACTIVATIONS": "0", "CQUANT_DISABLE_WGMMA": "yes"}
    parsed = {"wo_chunk_mib": 64, "group4_decode_min_m": 512}
    assert info.invalid_settings(ok, parsed) == {}
    assert set(info.invalid_settings({"CQUANT_WO_CHUNK_MB": "2000000000"}, {"wo_chunk_mib": 128})) == {
        "CQUANT_WO_CHUNK_MB"}  # past libcquant's bound: it keeps the default


def test_torch_keeps_its_local_build_tag(tmp_path):
    """torch's PyPI wheels say 2.11.0 in their metadata and 2.11.0+cu130 in torch.__version__;
    the tag tells which CUDA torch brings. Read without importing torch."""
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    (torch_dir / "__init__.py").write_text("raise ImportError('cquant info imported torch')\n")
    (torch_dir / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda = '13.0'\n")
    meta = tmp_path / "torch-2.11.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-m", "cquant", "info"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "libraries    torch 2.11.0+cu130," in r.stdout


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`cquant info | head -1`: the pipe closes before cquant writes; the command ended in a
    BrokenPipeError traceback (and another at exit, flushing stdout)."""
    p = subprocess.Popen([sys.executable, "-m", "cquant", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before cquant has written anything: its first write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
