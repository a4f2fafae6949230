"""Libraries libcquant opens at run time: where to find cuBLASLt.

libcquant does not link cuBLASLt (it must import where no CUDA is installed); on first use it
opens it with dlopen, trying the already-loaded library first (torch loads it), then the
directories in ``CQUANT_CUBLASLT_PATH``. Here that variable is filled, when the user has not
set it, with the library directories of the NVIDIA wheels (``nvidia-cublas``) that pip installs
next to torch, so a pip-only setup works without a CUDA toolkit.
"""

import glob
import importlib.util
import os


def nvidia_wheel_lib_dirs():
    """Directories of nvidia/*/lib (and nvidia/cu*/lib) that hold a libcublasLt.so.*."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    dirs = []
    for root in spec.submodule_search_locations:
        for pattern in ("*/lib/libcublasLt.so.*", "*/*/lib/libcublasLt.so.*"):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                d = os.path.dirname(path)
                if d not in dirs:
                    dirs.append(d)
    return dirs


# The CQUANT_* variables as the user set them, before this module added its own.
USER_SETTINGS = {k: v for k, v in os.environ.items() if k.startswith("CQUANT_")}


def export_cublaslt_path():
    """Set CQUANT_CUBLASLT_PATH to the wheel directories unless it is set already."""
    if os.environ.get("CQUANT_CUBLASLT_PATH"):
        return
    try:
        dirs = nvidia_wheel_lib_dirs()
    except (ImportError, ValueError, OSError):
        return
    if dirs:
        os.environ["CQUANT_CUBLASLT_PATH"] = os.pathsep.join(dirs)
