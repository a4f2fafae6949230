"""A minimal DLPack producer written with ctypes, for testing cquant as a consumer.

It exports a NumPy buffer as a versioned (DLPack 1.x, any version number) or legacy capsule
with whatever descriptor a test asks for (dtype code, lanes, strides, byte_offset, device,
read-only flag), and counts exports and deleter calls: a consumer must call the deleter exactly
once per capsule it took, and a capsule it did not take (not renamed "used_...") is deleted by
the capsule's destructor, as the DLPack spec says.
"""

import ctypes

import numpy as np

c_int64_p = ctypes.POINTER(ctypes.c_int64)

kDLCPU, kDLCUDA, kDLVulkan = 1, 2, 7
kDLInt, kDLUInt, kDLFloat, kDLBfloat = 0, 1, 2, 4
READ_ONLY = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", c_int64_p),
        ("strides", c_int64_p),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# PyCapsule keeps the name pointer: these bytes live as long as the module
_VERSIONED, _LEGACY = b"dltensor_versioned", b"dltensor"
_USED = (b"used_dltensor_versioned", b"used_dltensor")
_OWNERS = {}  # address of a live capsule's managed tensor -> its Producer


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # A capsule nobody took still has its original name: its deleter runs here. The managed
    # tensor's memory is released only now, so no address is reused while a capsule lives.
    for name in (_VERSIONED, _LEGACY, *_USED):
        if _api.PyCapsule_IsValid(capsule, name):
            addr = _api.PyCapsule_GetPointer(capsule, name)
            owner = _OWNERS.pop(addr, None)
            if owner is not None and name not in _USED:
                owner._delete(addr)
            # a taken capsule's managed tensor belongs to its consumer until it calls the deleter
            # (NumPy's from_dlpack drops the capsule long before): _delete releases it then
            return


class Producer:
    """DLPack view of a NumPy array (kept alive here) with an adjustable descriptor.

    version: (major, minor) for a versioned capsule, None for a legacy one. legacy_signature:
    __dlpack__ takes only `stream` (producers that predate DLPack 1.0). Other keywords override
    the descriptor: dtype=(code, bits, lanes), shape, strides (elements, or None for row-major),
    byte_offset (added to the data pointer by the consumer), data_offset (bytes added to the
    base pointer itself), device=(type, id), readonly.
    """

    def __init__(self, array, *, version=(1, 1), dtype=None, shape=None, strides=None, byte_offset=0,
                 data_offset=0, device=(kDLCPU, 0), readonly=False, report_device=None):
        self.array = array
        self.version = version
        self.dtype = dtype or _dl_dtype(array.dtype)
        self.shape = tuple(array.shape if shape is None else shape)
        self.strides = strides
        self.byte_offset = byte_offset
        self.data_offset = data_offset
        self.device = device
        self.report_device = report_device or device
        self.readonly = readonly
        self.exports = 0
        self.deletes = 0
        self._alive = {}  # address -> (managed struct, shape, strides) while its capsule lives
        self._deleter = DELETER(self._delete)

    def _delete(self, addr):
        self.deletes += 1
        self._alive.pop(addr, None)  # nobody reads the managed tensor any more: its memory may go

    def __dlpack_device__(self):
        return self.report_device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self._export()

    def _export(self):
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        if self.version is None:
            mt = DLManagedTensor()
            name = _LEGACY
        else:
            mt = DLManagedTensorVersioned()
            mt.version = DLPackVersion(*self.version)
            mt.flags = READ_ONLY if self.readonly else 0
            name = _VERSIONED
        t = mt.dl_tensor
        t.data = self.array.ctypes.data + self.data_offset
        t.device = DLDevice(*self.device)
        t.ndim = ndim
        t.dtype = DLDataType(*self.dtype)
        t.shape = shape
        t.strides = strides if strides is not None else c_int64_p()
        t.byte_offset = self.byte_offset
        mt.deleter = self._deleter
        addr = ctypes.addressof(mt)
        self._alive[addr] = (mt, shape, strides)
        _OWNERS[addr] = self
        self.exports += 1
        return _api.PyCapsule_New(addr, name, ctypes.cast(_capsule_destructor, ctypes.c_void_p))

    @property
    def balanced(self):
        """Every exported capsule is gone and its deleter ran exactly once."""
        return self.deletes == self.exports and not self._alive


class LegacyProducer(Producer):
    """A producer from before DLPack 1.0: __dlpack__ takes only `stream`, gives legacy capsules."""

    def __init__(self, array, **kw):
        super().__init__(array, version=None, **kw)

    def __dlpack__(self, stream=None):
        return self._export()


def _dl_dtype(dtype):
    dtype = np.dtype(dtype)
    code = {"f": kDLFloat, "i": kDLInt, "u": kDLUInt}[dtype.kind]
    return (code, dtype.itemsize * 8, 1)
