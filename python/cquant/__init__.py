"""cquant: quantized linear layers and attention for diffusion transformers, in C and CUDA."""

from . import _libs

_libs.export_cublaslt_path()

from . import _C
from ._C import CudaError
from . import ops

__version__ = _C.VERSION
FORMAT_VERSION = _C.FORMAT_VERSION

__all__ = ["CudaError", "FORMAT_VERSION", "__version__", "ops"]
