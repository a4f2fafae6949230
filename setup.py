"""Build of cquant: libcquant (C11 + CUDA) and the cquant._C extension linked to it.

Environment:
  CQUANT_CUDA=0            build CPU-only, even where nvcc is found
  CQUANT_CUDA_ARCHS        ';'- or ','-separated arches (default "80;89;90a")
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

import numpy

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libcquant.so"
AUTOLOAD_PTH = "cquant-autoload.pth"


def find_nvcc():
    if os.environ.get("CQUANT_CUDA", "1") == "0":
        return None
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


def cuda_arch_flags():
    archs = os.environ.get("CQUANT_CUDA_ARCHS", "80;89;90a").replace(",", ";").split(";")
    flags = []
    for arch in filter(None, (a.strip().replace("sm_", "") for a in archs)):
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if arch == "90a":
            flags.append("-DCQ_BUILD_SM90A")  # host code may select the wgmma kernels
    return flags


def run(cmd):
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)


def object_path(out, src, flags):
    """Object file of src in out, named after the flags too: a build with other flags (CPU-only,
    sanitizers, other arches) never links objects of an earlier one."""
    tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
    return os.path.join(out, f"{src.replace('/', '_')}.{tag}.o")


def newer(src, obj, deps_mtime):
    return not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src), deps_mtime)


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
        nvcc = find_nvcc()
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
        print(f"libcquant: CUDA {'with ' + nvcc if nvcc else 'disabled (CPU-only build)'}", flush=True)

        headers = [h for pattern in ("csrc/**/*.h", "kernels/*.h", "kernels/*.cuh")
                   for h in glob.glob(pattern, root_dir=ROOT, recursive=True)]
        deps_mtime = max([os.path.getmtime(os.path.join(ROOT, h)) for h in headers] + [os.path.getmtime(__file__)])
        jobs, objects = [], []
        for src in c_sources:
            obj = object_path(out, src, cflags)
            objects.append(obj)
            if newer(os.path.join(ROOT, src), obj, deps_mtime):
                jobs.append([cc, *cflags, "-c", src, "-o", obj])
        nvflags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Icsrc/include", "-Icsrc", "-Ikernels",
                   "-DCQ_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo", *cuda_arch_flags()]
        for src in cu_sources:
            obj = object_path(out, src, nvflags)
            objects.append(obj)
            if newer(os.path.join(ROOT, src), obj, deps_mtime):
                jobs.append([nvcc, *nvflags, "-c", src, "-o", obj])
        workers = int(os.environ.get("MAX_JOBS", os.cpu_count() or 2))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for fut in [pool.submit(run, job) for job in jobs]:
                fut.result()

        lib = os.path.join(out, LIB_NAME)
        # static libraries (cudart) stay private too
        link = [cc, "-shared", "-o", lib, *objects, "-fopenmp", "-lm", "-Wl,--exclude-libs,ALL"]
        if sanitize:
            link += [f"-fsanitize={sanitize}"]
        if nvcc:
            # static cudart: the library loads with no driver present and finds
            # libcuda only when a CUDA tensor arrives; cuBLASLt is opened at run time
            link += [f"-L{cuda_home}/lib64", "-lcudart_static", "-lstdc++", "-ldl", "-lrt", "-lpthread"]
        run(link)
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
    packages=["cquant", "cquant.integrations"],
    py_modules=["_cquant_autoload"],
    package_data={"cquant": [LIB_NAME, "data/*.json"]},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildLibAndExtension, "build_py": BuildPyWithAutoload},
)
