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
