"""CUDA quantize / dequantize / pack / unpack: bit-identical to the CPU reference.

The CPU path of the same ops is the C reference (cq_*_ref), itself checked exactly against
tests/reference.py by test_quantize.py. Every GPU output is poisoned before each run, twice with
different sentinels, so a position the kernel forgot to write cannot pass. Scales and codes
compare bit for bit (NaN scales included: both paths write the same quiet NaN); dequantized
values bit for bit except NaN payloads (the contract says NaN, not which one).

Run on a GPU machine: pytest -m cuda tests/test_quantize_cuda.py
"""

import numpy as np
import pytest

from cquant import ops

import reference as ref
from helpers import assert_same_bits, bits

pytestmark = pytest.mark.cuda

ALL = list(ref.FORMATS)
GRANULARITIES = ["row", "tensor"]
DTYPES = ["float32", "float16", "bfloat16"]
# (4608, 3, 128) .. (5, 8): rows of at most 32 16-byte vectors (attention heads' rows), which the
# per-row kernels give a few threads each, with row counts that leave a block partly empty
SHAPES = [(1, 1), (1, 7), (3, 97), (2, 3, 97), (7, 1025), (4608, 97), (4608, 1025), (4608, 3, 128), (37, 256),
          (3, 64), (5, 8)]
POISONS = (0xA5, 0x5A)
Y_POISON = 0x7B  # a finite value in f32, f16 and bf16: an unwritten output is not NaN


def poison(t, byte):
    import torch

    t.view(torch.uint8).fill_(byte)
    return t


def cpu_input(torch, gen, shape, dtype, spread=2.0):
    """Random N(0, 1) rows with magnitudes spread over e^(+-2 spread), as a CPU tensor of dtype."""
    x = torch.randn(shape, generator=gen)
    x *= torch.exp(spread * torch.randn(shape[:-1] + (1,), generator=gen))
    return x.to(getattr(torch, dtype))


def assert_same(gpu, cpu, what, nan_by_position=False):
    assert tuple(gpu.shape) == tuple(cpu.shape) and gpu.dtype == cpu.dtype, what
    assert gpu.is_cuda and not cpu.is_cuda
    assert_same_bits(gpu, cpu, what, nan_by_position=nan_by_position)


def quantize_both(torch, x_cpu, name, granularity, scale_cpu=None, what=""):
    """Quantize on the CPU and, twice with differently poisoned outputs, on the GPU; compare."""
    q_ref, s_ref = ops.quantize(x_cpu, name, granularity, scale=scale_cpu)
    x = x_cpu.cuda()
    scale = None if scale_cpu is None else scale_cpu.cuda()
    for byte in POISONS:
        q = poison(torch.empty_like(q_ref, device="cuda"), byte)
        s = poison(torch.empty_like(s_ref, device="cuda"), byte)
        q_out, s_out = ops.quantize(x, name, granularity, scale=scale, out=q, scale_out=None if scale is not None else s)
        assert q_out is q
        torch.cuda.synchronize()
        assert_same(q, q_ref, f"{what}: codes (poison {byte:#x})")
        if scale is None:
            assert s_out is s
            assert_same(s, s_ref, f"{what}: scales (poison {byte:#x})")
        else:
            assert s_out is scale
            np.testing.assert_array_equal(bits(scale), bits(scale_cpu))  # a static scale is only read
    return q_ref, s_ref


@pytest.fixture
def gen(torch, seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_quantize_matches_cpu(torch, gen, name, dtype, granularity):
    for shape in SHAPES:
        x = cpu_input(torch, gen, shape, dtype)
        quantize_both(torch, x, name, granularity, what=f"{name} {dtype} {granularity} {shape}")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1"])
def test_quantize_matches_cpu_at_model_size(torch, gen, name, granularity):
    x = cpu_input(torch, gen, (4608, 3072), "bfloat16", spread=0.5)
    quantize_both(torch, x, name, granularity, what=f"{name} 4608x3072")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "fp3_e2m0", "fp7_e6m0"])
def test_nonfinite_and_zero_rows_match_cpu(torch, gen, name, dtype, granularity):
    rows, cols = 37, 1025
    x = cpu_input(torch, gen, (rows, cols), dtype).float()
    x[3, 5] = float("nan")
    x[7, -1] = float("inf")
    x[11, 0] = float("-inf")
    x[13] = 0.0
    x[17] = -0.0
    x = x.to(getattr(torch, dtype))
    q, s = quantize_both(torch, x, name, granularity, what=f"{name} {dtype} {granularity} bad rows")
    if granularity == "row":
        assert torch.isnan(s[[3, 7, 11]]).all() and torch.isfinite(s[[0, 13, 17]]).all()
    else:
        assert torch.isnan(s).all()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_static_scales_match_cpu(torch, gen, name, dtype, granularity):
    rows, cols = 45, 97
    x = cpu_input(torch, gen, (rows, cols), dtype)
    _, s = ops.quantize(x, name, granularity)
    # from 4x too small (saturating) to 4x too large, and scales that give zero codes
    s = s * torch.exp2(torch.empty(s.shape).uniform_(-2, 2, generator=gen))
    quantize_both(torch, x, name, granularity, scale_cpu=s, what=f"{name} {dtype} {granularity} static")
    if granularity == "row":
        s[[1, 5, 9, 13, 17]] = torch.tensor([float("nan"), 0.0, -1.0, float("inf"), 1e-45])
        xx = x.float()
        xx[2, 3] = float("nan")  # static scales do not look at the data: NaN encodes to 0
        xx[4, 4] = float("inf")  # and Inf saturates
        quantize_both(torch, xx.to(x.dtype), name, granularity, scale_cpu=s, what=f"{name} bad static scales")
    else:
        for bad in (float("nan"), 0.0, -2.0):
            quantize_both(torch, x, name, granularity, scale_cpu=torch.tensor([bad]), what=f"{name} scale {bad}")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ALL)
def test_dequantize_matches_cpu(torch, gen, name, granularity):
    for shape in [(1, 1), (3, 97), (7, 1025), (4608, 97)]:
        x = cpu_input(torch, gen, shape, "float32")
        x[0, 0] = float("nan")  # row 0 (or the whole tensor) dequantizes to NaN
        q, s = ops.quantize(x, name, granularity)
        qg, sg = q.cuda(), s.cuda()
        for dtype in DTYPES:
            y_ref = ops.dequantize(q, s, name, cols=shape[-1], dtype=dtype, granularity=granularity)
            y = poison(torch.empty_like(y_ref, device="cuda"), Y_POISON)
            assert ops.dequantize(qg, sg, name, cols=shape[-1], granularity=granularity, out=y) is y
            torch.cuda.synchronize()
            assert_same(y, y_ref, f"{name} {granularity} {shape} -> {dtype}", nan_by_position=True)
            assert torch.isnan(y[0]).all()


@pytest.mark.parametrize("bits_", range(1, 9))
def test_pack_unpack_match_cpu(torch, gen, bits_):
    for rows, cols in [(1, 1), (1, 7), (3, 97), (5, 1025), (4, 128), (4608, 1025)]:
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)  # high bits ignored
        packed_ref = ops.pack(codes, bits_)
        np.testing.assert_array_equal(packed_ref.numpy(), ref.pack(codes.numpy() & ((1 << bits_) - 1), bits_))
        for byte in POISONS:
            packed = poison(torch.empty_like(packed_ref, device="cuda"), byte)
            assert ops.pack(codes.cuda(), bits_, out=packed) is packed
            torch.cuda.synchronize()
            assert_same(packed, packed_ref, f"pack {bits_} bits {rows}x{cols}")  # padding zero too
            out = poison(torch.empty_like(codes, device="cuda"), byte)
            assert ops.unpack(packed, bits_, cols, out=out) is out
            torch.cuda.synchronize()
            assert_same(out, ops.unpack(packed_ref, bits_, cols), f"unpack {bits_} bits {rows}x{cols}")
            if packed.shape[1] * 8 > cols * bits_:
                dirty = packed.clone()
                dirty[-1, -1] |= 0x80  # a bit set in the padding, which pack leaves zero
                with pytest.raises(ValueError, match=f"cols = {cols}"):
                    ops.unpack(dirty, bits_, cols, out=out)


@pytest.mark.parametrize("name", ["fp6_e3m2", "fp5_e2m2", "fp4_e2m1", "fp3_e1m1"])
def test_codes_past_cols_are_refused_on_cuda(torch, gen, name):
    """Rows packed with more columns than the cols given (same padded row size): the CUDA path
    refuses codes past cols as the CPU one does, and accepts zero ones with the CPU's result."""
    f = ref.fmt(name)
    cols = 3 * 128 // f.bits - 1
    c = next(c for c in range(1, cols) if ref.packed_row_bytes(f.bits, c) == ref.packed_row_bytes(f.bits, cols))
    codes = torch.randint(0, 1 << f.bits, (4608, cols), dtype=torch.uint8, generator=gen)
    codes[:, c:] = 0
    scale = torch.rand(4608, generator=gen) + 0.5
    clean = ops.pack(codes, f.bits)
    assert torch.equal(ops.unpack(clean.cuda(), f.bits, c).cpu(), codes[:, :c])
    assert_same(ops.dequantize(clean.cuda(), scale.cuda(), name, cols=c), ops.dequantize(clean, scale, name, cols=c),
                f"{name}: zero codes past {c}")
    for row, j in ((0, c), (4607, cols - 1)):  # the first padding bit of c columns; the last code
        dirty = codes.clone()
        dirty[row, j] = 1
        q = ops.pack(dirty, f.bits).cuda()
        with pytest.raises(ValueError, match=f"cols = {c}, .*past"):
            ops.unpack(q, f.bits, c)
        with pytest.raises(ValueError, match=f"cols = {c}, .*past"):
            ops.dequantize(q, scale.cuda(), name, cols=c)
        assert_same(ops.dequantize(q, scale.cuda(), name, cols=cols), ops.dequantize(q.cpu(), scale, name, cols=cols),
                    f"{name}: {cols} columns")


# GPU clock cycles torch.cuda._sleep spins for: about 0.1 s at H100 clocks, far longer than
# the host takes to enqueue the ops under test behind it.
SIDE_STREAM_SLEEP_CYCLES = 200_000_000


def test_quantize_runs_on_the_current_stream(torch, gen):
    """x becomes valid on a side stream only after a long sleep kernel there; ops that ran on any
    other stream (the legacy default one, say) would read the NaN poison it held before."""
    x_cpu = cpu_input(torch, gen, (513, 1025), "bfloat16")
    q_ref, s_ref = ops.quantize(x_cpu, "fp8_e4m3", "tensor")
    src = x_cpu.cuda()
    ops.dequantize(*ops.quantize(src, "fp8_e4m3", "tensor"), "fp8_e4m3", dtype="bfloat16")  # loads the kernels
    x = torch.full_like(src, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SIDE_STREAM_SLEEP_CYCLES)
        x.copy_(src)
        q, s = ops.quantize(x, "fp8_e4m3", "tensor")
        y = ops.dequantize(q, s, "fp8_e4m3", dtype="bfloat16")
    assert not side.query(), "the side stream finished before the ops were enqueued: lengthen the sleep"
    side.synchronize()
    assert_same(q, q_ref, "codes on a side stream")
    assert_same(s, s_ref, "scale on a side stream")
    assert_same(y, ops.dequantize(q_ref, s_ref, "fp8_e4m3", dtype="bfloat16"), "dequantize", nan_by_position=True)


@pytest.mark.parametrize("name, granularity", [("fp8_e4m3", "row"), ("fp8_e4m3", "tensor"), ("int8", "row"),
                                               ("int8", "tensor"), ("fp6_e3m2", "row"), ("fp4_e2m1", "tensor")])
def test_quantize_in_a_cuda_graph(torch, gen, name, granularity):
    """Captured once, replayed on new data: the ops allocate nothing and sync nothing."""
    shape = (257, 1025)
    x = cpu_input(torch, gen, shape, "bfloat16").cuda()
    q_ref, s_ref = ops.quantize(x.cpu(), name, granularity)
    q = torch.empty_like(q_ref, device="cuda")
    s = torch.empty_like(s_ref, device="cuda")
    y = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        for _ in range(2):
            ops.quantize(x, name, granularity, out=q, scale_out=s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.quantize(x, name, granularity, out=q, scale_out=s)
        ops.dequantize(q, s, name, cols=shape[1], granularity=granularity, out=y)
    for trial in range(4):
        new = cpu_input(torch, gen, shape, "bfloat16")
        if trial == 2:
            new[5, 7] = float("nan")
        x.copy_(new)
        poison(q, POISONS[trial % 2])
        poison(s, POISONS[trial % 2])
        poison(y, Y_POISON)
        graph.replay()
        torch.cuda.synchronize()
        q_ref, s_ref = ops.quantize(new, name, granularity)
        assert_same(q, q_ref, f"replay {trial}: codes")
        assert_same(s, s_ref, f"replay {trial}: scales")
        y_ref = ops.dequantize(q_ref, s_ref, name, cols=shape[1], dtype="bfloat16", granularity=granularity)
        assert_same(y, y_ref, f"replay {trial}: dequantized", nan_by_position=True)


def test_no_cuda_error_is_left_behind(torch):
    torch.cuda.synchronize()
    x = torch.randn(3, 5, device="cuda")
    ops.quantize(x, "int8")
    torch.cuda.synchronize()  # raises if any earlier launch faulted asynchronously


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "fp7_e6m0"])
def test_tiny_static_scales_saturate_like_cpu(torch, gen, name, dtype, granularity):
    """A valid scale below 2^-128 (1 / scale overflows fp32) saturates every nonzero element
    and gives code 0 for zeros, on the GPU as in the C reference (it gave all-zero codes)."""
    f = ref.fmt(name)
    x = cpu_input(torch, gen, (6, 97), dtype).float()
    x[:, 0], x[:, 1] = 0.0, float("inf")
    x = x.to(getattr(torch, dtype))
    for tiny in (1e-39, 2.0**-129, 1e-45):
        s = torch.tensor([tiny] if granularity == "tensor" else [tiny, 0.5, tiny, tiny, 0.25, tiny])
        q, _ = quantize_both(torch, x, name, granularity, scale_cpu=s, what=f"{name} {dtype} scale {tiny}")
        if not f.packed:
            codes = q.view(torch.uint8)[0].numpy().astype(np.int64)
            mags = np.where(codes >= 128, 256 - codes, codes) if f.kind == "int" else codes % f.sign_bit
            assert codes[0] == 0 and np.all(mags[1:] == f.max_code), f"{name} {tiny}: not saturated"
