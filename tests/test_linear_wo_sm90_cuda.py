"""The sm_90a weight-only GEMM (kernels/gemm_wo_sm90.cu): int8, fp8 and 4..6-bit fpX codes decoded
in registers into wgmma, the scale, bias, GELU and gate in its fp32 epilogue, one rounding.

Every test forces it for all M > 16 with CQUANT_WO_DECODE_M (the measured default may leave some
row counts to the decoded rows of wo_gemm.cu) and holds it to float64 of cquant.h's math within the
tensor cores' accumulation bound (tolerances "wo_mixed"). On GPUs other than compute capability 9.0
the same calls take the decoded rows, which the looser "wo_gemm" bound covers: those runs check
the fallback, and test_the_kernel_runs_on_hopper says which kernel ran.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, ops  # noqa: E402

import reference as ref  # noqa: E402
import tolerances as tol  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")]

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MIXED = str(1 << 30)  # CQUANT_WO_DECODE_M: no row count takes the decoded rows
KERNEL = "gemm_wo_kernel"


def hopper():
    return torch.cuda.get_device_capability() == (9, 0)


def path():
    return "wo_mixed" if hopper() else "wo_gemm"


@pytest.fixture
def mixed(cq_env):
    cq_env("CQUANT_WO_DECODE_M", MIXED)


def weight(fmt, n, k, seed, granularity="row"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g))
    return ops.quantize(w, fmt, granularity)


def gelu64(v):
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))


def float64_of(x, q, s, fmt, bias):
    """(pre-activation, terms) of cquant.h's math in float64 from the stored codes."""
    k = x.shape[-1]
    f = ref.fmt(fmt)
    codes = ref.codes_of_stored(f, q.view(torch.uint8).cpu().numpy(), k)
    b32 = None if bias is None else bias.float().cpu().numpy()
    return ref.linear(x.float().cpu().numpy(), codes, s.cpu().numpy(), f, "row" if s.numel() > 1 else "tensor",
                      None, "row", b32)


def assert_within(y, x, q, s, fmt, bias, activation, what, kernel_path=None):
    pre64, terms = float64_of(x, q, s, fmt, bias)
    kernel_path = kernel_path or path()
    k, dt = x.shape[-1], str(x.dtype).replace("torch.", "")
    bias_abs = 0.0 if bias is None else np.abs(bias.double().cpu().numpy())[None, :]
    if activation:
        want = gelu64(pre64)
        bound = tol.cuda_gelu_abs_bound(kernel_path, k, terms, bias_abs, pre64, want, dt, dt)
    else:
        want, bound = pre64, tol.cuda_linear_abs_bound(kernel_path, k, terms, bias_abs, pre64, dt, dt)
    got = y.float().cpu().double().numpy()
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten poison?)"
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |y - y64| = {err[worst]:.3g} > {bound[worst]:.3g} at {worst} "
                                  f"(y {got[worst]!r}, y64 {want[worst]!r})")


def run(x, q, s, fmt, k, bias=None, activation=None, out=None):
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, bias=None if bias is None else bias.cuda(),
                   in_features=k, activation=activation, out=out)
    torch.cuda.synchronize()
    return y


def kernels_of(fn):
    """Names of the CUDA kernels fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.skipif(not HAS_CUDA or not hopper(), reason="the kernel runs on compute capability 9.0")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_runs_on_hopper(fmt, cq_env):
    """With CQUANT_WO_DECODE_M above M the layer runs this kernel and nothing else; at or below M
    it decodes the weight for cuBLASLt instead."""
    q, s = weight(fmt, 96, 256, 0)
    x, q, s = torch.randn(40, 256, dtype=torch.bfloat16).cuda(), q.cuda(), s.cuda()
    call = lambda: ops.linear(x, q, s, weight_format=fmt, in_features=256)  # noqa: E731
    cq_env("CQUANT_WO_DECODE_M", MIXED)
    names = kernels_of(call)
    assert names and all(KERNEL in n for n in names), names
    cq_env("CQUANT_WO_DECODE_M", "17")
    assert not any(KERNEL in n for n in kernels_of(call))


@pytest.mark.skipif(not HAS_CUDA or not hopper(), reason="the kernel runs on compute capability 9.0")
@pytest.mark.parametrize("fmt,m,k,n,runs", [
    ("int8", 256, 3072, 12288, True),        # a wide weight, few rows
    ("int8", 256, 1024, 1024, False),        # a small weight, few rows: cuBLASLt's tiles
    ("int8", 512, 1024, 1024, True),
    ("int8", 4096, 3072, 64, False),         # N under one weight tile
    ("fp5_e2m2", 1024, 12288, 3072, True),   # 5- and 6-bit codes with K >= 4 N: this kernel too
    ("fp6_e2m3", 2048, 12288, 3072, True),
    ("fp6_e3m2", 512, 12288, 3072, True),
    ("int8", 1024, 12288, 3072, True),
])
def test_the_measured_choice(fmt, m, k, n, runs, cq_env):
    """Without CQUANT_WO_DECODE_M, decoded_rows_win (gemm_wo_sm90.cu) picks the kernel by shape."""
    cq_env("CQUANT_WO_DECODE_M", "")
    q, s = weight(fmt, n, k, 81)
    x, q, s = torch.randn(m, k, dtype=torch.bfloat16).cuda(), q.cuda(), s.cuda()
    names = kernels_of(lambda: ops.linear(x, q, s, weight_format=fmt, in_features=k))
    assert any(KERNEL in n for n in names) == runs, names


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_float64(fmt, dtype_name, bias_kind, activation, mixed):
    """Every format x dtype x bias kind x activation at M = 17, 33, 100 and 512, odd N, K past
    whole stages (64 or 128 codes; 8-bit rows take K % 16 == 0, TMA's stride) and per-row and
    per-tensor scales."""
    dt = DTYPES[dtype_name]
    for m, k, n, gran in ((17, 1008, 97, "row"), (33, 80, 200, "tensor"), (100, 144, 131, "row"),
                          (512, 272, 257, "row")):
        q, s = weight(fmt, n, k, m + n, gran)
        g = torch.Generator().manual_seed(m + k)
        x = torch.randn(m, k, generator=g).to(dt)
        bias = None if bias_kind is None else (torch.randn(n, generator=g) * 0.5).to(dt if bias_kind == "same" else torch.float32)
        out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
        y = run(x, q, s, fmt, k, bias, activation, out)
        assert y.data_ptr() == out.data_ptr()
        assert_within(y, x, q, s, fmt, bias, activation, f"{fmt} {dtype_name} M={m} K={k} N={n} {gran} bias={bias_kind}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1"])
def test_many_tokens_and_weight_tiles(fmt, dtype_name, mixed):
    """M = 4608 (18 token tiles), N over several weight tiles with a tail, K = 3072."""
    dt = DTYPES[dtype_name]
    m, k, n = 4608, 3072, 300
    q, s = weight(fmt, n, k, 5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dt)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dt)
    y = run(x, q, s, fmt, k, bias)
    rows = torch.arange(0, m, 37)  # the float64 reference on a sample of rows from every tile
    assert_within(y[rows], x[rows], q, s, fmt, bias, None, f"{fmt} {dtype_name} M={m}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ["int8", "fp8_e5m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1"])
def test_k_tails_into_a_column_slice(fmt, dtype_name, mixed):
    """K of 16, 80, 144 and 1008 codes (partial stages, partial 16-byte units of packed rows), N past
    several 128-row tiles, y a column slice of a wider tensor whose other columns stay untouched."""
    dt = DTYPES[dtype_name]
    for k in (16, 80, 144, 1008):
        m, n = 130, 300
        q, s = weight(fmt, n, k, k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dt)
        wide = torch.full((m, n + 24), 7.0, dtype=dt, device="cuda")
        y = run(x, q, s, fmt, k, out=wide[:, 16:16 + n])
        assert torch.all(wide[:, :16] == 7.0) and torch.all(wide[:, 16 + n:] == 7.0), f"{fmt} K={k}: wrote outside y"
        assert_within(y, x, q, s, fmt, None, None, f"{fmt} {dtype_name} K={k} column slice")


@pytest.mark.parametrize("m,samples", [(200, 2), (512, 2), (130, 1)])
@pytest.mark.parametrize("k", [256, 2048])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp4_e2m1"])
def test_gated_with_gelu(fmt, dtype_name, k, m, samples, mixed):
    """adaLN-Zero's gated residual in the epilogue, with GELU and a bias, in place on the residual:
    residual + gate[sample] * gelu(acc * sw + b), one rounding. 200 rows of two samples share a
    token tile (the staged epilogue); 512 rows of two samples give each tile one sample, and 130
    rows of one sample end inside a tile, the residual a column slice of a wider tensor (the
    residual loaded and y stored by TMA). K = 2048 gives the tiles' K to several ranges (split K),
    whose sum the gated epilogue takes."""
    dt = DTYPES[dtype_name]
    n = 136
    q, s = weight(fmt, n, k, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(m, k, generator=g).to(dt)
    bias = (torch.randn(n, generator=g) * 0.5).to(dt)
    gate = torch.randn(samples, n, generator=g).to(dt)
    residual = torch.randn(m, n, generator=g).to(dt)
    wide = torch.full((m, n + 16), 7.0, dtype=dt, device="cuda")
    res = wide[:, 8:8 + n] if samples == 1 else residual.cuda()
    res.copy_(residual.cuda())
    y = ops.linear_gated(x.cuda(), q.cuda(), s.cuda(), gate.cuda(), res, weight_format=fmt, bias=bias.cuda(),
                         in_features=k, activation="gelu_tanh", out=res)
    torch.cuda.synchronize()
    assert y.data_ptr() == res.data_ptr()
    assert torch.all(wide[:, :8] == 7.0) and torch.all(wide[:, 8 + n:] == 7.0), "wrote outside y"
    pre64, terms = float64_of(x, q, s, fmt, bias)
    v64 = gelu64(pre64)
    gate64 = np.repeat(gate.double().numpy(), m // samples, axis=0)
    res64 = residual.double().numpy()
    y64 = res64 + gate64 * v64
    bias_abs = np.abs(bias.double().numpy())[None, :]
    bound = tol.cuda_gated_abs_bound(path(), k, terms, bias_abs, pre64, v64, gate64, res64, y64, dtype_name,
                                     dtype_name, gelu=True)
    err = np.abs(y.float().cpu().double().numpy() - y64)
    assert np.all(err <= bound), f"{fmt} {dtype_name}: gated error {np.max(err - bound):.3g} past the bound"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1"])
def test_a_row_alone_and_in_batches_gives_the_same_bits(fmt, dtype_name, mixed, cq_env):
    """With CQUANT_WO_SPLIT_K=0 a row of x gives the same bits at M = 17 (with 16 other rows) and at
    other places of batches of 100 and 4608 rows: every M > 16 sums each output in one order."""
    cq_env("CQUANT_WO_SPLIT_K", "0")
    dt = DTYPES[dtype_name]
    k, n = 1024, 264
    q, s = weight(fmt, n, k, 21)
    g = torch.Generator().manual_seed(22)
    row = torch.randn(1, k, generator=g).to(dt)
    outs = []
    for m, at in ((17, 0), (100, 57), (4608, 4000)):
        x = torch.randn(m, k, generator=g).to(dt)
        x[at] = row[0]
        outs.append(run(x, q, s, fmt, k)[at].cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), f"{fmt} {dtype_name}: the row's bits differ"


SPLIT_FORMATS = ["int8", "fp8_e4m3", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1"]


def gelu_layer(fmt, m, k, n, seed):
    """The codes and scales (seed), x and a bias (seed + 1) of a GELU layer of the split-K tests."""
    q, s = weight(fmt, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    return q, s, x, bias


def run_again(first, x, q, s, fmt, bias, calls):
    """The layer's output has first's bits in `calls` more calls."""
    for _ in range(calls):
        assert torch.equal(run(x, q, s, fmt, x.shape[1], bias, "gelu_tanh"), first), f"{fmt}: bits differ between calls"


@pytest.mark.parametrize("k,n", [(4096, 200), (4608, 200), (1024, 6400)])
@pytest.mark.parametrize("fmt", SPLIT_FORMATS)
def test_split_k_adds_its_ranges_in_one_order(fmt, k, n, cq_env):
    """Few tiles with a long K (2 tiles, K = 4096 or 4608): the kernel cuts K into 8 ranges whose
    partial sums the last range to finish adds in their order. At K = 4608 a range is 9 stages of
    64 codes, so ranges start at odd stages too (a 5-bit row's codes then lie 8 bytes into their
    box). With 50 tiles (N = 6400) on a GPU of 100 to 149 SMs each is cut in two instead, added
    through the workspace (CQUANT_WO_CLUSTER_PAIRS=0): at K = 1024 ranges of 5 and 11 stages, the
    range that ends last keeping its own sums in registers. Within the bound of float64, with bias
    and GELU; the same bits call after call whichever range finishes last; within the bound of the
    unsplit kernel's result too (CQUANT_WO_SPLIT_K=0)."""
    cq_env("CQUANT_WO_DECODE_M", MIXED)
    cq_env("CQUANT_WO_CLUSTER_PAIRS", "0")
    q, s, x, bias = gelu_layer(fmt, 40, k, n, 51)
    first = run(x, q, s, fmt, k, bias, "gelu_tanh")
    assert_within(first, x, q, s, fmt, bias, "gelu_tanh", f"{fmt} split K")
    run_again(first, x, q, s, fmt, bias, 5)
    cq_env("CQUANT_WO_SPLIT_K", "0")
    assert_within(run(x, q, s, fmt, k, bias, "gelu_tanh"), x, q, s, fmt, bias, "gelu_tanh", f"{fmt} whole K")


@pytest.mark.parametrize("m,n", [(40, 6400), (300, 11648)])
@pytest.mark.parametrize("fmt", SPLIT_FORMATS)
def test_a_tile_cut_in_two_adds_through_a_cluster(fmt, m, n, cq_env):
    """By default (CQUANT_WO_CLUSTER_PAIRS=1) tiles cut in two along K (50 of them, alone or after a
    first wave of whole tiles on a GPU of 132 SMs; K = 1024) run as clusters of two CTAs, the first
    range's partial sums read by the second through distributed shared memory. Within the bound of
    float64, with bias and GELU; the same bits call after call; within the bound of the workspace
    path's result too."""
    cq_env("CQUANT_WO_DECODE_M", MIXED)
    cq_env("CQUANT_WO_CLUSTER_PAIRS", "1")
    k = 1024
    q, s, x, bias = gelu_layer(fmt, m, k, n, 71)
    first = run(x, q, s, fmt, k, bias, "gelu_tanh")
    rows = torch.arange(0, m, 7)
    assert_within(first[rows], x[rows], q, s, fmt, bias, "gelu_tanh", f"{fmt} cluster pairs")
    run_again(first, x, q, s, fmt, bias, 3)
    cq_env("CQUANT_WO_CLUSTER_PAIRS", "0")
    assert_within(run(x, q, s, fmt, k, bias, "gelu_tanh")[rows], x[rows], q, s, fmt, bias, "gelu_tanh",
                  f"{fmt} workspace pairs")


@pytest.mark.parametrize("fmt", ["int8", "fp6_e3m2"])
def test_whole_tiles_then_a_split_last_wave(fmt, mixed):
    """Four tiles more than the GPU has SMs: the first wave's tiles run over all of K, the four
    tiles past it are split along K over the idle SMs. Rows of every token tile, every column."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    tiles_n = (sms + 4 + 3) // 4
    m, k, n = 4 * 256, 1024, 128 * tiles_n  # 4 token tiles x tiles_n weight tiles
    q, s = weight(fmt, n, k, 61)
    g = torch.Generator().manual_seed(62)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y = run(x, q, s, fmt, k, bias)
    rows = torch.arange(0, m, 29)
    assert_within(y[rows], x[rows], q, s, fmt, bias, None, f"{fmt} whole tiles + split last wave")


def test_nan_codes_in_any_k_range_poison_their_rows(mixed):
    """e4m3 NaN codes in the first and in a middle K range of a split tile make their columns NaN
    whichever range adds the sums; the other columns stay within the bound."""
    m, k, n = 40, 2048, 200
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(71)).to(torch.bfloat16)
    q, s = weight("fp8_e4m3", n, k, 72)
    q.view(torch.uint8)[7, 10] = 0x7F
    q.view(torch.uint8)[130, 1100] = 0xFF
    y = run(x, q, s, "fp8_e4m3", k).float().cpu().double().numpy()
    special = np.zeros(n, bool)
    special[[7, 130]] = True
    assert np.isnan(y[:, special]).all() and not np.isnan(y[:, ~special]).any()
    pre64, terms = float64_of(x, q, s, "fp8_e4m3", None)
    bound = tol.cuda_linear_abs_bound(path(), k, terms, 0.0, pre64, "bfloat16", "bfloat16")
    assert (np.abs(y[:, ~special] - pre64[:, ~special]) <= bound[:, ~special]).all()


def test_nan_and_inf_poison_only_their_columns(mixed):
    """e4m3 NaN codes, a NaN scale and e5m2 infinities make their own output columns NaN or +-inf,
    as float64 of the same codes does; every other column stays finite and within the bound."""
    m, k, n = 40, 256, 200
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    for fmt, code, col in (("fp8_e4m3", 0x7F, 3), ("fp8_e4m3", 0xFF, 150), ("fp8_e5m2", 0x7C, 5),
                           ("fp8_e5m2", 0xFC, 140), ("fp8_e5m2", 0x7E, 77)):
        q, s = weight(fmt, n, k, 32)
        q.view(torch.uint8)[col, 100] = code
        s[9] = float("nan")
        y = run(x, q, s, fmt, k).float().cpu().double().numpy()
        pre64, terms = float64_of(x, q, s, fmt, None)
        special = np.zeros(n, bool)
        special[[col, 9]] = True
        assert np.array_equal(np.isnan(y[:, special]), np.isnan(pre64[:, special])), f"{fmt} {code:#x}: NaN columns"
        finite = np.isfinite(pre64[:, special])
        assert np.array_equal(y[:, special][~finite & ~np.isnan(pre64[:, special])],
                              pre64[:, special][~finite & ~np.isnan(pre64[:, special])]), f"{fmt} {code:#x}: infinities"
        bound = tol.cuda_linear_abs_bound(path(), k, terms, 0.0, pre64, "bfloat16", "bfloat16")
        ok = np.abs(y[:, ~special] - pre64[:, ~special]) <= bound[:, ~special]
        assert ok.all(), f"{fmt} {code:#x}: a column without specials is off"


@pytest.mark.parametrize("fmt", ["int8", "fp6_e3m2"])
def test_operands_the_kernel_does_not_take_fall_back(fmt, mixed):
    """x off a 16-byte boundary, K not a multiple of 8 (TMA strides), fp32 x: the decoded rows."""
    k, n = 256, 100
    q, s = weight(fmt, n, k, 41)
    x = torch.randn(50, k, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    flat = torch.empty(50 * k + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:] = x.reshape(-1).cuda()
    xo = flat[1:].view(50, k)  # 2 bytes past a 16-byte boundary
    y = ops.linear(xo, q.cuda(), s.cuda(), weight_format=fmt, in_features=k)
    torch.cuda.synchronize()
    assert_within(y, x, q, s, fmt, None, None, f"{fmt} misaligned x", kernel_path="wo_gemm")
    k2 = 97
    q2, s2 = weight(fmt, n, k2, 43)
    x2 = torch.randn(30, k2, generator=torch.Generator().manual_seed(44)).to(torch.float16)
    y2 = run(x2, q2, s2, fmt, k2)
    pre64, terms = float64_of(x2, q2, s2, fmt, None)
    bound = tol.cuda_linear_abs_bound("wo_gemm", k2, terms, 0.0, pre64, "float16", "float16")
    assert np.all(np.abs(y2.float().cpu().double().numpy() - pre64) <= bound), f"{fmt} K={k2}"
