"""Allocation in the caller's framework: results come back as the input's kind of array.

libcquant never allocates; this module makes outputs and workspaces with the framework the
input came from (NumPy, torch or CuPy) on the input's device, and finds the stream to run on.
"""

import sys

import numpy as np

# dtype names of libcquant (cq_dtype_name) -> NumPy dtype; NumPy has no bfloat16 or float8,
# so fp8 codes live in uint8 arrays there.
_NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def framework_of(x):
    """'torch', 'numpy' or 'cupy' for an array; TypeError for anything else."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if hasattr(x, "__dlpack__"):
        raise TypeError(
            f"cannot allocate a result like {type(x).__name__}: cquant allocates with NumPy, torch or CuPy; "
            "pass out= (and workspace=) buffers for other DLPack producers"
        )
    raise TypeError(f"expected a NumPy array, torch tensor or CuPy array, got {type(x).__name__}")


def dtype_name(x):
    """libcquant's name of an array's dtype ('float32', 'bfloat16', ...)."""
    name = str(x.dtype)
    return name.split(".")[-1]


def empty(like, shape, dtype):
    """An uninitialised array of `shape` and libcquant dtype name `dtype`, in like's framework and device."""
    kind = framework_of(like)
    shape = tuple(int(s) for s in shape)
    if kind == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        cupy = _cupy()
        if dtype not in _NUMPY_DTYPES:
            raise TypeError(f"CuPy has no {dtype} arrays")
        with like.device:
            return cupy.empty(shape, dtype=_NUMPY_DTYPES[dtype])
    if dtype not in _NUMPY_DTYPES:
        raise TypeError(f"NumPy has no {dtype} arrays; use float32 or float16 with NumPy inputs")
    return np.empty(shape, dtype=_NUMPY_DTYPES[dtype])


def readable(x):
    """x as libcquant must read it: a torch tensor with a lazy negative or conjugate bit (a view
    made by .conj(), torch._neg_view) is resolved into memory first, since DLPack drops the bit
    and its stored values would be read without the negation. Anything else as it is."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and (x.is_neg() or x.is_conj()):
        return x.resolve_conj().resolve_neg()
    return x


def check_writable(x, name):
    """Refuse an output buffer whose writes would not read back as written (a lazily negated
    torch view: DLPack exports its memory without the negation)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and (x.is_neg() or x.is_conj()):
        raise ValueError(f"{name} is a torch view with a lazy {'negative' if x.is_neg() else 'conjugate'} bit; "
                         f"cquant would write its memory without the negation: pass a plain tensor "
                         f"({name}.resolve_neg() makes one)")
    return x


def refuse_broadcast(x, name):
    """Refuse an input with a stride of 0 in a dim of extent > 1 (np.broadcast_to, tensor.expand):
    libcquant reads its inputs contiguous and would refuse it, but only after the result, sized by
    x's shape and not by its memory, had been allocated (terabytes for an expanded scalar)."""
    strides = x.stride() if callable(getattr(x, "stride", None)) else getattr(x, "strides", None)
    if strides is None or 0 in tuple(x.shape):  # an empty array may have any strides (NumPy 2 gives 0)
        return x
    for d, (extent, stride) in enumerate(zip(x.shape, strides)):
        if extent > 1 and stride == 0:
            raise ValueError(f"{name} is not contiguous (stride 0 in dim {d}: a broadcast view of shape "
                             f"{tuple(int(s) for s in x.shape)}); pass a contiguous row-major array")
    return x


def any_bit_from(x, bit):
    """Whether a uint8 array [..., row bytes] has a bit set at or past bit `bit` of any row's byte
    string (LSB first), or None where it is not read: another dtype or a torch device libcquant
    does not take (it refuses the array itself), or a CUDA stream being captured into a graph,
    where no host sync may happen. Reads only the bytes from bit // 8 on, in the array's own
    framework and on its device (one reduction and one host sync on CUDA); another DLPack
    producer through NumPy (CPU) or torch / CuPy (CUDA)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "cuda"):
        return None
    x = _native(x)
    if dtype_name(x) != "uint8" or is_cuda(x) and _capturing(x):
        return None
    first, shift = divmod(int(bit), 8)
    if first >= int(x.shape[-1]):
        return False
    rest = x[..., first + 1:].any()
    return bool((x[..., first] >> shift).any() | rest)


def _native(x):
    """x itself for NumPy, torch and CuPy arrays, else a view of it in one of them."""
    try:
        framework_of(x)
        return x
    except TypeError:
        pass
    if not is_cuda(x):
        return np.from_dlpack(x)
    for module in (_torch(), _cupy()):
        if module is not None:
            return module.from_dlpack(x)
    raise TypeError(f"cannot read a CUDA array of {type(x).__name__} without torch or CuPy: pass a torch "
                    "tensor or CuPy array")


def _capturing(x):
    """Whether work on x's current CUDA stream is being captured into a graph."""
    if framework_of(x) == "torch":
        torch = _torch()
        with torch.cuda.device(x.device):
            return torch.cuda.is_current_stream_capturing()
    with x.device:
        stream = _cupy().cuda.get_current_stream()
        return bool(getattr(stream, "is_capturing", lambda: False)())


def is_cuda(x):
    dev = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
    return int(dev[0]) == 2


def stream_of(x):
    """The CUDA stream work on x is enqueued on: the framework's current one.

    None lets cquant._C ask the producer itself through DLPack's C exchange table (torch has
    one), which costs no Python call; otherwise the stream's handle as an integer.
    """
    if hasattr(type(x), "__dlpack_c_exchange_api__"):
        return None
    if not is_cuda(x):
        return 0
    try:
        kind = framework_of(x)
    except TypeError:
        return 0  # another producer: its default stream
    if kind == "torch":
        return _torch().cuda.current_stream(x.device).cuda_stream
    if kind == "cupy":
        return _cupy().cuda.get_current_stream().ptr
    return 0
