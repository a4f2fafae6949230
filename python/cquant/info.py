"""`cquant info` (also `python -m cquant info`): what this cquant is and what it can do here.

It reports the build (version, CUDA or CPU-only, the arches of the machine code and of the PTX,
the CUDA version the kernels were compiled with, the library's size), what the machine gives it
(the CUDA runtime, the driver, cuBLASLt), the GPUs present and, for each, which schemes and
attention kernels run there and why not, the CQUANT_* switches that are set (saying which values
libcquant could not read, and what it uses instead), and the versions of
Python and of the libraries cquant works with. `--json` prints the same as one JSON object. Bug
reports ask for its output.

From Python: `cquant.info.collect()` returns the dict, `cquant.info.render(d)` the text.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys

from . import ops
from ._libs import USER_SETTINGS
from .schemes import SCHEME_NAMES, scheme

LIBRARIES = ("torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "numpy")


def _cuda_version(v):
    """'13.0' from 13000 (CUDA's 1000 * major + 10 * minor); None for 0."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else None


def _cublaslt_version(v):
    """'13.1.0' from cublasLtGetVersion's 130100."""
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v else None


def _torch_version():
    """torch's own version string, local build tag included ("2.11.0+cu130"), which the metadata of
    its PyPI wheels leaves out; read from torch/version.py, since importing torch takes seconds."""
    if "torch" in sys.modules:
        version = getattr(sys.modules["torch"], "__version__", None)
        return str(version) if version is not None else None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
                m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    return None


def _library_versions():
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out["torch"] is not None:
        out["torch"] = _torch_version() or out["torch"]
    return out


def _positive(key, used):
    def check(value, parsed):
        try:
            ok = int(value) == parsed[key]  # libcquant keeps its default for a value it refuses
        except ValueError:
            ok = False
        return None if ok else f"expected a positive integer; {used.format(parsed[key])} is used"
    return check


def _one_of(*values, used):
    def check(value, parsed):
        return None if value in values else f"expected {' or '.join(values)}; {used} is used"
    return check


def _attention_kernels(value, parsed):
    unknown = [n for n in (n.strip(" ") for n in value.split(",")) if n and n not in ATTENTION_KERNEL_NAMES]
    return (f"{', '.join(map(repr, unknown))} {'names' if len(unknown) == 1 else 'name'} no kernel (expected "
            f"{', '.join(ATTENTION_KERNEL_NAMES)}) and {'is' if len(unknown) == 1 else 'are'} ignored"
            if unknown else None)


ATTENTION_KERNEL_NAMES = ("mma", "sm90", "int8", "all")
# How libcquant reads each run-time switch it has a rule for (csrc/settings.c, the README's table):
# check(value, libcquant's parsed settings) -> None, or why the value is not in force and what is.
# It ignores a value it cannot read, without a word; the flags (CQUANT_DISABLE_*) take any value.
_SETTING_CHECKS = {
    "CQUANT_WO_CHUNK_MB": _positive("wo_chunk_mib", "the default, {} MiB,"),
    "CQUANT_GROUP4_DECODE_M": _positive("group4_decode_min_m", "the measured choice"),
    "CQUANT_WO_DECODE_M": _positive("wo_decode_min_m", "the measured choice"),
    "CQUANT_WO_SPLIT_K": _one_of("0", "1", used="the default, 1 (split where SMs would idle),"),
    "CQUANT_WO_CLUSTER_PAIRS": _one_of("0", "1", used="the default, 1 (clusters of two CTAs),"),
    "CQUANT_GEMV_PERSISTENT": _one_of("0", "1", used="the measured choice"),
    "CQUANT_ATTN_SM90": _one_of("0", "1", used="the measured choice"),
    "CQUANT_ATTN_DISABLE": _attention_kernels,
    "CQUANT_SHARE_ACTIVATIONS": _one_of("0", "1", used="the default, 1 (sharing on),"),
}


def invalid_settings(user, parsed):
    """{name: why its value is not in force, and what is} of the CQUANT_* switches in `user` ({name:
    value} as set) that libcquant could not read; `parsed` is ops.settings()."""
    return {name: why for name, value in sorted(user.items())
            if name in _SETTING_CHECKS and (why := _SETTING_CHECKS[name](value, parsed)) is not None}


def _gpus_from_nvidia_smi():
    """[(name, cc)] that nvidia-smi lists: the GPUs a CPU-only build cannot ask CUDA about."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            gpus.append((name.strip(), 10 * int(major) + int(minor)))
    return gpus


def _schemes_on(device):
    """{scheme: None (runs) or why not} on one device (a cuda_device dict)."""
    out = {}
    for name in SCHEME_NAMES:
        need = scheme(name).min_compute_capability
        if not device["kernels"]:
            out[name] = device["why_not"] or "cquant's kernels do not run on this GPU"
        elif device["cc"] < need:
            out[name] = (f"needs compute capability {need // 10}.{need % 10} (sm_{need}); this GPU is "
                         f"{device['cc'] // 10}.{device['cc'] % 10}")
        else:
            out[name] = None
    return out


def _attention_on(device, settings):
    """{mode: (runs, what)} on one device: the kernels each attention mode takes there, or why
    it has none (the same rules as the dispatch in kernels/attention_dispatch.cu)."""
    disabled = set(settings["attn_disabled"])
    sm90 = device["sm90a"] and settings["attn_sm90"] != "off" and "sm90" not in disabled
    out = {}
    for mode, need, kernel in (("bf16/fp16", ops.MIN_CC_ATTENTION, "mma"),
                               ("int8", ops.MIN_CC_ATTENTION_INT8, "int8")):
        if not device["kernels"]:
            out[mode] = (False, device["why_not"])
        elif device["cc"] < need:
            out[mode] = (False, f"needs compute capability {need // 10}.{need % 10} (sm_{need})")
        elif kernel in disabled:
            out[mode] = (False, f"switched off by CQUANT_ATTN_DISABLE={os.environ.get('CQUANT_ATTN_DISABLE', '')}")
        elif sm90:
            out[mode] = (True, f"sm_90a wgmma kernels up to head dim 128, mma.sync kernels up to "
                               f"{ops.ATTENTION_MAX_HEAD_DIM}")
        else:
            out[mode] = (True, f"mma.sync kernels up to head dim {ops.ATTENTION_MAX_HEAD_DIM}")
    return out


def collect():
    """Everything `cquant info` prints, as a JSON-able dict."""
    lib = os.path.join(os.path.dirname(os.path.abspath(ops.__file__)), "libcquant.so")
    build = dict(ops.build_info())
    build["library"] = lib
    build["library_bytes"] = os.path.getsize(lib) if os.path.exists(lib) else None
    info = {"cquant": build, "python": platform.python_version(), "platform": platform.platform(),
            "libraries": _library_versions(),
            "settings": dict(sorted(USER_SETTINGS.items())),
            "runtime": None, "gpus": []}
    settings = ops.settings()
    info["invalid_settings"] = invalid_settings(USER_SETTINGS, settings)
    if not build["cuda"]:
        # nvidia-smi still tells whether this machine has GPUs the build cannot use
        info["gpus"] = [{"name": name, "cc": cc, "kernels": False, "sm90a": False,
                         "why_not": "this cquant build is CPU-only (reinstall on this machine with nvcc, or the wheel)"}
                        for name, cc in _gpus_from_nvidia_smi()]
    else:
        rt = ops.cuda_runtime_info()
        info["runtime"] = rt
        for i in range(rt["device_count"]):
            try:
                info["gpus"].append({"index": i, **ops.cuda_device(i)})
            except (RuntimeError, NotImplementedError) as e:  # a device that cannot be asked
                info["gpus"].append({"index": i, "name": "?", "cc": 0, "kernels": False, "sm90a": False,
                                     "why_not": str(e)})
    for gpu in info["gpus"]:
        gpu["schemes"] = _schemes_on(gpu)
        gpu["attention"] = {mode: {"runs": runs, "detail": what}
                            for mode, (runs, what) in _attention_on(gpu, settings).items()}
    return info


def _build_line(b):
    if not b["cuda"]:
        return "CPU-only (no CUDA kernels)"
    archs = ", ".join(f"sm_{a}" for a in b["archs"].split(";") if a)
    ptx = f"; PTX compute_{b['ptx']}" if b["ptx"] else "; no PTX"
    return f"CUDA {_cuda_version(b['cuda_version'])}, machine code {archs}{ptx}"


def render(info):
    """The text `cquant info` prints."""
    b = info["cquant"]
    size = f"{b['library_bytes'] / 1e6:.1f} MB" if b["library_bytes"] is not None else "missing"
    lines = [f"cquant {b['version']}",
             f"  build        {_build_line(b)}",
             f"  library      {b['library']} ({size})"]
    rt = info["runtime"]
    if rt is not None:
        driver = _cuda_version(rt["driver_version"])
        lines.append(f"  CUDA         runtime {_cuda_version(rt['runtime_version'])} (in libcquant); "
                     + (f"driver supports CUDA {driver}" if driver else "no CUDA driver"))
        lines.append("  cuBLASLt     " + (f"{_cublaslt_version(rt['cublaslt_version'])} ({rt['cublaslt_path']})"
                                          if rt["cublaslt_version"] else f"not opened: {rt['cublaslt_error']}"))
    lines.append(f"  Python       {info['python']} ({info['platform']})")
    libs = ", ".join(f"{k} {v}" for k, v in info["libraries"].items() if v)
    missing = [k for k, v in info["libraries"].items() if not v]
    lines.append(f"  libraries    {libs}" + (f"; not installed: {', '.join(missing)}" if missing else ""))
    invalid = info.get("invalid_settings", {})
    lines.append("  settings     " + (", ".join(f"{k}={v}" + (f" (invalid: {invalid[k]})" if k in invalid else "")
                                              for k, v in info["settings"].items()) or "none set"))
    if not info["gpus"]:
        lines.append("GPUs: none" + (" visible to CUDA" if rt is not None else " found by nvidia-smi"))
    for g in info["gpus"]:
        head = f"GPU {g['index']}: {g['name']}" if "index" in g else f"GPU: {g['name']}"
        cc = f"compute capability {g['cc'] // 10}.{g['cc'] % 10}"
        extra = f", {g['sms']} SMs, {g['total_memory'] / 2**30:.1f} GiB" if g.get("sms") else ""
        lines.append(f"{head} ({cc}{extra})")
        if not g["kernels"]:
            lines.append(f"  kernels      none run here: {g['why_not']}")
        else:
            lines.append("  kernels      " + ("sm_90a machine code (wgmma GEMMs and attention, persistent GEMV)"
                                             if g["sm90a"] else "run here"))
        runs = [s for s, why in g["schemes"].items() if why is None]
        lines.append(f"  schemes      {'run: ' + ', '.join(runs) if runs else 'none run'}")
        for s, why in g["schemes"].items():
            if why is not None and g["kernels"]:
                lines.append(f"               {s}: no, {why}")
        for mode, a in g["attention"].items():
            lines.append(f"  attention    {mode}: {a['detail'] if a['runs'] else 'no, ' + a['detail']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="cquant info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
