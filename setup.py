"""Build of cquant: libcquant (C11 + CUDA) and the cquant._C extension linked to it.

Which CUDA kernels are built (compiling them takes minutes per GPU arch):
  unset                    the arches of the GPUs present (asked from nvidia-smi); no GPU, or
                           no nvcc: CPU-only, in seconds
  CQUANT_CUDA=0            CPU-only, even where a GPU and nvcc are found
  CQUANT_CUDA=1            every arch of CQUANT_CUDA_ARCHS (default 80;89;90a), e.g. for a wheel
                           built on a machine without a GPU; fails if nvcc is missing
  CQUANT_CUDA_ARCHS        ';'- or ','-separated arches, e.g. "90a" or "80;89;90a": overrides the
                           list (and, set, asks for CUDA as CQUANT_CUDA=1 does)
Every CUDA build also embeds PTX of its highest arch without the 'a' suffix (compute_90 for
90a), which the driver compiles for GPUs newer than the listed ones (sm_90a PTX would only run
on sm_90 itself).

Other settings:
  CQUANT_PREBUILT_LIB      path of an already built libcquant.so to reuse
  CQUANT_SANITIZE          e.g. "address,undefined": host code built with -fsanitize
  CUDA_HOME / CUDA_PATH    toolkit root (default: the one holding nvcc on PATH)
  MAX_JOBS                 parallel compile jobs (default: CPU count)
"""

import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import sysconfig
import time

import numpy

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libcquant.so"
AUTOLOAD_PTH = "cquant-autoload.pth"
DEFAULT_ARCHS = "80;89;90a"
# compute capability -> arch to build: Hopper's wgmma kernels need the arch-specific sm_90a
ARCH_OF_CAPABILITY = {"9.0": "90a"}


def log(msg):
    print(f"libcquant: {msg}", flush=True)


def find_nvcc():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def parse_archs(text):
    archs = [a.strip().lower().replace("sm_", "").replace("compute_", "") for a in text.replace(",", ";").split(";")]
    archs = [a for a in archs if a]
    for a in archs:
        if not a.rstrip("af").isdigit():
            raise SystemExit(f"CQUANT_CUDA_ARCHS: {a!r} is not an arch; expected numbers such as 80, 89, 90a")
    if not archs:
        raise SystemExit("CQUANT_CUDA_ARCHS is empty; expected arches such as 80;89;90a")
    return sorted(set(archs), key=lambda a: (int(a.rstrip("af")), a))


def detect_gpus():
    """[(name, compute capability "9.0")] of the GPUs nvidia-smi lists; [] without nvidia-smi or a
    driver. (pip builds in an isolated environment without torch, so torch cannot be asked.)"""
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
        if cap.strip().replace(".", "").isdigit():
            gpus.append((name.strip(), cap.strip()))
    return gpus


def nvcc_archs(nvcc):
    """The real arches (sm_XX) this nvcc compiles for, as arch strings ("90", "100", ...)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {tok[3:] for tok in out.split() if tok.startswith("sm_")} or None


def cuda_plan():
    """(nvcc or None, arches): what to build, from the environment and the GPUs present."""
    mode = os.environ.get("CQUANT_CUDA", "").strip()
    if mode == "0":
        log("CPU-only (CQUANT_CUDA=0)")
        return None, []
    if mode not in ("", "1"):
        raise SystemExit(f"CQUANT_CUDA={mode!r}; expected 0 (CPU-only), 1 (every listed arch) or unset (the GPUs present)")
    listed = os.environ.get("CQUANT_CUDA_ARCHS")
    nvcc = find_nvcc()
    if mode == "1" or listed:
        why = "CQUANT_CUDA_ARCHS" if listed else "CQUANT_CUDA=1"
        if nvcc is None:
            raise SystemExit(f"{why} asks for the CUDA kernels, but nvcc was not found: put it on PATH or set CUDA_HOME")
        archs = parse_archs(listed or DEFAULT_ARCHS)
        log(f"CUDA for sm_{', sm_'.join(archs)} ({why}), nvcc {nvcc}")
        return nvcc, archs
    gpus = detect_gpus()
    if not gpus:
        log("CPU-only: no GPU found (nvidia-smi absent or failing). CQUANT_CUDA=1 builds the CUDA kernels anyway")
        return None, []
    names = ", ".join(sorted({f"{name} (sm_{cap.replace('.', '')})" for name, cap in gpus}))
    if nvcc is None:
        log(f"CPU-only: GPU present ({names}) but nvcc was not found; put it on PATH or set CUDA_HOME, then reinstall")
        return None, []
    wanted = sorted({ARCH_OF_CAPABILITY.get(cap, cap.replace(".", "")) for _, cap in gpus})
    known = nvcc_archs(nvcc)
    archs = [a for a in wanted if known is None or a.rstrip("af") in known]
    if not archs:
        log(f"CPU-only: nvcc {nvcc} compiles for none of the GPUs present ({names}); CQUANT_CUDA_ARCHS=<the newest "
            "arch it knows> embeds PTX that the driver compiles for a newer GPU")
        return None, []
    log(f"CUDA for the GPUs present, {names}: sm_{', sm_'.join(archs)}; nvcc {nvcc}")
    return nvcc, archs


def portable_ptx_arch(archs):
    """The arch whose PTX is embedded: the highest listed, without 'a' / 'f' (arch- and
    family-specific PTX runs only on that arch / family)."""
    return str(max(int(a.rstrip("af")) for a in archs))


def cuda_arch_flags(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    ptx = portable_ptx_arch(archs)
    flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    if "90a" in archs:
        flags.append("-DCQ_BUILD_SM90A")  # host code may select the wgmma kernels
    return flags


def object_path(out, src, flags):
    """Object file of src in out, named after the flags too: a build with other flags (CPU-only,
    sanitizers, other arches) never links objects of an earlier one."""
    tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
    return os.path.join(out, f"{src.replace('/', '_')}.{tag}.o")


def newer(src, obj, deps_mtime):
    return not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src), deps_mtime)


def run(cmd):
    """Run a command in ROOT; (exit status, its output, seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return r.returncode, r.stdout, time.perf_counter() - t0


def compile_all(jobs, workers):
    """Compile [(source, command)] on `workers` threads, slowest (largest) sources first, with a
    progress line as each finishes; stop at the first failure, showing its command and output."""
    jobs = sorted(jobs, key=lambda j: -os.path.getsize(os.path.join(ROOT, j[0])))
    n, t0 = len(jobs), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run, cmd): (src, cmd) for src, cmd in jobs}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            (src, cmd), (rc, output, seconds) = futures[fut], fut.result()
            log(f"[{i}/{n}] {'compiled' if rc == 0 else 'FAILED'} {src} ({seconds:.0f} s)")
            if output.strip():
                print(output.rstrip(), flush=True)
            if rc:
                pool.shutdown(wait=False, cancel_futures=True)
                raise SystemExit(f"libcquant: compiling {src} failed (exit {rc}):\n  {' '.join(cmd)}")
    if n:
        log(f"compiled {n} files in {time.perf_counter() - t0:.0f} s")


class BuildLibAndExtension(build_ext):
    """Build libcquant first, place it next to cquant._C, link _C to it with rpath $ORIGIN."""

    def run(self):
        lib = os.environ.get("CQUANT_PREBUILT_LIB") or self.build_libcquant()
        pkg_dir = os.path.join(ROOT, "python", "cquant") if self.inplace else os.path.join(self.build_lib, "cquant")
        os.makedirs(pkg_dir, exist_ok=True)
        target = os.path.join(pkg_dir, LIB_NAME)
        if os.path.abspath(lib) != os.path.abspath(target):
            shutil.copyfile(lib, target)
        for ext in self.extensions:
            ext.library_dirs = [os.path.dirname(os.path.abspath(lib))]
        super().run()

    def build_libcquant(self):
        out = os.path.join(os.path.abspath(self.build_temp), "libcquant")
        os.makedirs(out, exist_ok=True)
        cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
        nvcc, archs = cuda_plan()
        sanitize = os.environ.get("CQUANT_SANITIZE")
        # hidden visibility: libcquant exports what cquant.h marks CQ_API, nothing else
        cflags = ["-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-Wall", "-Wextra", "-Icsrc/include",
                  "-Icsrc"]
        if sanitize:
            cflags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g", "-fno-sanitize-recover=all"]
        c_sources = sorted(glob.glob("csrc/*.c", root_dir=ROOT))
        cu_sources = []
        if nvcc:
            cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
            cflags += ["-DCQ_WITH_CUDA", "-Ikernels", f"-I{cuda_home}/include"]
            # host C of the CUDA layer (cuBLASLt glue, device queries): the C compiler, CUDA headers
            c_sources += sorted(glob.glob("csrc/cuda/*.c", root_dir=ROOT) + glob.glob("kernels/*.c", root_dir=ROOT))
            cu_sources = sorted(glob.glob("kernels/*.cu", root_dir=ROOT))

        headers = [h for pattern in ("csrc/**/*.h", "kernels/*.h", "kernels/*.cuh")
                   for h in glob.glob(pattern, root_dir=ROOT, recursive=True)]
        deps_mtime = max([os.path.getmtime(os.path.join(ROOT, h)) for h in headers] + [os.path.getmtime(__file__)])
        jobs, objects = [], []
        for src in c_sources:
            obj = object_path(out, src, cflags)
            objects.append(obj)
            if newer(os.path.join(ROOT, src), obj, deps_mtime):
                jobs.append((src, [cc, *cflags, "-c", src, "-o", obj]))
        workers = max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 2)))
        if nvcc:
            gencode = cuda_arch_flags(archs)
            # nvcc compiles a file's arches one after the other unless given threads: with them the
            # largest file, which finishes last, keeps more than one core busy
            targets = sum(1 for f in gencode if f.startswith("-gencode"))
            nvflags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Icsrc/include", "-Icsrc",
                       "-Ikernels",
                       "-DCQ_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo", *gencode]
            for src in cu_sources:
                obj = object_path(out, src, nvflags)
                objects.append(obj)
                if newer(os.path.join(ROOT, src), obj, deps_mtime):
                    jobs.append((src, [nvcc, *nvflags, f"--threads={min(targets, workers)}", "-c", src, "-o", obj]))
            n_cu = sum(1 for src, _ in jobs if src.endswith(".cu"))
            if n_cu:
                log(f"{n_cu} CUDA files for sm_{', sm_'.join(archs)} + PTX compute_{portable_ptx_arch(archs)}, "
                    f"{workers} at a time (MAX_JOBS): minutes per arch on a few cores")
        compile_all(jobs, workers)

        lib = os.path.join(out, LIB_NAME)
        # static libraries (cudart) stay private too
        link = [cc, "-shared", "-o", lib, *objects, "-fopenmp", "-lm", "-Wl,--exclude-libs,ALL"]
        if sanitize:
            link += [f"-fsanitize={sanitize}"]
        if nvcc:
            # static cudart: the library loads with no driver present and finds
            # libcuda only when a CUDA tensor arrives; cuBLASLt is opened at run time
            link += [f"-L{cuda_home}/lib64", "-lcudart_static", "-lstdc++", "-ldl", "-lrt", "-lpthread"]
        rc, output, _ = run(link)
        if rc:
            raise SystemExit(f"libcquant: linking failed (exit {rc}):\n  {' '.join(link)}\n{output}")
        return lib


class BuildPyWithAutoload(build_py):
    """Also put cquant-autoload.pth at the top of the build, so that it lands in site-packages: its
    one line lets diffusers and transformers load a cquant checkpoint before `import cquant`
    (python/_cquant_autoload.py says how)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(ROOT, "python", AUTOLOAD_PTH), os.path.join(self.build_lib, AUTOLOAD_PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, AUTOLOAD_PTH)]


extension = Extension(
    "cquant._C",
    sources=sorted(glob.glob("csrc/py/*.c", root_dir=ROOT)),
    include_dirs=["csrc/include", numpy.get_include()],
    libraries=["cquant"],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-Wno-cast-function-type"],
    extra_link_args=["-Wl,-rpath,$ORIGIN"],
)

setup(
    package_dir={"": "python"},
    packages=["cquant", "cquant.bench", "cquant.blocks", "cquant.integrations", "cquant.verify"],
    py_modules=["_cquant_autoload"],
    package_data={"cquant": [LIB_NAME, "data/*.json", "data/*.safetensors"]},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildLibAndExtension, "build_py": BuildPyWithAutoload},
)
