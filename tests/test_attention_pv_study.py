"""scripts/attention_pv_format_study.py: its e4m3 path is the 8-bit math of cquant.h (the NumPy
model of attention_oracle.py), and its u8 x s8 path is what it says."""

import importlib.util
import os

import numpy as np
import pytest

pytest.importorskip("ml_dtypes")

from attention_oracle import attention_f64, attention_int8, rel_l2  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
spec = importlib.util.spec_from_file_location("attention_pv_format_study",
                                              os.path.join(ROOT, "scripts", "attention_pv_format_study.py"))
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def heads(seed, sq=48, skv=320, d=64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)).astype(np.float32) for n in (sq, skv, skv)]


@pytest.mark.parametrize("seed", [0, 1])
def test_e4m3_path_is_the_oracle(seed):
    q, k, v = heads(seed)
    got = study.attention_8bit(q, k, v, 64**-0.5, "e4m3")
    want = attention_int8(q[None, :, None], k[None, :, None], v[None, :, None], 64**-0.5)[0][0, :, 0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_u8s8_is_exact_for_exact_codes():
    """Values that are multiples of amax / 127 and a softmax whose p are multiples of 1 / 255 pass
    through u8 x s8 unchanged: the output equals float64 attention within fp32 rounding."""
    d, skv = 16, 64
    v = (np.arange(skv * d).reshape(skv, d) % 255 - 127).astype(np.float32)  # integers in [-127, 127]
    v[0] = 127.0  # every channel's amax: scale 1, codes = values
    q = np.zeros((4, d), np.float32)  # every logit 0: p = 1 (code 255) everywhere
    k = np.random.default_rng(2).standard_normal((skv, d)).astype(np.float32)
    want = attention_f64(q[None, :, None], k[None, :, None], v[None, :, None], 1.0)[0][0, :, 0]
    for pv in ("u8s8", "u8s8_code_sum"):
        got = study.attention_8bit(q, k, v, 1.0, pv)
        assert rel_l2(got, want) < 1e-6, pv
