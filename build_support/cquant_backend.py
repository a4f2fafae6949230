"""The build backend of cquant: setuptools' own, plus one decision made before the build starts.
On a machine with a GPU that cquant's kernels run on and no CUDA toolkit, the CUDA compiler is
asked for as a build requirement (the `nvidia-cuda-nvcc` package and what it needs, matching the
CUDA version of the driver), so that `pip install .` builds the kernels instead of a CPU-only
library. Where no such compiler exists, the build stops and says what to do (setup.py).
"""

import sys

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403 (the hooks this module does not change)

import cquant_cuda_env


def _cuda_requirements():
    action, detail = cquant_cuda_env.compiler_plan()
    if action == "pypi":
        print(f"cquant: a GPU is present and no CUDA toolkit: asking for {', '.join(detail)}", file=sys.stderr)
        return list(detail)
    return []  # "stop" is reported by setup.py, with the same message, where pip shows it


def get_requires_for_build_wheel(config_settings=None):
    return _orig.get_requires_for_build_wheel(config_settings) + _cuda_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _orig.get_requires_for_build_editable(config_settings) + _cuda_requirements()
