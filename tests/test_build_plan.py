"""What `pip install .` decides before it compiles, on machines this one only pretends to be: a GPU
(a stand-in nvidia-smi on PATH) with or without a CUDA compiler. A GPU machine without nvcc must
get a compiler from the package index or a build that stops and says what to do, never a silent
CPU-only library."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "build_support"))
import cquant_cuda_env as env  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3, 9.0"
T4 = "Tesla T4, 7.5"


def fake_nvidia_smi(folder, gpus, cuda="13.0"):
    """An nvidia-smi that lists `gpus` ("name, cc" lines) and a driver supporting CUDA `cuda`."""
    path = os.path.join(folder, "nvidia-smi")
    listing = "\\n".join(gpus)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                'case "$*" in\n'
                f'  *--query-gpu=name,compute_cap*) printf "{listing}\\n" ;;\n'
                f'  "") echo "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: {cuda} |" ;;\n'
                "  *) exit 6 ;;\n"
                "esac\n")
    os.chmod(path, 0o755)
    return folder


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This process as a machine with the GPUs given to it and no CUDA toolkit anywhere."""
    def make(gpus, cuda="13.0"):
        bin_dir = fake_nvidia_smi(str(tmp_path), gpus, cuda)
        monkeypatch.setenv("PATH", bin_dir + os.pathsep + "/usr/bin" + os.pathsep + "/bin")
        for var in ("CUDA_HOME", "CUDA_PATH", "CQUANT_CUDA", "CQUANT_CUDA_ARCHS", "CQUANT_PREBUILT_LIB"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(env, "TOOLKIT_FALLBACKS", [])
        monkeypatch.setattr(env, "pypi_cuda_roots", lambda: [])
        return bin_dir
    return make


def test_the_stand_in_is_what_the_build_reads(machine):
    machine([H100, T4])
    assert env.detect_gpus() == [("NVIDIA H100 80GB HBM3", "9.0"), ("Tesla T4", "7.5")]
    assert env.usable_gpus(env.detect_gpus()) == [("NVIDIA H100 80GB HBM3", "9.0")]
    assert env.driver_cuda_version() == (13, 0)
    assert env.find_nvcc()[0] is None


def test_gpu_without_compiler_asks_the_package_index_for_one(machine):
    machine([H100], cuda="13.2")
    action, reqs = env.compiler_plan()
    assert action == "pypi"
    assert "nvidia-cuda-nvcc>=13.0,<13.3" in reqs
    assert {r.split(">=")[0] for r in reqs} >= {"nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm",
                                                "nvidia-cuda-runtime"}
    # no cuBLAS headers anywhere here either: the build needs cublasLt.h
    assert any(r.startswith("nvidia-cublas>=13.0,<14") for r in reqs)


def test_the_backend_adds_the_compiler_to_setuptools_requirements(machine, monkeypatch):
    machine([H100])
    monkeypatch.chdir(ROOT)  # a front end runs the backend in the source tree; setuptools reads ./setup.py
    import cquant_backend

    reqs = cquant_backend.get_requires_for_build_wheel()
    assert any(r.startswith("nvidia-cuda-nvcc") for r in reqs)
    assert any(r.startswith("nvidia-cuda-nvcc") for r in cquant_backend.get_requires_for_build_editable())


@pytest.mark.parametrize("cuda", ["12.8", "11.8"])
def test_a_driver_the_index_has_no_compiler_for_stops_with_what_to_do(machine, cuda):
    machine([H100], cuda=cuda)
    action, message = env.compiler_plan()
    assert action == "stop"
    for hint in ("H100", f"CUDA {cuda}", "CUDA_HOME", "CQUANT_CUDA=0", "wheel"):
        assert hint in message


def test_a_named_toolkit_without_nvcc_stops_rather_than_fetching_another(machine, monkeypatch, tmp_path):
    machine([H100])
    empty = tmp_path / "toolkit"
    empty.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty))
    action, message = env.compiler_plan()
    assert action == "stop" and f"CUDA_HOME={empty} has no bin/nvcc" in message


@pytest.mark.parametrize("setting", [{"CQUANT_CUDA": "0"}, {"CQUANT_CUDA": "1"}, {"CQUANT_CUDA_ARCHS": "90a"}])
def test_explicit_choices_fetch_nothing(machine, monkeypatch, setting):
    machine([H100])
    for k, v in setting.items():
        monkeypatch.setenv(k, v)
    assert env.compiler_plan() == ("none", "")


def test_no_gpu_or_only_old_ones_fetch_nothing(machine):
    machine([])
    assert env.compiler_plan() == ("none", "")
    machine([T4])
    assert env.compiler_plan() == ("none", "")


def test_a_found_compiler_is_used(machine, tmp_path, monkeypatch):
    machine([H100])
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert env.find_nvcc() == (str(nvcc), "CUDA_HOME")
    assert env.compiler_plan() == ("none", "")


def test_the_compiler_packages_layout_is_found(machine, monkeypatch, tmp_path):
    """nvidia-cuda-nvcc installs nvidia/cu13/bin/nvcc; cuBLAS's header may sit in another
    environment's nvidia/cu13/include (the one torch was installed into)."""
    machine([H100])
    build_env, user_env = tmp_path / "build" / "nvidia" / "cu13", tmp_path / "user" / "nvidia" / "cu13"
    for d in (build_env / "bin", build_env / "include", build_env / "lib", user_env / "include"):
        d.mkdir(parents=True)
    (build_env / "bin" / "nvcc").write_text("")
    (build_env / "lib" / "libcudart_static.a").write_text("")
    (user_env / "include" / "cublasLt.h").write_text("")
    monkeypatch.setattr(env, "pypi_cuda_roots", lambda: [str(build_env), str(user_env)])
    nvcc, where = env.find_nvcc()
    assert nvcc == str(build_env / "bin" / "nvcc") and "nvidia-cuda-nvcc" in where
    assert env.include_dirs(nvcc) == [str(build_env / "include"), str(user_env / "include")]
    assert env.library_dir(nvcc) == str(build_env / "lib")
    assert env.has_cublaslt_header()


def _setup_build(tmp_path, gpus, extra_env):
    """Run setup.py's library build on this checkout as a machine with `gpus`; (exit code, output).
    It stops before compiling anything when it must stop."""
    bin_dir = fake_nvidia_smi(str(tmp_path), gpus)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("CQUANT_", "CUDA_"))}
    run_env.update(PATH=bin_dir + os.pathsep + run_env.get("PATH", ""), **extra_env)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "build"),
                        "--build-lib", str(tmp_path / "lib")], cwd=ROOT, env=run_env, capture_output=True, text=True,
                       timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_setup_stops_on_a_gpu_machine_without_a_compiler(tmp_path):
    """The real build, not its helpers: a GPU, CUDA_HOME naming a folder without nvcc. It must
    stop before compiling, with the reason and the ways out, and leave no library behind."""
    empty = tmp_path / "no-toolkit"
    empty.mkdir()
    code, out = _setup_build(tmp_path, [H100], {"CUDA_HOME": str(empty)})
    assert code != 0
    for hint in ("GPU is present", "H100", "no CUDA compiler", "CUDA_HOME", "CQUANT_CUDA=0"):
        assert hint in out, out
    assert "compiled" not in out
    assert not list((tmp_path / "lib").rglob("libcquant.so"))


def test_setup_builds_cpu_only_on_request_even_with_a_gpu(tmp_path):
    empty = tmp_path / "no-toolkit"
    empty.mkdir()
    code, out = _setup_build(tmp_path, [H100], {"CUDA_HOME": str(empty), "CQUANT_CUDA": "0"})
    assert code == 0, out
    assert "CPU-only (CQUANT_CUDA=0)" in out
    assert list((tmp_path / "lib").rglob("libcquant.so"))


def test_a_malformed_cuda_define_stops_the_build(tmp_path):
    """CQUANT_CUDA_DEFINES takes NAME or NAME=VALUE words only: anything else stops the build
    before it compiles, naming the word."""
    code, out = _setup_build(tmp_path, [], {"CQUANT_CUDA": "0", "CQUANT_CUDA_DEFINES": "CQ_WO_SM90_PAIR_EXTRA=0 CQ_X;rm"})
    assert code != 0
    assert "CQUANT_CUDA_DEFINES" in out and "'CQ_X;rm'" in out, out
    assert "compiled" not in out
