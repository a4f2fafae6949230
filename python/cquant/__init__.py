"""cquant: quantized linear layers and attention for diffusion transformers, in C and CUDA."""

from . import _libs

_libs.export_cublaslt_path()

from . import _C
from ._C import CudaError
from . import ops

__version__ = _C.VERSION
FORMAT_VERSION = _C.FORMAT_VERSION

__all__ = ["CudaError", "FORMAT_VERSION", "__version__", "ops"]

from .attention import attention, register_torch_op as register_attention_op
from .attention import workspace_size as attention_workspace_size

__all__ += ["attention", "attention_workspace_size", "register_attention_op"]

from .attention_backend import enable_attention, register_attention_backends
from .attention_backend import install_import_hooks as _install_attention_hooks

_install_attention_hooks()
__all__ += ["enable_attention", "register_attention_backends"]
