"""cquant.metrics.sqnr_db: the one SQNR of the demo, the benchmarks and the tests."""

import math

import numpy as np
import pytest

from cquant.metrics import sqnr_db


def test_known_values_and_argument_order():
    ref = np.array([3.0, 4.0])  # |ref| = 5
    assert sqnr_db(ref, ref + [0.05, 0.0]) == pytest.approx(40.0)  # |noise| = |ref| / 100
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)
    # ref first: the noise is measured against ref's norm, so the order matters
    assert sqnr_db(ref * 1.1, ref) == pytest.approx(20.0 + 20 * math.log10(1.1))


def test_exact_zero_and_nonfinite():
    ref = np.array([1.0, -2.0, 0.5], np.float32)
    assert sqnr_db(ref, ref.copy()) == math.inf
    assert sqnr_db(np.zeros(3), np.zeros(3)) == math.inf
    assert sqnr_db(np.zeros(3), ref) == -math.inf
    for bad in (np.nan, np.inf):
        x = ref.copy()
        x[1] = bad
        assert math.isnan(sqnr_db(ref, x))
        assert math.isnan(sqnr_db(x, ref))


def test_float64_even_for_float32_inputs():
    """Differences of one float32 ulp are seen (a float32 computation would round them away)."""
    ref = np.full(1000, 1.0, np.float32)
    x = np.nextafter(ref, np.float32(2))
    assert sqnr_db(ref, x) == pytest.approx(20 * math.log10(1 / np.finfo(np.float32).eps))


def test_shapes_must_match():
    with pytest.raises(ValueError, match="shape"):
        sqnr_db(np.ones((2, 3)), np.ones(3))


def test_torch_and_numpy_agree(torch):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 33, generator=g, dtype=torch.float64)
    x = (ref + 0.01 * torch.randn(7, 33, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    want = sqnr_db(ref.numpy(), x.double().numpy())
    assert sqnr_db(ref, x) == pytest.approx(want, rel=1e-12)
    assert sqnr_db(ref.numpy(), x) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="shape"):
        sqnr_db(ref, x[:3])


@pytest.mark.parametrize("scale", [1e-200, 1e200])
def test_values_near_float64_limits(scale, torch):
    """The norms scale by the largest magnitude first: squares of 1e-200 underflowed to an SQNR of
    +inf ("identical") and squares of 1e200 overflowed to NaN."""
    ref = np.array([3.0, 4.0]) * scale
    x = ref * 1.1
    assert sqnr_db(ref, x) == pytest.approx(20.0)
    assert sqnr_db(torch.from_numpy(ref), torch.from_numpy(x)) == pytest.approx(20.0)
    assert sqnr_db(ref, np.zeros(2)) == pytest.approx(0.0)


def test_arguments_that_are_not_real_arrays_are_refused(torch):
    from cquant.metrics import psnr_db

    with pytest.raises(TypeError, match="ref is None"):
        sqnr_db(None, None)
    with pytest.raises(TypeError, match="ref has dtype complex128"):  # the imaginary part was dropped
        sqnr_db(np.array([1 + 1j]), np.array([1 + 0j]))
    with pytest.raises(TypeError, match="x has dtype torch.complex64"):
        sqnr_db(torch.ones(1), torch.ones(1, dtype=torch.complex64))
    for empty in (np.zeros(0), torch.zeros(0)):
        with pytest.raises(ValueError, match="empty"):
            sqnr_db(empty, empty)
    # data_range of any real scalar type, bools refused
    for data_range in (np.float32(1.0), torch.tensor(1.0), np.int64(1)):
        assert psnr_db(np.ones(4), np.full(4, 0.9), data_range=data_range) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="data_range"):
        psnr_db(np.ones(4), np.ones(4), data_range=True)
