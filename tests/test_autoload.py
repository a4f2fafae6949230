"""cquant-autoload.pth: diffusers and transformers load a cquant checkpoint before `import cquant`.

Each test runs a fresh interpreter that processes the .pth as site does for site-packages
(site.addsitedir on a directory holding a copy of it), as an installed cquant's would be."""

import json
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402

PTH = "cquant-autoload.pth"


def _pth_source():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", PTH)
    installed = os.path.join(os.path.dirname(os.path.dirname(cquant.__file__)), PTH)
    return next((p for p in (here, installed) if os.path.exists(p)), None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{library: (directory, expected output file)} of a quantized tiny Flux and CLIP encoder."""
    root = tmp_path_factory.mktemp("autoload")
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        flux = tm.build("flux")
        cquant.quantize_(flux, "fp8dqrow")
        flux.save_pretrained(root / "flux")
        torch.save(tm.run(flux, "flux"), root / "flux.pt")
        clip = tm.clip_text_encoder()
        cquant.quantize_(clip, "int8wo")
        clip.save_pretrained(root / "clip")
        with torch.no_grad():
            torch.save(clip(torch.arange(2, 14).view(1, 12)).last_hidden_state, root / "clip.pt")
    return root


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    source = _pth_source()
    if source is None:
        pytest.skip(f"no {PTH} next to the sources or the installed cquant")
    d = tmp_path_factory.mktemp("site")
    shutil.copy(source, d / PTH)
    return d


def run_fresh(site_dir, body):
    """Run `body` in a new interpreter whose start-up processed the .pth; returns its stdout lines."""
    code = "\n".join([
        "import site, sys, warnings",
        "warnings.simplefilter('ignore')",
        f"site.addsitedir({str(site_dir)!r})",
        body,
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_start_up_imports_only_the_hook(site_dir):
    lines = run_fresh(site_dir, "print(sorted(m for m in ('_cquant_autoload', 'cquant', 'torch', 'numpy', "
                                "'diffusers', 'transformers', 'importlib.util') if m in sys.modules))")
    assert lines[0] == "['_cquant_autoload']"


def test_checkpoints_load_without_import_cquant(site_dir, checkpoints):
    # without the hook, diffusers raises "Unknown quantization type, got cquant", and transformers
    # logs a warning and loads the int8 codes as float weights
    lines = run_fresh(site_dir, f"""
import torch, diffusers, transformers
from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING
print(AUTO_QUANTIZER_MAPPING['cquant'].__name__, 'cquant' in sys.modules)
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import tiny_models as tm
with tm.native_attention():
    model = diffusers.FluxTransformer2DModel.from_pretrained({str(checkpoints / 'flux')!r})
    y = tm.run(model, 'flux')
    print(type(model.proj_out).__name__, torch.equal(y, torch.load({str(checkpoints / 'flux.pt')!r})))
model = transformers.CLIPTextModel.from_pretrained({str(checkpoints / 'clip')!r})
with torch.no_grad():
    y = model(torch.arange(2, 14).view(1, 12)).last_hidden_state
print(type(model.encoder.layers[0].mlp.fc1).__name__, torch.equal(y, torch.load({str(checkpoints / 'clip.pt')!r})))
""")
    assert lines[0] == "CQuantPlaceholder[AUTO_QUANTIZER_MAPPING] False"
    assert lines[1] == "QuantizedLinear True"
    assert lines[2] == "QuantizedLinear True"


def test_cquant_not_importable_says_to_import_it(site_dir, checkpoints):
    lines = run_fresh(site_dir, f"""
class Blocked:
    def find_spec(self, name, path, target=None):
        if name == 'cquant':
            raise ImportError('not installed')
sys.meta_path.insert(0, Blocked())
import diffusers, transformers
for load in (lambda: diffusers.FluxTransformer2DModel.from_pretrained({str(checkpoints / 'flux')!r}),
             lambda: transformers.CLIPTextModel.from_pretrained({str(checkpoints / 'clip')!r})):
    try:
        load()
        print('loaded')
    except ImportError as e:
        print(str(e).replace(chr(10), ' '))
""")
    for line in lines[:2]:
        assert "quantized with cquant" in line and "`import cquant`" in line and "not installed" in line, lines


def test_placeholders_until_cquant_is_imported(site_dir):
    # PipelineQuantizationConfig(quant_backend="cquant") builds the config from the table; importing
    # cquant afterwards replaces the placeholders without a RegistrationWarning
    lines = run_fresh(site_dir, """
warnings.simplefilter('error')
import diffusers, diffusers.quantizers.auto as d, transformers.quantizers.auto as t
q = diffusers.PipelineQuantizationConfig(quant_backend='cquant', quant_kwargs={'quant_type': 'int8wo'},
                                         components_to_quantize=['transformer'])
print(type(q._resolve_quant_config(is_diffusers=True, module_name='transformer')).__name__)
import cquant
print(d.AUTO_QUANTIZER_MAPPING['cquant'].__name__, t.AUTO_QUANTIZATION_CONFIG_MAPPING['cquant'].__name__,
      cquant.integrations.registered())
""")
    assert lines[0] == "CQuantConfig"
    assert lines[1] == "CQuantDiffusersQuantizer CQuantConfig {'diffusers': True, 'transformers': True}"


def test_placeholders_only_where_nothing_is_registered():
    import _cquant_autoload

    real = object()
    fake = types.SimpleNamespace(__name__="diffusers.quantizers.auto", AUTO_QUANTIZER_MAPPING={"cquant": real},
                                 AUTO_QUANTIZATION_CONFIG_MAPPING={})
    _cquant_autoload.add_placeholders(fake)
    assert fake.AUTO_QUANTIZER_MAPPING["cquant"] is real
    assert fake.AUTO_QUANTIZATION_CONFIG_MAPPING["cquant"]._cquant_placeholder
    _cquant_autoload.add_placeholders(types.SimpleNamespace(__name__="diffusers.quantizers.auto"))  # no tables: fine
    with open(_pth_source() or os.devnull) as f:
        assert f.read().count("\n") <= 1  # site runs a .pth import line as one line


def test_registration_replaces_a_placeholder():
    import _cquant_autoload
    from cquant import integrations
    from cquant.integrations.diffusers_quantizer import CQuantDiffusersQuantizer

    auto = types.SimpleNamespace(__name__="diffusers.quantizers.auto", AUTO_QUANTIZER_MAPPING={},
                                 AUTO_QUANTIZATION_CONFIG_MAPPING={})
    _cquant_autoload.add_placeholders(auto)
    integrations._put(auto, "diffusers", CQuantDiffusersQuantizer, cquant.CQuantConfig)
    assert auto.AUTO_QUANTIZER_MAPPING["cquant"] is CQuantDiffusersQuantizer
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["cquant"] is cquant.CQuantConfig
    assert json.loads(json.dumps(integrations.registered()))["diffusers"]
