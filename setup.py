"""Build of cquant: libcquant (C11 + CUDA) and the cquant._C extension linked to it.

Which CUDA kernels are built (compiling them takes minutes on a few cores):
  unset                    the arches of the GPUs present (asked from nvidia-smi), machine code
                           only. No GPU (or only GPUs older than compute capability 8.0, which
                           run none of cquant's kernels): CPU-only, in seconds. A GPU but no CUDA
                           compiler: the build backend (build_support/cquant_backend.py) fetches
                           the nvidia-cuda-nvcc package for a CUDA 13 driver; otherwise the build
                           stops and says what to do -- never a silent CPU-only build.
  CQUANT_CUDA=0            CPU-only, even where a GPU and nvcc are found
  CQUANT_CUDA=1            every arch of CQUANT_CUDA_ARCHS (default 80;89;90a), e.g. for a wheel
                           built on a machine without a GPU; fails if nvcc is missing
  CQUANT_CUDA_ARCHS        ';'- or ','-separated arches, e.g. "90a" or "80;89;90a": overrides the
                           list (and, set, asks for CUDA as CQUANT_CUDA=1 does)
A build for a list of arches also embeds PTX of its highest arch without the 'a' suffix
(compute_90 for 90a), which the driver compiles for GPUs newer than the listed ones (sm_90a PTX
would only run on sm_90 itself); a build for the GPUs present embeds none, unless nvcc cannot
compile machine code for one of them.

Other settings:
  CQUANT_PREBUILT_LIB      path of an already built libcquant.so to reuse
  CQUANT_SANITIZE          e.g. "address,undefined": host code built with -fsanitize
  CQUANT_LINEINFO=1        device code keeps line tables for profilers (a library several times
                           larger)
  CQUANT_CUDA_DEFINES      space-separated NAME or NAME=VALUE passed to nvcc as -D, e.g.
                           "CQ_WO_SM90_PAIR_EXTRA=2": a kernel's compile-time variant, for an A/B of builds
  CUDA_HOME / CUDA_PATH    toolkit root (default: the one holding nvcc on PATH, /usr/local/cuda, or
                           the nvidia-cuda-nvcc package)
  MAX_JOBS                 parallel compile jobs (default: CPU count)
"""

import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "build_support"))
import cquant_cuda_env as cuda_env  # noqa: E402 (the build's own helper, beside setup.py)

LIB_NAME = "libcquant.so"
AUTOLOAD_PTH = "cquant-autoload.pth"
DEFAULT_ARCHS = "80;89;90a"


def log(msg):
    print(f"libcquant: {msg}", flush=True)


def parse_archs(text):
    archs = [a.strip().lower().replace("sm_", "").replace("compute_", "") for a in text.replace(",", ";").split(";")]
    archs = [a for a in archs if a]
    for a in archs:
        if not a.rstrip("af").isdigit():
            raise SystemExit(f"CQUANT_CUDA_ARCHS: {a!r} is not an arch; expected numbers such as 80, 89, 90a")
    if not archs:
        raise SystemExit("CQUANT_CUDA_ARCHS is empty; expected arches such as 80;89;90a")
    return sorted(set(archs), key=lambda a: (int(a.rstrip("af")), a))


def nvcc_archs(nvcc):
    """The real arches (sm_XX) this nvcc compiles for, as arch strings ("90", "100", ...)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {tok[3:] for tok in out.split() if tok.startswith("sm_")} or None


def cuda_plan():
    """(nvcc or None, arches, ptx): what to build, from the environment and the GPUs present;
    ptx is the arch whose PTX is embedded, or None."""
    mode = os.environ.get("CQUANT_CUDA", "").strip()
    if mode == "0":
        log("CPU-only (CQUANT_CUDA=0)")
        return None, [], None
    if mode not in ("", "1"):
        raise SystemExit(f"CQUANT_CUDA={mode!r}; expected 0 (CPU-only), 1 (every listed arch) or unset (the GPUs present)")
    listed = os.environ.get("CQUANT_CUDA_ARCHS")
    nvcc, where = cuda_env.find_nvcc()
    if mode == "1" or listed:
        why = "CQUANT_CUDA_ARCHS" if listed else "CQUANT_CUDA=1"
        if nvcc is None:
            raise SystemExit(f"{why} asks for the CUDA kernels, but no nvcc was found ({where}): put it on PATH or "
                             "set CUDA_HOME")
        archs = parse_archs(listed or DEFAULT_ARCHS)
        log(f"CUDA for sm_{', sm_'.join(archs)} ({why}), nvcc {nvcc}")
        return nvcc, archs, portable_ptx_arch(archs)
    present = cuda_env.detect_gpus()
    gpus = cuda_env.usable_gpus(present)
    if not gpus:
        if present:
            log(f"CPU-only: the GPUs present ({cuda_env.describe_gpus(present)}) are older than compute capability "
                "8.0, which cquant's kernels need")
        else:
            log("CPU-only: no GPU found (nvidia-smi absent or failing). CQUANT_CUDA=1 builds the CUDA kernels anyway")
        return None, [], None
    names = cuda_env.describe_gpus(gpus)
    if nvcc is None:
        raise SystemExit(cuda_env.no_compiler_message(gpus, cuda_env.driver_cuda_version(), where))
    wanted = sorted({cuda_env.wanted_arch(cap) for _, cap in gpus}, key=lambda a: (int(a.rstrip("af")), a))
    known = nvcc_archs(nvcc)
    archs = [a for a in wanted if known is None or a.rstrip("af") in known]
    if not archs:
        raise SystemExit(f"cquant: nvcc {nvcc} compiles for none of the GPUs present ({names}). Use a newer CUDA "
                         "toolkit (CUDA_HOME), set CQUANT_CUDA_ARCHS to the newest arch this nvcc knows (its PTX "
                         "is compiled by the driver for the newer GPU), or build CPU-only with CQUANT_CUDA=0")
    ptx = None
    if len(archs) < len(wanted):  # a GPU newer than nvcc: it runs the PTX of the newest arch nvcc knows
        ptx = portable_ptx_arch(archs)
        log(f"nvcc {nvcc} has no machine code for sm_{', sm_'.join(a for a in wanted if a not in archs)}: "
            f"embedding compute_{ptx} PTX for it")
    log(f"CUDA for the GPUs present, {names}: sm_{', sm_'.join(archs)}; nvcc {nvcc} ({where})")
    return nvcc, archs, ptx


def portable_ptx_arch(archs):
    """The arch whose PTX is embedded: the highest listed, without 'a' / 'f' (arch- and
    family-specific PTX runs only on that arch / family)."""
    return str(max(int(a.rstrip("af")) for a in archs))


def cuda_arch_flags(archs, ptx):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx:
        flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    if "90a" in archs:
        flags.append("-DCQ_BUILD_SM90A")  # host code may select the wgmma kernels
    return flags


def build_info_flags(archs, ptx, version):
    """What libcquant reports about its build (cq_build_info_get)."""
    return [f'-DCQ_BUILD_ARCHS="{";".join(archs)}"', f'-DCQ_BUILD_PTX="{ptx or ""}"', f'-DCQ_VERSION="{version}"']


def nvcc_supports(nvcc, option):
    try:
        out = subprocess.run([nvcc, "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return option in out


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


def project_includes(src, seen=None):
    """The project files a source is made of: itself and the headers it includes, transitively."""
    seen = set() if seen is None else seen
    path = os.path.join(ROOT, src)
    if src in seen or not os.path.exists(path):
        return seen
    seen.add(src)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#include \""):
                name = line.split('"')[1]
                for d in (os.path.dirname(src), "kernels", "csrc", "csrc/include"):
                    if os.path.exists(os.path.join(ROOT, d, name)):
                        project_includes(os.path.normpath(os.path.join(d, name)), seen)
                        break
    return seen


def compile_order(sources):
    """Sources, heaviest first, so that no long compile starts last: by the bytes of the files each
    is made of beyond those that all share (a small file of instantiations over a large header of
    kernels compiles slowly; the common headers say nothing)."""
    parts = {src: project_includes(src) for src in sources}
    common = set.intersection(*parts.values()) if parts else set()
    weight = {src: sum(os.path.getsize(os.path.join(ROOT, f)) for f in files - common) for src, files in parts.items()}
    return sorted(sources, key=lambda src: -weight[src])


def compile_all(jobs, workers):
    """Compile [(source, command)] on `workers` threads, heaviest sources first (so that no long
    compile starts last), with a progress line as each finishes; stop at the first failure,
    showing its command and output."""
    rank = {src: i for i, src in enumerate(compile_order([src for src, _ in jobs if src.endswith(".cu")]))}
    jobs = sorted(jobs, key=lambda j: rank.get(j[0], len(rank)))
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
        nvcc, archs, ptx = cuda_plan()
        defines = cuda_defines()  # checked before anything compiles, CUDA or not
        sanitize = os.environ.get("CQUANT_SANITIZE")
        # hidden visibility: libcquant exports what cquant.h marks CQ_API, nothing else
        cflags = ["-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-Wall", "-Wextra", "-Icsrc/include",
                  "-Icsrc", *build_info_flags(archs, ptx, self.distribution.get_version())]
        if sanitize:
            cflags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g", "-fno-sanitize-recover=all"]
        c_sources = sorted(glob.glob("csrc/*.c", root_dir=ROOT))
        cu_sources = []
        if nvcc:
            cflags += ["-DCQ_WITH_CUDA", "-Ikernels", *(f"-I{d}" for d in cuda_env.include_dirs(nvcc))]
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
            gencode = cuda_arch_flags(archs, ptx)
            # nvcc compiles a file's arches one after the other unless given threads: with them the
            # largest file, which finishes last, keeps more than one core busy
            targets = sum(1 for f in gencode if f.startswith("-gencode"))
            nvflags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Icsrc/include", "-Icsrc",
                       "-Ikernels",
                       "-DCQ_WITH_CUDA", "--expt-relaxed-constexpr", *gencode]
            if os.environ.get("CQUANT_LINEINFO", "0") not in ("", "0"):
                nvflags.append("-lineinfo")  # source lines for profilers: several times the library's size
            nvflags += [f"-D{d}" for d in defines]
            if nvcc_supports(nvcc, "--compress-mode"):
                nvflags.append("--compress-mode=size")  # the device code, decompressed once at load
            for src in cu_sources:
                obj = object_path(out, src, nvflags)
                objects.append(obj)
                if newer(os.path.join(ROOT, src), obj, deps_mtime):
                    jobs.append((src, [nvcc, *nvflags, f"--threads={min(targets, workers)}", "-c", src, "-o", obj]))
            n_cu = sum(1 for src, _ in jobs if src.endswith(".cu"))
            if n_cu:
                log(f"{n_cu} CUDA files for sm_{', sm_'.join(archs)}{f' + PTX compute_{ptx}' if ptx else ''}, "
                    f"{workers} at a time (MAX_JOBS): minutes on a few cores")
        compile_all(jobs, workers)

        lib = os.path.join(out, LIB_NAME)
        # static libraries (cudart) stay private too
        link = [cc, "-shared", "-o", lib, *objects, "-fopenmp", "-lm", "-Wl,--exclude-libs,ALL"]
        if sanitize:
            link += [f"-fsanitize={sanitize}"]
        if nvcc:
            # static cudart: the library loads with no driver present and finds
            # libcuda only when a CUDA tensor arrives; cuBLASLt is opened at run time
            link += [f"-L{cuda_env.library_dir(nvcc)}", "-lcudart_static", "-lstdc++", "-ldl", "-lrt", "-lpthread"]
        rc, output, _ = run(link)
        if rc:
            raise SystemExit(f"libcquant: linking failed (exit {rc}):\n  {' '.join(link)}\n{output}")
        return lib


def cuda_defines():
    """CQUANT_CUDA_DEFINES as a list of NAME or NAME=VALUE (identifier names, plain values)."""
    defines = os.environ.get("CQUANT_CUDA_DEFINES", "").split()
    for d in defines:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?", d):
            raise SystemExit(f"CQUANT_CUDA_DEFINES: {d!r} is not NAME or NAME=VALUE")
    return defines


class BuildPyWithAutoload(build_py):
    """Also put cquant-autoload.pth at the top of the build, so that it lands in site-packages: its
    one line lets diffusers and transformers load a cquant checkpoint before `import cquant`
    (python/_cquant_autoload.py says how)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(ROOT, "python", AUTOLOAD_PTH), os.path.join(self.build_lib, AUTOLOAD_PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, AUTOLOAD_PTH)]


# The extension uses CPython's stable ABI (Py_LIMITED_API in csrc/py/cqpy.h): one build, and one
# wheel, serves CPython 3.10 and every later version.
extension = Extension(
    "cquant._C",
    sources=sorted(glob.glob("csrc/py/*.c", root_dir=ROOT)),
    include_dirs=["csrc/include"],
    py_limited_api=True,
    libraries=["cquant"],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-Wno-cast-function-type"],
    # glibc named among its needs although it calls libcquant alone: auditwheel tells a wheel's libc
    # from its extension
    extra_link_args=["-Wl,-rpath,$ORIGIN", "-Wl,--no-as-needed", "-lc", "-Wl,--as-needed"],
)

setup(
    package_dir={"": "python"},
    packages=["cquant", "cquant.bench", "cquant.blocks", "cquant.integrations", "cquant.verify"],
    py_modules=["_cquant_autoload"],
    package_data={"cquant": [LIB_NAME, "data/*.json", "data/*.safetensors"]},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildLibAndExtension, "build_py": BuildPyWithAutoload},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
