"""cquant.metrics.psnr_db and ssim: the image quality of whole-pipeline benchmarks."""

import math

import numpy as np
import pytest

from cquant.metrics import psnr_db, ssim


def _images(shape, seed=0):
    return np.random.default_rng(seed).random(shape)


def _ssim_direct(ref, x, data_range=1.0):
    """SSIM the slow, obvious way: every valid 11x11 window of every 2D image, weighted sums."""
    t = np.arange(11) - 5.0
    g = np.exp(-t * t / (2 * 1.5 ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    vals = []
    for a, b in zip(ref.reshape(-1, *ref.shape[-2:]), x.reshape(-1, *x.shape[-2:])):
        for i in range(a.shape[0] - 10):
            for j in range(a.shape[1] - 10):
                pa, pb = a[i:i + 11, j:j + 11], b[i:i + 11, j:j + 11]
                ma, mb = (w * pa).sum(), (w * pb).sum()
                va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
                cov = (w * (pa - ma) * (pb - mb)).sum()
                vals.append((2 * ma * mb + c1) * (2 * cov + c2) / ((ma * ma + mb * mb + c1) * (va + vb + c2)))
    return float(np.mean(vals))


def test_psnr_identical_and_closed_form():
    ref = _images((2, 3, 16, 16))
    assert psnr_db(ref, ref.copy()) == math.inf
    # a constant offset of 0.1 everywhere: MSE 0.01, PSNR 10 log10(1 / 0.01) = 20 dB
    assert psnr_db(ref, ref + 0.1) == pytest.approx(20.0)
    assert psnr_db(ref * 255, ref * 255 + 25.5, data_range=255) == pytest.approx(20.0)
    # half the elements off by 0.2: MSE 0.02
    x = ref.copy()
    x[:, :, :8] += 0.2
    assert psnr_db(ref, x) == pytest.approx(10 * math.log10(1 / 0.02))


def test_psnr_nonfinite_and_errors():
    ref = _images((1, 3, 12, 12))
    x = ref.copy()
    x[0, 0, 0, 0] = np.nan
    assert math.isnan(psnr_db(ref, x))
    x[0, 0, 0, 0] = np.inf
    assert math.isnan(psnr_db(x, ref))
    with pytest.raises(ValueError, match="psnr_db: ref has shape"):
        psnr_db(ref, ref[..., :11])
    with pytest.raises(ValueError, match="data_range"):
        psnr_db(ref, ref, data_range=0)


def test_ssim_identical_is_one_and_matches_direct_sum():
    ref = _images((2, 3, 16, 18))
    assert ssim(ref, ref.copy()) == 1.0
    x = np.clip(ref + 0.1 * _images(ref.shape, seed=1) - 0.05, 0, 1)
    got = ssim(ref, x)
    assert got == pytest.approx(_ssim_direct(ref, x), rel=1e-10)
    assert 0 < got < 1
    # a constant offset leaves the structure and contrast terms at 1: only the luminance term
    # (2 mu_r mu_x + C1) / (mu_r^2 + mu_x^2 + C1) < 1 remains
    flat = np.full((1, 1, 11, 11), 0.5)
    c1 = (0.01) ** 2
    assert ssim(flat, flat + 0.2) == pytest.approx((2 * 0.5 * 0.7 + c1) / (0.25 + 0.49 + c1))
    assert ssim(ref, x, data_range=2.0) > got  # bigger constants: more tolerant


def test_ssim_video_folds_frames_and_torch_inputs():
    torch = pytest.importorskip("torch")
    ref = _images((1, 3, 4, 12, 12))
    x = np.clip(ref + 0.05 * _images(ref.shape, seed=2), 0, 1)
    frames = ref.transpose(0, 2, 1, 3, 4).reshape(4, 3, 12, 12)
    frames_x = x.transpose(0, 2, 1, 3, 4).reshape(4, 3, 12, 12)
    assert ssim(ref, x) == pytest.approx(ssim(frames, frames_x), rel=1e-12)
    assert ssim(torch.from_numpy(ref).float(), torch.from_numpy(x).float()) == pytest.approx(ssim(ref, x), rel=1e-5)
    assert psnr_db(torch.from_numpy(ref), torch.from_numpy(x)) == pytest.approx(psnr_db(ref, x))


def test_ssim_nonfinite_and_errors():
    ref = _images((1, 3, 12, 12))
    x = ref.copy()
    x[0, 1, 2, 3] = np.nan
    assert math.isnan(ssim(ref, x))
    with pytest.raises(ValueError, match="ssim: ref has shape"):
        ssim(ref, ref[:, :2])
    with pytest.raises(ValueError, match="smaller than the 11x11 window"):
        ssim(ref[..., :10, :10], ref[..., :10, :10])
    with pytest.raises(ValueError, match="expected"):
        ssim(ref[0, 0, 0], ref[0, 0, 0])
