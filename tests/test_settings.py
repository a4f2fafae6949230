"""libcquant's run-time switches (cq_settings, csrc/settings.c): every CQUANT_* variable read
once into one struct, parsed the same way for every reader, reported to Python by
_C.settings() and read again by _C.reload_settings()."""

import os
import subprocess
import sys

import pytest

from cquant import _C

SWITCHES = ("CQUANT_DISABLE_WGMMA", "CQUANT_DISABLE_CUBLASLT_FP8", "CQUANT_WO_CHUNK_MB", "CQUANT_GEMV_PERSISTENT",
            "CQUANT_ATTN_SM90", "CQUANT_ATTN_DISABLE", "CQUANT_GROUP4_DECODE_M", "CQUANT_WO_DECODE_M",
            "CQUANT_WO_SPLIT_K", "CQUANT_WO_CLUSTER_PAIRS")


@pytest.fixture
def clean_env(cq_env, monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    _C.reload_settings()
    return cq_env


def test_defaults(clean_env):
    s = _C.settings()
    assert s["disable_wgmma"] is False and s["disable_cublaslt_fp8"] is False
    assert s["wo_chunk_mib"] == 128
    assert s["gemv_persistent"] == "auto" and s["attn_sm90"] == "auto"
    assert s["attn_disabled"] == ()
    assert s["group4_decode_min_m"] == -1 and s["wo_decode_min_m"] == -1
    assert s["wo_split_k"] is True
    assert s["wo_cluster_pairs"] is True
    assert isinstance(s["cublaslt_path"], str)


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("0", False), ("", False), ("00", False)])
def test_flags(clean_env, value, expected):
    clean_env("CQUANT_DISABLE_WGMMA", value)
    clean_env("CQUANT_DISABLE_CUBLASLT_FP8", value)
    s = _C.settings()
    assert s["disable_wgmma"] is expected and s["disable_cublaslt_fp8"] is expected


@pytest.mark.parametrize("value,expected", [("0", "off"), ("1", "on"), ("2", "auto"), ("on", "auto"), ("", "auto")])
def test_tristates(clean_env, value, expected):
    clean_env("CQUANT_GEMV_PERSISTENT", value)
    clean_env("CQUANT_ATTN_SM90", value)
    s = _C.settings()
    assert s["gemv_persistent"] == expected and s["attn_sm90"] == expected


@pytest.mark.parametrize("value,expected", [("1", 1), ("4096", 4096), ("0", 128), ("-5", 128), ("12x", 128),
                                            ("", 128), ("99999999999999999999", 128)])
def test_chunk_size(clean_env, value, expected):
    clean_env("CQUANT_WO_CHUNK_MB", value)
    assert _C.settings()["wo_chunk_mib"] == expected


@pytest.mark.parametrize("value,expected", [("17", 17), ("1", 1), ("0", -1), ("-3", -1), ("x", -1), ("", -1)])
def test_group4_decode_rows(clean_env, value, expected):
    clean_env("CQUANT_GROUP4_DECODE_M", value)
    assert _C.settings()["group4_decode_min_m"] == expected


@pytest.mark.parametrize("value,expected", [("17", 17), ("1", 1), ("0", -1), ("-3", -1), ("x", -1), ("", -1)])
def test_weight_only_decode_rows(clean_env, value, expected):
    clean_env("CQUANT_WO_DECODE_M", value)
    assert _C.settings()["wo_decode_min_m"] == expected


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("", True), ("00", True), ("off", True)])
def test_weight_only_split_k(clean_env, value, expected):
    clean_env("CQUANT_WO_SPLIT_K", value)
    assert _C.settings()["wo_split_k"] is expected


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("", True), ("00", True), ("off", True)])
def test_weight_only_cluster_pairs(clean_env, value, expected):
    clean_env("CQUANT_WO_CLUSTER_PAIRS", value)
    assert _C.settings()["wo_cluster_pairs"] is expected


@pytest.mark.parametrize("value,expected", [
    ("mma", ("mma",)), ("int8, sm90", ("sm90", "int8")), (" all ", ("mma", "sm90", "int8")),
    ("something_else", ()), ("mma,,int8,", ("mma", "int8")), ("MMA", ()),
])
def test_attention_kernels(clean_env, value, expected):
    clean_env("CQUANT_ATTN_DISABLE", value)
    assert _C.settings()["attn_disabled"] == expected


def test_read_once_until_reload(clean_env, monkeypatch):
    """The environment is read once: a change takes effect at reload_settings, not before."""
    assert _C.settings()["attn_disabled"] == ()
    monkeypatch.setenv("CQUANT_ATTN_DISABLE", "int8")
    assert _C.settings()["attn_disabled"] == ()
    _C.reload_settings()
    assert _C.settings()["attn_disabled"] == ("int8",)


def test_first_read_in_a_fresh_process():
    """A process that sets the variables before its first call sees them without a reload."""
    env = {**os.environ, "CQUANT_ATTN_DISABLE": "sm90", "CQUANT_WO_CHUNK_MB": "7", "CQUANT_GEMV_PERSISTENT": "0"}
    code = "from cquant import _C; s = _C.settings(); print(s['attn_disabled'], s['wo_chunk_mib'], s['gemv_persistent'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["('sm90',)", "7", "off"]


def test_cuda_device_supported_answers():
    supported, reason = _C.cuda_device_supported(0)
    if not _C.built_with_cuda():
        assert supported is False and "CPU-only" in reason
    else:
        assert isinstance(supported, bool) and (supported or reason)


@pytest.mark.cuda
def test_cuda_device_supported_on_the_gpu():
    """The build holds code the device loads (machine code, or PTX the driver compiles for a GPU
    newer than the build's arches); an absent device is reported, not raised."""
    import torch

    assert _C.cuda_device_supported(torch.cuda.current_device()) == (True, "")
    supported, reason = _C.cuda_device_supported(torch.cuda.device_count() + 7)
    assert supported is False and "device" in reason
