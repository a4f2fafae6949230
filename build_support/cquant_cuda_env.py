"""What the build of cquant finds on the machine: the GPUs present, the CUDA version their driver
supports, a CUDA compiler (a toolkit, or the `nvidia-cuda-nvcc` package from the package index)
and the headers and libraries beside it. Used by setup.py and by the build backend
(cquant_backend.py), which asks for the compiler package when a GPU is present and no toolkit is.

Standard library only: the build backend imports it before any build requirement is installed.
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

# Compute capability -> arch to build: Hopper's wgmma kernels need the arch-specific sm_90a.
ARCH_OF_CAPABILITY = {"9.0": "90a"}
# cquant's kernels need mma.sync with bf16 (compute capability 8.0); older GPUs run none of them.
MIN_CAPABILITY = (8, 0)
# CUDA majors whose compiler the package index has in the layout below (nvidia/cu<major>/...)
# and that cquant's kernels are built and tested with.
PYPI_CUDA_MAJORS = (13,)


def _capability(cap):
    major, _, minor = cap.partition(".")
    return int(major), int(minor or 0)


def detect_gpus():
    """[(name, compute capability "9.0")] of the GPUs nvidia-smi lists; [] without nvidia-smi or a
    driver. (A build runs in an isolated environment without torch, so torch cannot be asked.)"""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    gpus = []
    for line in r.stdout.splitlines():
        name, _, cap = line.rpartition(",")
        if re.fullmatch(r"\d+\.\d+", cap.strip()):
            gpus.append((name.strip(), cap.strip()))
    return gpus


def usable_gpus(gpus):
    """The GPUs cquant's kernels can run on (compute capability 8.0 or newer)."""
    return [(name, cap) for name, cap in gpus if _capability(cap) >= MIN_CAPABILITY]


def describe_gpus(gpus):
    return ", ".join(sorted({f"{name} (sm_{cap.replace('.', '')})" for name, cap in gpus}))


def wanted_arch(cap):
    return ARCH_OF_CAPABILITY.get(cap, cap.replace(".", ""))


def driver_cuda_version():
    """(major, minor) of the newest CUDA the driver supports, from nvidia-smi's banner; None if
    it cannot be read."""
    try:
        r = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", r.stdout or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def package_dirs():
    """site-packages folders to look in for the CUDA packages of the package index: this
    interpreter's path (a build environment's own packages) and its installation's purelib and
    platlib (the packages of the environment being installed into, e.g. those torch brought)."""
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and os.path.isdir(p):
            dirs.append(p)
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen:
            seen.add(real)
            out.append(d)
    return out


def pypi_cuda_roots():
    """nvidia/cu<major> folders of installed CUDA packages, newest major first."""
    roots = []
    for d in package_dirs():
        roots += glob.glob(os.path.join(d, "nvidia", "cu[0-9]*"))
    return sorted(set(roots), key=lambda r: -int(re.sub(r"\D", "", os.path.basename(r)) or 0))


# Where a toolkit is looked for after CUDA_HOME / CUDA_PATH and PATH (tests replace this).
TOOLKIT_FALLBACKS = ["/usr/local/cuda/bin/nvcc"]


def find_nvcc():
    """(path of nvcc, where it was found) or (None, why none): CUDA_HOME or CUDA_PATH when set
    (and only there: a toolkit named explicitly is not second-guessed), else PATH, the usual
    toolkit folder, then the `nvidia-cuda-nvcc` package in this environment."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
            if os.path.exists(nvcc):
                return nvcc, var
            return None, f"{var}={home} has no bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc, "PATH"
    for nvcc in TOOLKIT_FALLBACKS:
        if os.path.exists(nvcc):
            return nvcc, os.path.dirname(os.path.dirname(nvcc))
    for root in pypi_cuda_roots():
        nvcc = os.path.join(root, "bin", "nvcc")
        if os.path.exists(nvcc):
            return nvcc, "the nvidia-cuda-nvcc package"
    return None, "no nvcc on PATH, in CUDA_HOME, in /usr/local/cuda or from the nvidia-cuda-nvcc package"


def toolkit_root(nvcc):
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _first_with(dirs, name):
    return next((d for d in dirs if os.path.exists(os.path.join(d, name))), None)


def include_dirs(nvcc):
    """Header folders for the C files that include CUDA headers: the toolkit's, then wherever
    cublasLt.h is if the toolkit lacks it (a compiler from the package index has no cuBLAS; the
    nvidia-cublas package torch installs has the header)."""
    root = os.path.join(toolkit_root(nvcc), "include")
    dirs = [root]
    if not os.path.exists(os.path.join(root, "cublasLt.h")):
        extra = _first_with([os.path.join(r, "include") for r in pypi_cuda_roots()], "cublasLt.h")
        if extra:
            dirs.append(extra)
    return dirs


def library_dir(nvcc):
    """The folder holding libcudart_static.a (lib64 in a toolkit, lib in the packages)."""
    root = toolkit_root(nvcc)
    cands = [os.path.join(root, "lib64"), os.path.join(root, "lib")]
    cands += [os.path.join(r, "lib") for r in pypi_cuda_roots()]
    return _first_with(cands, "libcudart_static.a") or cands[0]


def has_cublaslt_header(nvcc=None):
    dirs = [os.path.join(toolkit_root(nvcc), "include")] if nvcc else []
    dirs += [os.path.join(r, "include") for r in pypi_cuda_roots()]
    return _first_with(dirs, "cublasLt.h") is not None


def pypi_compiler_requirements(cuda):
    """Requirements that bring a CUDA compiler matching a driver that supports CUDA `cuda`
    (major, minor): nvcc with its front end, NVVM and runtime headers of the same release line,
    and cuBLAS's headers where the environment has none."""
    major, minor = cuda
    spec = f">={major}.0,<{major}.{minor + 1}"
    reqs = [f"nvidia-cuda-nvcc{spec}", f"nvidia-cuda-crt{spec}", f"nvidia-nvvm{spec}", f"nvidia-cuda-runtime{spec}"]
    if not has_cublaslt_header():
        reqs.append(f"nvidia-cublas>={major}.0,<{major + 1}")
    return reqs


def compiler_plan():
    """What a build without a toolkit should do, from the environment and the GPUs present:
    ("none", "") when no compiler is needed or one is found, ("pypi", reqs) to fetch one from the
    package index, or ("stop", message) when none can be had."""
    mode = os.environ.get("CQUANT_CUDA", "").strip()
    if mode == "0" or mode == "1" or os.environ.get("CQUANT_CUDA_ARCHS") or os.environ.get("CQUANT_PREBUILT_LIB"):
        return "none", ""  # explicit choices are setup.py's to check
    gpus = usable_gpus(detect_gpus())
    if not gpus:
        return "none", ""
    nvcc, why = find_nvcc()
    if nvcc:
        return "none", ""
    cuda = driver_cuda_version()
    if any(os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")):  # a toolkit named, but not there
        return "stop", no_compiler_message(gpus, cuda, why)
    if cuda and cuda[0] in PYPI_CUDA_MAJORS:
        return "pypi", pypi_compiler_requirements(cuda)
    return "stop", no_compiler_message(gpus, cuda, why)


def no_compiler_message(gpus, cuda=None, why=None):
    drv = f" (its driver supports CUDA {cuda[0]}.{cuda[1]})" if cuda else ""
    return (f"cquant: a GPU is present, {describe_gpus(gpus)}{drv}, but no CUDA compiler was found"
            f"{' (' + why + ')' if why else ''}, so the CUDA kernels cannot be built. Either:\n"
            "  - install the prebuilt wheel, which needs no compiler (README, Install);\n"
            "  - point CUDA_HOME at a CUDA 13 toolkit (the folder holding bin/nvcc), or put its nvcc on PATH;\n"
            "  - `pip install nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime` into this "
            "environment and build with --no-build-isolation;\n"
            "  - or build CPU-only on purpose with CQUANT_CUDA=0.")
