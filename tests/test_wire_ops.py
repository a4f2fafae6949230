"""ops.wire_encode / ops.wire_decode (cq_wire_encode / cq_wire_decode): rows of strided views to int8
codes, fp32 scales and decoded-row norms and back, as cquant.h states the math: the C reference
against the same fp32 operations written in torch, bit for bit; the CUDA path against the C
reference, bit for bit, on every path (vectors of 4 to 32 threads a row, a warp a row for other
alignments and lengths); the arguments it refuses."""

import numpy as np
import pytest
import torch

from cquant import _C, ops
from tolerances import OUTPUT_UNIT_ROUNDOFF

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()


def _want_encode(x, mean):
    """codes, scales, norms by cquant.h's math, each fp32 operation rounded once (numpy's float32
    ops are IEEE's; torch's vectorized CPU division and square root can land an ulp away)."""
    v = x.float().numpy() if mean is None else x.float().numpy() - mean.numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.abs(v).max(-1)
        finite = np.isfinite(amax)
        a = np.maximum(amax, np.float32(2.0**-90))
        scale, inv = a / np.float32(127), np.float32(127) / a
        codes = np.where(finite[..., None], np.clip(np.rint(v * inv[..., None]), -127, 127), 0).astype(np.int8)
    scale = np.where(finite, scale, np.float32("nan")).astype(np.float32)
    sumsq = np.square(codes.astype(np.int64)).sum(-1).astype(np.float32)
    norms = scale * np.sqrt(sumsq)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(norms)


def _want_decode(codes, scales, mean, dtype):
    v = codes.numpy().astype(np.float32) * scales.numpy()[..., None]
    return torch.from_numpy(v if mean is None else v + mean.numpy()).to(dtype)


def _view(shape, how, dtype, device, gen, fill=None):
    """A view of `shape` cut from a larger buffer: "dense", "sliced" (rows apart: a column slice of a
    wider buffer), "permuted" (the outer dims in another order), "offset" (one element off 16-byte
    alignment: the kernels' warp-a-row path)."""
    if how == "dense":
        base = torch.empty(shape, dtype=dtype, device=device)
        view = base
    elif how == "sliced":
        base = torch.empty(*shape[:-1], shape[-1] + 8, dtype=dtype, device=device)
        view = base[..., 8:]
    elif how == "permuted":
        order = list(range(len(shape) - 1))[::-1] + [len(shape) - 1]
        base = torch.empty([shape[i] for i in order], dtype=dtype, device=device)
        view = base.permute(*[order.index(i) for i in range(len(shape))])
    else:
        base = torch.empty(shape.numel() + 1 if hasattr(shape, "numel") else _numel(shape) + 1, dtype=dtype,
                           device=device)
        view = base[1:].view(shape)
    if fill is not None:
        view.copy_(fill)
    return base, view


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _inputs(shape, dtype, gen, special=True):
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[:-1], generator=gen))[..., None]
    x += 3.0 * torch.randn(shape[-1], generator=gen)
    if special and _numel(shape[:-1]) >= 4:
        flat = x.view(-1, shape[-1])
        flat[1] = 0.0  # amax 0: the floor of the scale
        flat[2, 3] = float("nan")
        flat[3, 0] = float("inf")
    mean = torch.randn(*shape[:-2], 1, shape[-1], generator=gen) if len(shape) >= 3 else None
    return x.to(dtype), mean


SHAPES = [(5, 64), (3, 7, 128), (2, 9, 3, 128), (2, 3, 5, 2, 32), (4, 6, 100), (3, 5, 256), (2, 3, 1024),
          (2, 2, 2056), (70, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("how", ["dense", "sliced", "permuted", "offset"])
def test_cpu_matches_the_documented_math(shape, dtype, how):
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x, mean = _inputs(shape, dtype, gen)
    _, xv = _view(shape, how, dtype, "cpu", gen, fill=x)
    for m in (None, mean):
        mv = None if m is None else m.expand(shape)
        codes, scales, norms = (torch.empty(shape, dtype=torch.int8), torch.empty(shape[:-1]),
                                torch.empty(shape[:-1]))
        assert ops.wire_encode(xv, codes, scales, mean=mv, norms=norms) == (codes, scales)
        want = _want_encode(x, mv)
        assert torch.equal(codes, want[0]), (shape, dtype, how)
        assert torch.equal(scales.nan_to_num(7.0), want[1].nan_to_num(7.0))
        assert torch.equal(norms.nan_to_num(7.0), want[2].nan_to_num(7.0))
        _, yv = _view(shape, how, dtype, "cpu", gen)
        assert ops.wire_decode(codes, scales, yv, mean=mv) is yv
        assert torch.equal(yv.nan_to_num(7.0), _want_decode(codes, scales, mv, dtype).nan_to_num(7.0))
        # the round trip: within half a code step of v, then the output's rounding
        finite = torch.isfinite(scales)
        err = (yv.float() - x.float()).abs()[finite]
        bound = (scales[..., None] / 2 + yv.float().abs() * OUTPUT_UNIT_ROUNDOFF[str(dtype)[6:]] * 2)
        assert (err <= bound.expand(shape)[finite] * (1 + 2.0**-20) + 1e-30).all()


def test_the_wires_send_buffer_layout():
    """Codes then scales of each destination in one uint8 buffer (cquant.ulysses_wire): views whose
    spans interleave, which the op takes, and rows sent straight from a permuted model layout."""
    from cquant.ulysses_wire import SCALE_BYTES, _regions

    gen = torch.Generator().manual_seed(5)
    n, seq, b, hl, d = 2, 6, 1, 4, 64
    x = torch.randn(b, seq, n * hl, d, generator=gen).bfloat16()
    buf = torch.zeros(n * seq * b * hl * (d + SCALE_BYTES), dtype=torch.uint8)
    codes, scales = _regions(torch, buf, n, (seq, b, hl), d)
    rows = x.unflatten(2, (n, hl)).permute(2, 1, 0, 3, 4)
    ops.wire_encode(rows, codes, scales)
    want = _want_encode(rows.contiguous(), None)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    y = torch.empty(b, n, seq, hl, d, dtype=torch.bfloat16)
    ops.wire_decode(codes, scales, y.permute(1, 2, 0, 3, 4))
    assert torch.equal(y.permute(1, 2, 0, 3, 4), _want_decode(want[0], want[1], None, torch.bfloat16))


def test_refuses():
    x = torch.randn(4, 3, 16)
    c, s = torch.empty(4, 3, 16, dtype=torch.int8), torch.empty(4, 3)
    big = torch.empty(4 * 3 * 16 + 64, dtype=torch.uint8)
    cases = [
        (lambda: ops.wire_encode(x.double(), c, s), TypeError, "x has dtype float64"),
        (lambda: ops.wire_encode(x, c.to(torch.uint8), s), TypeError, "codes has dtype uint8"),
        (lambda: ops.wire_encode(x, c, s.double()), TypeError, "scales has dtype float64"),
        (lambda: ops.wire_encode(x, c, s, mean=x.bfloat16()), TypeError, "mean has dtype bfloat16"),
        (lambda: ops.wire_encode(x, c[:, :2], s), ValueError, "codes has shape"),
        (lambda: ops.wire_encode(x, c, s[:3]), ValueError, "scales has shape"),
        (lambda: ops.wire_encode(x, c, s, norms=torch.empty(4)), ValueError, "norms has shape"),
        (lambda: ops.wire_encode(x[..., ::2], c[..., :8], s), ValueError, "x has stride 2 in its last dim"),
        (lambda: ops.wire_encode(torch.randn(16), c[0, 0], s[0]), ValueError, "2 to 5"),
        (lambda: ops.wire_encode(torch.randn(1, 1, 1, 1, 2, 4), torch.empty(1, 1, 1, 1, 2, 4, dtype=torch.int8),
                                 torch.empty(1, 1, 1, 1, 2)), ValueError, "2 to 5"),
        (lambda: ops.wire_encode(torch.randn(0, 16), torch.empty(0, 16, dtype=torch.int8), torch.empty(0)),
         ValueError, "zero-size"),
        (lambda: ops.wire_encode(torch.randn(1, 65537), torch.empty(1, 65537, dtype=torch.int8), torch.empty(1)),
         ValueError, "at most 65536"),
        (lambda: ops.wire_encode(x, c, s, norms=s), ValueError, "overlaps"),
        (lambda: ops.wire_encode(x, big[:192].view(torch.int8).view(4, 3, 16), big[160:208].view(torch.float32)
                                 .view(4, 3)), ValueError, "codes overlaps scales"),
        (lambda: ops.wire_encode(x, c, torch.empty(4, 1).expand(4, 3)), ValueError, "scales"),
        (lambda: ops.wire_decode(c, s, x.bfloat16()[..., ::2]), ValueError, "y has"),
        (lambda: ops.wire_decode(c, s, torch.empty(4, 3, 16, dtype=torch.int32)), TypeError, "y has dtype int32"),
        (lambda: ops.wire_decode(c, s, c.view(torch.uint8)), TypeError, "y has dtype"),
        (lambda: ops.wire_decode(c, s, torch.empty(4, 3, 16), mean=torch.empty(3, 16)), ValueError, "mean has shape"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of cquant")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(3, 1000, 8, 128), (2, 4, 33, 16)])
@pytest.mark.parametrize("how", ["dense", "sliced", "permuted", "offset"])
def test_cuda_is_the_c_reference(shape, dtype, how):
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    x, mean = _inputs(shape, dtype, gen)
    for m in (None, mean):
        mv = None if m is None else m.expand(shape)
        outs = {}
        for device in ("cpu", "cuda"):
            _, xv = _view(shape, how, dtype, device, gen, fill=x)
            md = None if mv is None else mv.to(device)
            codes = torch.full(shape, 99, dtype=torch.int8, device=device)
            scales, norms = (torch.full(shape[:-1], 5.0, device=device) for _ in range(2))
            ops.wire_encode(xv, codes, scales, mean=md, norms=norms if m is not None else None)
            _, yv = _view(shape, how, dtype, device, gen)
            ops.wire_decode(codes, scales, yv, mean=md)
            outs[device] = [t.cpu().nan_to_num(7.0) for t in (codes, scales, norms, yv)]
            if m is None:
                outs[device][2] = None
        for name, a, b in zip(("codes", "scales", "norms", "y"), outs["cpu"], outs["cuda"]):
            assert a is None and b is None or torch.equal(a, b), (name, shape, dtype, how)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of cquant")
def test_cuda_send_buffer_layout_and_stream():
    """The wire's interleaved send buffer on the GPU, on a side stream, into a buffer another
    device's tensors cannot be mixed with."""
    from cquant.ulysses_wire import SCALE_BYTES, _regions

    n, seq, b, hl, d = 4, 300, 2, 6, 128
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(b, seq, n * hl, d, generator=gen).bfloat16()
    mean = torch.randn(b, n * hl, d, generator=gen)
    want = {}
    for device in ("cpu", "cuda"):
        buf = torch.zeros(n * seq * b * hl * (d + SCALE_BYTES), dtype=torch.uint8, device=device)
        codes, scales = _regions(torch, buf, n, (seq, b, hl), d)
        rows = x.to(device).unflatten(2, (n, hl)).permute(2, 1, 0, 3, 4)
        m = mean.to(device).unflatten(1, (n, hl)).transpose(0, 1)[:, None].expand(n, seq, b, hl, d)
        stream = torch.cuda.Stream() if device == "cuda" else None
        with torch.cuda.stream(stream) if stream else _nothing():
            ops.wire_encode(rows, codes, scales, mean=m)
        if stream:
            stream.synchronize()
        want[device] = buf.cpu()
    assert torch.equal(want["cpu"], want["cuda"])
    with pytest.raises(ValueError, match="device"):
        ops.wire_encode(x.cuda(), torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[:-1], device="cuda"))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
