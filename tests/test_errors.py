"""Bad input: every case raises the documented exception type, and its message names the
argument. DLPack capsules (built with a ctypes producer) are deleted exactly once on every path.
"""

import re

import numpy as np
import pytest

import cquant
from cquant import _C, ops

from dlpack_producer import LegacyProducer, Producer, kDLBfloat, kDLCPU, kDLCUDA, kDLFloat, kDLInt, kDLVulkan

F32 = np.float32


def raises(exc, name, fn):
    """fn() raises exc, and the message names `name` as a word."""
    with pytest.raises(exc, match=rf"(^|\W){re.escape(name)}(\W|$)"):
        fn()


def x_(rows=3, cols=8, dtype=F32):
    return np.arange(rows * cols, dtype=np.float64).reshape(rows, cols).astype(dtype) / (rows * cols) - 0.5


def int8_weight(n=4, k=8):
    return ops.quantize(x_(n, k), "int8")


def misaligned_f32(rows=3, cols=8):
    """A float32 array whose data starts 1 byte past an aligned address."""
    buf = np.zeros(rows * cols * 4 + 1, np.uint8)
    a = buf[1:].view(F32).reshape(rows, cols)
    assert a.ctypes.data % 4 == 1
    return a


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def lin(x, w=None, ws=None, **kw):
    if w is None:
        w, ws = int8_weight(4, 8)
    kw.setdefault("weight_format", "int8")
    return ops.linear(x, w, ws, **kw)


# (id, exception, argument named in the message, call)
CASES = [
    # ---- wrong dtype: TypeError
    ("quantize x int32", TypeError, "x", lambda: ops.quantize(np.ones((2, 3), np.int32), "int8")),
    ("quantize x float64", TypeError, "x", lambda: ops.quantize(np.ones((2, 3)), "int8")),
    ("quantize q float32", TypeError, "q", lambda: ops.quantize(x_(), "int8", out=np.zeros((3, 8), F32))),
    ("quantize fp8 q int8", TypeError, "q", lambda: ops.quantize(x_(), "fp8_e4m3", out=np.zeros((3, 8), np.int8))),
    ("quantize scale float64", TypeError, "scale", lambda: ops.quantize(x_(), "int8", scale_out=np.zeros(3))),
    ("quantize static scale f16", TypeError, "scale",
     lambda: ops.quantize(x_(), "int8", scale=np.ones(3, np.float16))),
    ("dequantize q uint8 for int8", TypeError, "q",
     lambda: ops.dequantize(np.zeros((3, 8), np.uint8), np.ones(3, F32), "int8")),
    ("dequantize y int8", TypeError, "y",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", out=np.zeros((3, 8), np.int8))),
    ("pack codes int8", TypeError, "codes", lambda: ops.pack(np.zeros((2, 5), np.int8), 4)),
    ("pack packed float32", TypeError, "packed", lambda: ops.pack(np.zeros((2, 5), np.uint8), 4, out=np.zeros((2, 4), F32))),
    ("unpack packed int8", TypeError, "packed", lambda: ops.unpack(np.zeros((2, 16), np.int8), 4, 5)),
    ("linear x int32", TypeError, "x", lambda: lin(np.ones((2, 8), np.int32))),
    ("linear w float32", TypeError, "w", lambda: lin(x_(), np.ones((4, 8), F32), np.ones(4, F32))),
    ("linear w_scale f16", TypeError, "w_scale", lambda: lin(x_(), int8_weight()[0], np.ones(4, np.float16))),
    ("linear bias float64", TypeError, "bias", lambda: lin(x_(), bias=np.ones(4))),
    ("linear bias f16 for f32 x", TypeError, "bias", lambda: lin(x_(), bias=np.ones(4, np.float16))),
    ("linear y dtype", TypeError, "y", lambda: lin(x_(), out=np.zeros((3, 4), np.float16))),
    # ---- wrong ndim / shape: ValueError
    ("quantize x 0-d", ValueError, "x", lambda: ops.quantize(np.array(1.0, F32), "int8")),
    ("quantize q shape", ValueError, "q", lambda: ops.quantize(x_(), "int8", out=np.zeros((3, 7), np.int8))),
    ("quantize packed q shape", ValueError, "q",
     lambda: ops.quantize(x_(3, 97), "fp6_e3m2", out=np.zeros((3, 73), np.uint8))),
    ("quantize q rows", ValueError, "q", lambda: ops.quantize(x_(), "int8", out=np.zeros((2, 8), np.int8))),
    ("quantize scale size", ValueError, "scale", lambda: ops.quantize(x_(), "int8", scale_out=np.zeros(2, F32))),
    ("quantize tensor scale size", ValueError, "scale",
     lambda: ops.quantize(x_(), "int8", "tensor", scale_out=np.zeros(3, F32))),
    ("quantize static scale size", ValueError, "scale", lambda: ops.quantize(x_(), "int8", scale=np.ones(4, F32))),
    ("dequantize y shape", ValueError, "q",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", out=np.zeros((3, 9), F32))),
    ("dequantize scale size", ValueError, "scale",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(2, F32), "int8")),
    ("pack packed shape", ValueError, "packed",
     lambda: ops.pack(np.zeros((2, 5), np.uint8), 4, out=np.zeros((2, 8), np.uint8))),
    ("unpack packed width", ValueError, "packed", lambda: ops.unpack(np.zeros((2, 16), np.uint8), 6, 97)),
    ("linear in_features", ValueError, "in_features", lambda: lin(x_(), in_features=9)),
    ("linear w 1-D", ValueError, "w", lambda: lin(x_(), np.zeros(8, np.int8), np.ones(1, F32))),
    ("linear w 3-D", ValueError, "w", lambda: lin(x_(), np.zeros((2, 2, 8), np.int8), np.ones(4, F32))),
    ("linear w columns", ValueError, "w", lambda: lin(x_(), np.zeros((4, 9), np.int8), np.ones(4, F32))),
    ("linear w_scale size", ValueError, "w_scale", lambda: lin(x_(), np.zeros((4, 8), np.int8), np.ones(3, F32))),
    ("linear bias size", ValueError, "bias", lambda: lin(x_(), bias=np.ones(5, F32))),
    ("linear y shape", ValueError, "y", lambda: lin(x_(), out=np.zeros((3, 5), F32))),
    ("linear x 0-d", ValueError, "x", lambda: lin(np.array(1.0, F32))),
    # ---- zero-size dims
    ("quantize zero rows", ValueError, "x", lambda: ops.quantize(np.zeros((0, 8), F32), "int8")),
    ("quantize zero cols", ValueError, "x", lambda: ops.quantize(np.zeros((3, 0), F32), "fp6_e3m2")),
    ("C quantize zero rows", ValueError, "x",
     lambda: _C.quantize(np.zeros((0, 8), F32), np.zeros((1, 8), np.int8), np.zeros(1, F32), 1, 1)),
    ("C quantize zero-size q", ValueError, "q",
     lambda: _C.quantize(x_(), np.zeros((0, 8), np.int8), np.zeros(3, F32), 1, 1)),
    ("linear zero rows", ValueError, "x", lambda: lin(np.zeros((0, 8), F32))),
    ("linear zero out features", ValueError, "w", lambda: lin(x_(), np.zeros((0, 8), np.int8), np.ones(1, F32))),
    ("dequantize zero cols", ValueError, "q", lambda: ops.dequantize(np.zeros((3, 0), np.int8), np.ones(3, F32), "int8")),
    # ---- layout: non-contiguous, negative strides, misaligned
    ("quantize x strided", ValueError, "x", lambda: ops.quantize(x_(3, 16)[:, ::2], "int8")),
    ("quantize x transposed", ValueError, "x", lambda: ops.quantize(x_(8, 3).T, "int8")),
    ("quantize x reversed", ValueError, "x", lambda: ops.quantize(x_()[::-1], "int8")),
    ("quantize x reversed cols", ValueError, "x", lambda: ops.quantize(x_()[:, ::-1], "int8")),
    ("quantize x misaligned", ValueError, "x", lambda: ops.quantize(misaligned_f32(), "int8")),
    ("quantize q strided", ValueError, "q", lambda: ops.quantize(x_(), "int8", out=np.zeros((3, 16), np.int8)[:, ::2])),
    ("quantize scale strided", ValueError, "scale", lambda: ops.quantize(x_(), "int8", scale_out=np.zeros(6, F32)[::2])),
    ("dequantize y misaligned", ValueError, "y",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", out=misaligned_f32())),
    ("linear x strided", ValueError, "x", lambda: lin(x_(3, 16)[:, ::2])),
    ("linear x misaligned", ValueError, "x", lambda: lin(misaligned_f32())),
    ("linear w reversed", ValueError, "w", lambda: lin(x_(), int8_weight()[0][::-1], int8_weight()[1])),
    ("linear bias strided", ValueError, "bias", lambda: lin(x_(), bias=np.ones(8, F32)[::2])),
    ("linear y reversed", ValueError, "y", lambda: lin(x_(), out=np.zeros((3, 4), F32)[::-1])),
    # ---- read-only outputs
    ("quantize q read-only", ValueError, "q", lambda: ops.quantize(x_(), "int8", out=readonly(np.zeros((3, 8), np.int8)))),
    ("quantize scale read-only", ValueError, "scale",
     lambda: ops.quantize(x_(), "int8", scale_out=readonly(np.zeros(3, F32)))),
    ("dequantize y read-only", ValueError, "y",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", out=readonly(np.zeros((3, 8), F32)))),
    ("pack packed read-only", ValueError, "packed",
     lambda: ops.pack(np.zeros((2, 5), np.uint8), 4, out=readonly(np.zeros((2, 16), np.uint8)))),
    ("linear y read-only", ValueError, "y", lambda: lin(x_(), out=readonly(np.zeros((3, 4), F32)))),
    # ---- not arrays: TypeError
    ("quantize x list", TypeError, "x", lambda: ops.quantize([[1.0, 2.0]], "int8")),
    ("quantize x None", TypeError, "x", lambda: ops.quantize(None, "int8")),
    ("C quantize x list", TypeError, "x", lambda: _C.quantize([[1.0]], np.zeros((1, 1), np.int8), np.zeros(1, F32), 1, 1)),
    ("C quantize q list", TypeError, "q", lambda: _C.quantize(x_(), [[0]], np.zeros(3, F32), 1, 1)),
    ("C quantize scale None", TypeError, "scale", lambda: _C.quantize(x_(), np.zeros((3, 8), np.int8), None, 1, 1)),
    ("dequantize q list", TypeError, "q", lambda: ops.dequantize([[1]], np.ones(1, F32), "int8")),
    ("dequantize scale list", TypeError, "scale", lambda: ops.dequantize(np.zeros((3, 8), np.int8), [1.0], "int8")),
    ("pack codes list", TypeError, "codes", lambda: ops.pack([[1, 2]], 4)),
    ("unpack packed list", TypeError, "packed", lambda: ops.unpack([[1, 2]], 4, 3)),
    ("linear x list", TypeError, "x", lambda: lin([[1.0] * 8])),
    ("linear w list", TypeError, "w", lambda: lin(x_(), [[1] * 8] * 4, np.ones(4, F32))),
    ("linear w_scale list", TypeError, "w_scale", lambda: lin(x_(), int8_weight()[0], [1.0] * 4)),
    ("linear bias list", TypeError, "bias", lambda: lin(x_(), bias=[0.0] * 4)),
    ("linear workspace list", TypeError, "workspace", lambda: lin(x_(), workspace=[0])),
    ("allocation for an unknown producer", TypeError, "out=", lambda: ops.quantize(Producer(x_()), "int8")),
    # ---- formats, granularities, bits
    ("format name", ValueError, "format", lambda: ops.quantize(x_(), "fp9_e4m4")),
    ("format id", ValueError, "format", lambda: ops.quantize(x_(), 0x999)),
    ("format float", TypeError, "format", lambda: ops.quantize(x_(), 1.5)),
    ("format bool", TypeError, "format", lambda: ops.quantize(x_(), True)),
    ("C format id", ValueError, "format", lambda: _C.quantize(x_(), np.zeros((3, 8), np.int8), np.zeros(3, F32), 99, 1)),
    ("C fpX with E = 0", ValueError, "format",
     lambda: _C.quantize(x_(), np.zeros((3, 16), np.uint8), np.zeros(3, F32), 0x104, 1)),
    ("format_values id", ValueError, "format", lambda: ops.format_values(0x180)),
    ("weight_format", ValueError, "weight_format", lambda: lin(x_(), weight_format="int3")),
    ("act_format", ValueError, "act_format", lambda: lin(x_(), act_format="fp6_e3m2")),
    ("act_format with int8 weights", ValueError, "act_format", lambda: lin(x_(), act_format="fp8_e4m3")),
    ("C act_format id", ValueError, "act_format",
     lambda: _C.linear(x_(), *int8_weight(), None, np.zeros((3, 4), F32), 1, 1, 77, 1, 8)),
    ("granularity", ValueError, "granularity", lambda: ops.quantize(x_(), "int8", "channel")),
    ("C granularity", ValueError, "granularity",
     lambda: _C.quantize(x_(), np.zeros((3, 8), np.int8), np.zeros(3, F32), 1, 7)),
    ("dequantize granularity", ValueError, "granularity",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", granularity="block")),
    ("weight_granularity", ValueError, "weight_granularity", lambda: lin(x_(), weight_granularity="col")),
    ("act_granularity", ValueError, "act_granularity", lambda: lin(x_(), act_format="int8", act_granularity=None)),
    ("C weight_granularity", ValueError, "weight_granularity",
     lambda: _C.linear(x_(), *int8_weight(), None, np.zeros((3, 4), F32), 1, 0, 0, 1, 8)),
    ("pack bits 0", ValueError, "bits", lambda: ops.pack(np.zeros((2, 5), np.uint8), 0)),
    ("pack bits 9", ValueError, "bits", lambda: ops.pack(np.zeros((2, 5), np.uint8), 9)),
    ("unpack bits 9", ValueError, "bits", lambda: ops.unpack(np.zeros((2, 16), np.uint8), 9, 5)),
    ("unpack bits -1", ValueError, "bits", lambda: ops.unpack(np.zeros((2, 16), np.uint8), -1, 5)),
    ("C pack bits 0", ValueError, "bits", lambda: _C.pack(np.zeros((2, 5), np.uint8), np.zeros((2, 16), np.uint8), 0)),
    ("fpx_format E = 0", ValueError, "ebits", lambda: ops.fpx_format(0, 3)),
    ("fpx_format 8 bits", ValueError, "ebits", lambda: ops.fpx_format(4, 3)),
    ("fpx_format float", TypeError, "ebits", lambda: ops.fpx_format(2.0, 1)),
    ("fpx_format mbits str", TypeError, "mbits", lambda: ops.fpx_format(2, "1")),
    ("packed_row_bytes cols", ValueError, "cols", lambda: ops.packed_row_bytes("fp6_e3m2", 0)),
    ("dequantize packed without cols", ValueError, "cols",
     lambda: ops.dequantize(np.zeros((1, 16), np.uint8), np.ones(1, F32), "fp4_e2m1")),
    # broadcast views (stride 0) are refused before a result sized by their shape is allocated
    ("quantize broadcast x", ValueError, "x",
     lambda: ops.quantize(np.broadcast_to(np.zeros((1, 1), F32), (2**40, 2**20)), "int8")),
    ("dequantize broadcast q", ValueError, "q",
     lambda: ops.dequantize(np.broadcast_to(np.zeros((1, 8), np.int8), (2**50, 8)), np.ones(1, F32), "int8")),
    ("linear broadcast x", ValueError, "x", lambda: lin(np.broadcast_to(np.zeros((1, 8), F32), (2**50, 8)))),
    ("linear broadcast w", ValueError, "w",
     lambda: lin(x_(), np.broadcast_to(np.zeros((1, 8), np.int8), (2**50, 8)), np.ones(1, F32))),
    ("pack broadcast codes", ValueError, "codes",
     lambda: ops.pack(np.broadcast_to(np.zeros((1, 8), np.uint8), (2**50, 8)), 4)),
    ("unpack broadcast packed", ValueError, "packed",
     lambda: ops.unpack(np.broadcast_to(np.zeros((1, 16), np.uint8), (2**50, 16)), 4, 8)),
    # cols is checked against packed's rows before the codes are allocated: 3 x 2**40 bytes here
    ("unpack cols past packed's rows", ValueError, "cols", lambda: ops.unpack(np.zeros((3, 16), np.uint8), 3, 2**40)),
    ("logit error q list", TypeError, "q", lambda: ops.attention_int8_logit_error([[1.0]], np.zeros((1, 2, 1, 8), F32), 0.25)),
    ("logit error k None", TypeError, "k", lambda: ops.attention_int8_logit_error(np.zeros((1, 2, 1, 8), F32), None, 0.25)),
    ("numpy has no bfloat16", TypeError, "bfloat16",
     lambda: ops.dequantize(np.zeros((3, 8), np.int8), np.ones(3, F32), "int8", dtype="bfloat16")),
]


@pytest.mark.parametrize("exc, name, fn", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(exc, name, fn):
    raises(exc, name, fn)


def test_exception_types_follow_the_status_codes():
    assert issubclass(cquant.CudaError, RuntimeError)
    assert (_C.OK, _C.ERR_INVALID_ARG, _C.ERR_TYPE, _C.ERR_UNSUPPORTED, _C.ERR_DLPACK) == (0, 1, 2, 3, 4)


def test_bad_inputs_leave_outputs_alone():
    """Arguments are checked before anything is written."""
    q = np.full((3, 8), 7, np.int8)
    s = np.full(2, 3.0, F32)  # wrong size
    with pytest.raises(ValueError, match="scale"):
        ops.quantize(x_(), "int8", out=q, scale_out=s)
    assert np.all(q == 7) and np.all(s == 3.0)


def test_read_only_inputs_are_fine():
    x = readonly(x_())
    scale = readonly(np.full(3, 0.01, F32))
    q, s = ops.quantize(x, "int8", scale=scale)
    assert s is scale
    w, ws = int8_weight()
    y = ops.linear(x, readonly(w), readonly(ws), weight_format="int8", bias=readonly(np.ones(4, F32)))
    assert y.shape == (3, 4)


# ---------------------------------------------------------------- DLPack protocol


def quantize_via(producer, rows=3, cols=8):
    """_C.quantize with x from `producer`; returns (q, scale)."""
    q, s = np.zeros((rows, cols), np.int8), np.zeros(rows, F32)
    _C.quantize(producer, q, s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    return q, s


def test_versioned_producer_is_accepted_and_deleted_once():
    x = x_()
    p = Producer(x, version=(1, 0))
    q, s = quantize_via(p)
    q0, s0 = ops.quantize(x, "int8")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(s, s0)
    assert p.exports == 1 and p.deletes == 1 and p.balanced
    assert _C.dlpack_info(Producer(x, version=(1, 3)))["versioned"]


@pytest.mark.parametrize("cls_kw", [(LegacyProducer, {}), (Producer, {"version": None})],
                         ids=["no max_version", "legacy capsule"])
def test_legacy_capsule_is_accepted_and_deleted_once(cls_kw):
    cls, kw = cls_kw
    x = x_()
    p = cls(x, **kw)
    q, s = quantize_via(p)
    np.testing.assert_array_equal(q, ops.quantize(x, "int8")[0])
    assert p.exports == 1 and p.deletes == 1 and p.balanced
    info = _C.dlpack_info(cls(x, **kw))
    assert info["versioned"] is False and info["shape"] == (3, 8) and info["dtype"] == "float32"


@pytest.mark.parametrize("major", [2, 7])
def test_newer_major_version_is_refused(major):
    p = Producer(x_(), version=(major, 0))
    with pytest.raises(BufferError, match=r"(^|\W)x\W.*version"):
        quantize_via(p)
    assert p.exports == 1 and p.deletes == 1 and p.balanced  # by the capsule's destructor


def test_byte_offset_is_honoured():
    x = x_(4, 8)
    p = Producer(x, shape=(3, 8), byte_offset=8 * 4)  # rows 1..3
    q, s = quantize_via(p)
    q0, s0 = ops.quantize(x[1:], "int8")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(s, s0)
    assert p.balanced


def test_explicit_row_major_strides_are_accepted():
    x = x_()
    p = Producer(x, strides=(8, 1))
    np.testing.assert_array_equal(quantize_via(p)[0], ops.quantize(x, "int8")[0])
    assert p.balanced


def _bad_producers():
    x = x_()
    return [
        ("negative strides", ValueError, Producer(x[::-1].copy(), strides=(-8, 1), data_offset=2 * 8 * 4)),
        ("column-major strides", ValueError, Producer(x, strides=(1, 3))),
        ("byte_offset misaligned", ValueError, Producer(np.zeros(64, np.uint8), dtype=(kDLFloat, 32, 1), shape=(3, 5),
                                                        byte_offset=1)),
        ("data misaligned", ValueError, Producer(np.zeros(64, np.uint8), dtype=(kDLFloat, 32, 1), shape=(3, 5),
                                                 data_offset=2)),
        ("vector lanes", TypeError, Producer(x, dtype=(kDLFloat, 32, 4))),
        ("float 24 bits", TypeError, Producer(x, dtype=(kDLFloat, 24, 1))),
        ("int16", TypeError, Producer(x, dtype=(kDLInt, 16, 1))),
        ("bfloat 32", TypeError, Producer(x, dtype=(kDLBfloat, 32, 1))),
        ("vulkan device", NotImplementedError, Producer(x, device=(kDLVulkan, 0), report_device=(kDLVulkan, 0))),
        ("device mismatch", BufferError, Producer(x, report_device=(kDLCPU, 0), device=(kDLCUDA, 0))),
        ("ndim 9", BufferError, Producer(np.zeros(1, F32), shape=(1,) * 9)),
        ("negative extent", BufferError, Producer(x, shape=(3, -8))),
        # sizes whose products overflow int64 (they segfaulted or hung)
        ("element count overflows int64", BufferError, Producer(x, shape=(2**40, 2**40))),
        ("element count overflows over three dims", BufferError, Producer(x, shape=(2**21, 2**21, 2**22))),
        ("byte count overflows int64", BufferError, Producer(x, shape=(2**62,))),
        ("strides reach past int64", BufferError, Producer(x, strides=(2**62, 1))),
        ("negative strides reach past int64", BufferError, Producer(x, strides=(-(2**62), 1))),
        ("stride INT64_MIN", BufferError, Producer(x, strides=(-(2**63), 1))),
        ("byte_offset past the address space", BufferError, Producer(x, byte_offset=2**64 - 8)),
        ("read-only output", ValueError, None),
    ]


@pytest.mark.parametrize("case", range(len(_bad_producers())), ids=[c[0] for c in _bad_producers()])
def test_bad_dlpack_tensors_are_refused_and_deleted_once(case):
    what, exc, p = _bad_producers()[case]
    if p is None:  # the read-only flag, on the output
        x, p = x_(), Producer(np.zeros((3, 8), np.int8), readonly=True)
        with pytest.raises(exc, match=r"(^|\W)q\W"):
            _C.quantize(x, p, np.zeros(3, F32), _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    else:
        with pytest.raises(exc, match=r"(^|\W)x\W"):
            quantize_via(p)
    assert p.exports == 1 and p.deletes == 1 and p.balanced, what


def test_every_argument_is_deleted_once_when_a_later_one_fails():
    x, q, s = Producer(x_()), Producer(np.zeros((3, 8), np.int8)), Producer(np.zeros(3, F32))
    bad_s = Producer(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="scale"):
        _C.quantize(x, q, bad_s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    with pytest.raises(ValueError, match="granularity"):  # fails after every import
        _C.quantize(x, q, s, _C.FORMAT_INT8, 9)
    with pytest.raises(TypeError, match="q"):  # q not an array: x was already taken
        _C.quantize(x, [1], s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    for p in (x, q, s, bad_s):
        assert p.balanced and p.deletes == p.exports >= 1
    assert x.exports == 3


def test_linear_deletes_every_argument_once():
    w, ws = int8_weight()
    ps = [Producer(a) for a in (x_(), w, ws, np.ones(4, F32), np.zeros((3, 4), F32))]
    ops.linear(ps[0], ps[1], ps[2], weight_format="int8", bias=ps[3], out=ps[4])
    np.testing.assert_array_equal(ps[4].array, ops.linear(x_(), w, ws, weight_format="int8", bias=np.ones(4, F32)))
    bad_out = Producer(np.zeros((3, 5), F32))
    with pytest.raises(ValueError, match="y"):
        ops.linear(ps[0], ps[1], ps[2], weight_format="int8", bias=ps[3], out=bad_out)
    for p in ps + [bad_out]:
        assert p.balanced and p.exports >= 1


def test_dlpack_returning_a_non_capsule_is_a_buffer_error():
    class NotACapsule:
        shape = (3, 8)

        def __dlpack__(self, stream=None, max_version=None):
            return 42

    with pytest.raises(BufferError, match=r"(^|\W)x\W"):
        quantize_via(NotACapsule())


@pytest.mark.parametrize("dtype", ["bogus", "Tensor", "float64", None])
def test_dequantize_names_a_result_dtype_it_cannot_make(torch, dtype):
    """An unknown dtype name is a TypeError naming dtype, for torch inputs too (it was an
    AttributeError from torch: the name was looked up on the torch module)."""
    q, s = ops.quantize(torch.randn(3, 8), "int8")
    raises(TypeError, "dtype", lambda: ops.dequantize(q, s, "int8", dtype=dtype))


def test_dequantize_takes_torch_and_numpy_dtypes(torch):
    q, s = ops.quantize(torch.randn(3, 8), "int8")
    for dtype, name in ((torch.bfloat16, "bfloat16"), (np.float16, "float16"), (np.dtype("float32"), "float32")):
        assert torch.equal(ops.dequantize(q, s, "int8", dtype=dtype), ops.dequantize(q, s, "int8", dtype=name))


@pytest.mark.cuda
def test_mixed_devices(torch):
    x = torch.randn(3, 8, device="cuda")
    q, s = np.zeros((3, 8), np.int8), np.zeros(3, F32)
    with pytest.raises(ValueError, match=r"(^|\W)q\W.*cpu.*cuda"):
        _C.quantize(x, q, s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    qc = torch.zeros(3, 8, dtype=torch.int8, device="cuda")
    with pytest.raises(ValueError, match=r"(^|\W)scale\W"):
        ops.quantize(x, "int8", out=qc, scale_out=torch.zeros(3))
    w, ws = ops.quantize(torch.randn(4, 8), "int8")  # CPU weights
    with pytest.raises(ValueError, match=r"(^|\W)w\W"):
        ops.linear(x, w, ws, weight_format="int8")
    wc, wsc = w.cuda(), ws.cuda()
    with pytest.raises(ValueError, match=r"(^|\W)bias\W"):
        ops.linear(x, wc, wsc, weight_format="int8", bias=torch.zeros(4))


# ---------------------------------------------------------------- outputs that overlap other arguments


def _carve(base, offset, dtype, shape):
    """A view of `shape` `dtype` elements starting `offset` bytes into the uint8 array base."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return base[offset:offset + n].view(dtype).reshape(shape)


def _overlap_cases():
    """(id, output argument, other argument, call): each call passes an output that shares bytes
    with another argument, carved out of one buffer."""
    b = lambda: np.zeros(4096, np.uint8)  # noqa: E731
    w, ws = int8_weight(4, 8)
    I8, G = _C.FORMAT_INT8, _C.GRANULARITY_ROW
    cases = []

    def quantize_q_x():
        base = b()
        x = _carve(base, 0, F32, (3, 8))
        x[:] = x_()
        return _C.quantize(x, _carve(base, 16, np.int8, (3, 8)), np.zeros(3, F32), I8, G)

    def quantize_scale_x():
        base = b()
        x = _carve(base, 0, F32, (3, 8))
        x[:] = x_()
        return _C.quantize(x, np.zeros((3, 8), np.int8), _carve(base, 8, F32, (3,)), I8, G)

    def quantize_q_scale():
        base = b()
        return _C.quantize(x_(), _carve(base, 0, np.int8, (3, 8)), _carve(base, 4, F32, (3,)), I8, G)

    def quantize_q_static_scale():
        base = b()
        s = _carve(base, 0, F32, (3,))
        s[:] = 0.01
        return _C.quantize(x_(), _carve(base, 8, np.int8, (3, 8)), s, I8, G, True)

    def dequantize_y_q():
        base = b()
        q = _carve(base, 0, np.int8, (3, 8))
        return _C.dequantize(q, np.ones(3, F32), _carve(base, 0, F32, (3, 8)), I8, G)

    def dequantize_y_scale():
        base = b()
        return _C.dequantize(np.zeros((3, 8), np.int8), _carve(base, 80, F32, (3,)), _carve(base, 0, F32, (3, 8)), I8, G)

    def pack_packed_codes():
        base = b()
        return _C.pack(_carve(base, 0, np.uint8, (3, 8)), _carve(base, 8, np.uint8, (3, 16)), 3)

    def unpack_codes_packed():
        base = b()
        return _C.unpack(_carve(base, 0, np.uint8, (3, 16)), _carve(base, 40, np.uint8, (3, 8)), 3)

    def linear_with(y_over):
        def call():
            base = b()
            args = dict(x=x_(), w=w.copy(), w_scale=ws.copy(), bias=np.zeros(4, F32))
            args[y_over] = _carve(base, 0, args[y_over].dtype, args[y_over].shape)
            args[y_over][:] = {"x": x_(), "w": w, "w_scale": ws, "bias": 0.0}[y_over]
            y = _carve(base, 8, F32, (3, 4))
            return _C.linear(args["x"], args["w"], args["w_scale"], args["bias"], y, I8, G, 0, G, 8)
        return call

    def linear_quantized_with(y_over):
        def call():
            base = b()
            xc, xs = ops.quantize(x_(), "int8")
            args = dict(x_codes=xc, x_scale=xs)
            args[y_over] = _carve(base, 0, args[y_over].dtype, args[y_over].shape)
            args[y_over][:] = {"x_codes": xc, "x_scale": xs}[y_over]
            y = _carve(base, 4, F32, (3, 4))
            return _C.linear_quantized(args["x_codes"], args["x_scale"], w, ws, None, y, I8, G, I8, G, 8)
        return call

    def attention_lse(over):
        def call():
            base = b()
            q, k, v = (np.ones((1, 7, 2, 8), F32) for _ in range(3))
            lse = _carve(base, 0, F32, (1, 2, 7))
            args = dict(q=q, k=k, v=v)
            args[over] = _carve(base, 16, F32, (1, 7, 2, 8))
            args[over][:] = 1.0
            return _C.attention(args["q"], args["k"], args["v"], np.empty((1, 7, 2, 8), F32), 0.1,
                                _C.ATTENTION_FULL, lse=lse)
        return call

    cases += [
        ("quantize q over x", "q", "x", quantize_q_x),
        ("quantize scale over x", "scale", "x", quantize_scale_x),
        ("quantize q over scale", "q", "scale", quantize_q_scale),
        ("quantize q over a static scale", "q", "scale", quantize_q_static_scale),
        ("dequantize y over q", "y", "q", dequantize_y_q),
        ("dequantize y over scale", "y", "scale", dequantize_y_scale),
        ("pack packed over codes", "packed", "codes", pack_packed_codes),
        ("unpack codes over packed", "codes", "packed", unpack_codes_packed),
        ("attention lse over q", "lse", "q", attention_lse("q")),
        ("attention lse over v", "lse", "v", attention_lse("v")),
    ]
    cases += [(f"linear y over {a}", "y", a, linear_with(a)) for a in ("x", "w", "w_scale", "bias")]
    cases += [(f"linear_quantized y over {a}", "y", a, linear_quantized_with(a)) for a in ("x_codes", "x_scale")]
    return cases


@pytest.mark.parametrize("case", _overlap_cases(), ids=lambda c: c[0])
def test_outputs_overlapping_inputs_are_refused(case):
    """An op that wrote an output sharing bytes with an argument it still reads (or with another
    output) would compute from half-written data: quantize with q over x gave wrong codes. Every
    op refuses it, naming both arguments."""
    _, out, other, call = case
    with pytest.raises(ValueError, match=rf"\b{out} overlaps {other}\b"):
        call()


def test_neighbouring_views_of_one_buffer_are_fine():
    """Views of one buffer that do not share bytes are separate arguments."""
    base = np.zeros(4096, np.uint8)
    x = _carve(base, 0, F32, (3, 8))
    x[:] = x_()
    q = _carve(base, 96, np.int8, (3, 8))
    s = _carve(base, 120, F32, (3,))
    _C.quantize(x, q, s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    ref_q, ref_s = ops.quantize(x_(), "int8")
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(s, ref_s)


# ---------------------------------------------------------------- sizes that overflow


@pytest.mark.parametrize("fmt", ["fp7_e6m0", "fp3_e1m1", "fp4_e2m1"])
def test_packed_row_bytes_of_huge_column_counts_is_refused(fmt):
    f = ops.format_info(fmt)
    assert _C.packed_row_bytes(f.id, 2**40) == 2**40 * f.bits // 8
    for cols in (2**62, (2**63 - 1) // f.bits, 2**63 - 1):
        with pytest.raises(ValueError, match="int64"):
            _C.packed_row_bytes(f.id, cols)
    assert _C.packed_row_bytes(ops.format_info("int8").id, 2**63 - 1) == 2**63 - 1  # unpacked: one byte a code


def test_huge_column_counts_of_packed_formats_are_refused():
    """A row of 2^61 - 1 float32 values fits int64 bytes, its fp7 packed row (7 bits a code) does
    not: refused before anything is read, naming the argument (the unchecked product wrapped)."""
    cols = 2**61 - 1
    x = Producer(np.zeros(1, F32), shape=(1, cols))
    q = np.zeros((1, 16), np.uint8)
    with pytest.raises(ValueError, match=r"\bx has \d+ columns"):
        _C.quantize(x, q, np.zeros(1, F32), ops.format_info("fp7_e6m0").id, _C.GRANULARITY_ROW)
    codes = Producer(np.zeros(1, np.uint8), shape=(1, 2**62))
    with pytest.raises(ValueError, match=r"\bcodes has \d+ columns"):
        _C.pack(codes, np.zeros((1, 16), np.uint8), 3)
    assert x.balanced and codes.balanced


def test_int8_layers_refuse_k_past_the_int32_limit():
    """int8 x int8 sums are int32: K * 128 * 128 must stay below 2^31 for any codes (cquant.h,
    CQ_LINEAR_INT8_MAX_K). One more feature is refused on every device."""
    kmax = _C.LINEAR_INT8_MAX_K
    assert kmax == (2**31 - 1) // (128 * 128)
    x = np.ones((1, kmax + 1), F32)
    w = np.full((1, kmax + 1), 127, np.int8)
    with pytest.raises(NotImplementedError, match="CQ_LINEAR_INT8_MAX_K"):
        ops.linear(x, w, np.ones(1, F32), weight_format="int8", act_format="int8")
    xc, xs = ops.quantize(x, "int8")
    with pytest.raises(NotImplementedError, match="x_codes has"):
        _C.linear_quantized(xc, xs, w, np.ones(1, F32), None, np.zeros((1, 1), F32), _C.FORMAT_INT8,
                            _C.GRANULARITY_ROW, _C.FORMAT_INT8, _C.GRANULARITY_ROW, kmax + 1)
    # weight-only int8 (fp32 sums) takes any K
    ops.linear(x, w, np.ones(1, F32), weight_format="int8")


def test_int8_layer_at_the_k_limit_is_exact():
    """At K = CQ_LINEAR_INT8_MAX_K with every code 127 the int32 sum is 127^2 K < 2^31, exactly."""
    kmax = _C.LINEAR_INT8_MAX_K
    x = np.ones((1, kmax), F32)
    w = np.full((2, kmax), 127, np.int8)
    w[1] = -127
    sw = np.ones(2, F32)
    y = ops.linear(x, w, sw, weight_format="int8", act_format="int8")
    sx = np.float32(1.0) / np.float32(127.0)  # the scale of an all-ones row
    acc = float(127 * 127 * kmax)
    np.testing.assert_array_equal(y[0], np.array([np.float32(acc) * sx, -(np.float32(acc) * sx)], F32))


def test_int8_codes_of_minus_128_are_exact_at_the_k_limit():
    """-128, which the quantizer never writes, is a code a caller or an edited checkpoint may hold:
    it decodes to -128 and the int32 sum of K = CQ_LINEAR_INT8_MAX_K such products is exact (at the
    old limit, from 127^2, it wrapped to a wrong sign)."""
    kmax = _C.LINEAR_INT8_MAX_K
    xc = np.full((1, kmax), -128, np.int8)
    w = np.full((2, kmax), -128, np.int8)
    w[1] = 127
    xs, sw = np.ones(1, F32), np.ones(2, F32)
    y = np.zeros((1, 2), F32)
    _C.linear_quantized(xc, xs, w, sw, None, y, _C.FORMAT_INT8, _C.GRANULARITY_ROW, _C.FORMAT_INT8,
                        _C.GRANULARITY_ROW, kmax)
    np.testing.assert_array_equal(y[0], np.array([128 * 128 * kmax, -128 * 127 * kmax], F32))
    assert ops.dequantize(w[:1, :3], np.ones(1, F32), "int8").tolist() == [[-128.0] * 3]


def test_torch_negative_bit_views_are_refused(torch):
    """torch's lazily negated views (torch._neg_view, and what some ops return) export their stored
    values through DLPack, the opposite of the values they hold: read, they gave codes of -x.
    libcquant's extension refuses them as a BufferError naming the argument, in or out."""
    x = torch.from_numpy(x_())
    neg = torch._neg_view(x)
    assert neg.is_neg()
    q, s = torch.zeros(3, 8, dtype=torch.int8), torch.zeros(3)
    with pytest.raises(BufferError, match=r"\bx has torch's negative bit set"):
        _C.quantize(neg, q, s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    q_neg = torch._neg_view(q)  # torch allows the bit on any signed type
    with pytest.raises(BufferError, match=r"\bq has torch's negative bit set"):
        _C.quantize(x, q_neg, s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
    # the Python ops resolve such inputs before they reach libcquant
    codes, _ = ops.quantize(neg, "int8")
    np.testing.assert_array_equal(codes.numpy(), ops.quantize(-x_(), "int8")[0])


def test_messages_name_what_the_caller_passed():
    """Each refusal names the caller's own argument and the real cause: an empty NumPy array (whose
    strides NumPy 2 writes as 0) is not "a broadcast view", a residual of the wrong dtype is not
    "y", a bool x is not refused while allocating y, and int4 weights with uint4's [N, G, 2]
    scales are not blamed on a group size nobody passed."""
    w, ws = int8_weight()
    with pytest.raises(ValueError, match=r"x has a zero-size dimension"):
        ops.quantize(np.zeros((0, 8), F32), "int8")
    with pytest.raises(TypeError, match=r"^residual has dtype float16"):
        ops.linear_gated(x_(4), w, ws, np.ones((1, 4), F32), np.ones((4, 4), np.float16), weight_format="int8")
    with pytest.raises(TypeError, match=r"^x has dtype bool"):
        ops.linear(np.ones((3, 8), bool), w, ws, weight_format="int8")
    q4, _ = ops.quantize(np.ones((4, 64), F32), "int4", group_size=32)
    _, su = ops.quantize(np.ones((4, 64), F32), "uint4", group_size=32)
    with pytest.raises(ValueError, match=r"^w_scale has shape \(4, 2, 2\); expected fp32 \[4, G\]"):
        ops.linear(np.ones((3, 64), F32), q4, su, weight_format="int4", in_features=64)
    a = np.ones((1, 2, 1, 8), F32)
    with pytest.raises(TypeError, match=r"^scale must be a real number"):
        cquant.attention(a, a, a, scale="x")
    d0 = np.ones((1, 2, 1, 0), F32)
    with pytest.raises(ValueError, match=r"head_dim = 0; expected"):  # the default scale 1/sqrt(0) raised first
        cquant.attention(d0, d0, d0)
