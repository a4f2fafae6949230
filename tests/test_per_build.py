"""What can differ from one build of cquant to another, checked against the build under test.

CI runs the whole suite against the README's `pip install .` (and again under the sanitizers,
scripts/sanitize.sh). Its CUDA build for a stand-in H100 (scripts/compile_cuda.sh) and its binary
wheel, installed where no source tree is in sight (.ci/run), get only the tests marked
`per_build`, these among them: every module imports from the build, the installed package holds
what the source tree has, the libraries it loads are its own, the command line runs, and each
scheme of the SCHEMES table quantizes a model, computes what the reference says of the codes it
stored, and is saved and loaded again from a temporary directory. The rest of the suite runs the
same Python code and the same C reference kernels whichever build it tests. On a machine without
a GPU a CUDA build runs its CPU path here, as it must.
"""

import json
import os
import site
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cquant
from cquant import SCHEMES, ops

import reference as ref
from helpers import run_fresh_python
from tolerances import linear_abs_bound, linear_group_abs_bound, two_level_linear_abs_bound

pytestmark = pytest.mark.per_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(os.path.abspath(cquant.__file__))
# site-packages (or a user site): where pip puts cquant, and where start-up reads .pth files
INSTALLED = os.path.dirname(PACKAGE) in {os.path.abspath(p) for p in
                                         site.getsitepackages() + [site.getusersitepackages()]}
installed_only = pytest.mark.skipif(not INSTALLED, reason=f"cquant under test is not installed: {PACKAGE}")


def _files(top, keep):
    """Paths under top (relative, '/'-separated) that keep(name) accepts, without __pycache__."""
    out = set()
    for d, dirs, files in os.walk(top):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out.update(os.path.relpath(os.path.join(d, f), top).replace(os.sep, "/") for f in files if keep(f))
    return out


def _module_names():
    names = []
    for rel in _files(PACKAGE, lambda f: f.endswith(".py")):
        parts = rel[:-3].split("/")
        names.append(".".join(["cquant"] + parts[:-1 if parts[-1] == "__init__" else None]))
    return sorted(names)


def test_every_module_imports_from_the_build_under_test():
    """In a new interpreter: importing a submodule changes its package (`import cquant.summary`
    leaves the module where cquant.summary, the function, would load), which must not reach the
    tests that run after this one in this process."""
    names = _module_names()
    assert {"cquant", "cquant.ops", "cquant.torch_ops", "cquant.integrations.diffusers_quantizer"} <= set(names)
    code = ("import importlib, json, sys\n"
            "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))")
    files = json.loads(run_fresh_python(code, args=names))
    for name in names:
        assert os.path.abspath(files[name]).startswith(PACKAGE + os.sep), (name, files[name])


def test_the_package_holds_every_module_and_data_file_of_the_source_tree():
    source = os.path.join(ROOT, "python", "cquant")
    wanted = _files(source, lambda f: f.endswith(".py"))
    wanted |= {f"data/{f}" for f in os.listdir(os.path.join(source, "data"))}
    here = _files(PACKAGE, lambda f: True)
    assert wanted - here == set(), f"{PACKAGE} lacks files of {source}"
    # one extension for every CPython from 3.10 on (the stable ABI), beside its library
    assert os.path.basename(cquant._C.__file__) == "_C.abi3.so"
    assert os.path.isfile(os.path.join(PACKAGE, "libcquant.so"))


def _mapped(name):
    """Real paths of the loaded shared objects whose file name starts with `name`."""
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {os.path.realpath(p) for p in paths if os.path.basename(p).startswith(name)}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_the_extension_loads_the_library_beside_it_and_no_other():
    assert _mapped("libcquant") == {os.path.realpath(os.path.join(PACKAGE, "libcquant.so"))}
    assert _mapped("_C.abi3") == {os.path.realpath(cquant._C.__file__)}


def test_cublaslt_is_looked_for_where_pip_puts_it():
    """libcquant opens cuBLASLt at first use; the NVIDIA wheels' folders are handed to it."""
    from cquant import _libs

    dirs = _libs.nvidia_wheel_lib_dirs()
    assert all(any(f.startswith("libcublasLt.so.") for f in os.listdir(d)) for d in dirs)
    if dirs and "CQUANT_CUBLASLT_PATH" not in _libs.USER_SETTINGS:
        assert os.environ["CQUANT_CUBLASLT_PATH"].split(os.pathsep) == dirs


@installed_only
def test_an_installed_cquant_sees_no_source_tree():
    source = os.path.join(ROOT, "python")
    assert source not in {os.path.abspath(p) for p in sys.path if p}
    assert not os.path.abspath(cquant.__file__).startswith(source + os.sep)


def _installed_script():
    """The `cquant` command pip installed beside this interpreter's other scripts."""
    import importlib.metadata as md
    import sysconfig

    dist = md.distribution("cquant")
    assert os.path.samefile(dist.locate_file("cquant/__init__.py"), cquant.__file__), dist.locate_file("cquant")
    (entry,) = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "cquant"]
    assert entry.value == "cquant.__main__:main"
    script = os.path.join(sysconfig.get_path("scripts"), "cquant")
    assert os.access(script, os.X_OK), f"{script} was not installed"
    return script


@installed_only
def test_the_installed_command_runs_this_build():
    out = subprocess.run([_installed_script(), "info", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)["cquant"]
    assert d["library"] == os.path.join(PACKAGE, "libcquant.so")
    assert {k: d[k] for k in ("version", "cuda", "archs", "ptx")} == {
        k: v for k, v in ops.build_info().items() if k in ("version", "cuda", "archs", "ptx")}


@installed_only
def test_start_up_reads_the_installed_autoload_hook():
    """cquant-autoload.pth lands in site-packages, so a new interpreter installs the hook that lets
    diffusers and transformers load a cquant checkpoint before `import cquant` (test_autoload.py)."""
    assert os.path.isfile(os.path.join(os.path.dirname(PACKAGE), "cquant-autoload.pth"))
    code = "import sys; print(sorted(m for m in ('_cquant_autoload', 'cquant') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['_cquant_autoload']"]


def _stored_math(layer, x):
    """float64 evaluation (tests/reference.py) of a QuantizedLinear from the codes it stores,
    with its elementwise bound for float32 compute: (y64, bound)."""
    s = layer.scheme
    k = layer.in_features
    x = x.detach().numpy()
    q, scale = layer.weight.detach().numpy(), layer.weight_scale.detach().numpy()
    bias = layer.bias.detach().double().numpy()
    act = ref.fmt(s.act_format.name) if s.act_format else None
    if s.weight_granularity == "two_level":
        xc, sx = ref.quantize(x, act, "row")
        codes = ref.codes_of_stored_group(q, "int4", k)
        y64, terms, _ = ref.linear_two_level(ref.decode(act, xc), sx, codes, scale, s.weight_group_size, bias)
        return y64, two_level_linear_abs_bound(terms, y64, "float32")
    if s.grouped:
        codes = ref.codes_of_stored_group(q, s.weight_format.name, k)
        y64, terms = ref.linear_group(x, codes, scale, s.weight_format.name, s.weight_group_size, "float32", act,
                                      bias)
        return y64, linear_group_abs_bound(k, k // s.weight_group_size, terms, y64, "float32")
    wf = ref.fmt(s.weight_format.name)
    y64, terms = ref.linear(x, ref.codes_of_stored(wf, q, k), scale, wf, s.weight_granularity, act,
                            s.act_granularity, bias)
    return y64, linear_abs_bound(k, terms, y64, "float32")


def _model(torch, seed):
    torch.manual_seed(seed)
    # widths that every scheme takes, the 4-bit ones' group of 128 columns included
    return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.GELU(), torch.nn.Linear(128, 40)).eval()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantize_forward_save_and_load_every_scheme(torch, name, seed, tmp_path):
    """quantize_ a small model, run it, check each layer against the float64 evaluation of the
    codes it stores (only fp32 rounding may differ), and load it from a file into another model."""
    from cquant.nn import QuantizedLinear

    model = _model(torch, seed)
    cquant.quantize_(model, name)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m, QuantizedLinear) and m.scheme.name == name for m in layers)
    seen = []
    for m in layers:
        m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], out)))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = model(x)
    assert [mod for mod, _, _ in seen] == layers
    for i, (mod, inp, out) in enumerate(seen):
        y64, bound = _stored_math(mod, inp)
        err = np.abs(out.double().numpy() - y64)
        assert np.all(err <= bound), f"{name} layer {i}: |y - y64| up to {err.max():.3g}, bound {bound.min():.3g}"

    path = tmp_path / "model.safetensors"
    cquant.save_quantized(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean load warns of nothing
        loaded = cquant.load_quantized(_model(torch, seed + 1), path)
    with torch.no_grad():
        assert torch.equal(loaded(x), y)


def test_the_bundled_demo_model_loads_from_the_package(torch):
    """Package data: the demo's trained weights come with the build (cquant/data)."""
    from cquant import demo_model

    model, _, spec = demo_model.load_bundled()
    assert sum(p.numel() for p in model.parameters()) > 1_000_000 and spec["image_size"] == 32
