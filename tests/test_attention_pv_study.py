"""scripts/attention_pv_format_study.py: its u8s8_tile_max path is the 8-bit math of cquant.h (the
NumPy model of attention_oracle.py), and its other paths are what they say."""

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
def test_tile_max_path_is_the_oracle(seed):
    q, k, v = heads(seed)
    got = study.attention_8bit(q, k, v, 64**-0.5, "u8s8_tile_max")
    want = attention_int8(q[None, :, None], k[None, :, None], v[None, :, None], 64**-0.5)[0][0, :, 0]
    np.testing.assert_array_equal(got, want)


def test_paths_are_exact_for_exact_codes():
    """Values whose codes are exact (integers in [-127, 127] with amax 127 for u8 x s8; powers of
    two with amax 448 for e4m3) and a softmax whose p are all 1 (every logit 0: the top code)
    pass through every path unchanged: the output equals float64 attention within fp32 rounding."""
    d, skv = 16, 320  # three tiles of 128 keys
    q = np.zeros((4, d), np.float32)
    k = np.random.default_rng(2).standard_normal((skv, d)).astype(np.float32)
    v_int = (np.arange(skv * d).reshape(skv, d) % 255 - 127).astype(np.float32)
    v_int[0] = 127.0  # every channel's amax: scale 1, codes = values
    idx = np.arange(skv * d).reshape(skv, d)
    v_pow2 = (2.0 ** (idx % 9) * (-1.0) ** idx).astype(np.float32)  # +-1 .. +-256
    v_pow2[0] = 448.0
    for v, paths in ((v_int, ("u8s8_tile_max", "u8s8", "u8s8_code_sum")), (v_pow2, ("e4m3",))):
        want = attention_f64(q[None, :, None], k[None, :, None], v[None, :, None], 1.0)[0][0, :, 0]
        for pv in paths:
            got = study.attention_8bit(q, k, v, 1.0, pv)
            assert rel_l2(got, want) < 1e-6, pv
