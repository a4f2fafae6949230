"""GPU tests of cquant's attention kernels (need a CUDA device and a CUDA build of cquant).

Full precision: the kernel's error against float64 attention is at most
ATTN_CUDA_VS_SDPA_FACTOR times the error of torch's SDPA in the same dtype on the same inputs,
on every attention shape of benchmarks/shapes.json and on odd lengths and head dims. Large
shapes are checked on a random subset of query rows (the float64 reference of every row of a
CogVideoX-size call would not fit), the kernel still computing all of them. 8-bit: the accuracy
targets against float64, and agreement with the C reference of the same quantized math.
Outputs are poisoned with NaN before every call, so a row or column the kernel skips fails."""

import json
import math
import os

import numpy as np
import pytest

import cquant
import test_attention
from attention_oracle import attention_rows_f64, cosine, rel_l2
from cquant import ops
from helpers import dit_attention_inputs
from tolerances import (ATTN_CUDA_FULL_VS_REF_REL_L2, ATTN_CUDA_INT8_BOUND_MARGIN, ATTN_CUDA_INT8_VS_REF_REL_L2, ATTN_CUDA_LSE_ABS, ATTN_CUDA_REL_L2_FLOOR,
                        ATTN_CUDA_VS_SDPA_FACTOR, ATTN_INT8_IID_MIN_OUTPUTS, ATTN_INT8_IID_SPREAD, ATTN_INT8_LSE_ABS, ATTN_INT8_MIN_COSINE, ATTN_INT8_REL_L2, ATTN_INT8_REL_L2_IID,
                        ATTN_MODEL_FULL_REL_L2, ATTN_MODEL_INT8_REL_L2)

torch = pytest.importorskip("torch")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def _cuda_ok():
    return torch.cuda.is_available() and cquant._C.built_with_cuda()


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _cuda_ok(), reason="needs a CUDA GPU and a CUDA build")]

SHAPES_JSON = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "shapes.json")
MODEL_SHAPES = [(a["B"], a.get("Sq", a.get("S")), a.get("Skv", a.get("S")), a["H"], a["D"], a["model"])
                for a in json.load(open(SHAPES_JSON))["attention"]]
# (B, Sq, Skv, H, D): odd lengths and every head-dim specialisation (8 .. 256, padded ones too)
ODD_SHAPES = [(1, 1, 1, 1, 64), (1, 77, 77, 3, 64), (2, 333, 77, 2, 72), (1, 77, 333, 2, 128), (1, 4097, 4097, 2, 128),
              (1, 333, 4097, 1, 72), (2, 97, 1, 2, 40), (1, 1, 4097, 2, 8), (1, 257, 333, 2, 96), (1, 129, 200, 2, 160),
              (1, 77, 191, 2, 192), (1, 65, 333, 2, 256), (3, 130, 131, 2, 80), (1, 333, 333, 2, 248)]
# Cross attention at the odd lengths of text encoders and latents, Sq != Skv in {1, 77, 333, 4097},
# batch 2 (CFG-like, see _gen): every ordered pair once, each head dim 64, 72, 128, 256 with every
# Sq and every Skv but one (a covering set; the full product would be 48 shapes).
CROSS_SHAPES = [(2, 1, 77, 2, 64), (2, 1, 333, 2, 72), (2, 1, 4097, 2, 128), (2, 77, 1, 2, 256),
                (2, 77, 333, 2, 128), (2, 77, 4097, 2, 72), (2, 333, 1, 2, 72), (2, 333, 77, 2, 256),
                (2, 333, 4097, 2, 64), (2, 4097, 1, 2, 64), (2, 4097, 77, 2, 128), (2, 4097, 333, 2, 256)]
MAX_CHECK_ROWS = 256
Q_BLOCK_DEFAULT = 32  # CQ_ATTENTION_Q_BLOCK (cquant.h): the 8-bit mode's query rows per int8 scale


def _gen(shape, dtype, seed, key_offset=0.0, value_mean=False):
    """q, k, v of `shape`. Batches of several samples are CFG-like: every sample but the first
    gets keys with a channel offset of its own and odd ones values 4x larger, so the per-(batch,
    head) statistics of the 8-bit pre-pass (key means, value amax) differ between samples and a
    kernel that reads another sample's fails (i.i.d. samples would have nearly equal ones)."""
    b, sq, skv, h, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, skv, h, d, device="cuda", generator=g)
    if key_offset:
        k = k + key_offset * torch.randn(1, 1, h, d, device="cuda", generator=g)
    v = torch.randn(b, skv, h, d, device="cuda", generator=g)
    if value_mean:
        v = v + torch.randn(1, 1, h, d, device="cuda", generator=g)
    if b > 1:
        sample = torch.arange(b, device="cuda").view(b, 1, 1, 1)
        k = k + 3.0 * torch.randn(b, 1, h, d, device="cuda", generator=g) * (sample > 0)
        v = v * (1.0 + 3.0 * (sample % 2))
    return q, k.to(dtype), v.to(dtype)


def _rows(sq, seed):
    if sq <= MAX_CHECK_ROWS:
        return torch.arange(sq, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return torch.randperm(sq, device="cuda", generator=g)[:MAX_CHECK_ROWS].sort().values


def _poisoned_call(q, k, v, **kw):
    b, sq, h, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    o = cquant.attention(q, k, v, out=out, **kw)
    assert o is out
    # lse through the torch op path (its own allocation) and compared with the out= path
    o2, lse = cquant.attention(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(o2, out)  # deterministic kernels: both paths give the same bits
    return out, lse


def _sdpa(q, k, v, scale):
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if scale is not None and scale <= 0:
        # torch's fused backends return NaN for a scale <= 0; its math backend takes any scale
        with sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(*args, scale=scale).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(*args, scale=scale).transpose(1, 2)


def _check_full(shape, dtype, seed, scale=None, qkv=None):
    q, k, v = qkv if qkv is not None else _gen(shape, dtype, seed)
    d = shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = _poisoned_call(q, k, v, scale=scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    rows = _rows(shape[1], seed)
    ref, ref_lse = attention_rows_f64(q, k, v, scale, rows)
    err = rel_l2(out[:, rows].double().cpu().numpy(), ref.cpu().numpy())
    sdpa_err = rel_l2(_sdpa(q, k, v, scale)[:, rows].double().cpu().numpy(), ref.cpu().numpy())
    assert err <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + ATTN_CUDA_REL_L2_FLOOR, (err, sdpa_err)
    assert (lse[:, :, rows].double() - ref_lse).abs().max().item() <= ATTN_CUDA_LSE_ABS


# "mma": the mma.sync kernels (every sm_80+ GPU; 8-bit on sm_89+); "sm90": the wgmma kernels
# (CQUANT_ATTN_SM90=1, sm_90 only; head dims they do not take run the mma.sync ones). Each is
# pinned explicitly, whatever the build's default.
KERNELS = ["mma", "sm90"]


@pytest.fixture
def kernel(request, cq_env):
    cq_env("CQUANT_ATTN_SM90", "0")
    if request.param.startswith("sm90"):
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the wgmma kernels run on sm_90")
        cq_env("CQUANT_ATTN_SM90", "1")
    return request.param


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=[s[-1] for s in MODEL_SHAPES])
def test_full_model_shapes_bf16(shape, seed, kernel):
    _check_full(shape[:5], torch.bfloat16, seed)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", ODD_SHAPES + CROSS_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_full_odd_shapes(shape, dtype, seed, kernel):
    _check_full(shape, getattr(torch, dtype), seed)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
@pytest.mark.parametrize("d", [64, 72, 128])
def test_full_scale_sign(d, scale, seed, kernel):
    """A negative scale (folded into Q by the kernels), zero, and a large one."""
    _check_full((1, 133, 333, 2, d), torch.bfloat16, seed, scale=scale)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_full_running_max_grows(d, dtype, seed, kernel):
    """Scores that rise along the keys, so that the running max of every row grows on every
    tile, by more and by less than the kernels' rescale slack; and falling ones."""
    b, sq, skv, h = 1, 200, 1100, 2
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g)
    u = torch.randn(1, 1, h, d, device="cuda", generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    q = q + 3.0 * u  # every query leans along u
    ramp = torch.linspace(-60.0, 60.0, skv, device="cuda").view(1, skv, 1, 1)
    k = torch.randn(b, skv, h, d, device="cuda", generator=g) + ramp * u * math.sqrt(d) / 3.0
    v = torch.randn(b, skv, h, d, device="cuda", generator=g)
    dt = getattr(torch, dtype)
    _check_full((b, sq, skv, h, d), dt, seed, qkv=(q.to(dt), k.to(dt), v.to(dt)))
    _check_full((b, sq, skv, h, d), dt, seed, qkv=(q.to(dt), k.flip(1).to(dt), v.to(dt)))


# Key counts around the kernels' key steps: 64 keys (bf16 mma.sync), 128 (the wgmma kernels and
# both 8-bit kernels, whose softmax tile is k_block = 128: a ragged last tile is a path of its
# own), and past the wrap-around of their shared-memory rings (2 and 4 stages).
TILE_EDGE_SKV = [63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 513]
# Query counts around the CTA tiles: 64 and 128 rows (mma.sync), 128 (bf16 wgmma at D > 64), 192
# (bf16 wgmma at D <= 64, the 8-bit wgmma kernel), and one past two tiles of each.
TILE_EDGE_SQ = [127, 128, 129, 191, 192, 193, 257, 385]
# (Sq, Skv): the key edges under a partial query tile, the query edges over 129 keys (a last
# key step of one key).
TILE_EDGES = [(130, skv) for skv in TILE_EDGE_SKV] + [(sq, 129) for sq in TILE_EDGE_SQ]
TILE_EDGE_IDS = [f"sq{sq}-skv{skv}" for sq, skv in TILE_EDGES]


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("sq, skv", TILE_EDGES, ids=TILE_EDGE_IDS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_full_tile_edges(d, sq, skv, dtype, seed, kernel):
    _check_full((1, sq, skv, 2, d), getattr(torch, dtype), seed)


def test_full_strided_inputs_and_output():
    b, s, h, d = 2, 333, 3, 72
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    big = torch.full((b, s, h + 2, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = cquant.attention(q, k, v, out=big[:, :, 1:h + 1])
    ref, _ = attention_rows_f64(q, k, v, d ** -0.5, torch.arange(s, device="cuda"))
    sdpa_err = rel_l2(_sdpa(q, k, v, d ** -0.5).double().cpu().numpy(), ref.cpu().numpy())
    assert rel_l2(out.double().cpu().numpy(), ref.cpu().numpy()) <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + 1e-4
    assert torch.isnan(big[:, :, 0]).all() and torch.isnan(big[:, :, h + 1]).all()


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_broadcast_keys_and_values(mode):
    """k and v shared by the batch (stride 0 along it, as expand gives): the sm_90a kernels' tensor
    maps step forward only, so such calls run the mma.sync kernel; the result is the same math."""
    if mode == "int8" and _cc() < 89:
        pytest.skip("8-bit attention needs sm_89+")
    b, sq, skv, h, d = 2, 130, 200, 2, 128
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, skv, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = k1.expand(b, -1, -1, -1), v1.expand(b, -1, -1, -1)
    assert k.stride(0) == 0
    got = cquant.attention(q, k, v, mode=mode)
    if mode == "int8":  # the pre-pass reads any strides: the same codes, the same kernel
        assert torch.equal(got, cquant.attention(q, k.contiguous(), v.contiguous(), mode=mode))
        return
    ref, _ = attention_rows_f64(q, k, v, d ** -0.5, torch.arange(sq, device="cuda"))
    sdpa_err = rel_l2(_sdpa(q, k, v, d ** -0.5).double().cpu().numpy(), ref.cpu().numpy())
    assert rel_l2(got.double().cpu().numpy(), ref.cpu().numpy()) <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + 1e-4


def _query_windows(sq, block):
    """Rows compared with the C reference: all of a short call; of a long one its first and last
    rows, each window starting on a multiple of `block` (the 8-bit mode's int8 scales cover
    blocks of queries; the reference of every row of a long call would take seconds on the CPU)."""
    if sq <= 2 * MAX_CHECK_ROWS:
        return [(0, sq)]
    return [(0, MAX_CHECK_ROWS // 2 + block), ((sq - MAX_CHECK_ROWS // 2) // block * block, sq)]


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_full_matches_c_reference_small(seed, kernel):
    q, k, v = _gen((2, 77, 333, 2, 128), torch.bfloat16, seed)
    out = cquant.attention(q, k, v, scale=0.1)
    ref = cquant.attention(q.cpu(), k.cpu(), v.cpu(), scale=0.1)
    assert rel_l2(out.float().cpu().numpy(), ref.float().numpy()) <= ATTN_CUDA_FULL_VS_REF_REL_L2


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=[s[-1] for s in MODEL_SHAPES])
def test_full_model_shapes_match_c_reference(shape, seed, kernel):
    q, k, v = _gen(shape[:5], torch.bfloat16, seed)
    out = cquant.attention(q, k, v)
    for r0, r1 in _query_windows(q.shape[1], 1):
        ref = cquant.attention(q[:, r0:r1].cpu(), k.cpu(), v.cpu())
        assert rel_l2(out[:, r0:r1].float().cpu().numpy(), ref.float().numpy()) <= ATTN_CUDA_FULL_VS_REF_REL_L2, (r0, r1)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_large_scores_and_nan_propagation(seed, kernel):
    q, k, v = _gen((1, 200, 300, 2, 64), torch.bfloat16, seed)
    out = cquant.attention(q * 20, k * 20, v)
    assert torch.isfinite(out).all()
    k[0, 5, 1, 3] = float("nan")
    out = cquant.attention(q, k, v)
    assert torch.isnan(out[:, :, 1]).all() and torch.isfinite(out[:, :, 0]).all()


# ---------------------------------------------------------------- 8-bit


def _cc():
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


needs_int8_attention = pytest.mark.skipif(_cc() < 89 if _cuda_ok() else True, reason="8-bit attention needs sm_89+")


def _check_int8_accuracy(shape, seed, key_offset, scale=None):
    """The 8-bit mode's accuracy targets against float64, on values with channel means (the
    realistic case) and on i.i.d. ones (the worst case)."""
    scale = shape[-1] ** -0.5 if scale is None else scale
    for value_mean, bound in ((True, ATTN_INT8_REL_L2), (False, ATTN_INT8_REL_L2_IID)):
        q, k, v = _gen(shape, torch.bfloat16, seed, key_offset=key_offset, value_mean=value_mean)
        out, lse = _poisoned_call(q, k, v, scale=scale, mode="int8")
        rows = _rows(shape[1], seed)
        ref, ref_lse = attention_rows_f64(q, k, v, scale, rows)
        got = out[:, rows].double().cpu().numpy()
        if value_mean:
            assert cosine(got, ref.cpu().numpy()) >= ATTN_INT8_MIN_COSINE
        else:  # incoherent averages: the error of few outputs is itself a noisy estimate
            bound *= 1 + ATTN_INT8_IID_SPREAD / got.size ** 0.5
        if value_mean or got.size >= ATTN_INT8_IID_MIN_OUTPUTS:
            assert rel_l2(got, ref.cpu().numpy()) <= bound
        assert (lse[:, :, rows].double() - ref_lse).abs().max().item() <= ATTN_INT8_LSE_ABS * max(1.0, ref_lse.abs().max().item())


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", MODEL_SHAPES + [s + ("odd",) for s in ODD_SHAPES + CROSS_SHAPES],
                         ids=[s[-1] for s in MODEL_SHAPES] + [str(s) for s in ODD_SHAPES + CROSS_SHAPES])
@pytest.mark.parametrize("key_offset", [0.0, 20.0])
def test_int8_accuracy(shape, key_offset, seed, kernel):
    _check_int8_accuracy(shape[:5], seed, key_offset)


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("d", [64, 72, 128])
def test_int8_negative_scale_accuracy(d, seed, kernel):
    """scale = -1/sqrt(D) (folded into Q's int8 codes): the accuracy targets as for the usual sign."""
    _check_int8_accuracy((2, 133, 333, 2, d), seed, key_offset=20.0, scale=-d ** -0.5)


def _check_int8_vs_c(q, k, v, q_block=None, scale=None):
    """The 8-bit kernel against the C reference of the same quantized math, on _query_windows'
    rows (windows on query blocks, so that their int8 scales are the full call's)."""
    out, lse = cquant.attention(q, k, v, mode="int8", q_block=q_block, scale=scale, return_lse=True)
    for r0, r1 in _query_windows(q.shape[1], q_block or Q_BLOCK_DEFAULT):
        ref, ref_lse = cquant.attention(q[:, r0:r1].cpu(), k.cpu(), v.cpu(), mode="int8", q_block=q_block, scale=scale,
                                        return_lse=True)
        got, got_lse = out[:, r0:r1].float().cpu(), lse[:, :, r0:r1].cpu()
        assert rel_l2(got.numpy(), ref.float().numpy()) <= ATTN_CUDA_INT8_VS_REF_REL_L2, (r0, r1)
        assert (got_lse - ref_lse).abs().max().item() <= 1e-3 * max(1.0, ref_lse.abs().max().item()), (r0, r1)


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=[s[-1] for s in MODEL_SHAPES])
def test_int8_model_shapes_match_c_reference(shape, seed, kernel):
    _check_int8_vs_c(*_gen(shape[:5], torch.bfloat16, seed))


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", [(1, 77, 333, 2, 64), (2, 333, 77, 1, 72), (1, 130, 97, 2, 128),
                                   (1, 65, 129, 1, 256), (1, 1, 1, 1, 64), (1, 97, 200, 2, 40)], ids=str)
@pytest.mark.parametrize("q_block", [None, 16, 7, 128])
def test_int8_matches_c_reference(shape, q_block, seed, kernel):
    _check_int8_vs_c(*_gen(shape, torch.float16, seed, key_offset=5.0), q_block=q_block)


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("shape", CROSS_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int8_cross_shapes_match_c_reference(shape, dtype, seed, kernel):
    _check_int8_vs_c(*_gen(shape, getattr(torch, dtype), seed, key_offset=5.0))


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
@pytest.mark.parametrize("d", [64, 72, 128])
def test_int8_scale_sign_matches_c_reference(d, scale, seed, kernel):
    """A negative scale (folded into Q's int8 codes), zero (every Q code 0: uniform softmax), and
    a large one, as test_full_scale_sign for the full-precision kernels."""
    _check_int8_vs_c(*_gen((1, 133, 333, 2, d), torch.bfloat16, seed, key_offset=5.0), scale=scale)


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("sq, skv", TILE_EDGES, ids=TILE_EDGE_IDS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int8_tile_edges_match_c_reference(d, sq, skv, dtype, seed, kernel):
    _check_int8_vs_c(*_gen((1, sq, skv, 2, d), getattr(torch, dtype), seed, key_offset=5.0))


# ---------------------------------------------------------------- 8-bit accuracy bound

TAU = ops.ATTENTION_INT8_MAX_LOGIT_ERROR
# helpers.dit_attention_inputs arguments, B = 2, H = 3: heads on both sides of the threshold in
# one call, in both batches (tests/test_attention_int8_bound.py runs the same on the CPU)
BOUND_CASES = {
    "peaked": dict(q_mult=[[1, 8, 1], [30, 1, 8]]),
    "key_offset_100": dict(q_mult=[[1, 1, 10], [1, 10, 1]], key_offset=100.0),
    "value_offset_100": dict(q_mult=[[1, 10, 1], [1, 1, 10]], value_offset=100.0),
    "outlier_channels": dict(q_mult=[[1, 1, 1], [1, 0.15, 1]], outliers=2),
}


def _bound_decisions(q, k, scale):
    """The C reference's estimate of every head (from the same rounded inputs) and whether the
    8-bit mode falls back; the inputs must keep clear of the threshold, where the GPU's fp32
    estimate (its kmean summed in another order) could land on the other side."""
    bound = ops.attention_int8_logit_error(q.cpu(), k.cpu(), scale).numpy()
    assert (np.abs(bound / TAU - 1) > ATTN_CUDA_INT8_BOUND_MARGIN).all(), bound / TAU
    return bound > TAU


@needs_int8_attention
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("case", list(BOUND_CASES))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_int8_bound_falls_back_like_the_c_reference(case, d, seed, kernel):
    """Peaked softmax and offset inputs on the GPU: the heads the C reference computes in full
    precision are the full-precision kernel's output bit for bit (lse too), the others match the
    C reference's 8-bit math, and every head meets the mode's targets against float64."""
    rng = np.random.default_rng(seed)
    sq, skv = 333, 300
    q, k, v = (torch.from_numpy(t).to("cuda", torch.bfloat16)
               for t in dit_attention_inputs(rng, 2, sq, skv, 3, d, **BOUND_CASES[case]))
    scale = d ** -0.5
    falls_back = _bound_decisions(q, k, scale)
    assert falls_back.any() and not falls_back.all()
    out, lse = _poisoned_call(q, k, v, scale=scale, mode="int8")
    full, full_lse = cquant.attention(q, k, v, scale=scale, return_lse=True)
    ref, ref_lse = cquant.attention(q.cpu(), k.cpu(), v.cpu(), scale=scale, mode="int8", return_lse=True)
    f64, _ = attention_rows_f64(q, k, v, scale, torch.arange(sq, device="cuda"))
    for b in range(2):
        for h in range(3):
            got = out[b, :, h]
            if falls_back[b, h]:
                assert torch.equal(got, full[b, :, h]) and torch.equal(lse[b, h], full_lse[b, h]), (b, h)
            else:
                assert not torch.equal(got, full[b, :, h]), (b, h)  # the 8-bit kernel's
                assert rel_l2(got.float().cpu().numpy(), ref[b, :, h].float().numpy()) <= ATTN_CUDA_INT8_VS_REF_REL_L2
                assert (lse[b, h].cpu() - ref_lse[b, h]).abs().max().item() <= 1e-3 * max(
                    1.0, ref_lse[b, h].abs().max().item())
            g, r = got.double().cpu().numpy(), f64[b, :, h].cpu().numpy()
            assert cosine(g, r) >= ATTN_INT8_MIN_COSINE and rel_l2(g, r) <= ATTN_INT8_REL_L2, (b, h)


@needs_int8_attention
@pytest.mark.parametrize("bh", [(1, 65537), (70001, 1)], ids=["heads", "batch"])
def test_int8_bound_in_sliced_calls(bh):
    """Calls of more than 65535 (batch, head) pairs run in slices, each with its own flags:
    every other head's q times 30 falls back; those heads are the full-precision result bit for
    bit, the others the C reference's 8-bit math."""
    b, h = bh
    q, k, v = _gen((b, 3, 5, h, 64), torch.bfloat16, seed=35)
    mult = torch.where(torch.arange(b * h, device="cuda") % 2 == 1, 30.0, 1.0).reshape(b, 1, h, 1)
    q = (q.float() * mult).to(torch.bfloat16)
    falls_back = torch.from_numpy(_bound_decisions(q, k, 0.125)).to("cuda")
    assert torch.equal(falls_back, (mult.reshape(b, h) == 30.0))
    out, lse = cquant.attention(q, k, v, mode="int8", return_lse=True)
    full, full_lse = cquant.attention(q, k, v, return_lse=True)
    ref = cquant.attention(q.cpu(), k.cpu(), v.cpu(), mode="int8").to("cuda")
    sel = falls_back[:, None, :].expand(b, 3, h)
    assert torch.equal(out[sel], full[sel]) and torch.equal(lse[falls_back], full_lse[falls_back])
    rest = ~sel
    assert rel_l2(out[rest].float().cpu().numpy(), ref[rest].float().cpu().numpy()) <= ATTN_CUDA_INT8_VS_REF_REL_L2


@needs_int8_attention
def test_int8_cuda_rejects_other_k_block():
    q, k, v = _gen((1, 7, 9, 1, 64), torch.bfloat16, seed=7)
    with pytest.raises(NotImplementedError, match="k_block = 128"):
        cquant.attention(q, k, v, mode="int8", k_block=32)


@pytest.mark.skipif(not _cuda_ok() or _cc() >= 89, reason="checks the refusal below sm_89")
def test_int8_refused_below_sm89():
    q, k, v = _gen((1, 7, 9, 1, 64), torch.bfloat16, seed=7)
    with pytest.raises(NotImplementedError, match="compute capability 8.9"):
        cquant.attention(q, k, v, mode="int8")


# ---------------------------------------------------------------- errors, switches, graphs, compile


def test_cuda_rejections():
    q, k, v = _gen((1, 7, 9, 1, 64), torch.bfloat16, seed=8)
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        cquant.attention(q.float(), k.float(), v.float())
    q2, k2, v2 = (torch.randn(1, 7, 1, 36, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        cquant.attention(q2, k2, v2)
    with pytest.raises(ValueError, match="on one device"):
        cquant.attention(q, k.cpu(), v)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_sm90_switch_falls_back(cq_env, mode):
    """CQUANT_ATTN_DISABLE=sm90 overrides CQUANT_ATTN_SM90=1: the mma.sync kernels run (and give
    the same result as with CQUANT_ATTN_SM90=0)."""
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    q, k, v = _gen((1, 77, 300, 2, 128), torch.bfloat16, seed=13)
    cq_env("CQUANT_ATTN_SM90", "0")
    ref = cquant.attention(q, k, v, mode=mode)
    cq_env("CQUANT_ATTN_SM90", "1")
    cq_env("CQUANT_ATTN_DISABLE", "sm90")
    assert torch.equal(cquant.attention(q, k, v, mode=mode), ref)


@pytest.mark.parametrize("mode,name", [("bf16", "mma"), ("int8", "int8")])
def test_kernel_switch(cq_env, mode, name):
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    q, k, v = _gen((1, 7, 9, 1, 64), torch.bfloat16, seed=9)
    cq_env("CQUANT_ATTN_SM90", "0")
    cq_env("CQUANT_ATTN_DISABLE", name)
    with pytest.raises(NotImplementedError, match="disabled by CQUANT_ATTN_DISABLE"):
        cquant.attention(q, k, v, mode=mode)
    cq_env("CQUANT_ATTN_DISABLE", "something_else")
    cquant.attention(q, k, v, mode=mode)


@pytest.mark.parametrize("mode", ["bf16", "int8", "sm90_bf16", "sm90_int8"])
def test_cuda_graph_capture(mode, cq_env):
    cq_env("CQUANT_ATTN_SM90", "0")
    if mode.startswith("sm90"):
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the wgmma kernels run on sm_90")
        cq_env("CQUANT_ATTN_SM90", "1")
        mode = mode[5:]
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    q, k, v = _gen((2, 333, 300, 4, 128), torch.bfloat16, seed=10)
    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up (custom op registration, allocator)
            cquant.attention(*static, mode=mode)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cquant.attention(*static, mode=mode)
    q2, k2, v2 = _gen((2, 333, 300, 4, 128), torch.bfloat16, seed=11)
    for s, n in zip(static, (q2, k2, v2)):
        s.copy_(n)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = cquant.attention(q2, k2, v2, mode=mode)
    assert torch.equal(out, eager)


def test_torch_compile_fullgraph_cuda():
    q, k, v = _gen((1, 333, 200, 2, 64), torch.bfloat16, seed=12)

    def f(q, k, v):
        return cquant.attention(q * 2, k, v) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


# ---------------------------------------------------------------- diffusers end to end


def _to_cuda(v):
    if isinstance(v, tuple):  # rotary cos, sin: float32, as the pipelines make them
        return tuple(t.to("cuda") for t in v)
    return v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda")


@pytest.mark.parametrize("model_name", ["flux", "flux_cfg", "pixart", "cogvideox", "cogvideox_rope"])
def test_diffusers_end_to_end_cuda(model_name):
    pytest.importorskip("diffusers")
    model, inputs = getattr(test_attention, "tiny_" + model_name)(torch)
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: _to_cuda(v) for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**inputs).sample.float()
        test_attention.enable_attention_everywhere(model, "bf16")
        out = model(**inputs).sample.float()
        assert rel_l2(out.cpu().numpy(), ref.cpu().numpy()) <= ATTN_MODEL_FULL_REL_L2["bfloat16"]
        if _cc() >= 89:
            test_attention.enable_attention_everywhere(model, "int8")
            out8 = model(**inputs).sample.float()
            assert rel_l2(out8.cpu().numpy(), ref.cpu().numpy()) <= ATTN_MODEL_INT8_REL_L2
            assert not torch.equal(out8, out)  # the 8-bit kernels really ran
    model.set_attention_backend("native")


@needs_int8_attention
def test_int8_workspace_overlapping_an_argument_is_refused():
    """The 8-bit mode writes its workspace: one sharing bytes with out (or lse, q, k, v) is refused."""
    q, k, v = _gen((1, 77, 77, 2, 64), torch.bfloat16, seed=21)
    need = cquant._C.attention_workspace_size(cquant._C.ATTENTION_INT8, 1, 2, 77, 77, 64, True)
    nbytes = q.numel() * 2
    buf = torch.empty(nbytes + need + 256, dtype=torch.uint8, device="cuda")
    out = buf[:nbytes].view(torch.bfloat16).view(q.shape)
    ws = buf[256:256 + need]
    with pytest.raises(ValueError, match="workspace overlaps out"):
        cquant._C.attention(q, k, v, out, 0.125, cquant._C.ATTENTION_INT8, workspace=ws)


# ---------------------------------------------------------------- degenerate sizes, huge grids


@pytest.mark.parametrize("mode", ["bf16", "int8"])
@pytest.mark.parametrize("shape", [(0, 7, 5, 2, 64), (2, 0, 5, 2, 64), (2, 7, 5, 0, 64)], ids=str)
def test_empty_batch_sequence_or_heads_do_nothing(shape, mode):
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    q, k, v = _gen(shape, torch.bfloat16, seed=31)
    b, sq, _, h, d = shape
    out, lse = torch.empty(b, sq, h, d, dtype=q.dtype, device="cuda"), torch.empty(b, h, sq, device="cuda")
    m = cquant._C.ATTENTION_INT8 if mode == "int8" else cquant._C.ATTENTION_FULL
    cquant._C.attention(q, k, v, out, 0.125, m, lse=lse)  # libcquant itself: the wrapper short-cuts empties
    torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_no_keys_give_zero_output_and_minus_infinite_lse(mode):
    """Skv = 0: out = 0 and lse = -inf (cquant.h), as on the CPU."""
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    q, k, v = _gen((2, 77, 0, 3, 64), torch.float16, seed=32)
    out, lse = torch.full(q.shape, 5.0, dtype=q.dtype, device="cuda"), torch.zeros(2, 3, 77, device="cuda")
    m = cquant._C.ATTENTION_INT8 if mode == "int8" else cquant._C.ATTENTION_FULL
    cquant._C.attention(q, k, v, out, 0.125, m, lse=lse)  # libcquant's own fill kernel
    torch.cuda.synchronize()
    assert not out.any().item() and torch.isneginf(lse).all().item()


@pytest.mark.parametrize("mode", ["bf16", "int8"])
@pytest.mark.parametrize("bh", [(1, 65537), (70001, 1), (3, 30000)], ids=["heads", "batch", "product"])
def test_more_than_65535_batch_heads(mode, bh):
    """Grids hold at most 65535 heads (y) and batches (z), the 8-bit pre-pass 65535 (batch, head)
    pairs: larger calls run in slices (they raised). Every slice's rows, lse included, match the
    same call split by hand into calls of one batch or a few heads."""
    if mode == "int8" and _cc() < 89:
        pytest.skip("needs sm_89")
    b, h = bh
    q, k, v = _gen((b, 3, 5, h, 64), torch.bfloat16, seed=33)
    out, lse = cquant.attention(q, k, v, mode=mode, return_lse=True)
    step_b, step_h = (1, 4096) if b < h else (4096, h)
    for b0 in range(0, b, step_b * max(1, b // (4 * step_b))):
        for h0 in range(0, h, step_h * max(1, h // (4 * step_h))):
            sl = (slice(b0, b0 + step_b), slice(None), slice(h0, h0 + step_h))
            o, l = cquant.attention(q[sl].contiguous(), k[sl].contiguous(), v[sl].contiguous(), mode=mode,
                                    return_lse=True)
            assert torch.equal(out[sl], o), (b0, h0)
            assert torch.equal(lse[b0:b0 + step_b, h0:h0 + step_h], l), (b0, h0)
    if mode == "bf16":
        rows = torch.arange(3, device="cuda")
        hs = slice(h - 7, h)
        ref, ref_lse = attention_rows_f64(q[-2:, :, hs], k[-2:, :, hs], v[-2:, :, hs], 1 / 8, rows)
        err = rel_l2(out[-2:, :, hs].double().cpu().numpy(), ref.cpu().numpy())
        sdpa_err = rel_l2(_sdpa(q[-2:, :, hs], k[-2:, :, hs], v[-2:, :, hs], 1 / 8).double().cpu().numpy(),
                          ref.cpu().numpy())
        assert err <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + ATTN_CUDA_REL_L2_FLOOR


def test_output_whose_elements_alias_is_refused():
    q, k, v = _gen((2, 7, 5, 2, 64), torch.bfloat16, seed=34)
    out = torch.empty(2 * 7 * 64, dtype=torch.bfloat16, device="cuda").as_strided((2, 7, 2, 64), (0, 64, 0, 1))
    with pytest.raises(ValueError, match="out has stride .* share memory"):
        cquant.attention(q, k, v, out=out)
