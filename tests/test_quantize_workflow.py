"""cquant.quantize_, dequantize_ and summary on plain torch modules (CPU)."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import cquant  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402
from cquant.quantize import swap_in  # noqa: E402
from helpers import sqnr_db, ungrouped_schemes  # noqa: E402
from tolerances import MODEL_SQNR_FLOOR_DB  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.ModuleDict({"to_q": torch.nn.Linear(64, 64), "to_out": torch.nn.Linear(64, 64)})
        self.ff = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

    def forward(self, x):
        x = x + self.attn["to_out"](self.attn["to_q"](x))
        return x + self.ff(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(8, 64)  # in_features too small for every scheme
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 40)  # any out_features is fine
        self.proj_out = torch.nn.Linear(40, 24)  # in_features not a multiple of 16: every scheme refuses

    def forward(self, x):
        x = self.proj_in(x)
        for b in self.blocks:
            x = b(x)
        return self.proj_out(self.head(self.norm(x)))


def net(seed=0):
    torch.manual_seed(seed)
    return Net().eval()


def quantize_quiet(model, config, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
        return cquant.quantize_(model, config, **kw)


def test_quantizes_every_linear_it_can_and_reports_the_rest():
    m = net()
    x = torch.randn(5, 8)
    ref = m(x)
    with pytest.warns(cquant.SkippedLayersWarning, match=r"(?s)2 of 11 linear layers.*in_features=8 is below 16.*proj_in"
                      r".*in_features=40 is not a multiple of 16.*proj_out") as rec:
        cquant.quantize_(m, "fp8dqrow")
    assert len(rec) == 1
    kinds = {n: type(mod).__name__ for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert kinds.pop("proj_in") == "Linear" and kinds.pop("proj_out") == "Linear"
    assert set(kinds.values()) == {"QuantizedLinear"}
    y = m(x)
    assert 20 * torch.log10(ref.norm() / (ref - y).norm()) > 20
    s = cquant.summary(m)
    assert s.count("quantized") == 9 and s.count("skipped") == 2
    assert set(s.skipped) == {"proj_in", "proj_out"}
    assert "below 16" in s.skipped["proj_in"]
    text = str(s)
    assert "blocks.0.ff.2" in text and "fp8dqrow" in text and "skipped" in text and "9 quantized" in text
    html = s._repr_html_()
    assert html.startswith("<table>") and html.count("<tr>") == 12 and "proj_out" in html


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_any_out_features(scheme):
    m = net()
    with pytest.warns(cquant.SkippedLayersWarning, match="2 of 11"):
        cquant.quantize_(m, scheme)
    assert isinstance(m.head, QuantizedLinear) and m.head.out_features == 40
    assert m(torch.randn(2, 8)).shape == (2, 24)


@pytest.mark.parametrize("name", ungrouped_schemes(cquant.SCHEME_NAMES))
def test_string_names(name):
    m = net()
    quantize_quiet(m, name)
    assert m.blocks[0].ff[0].scheme.name == name
    assert m(torch.randn(2, 8)).shape == (2, 24)


def test_mapping_configs():
    m = net()
    quantize_quiet(m, {
        "blocks.0.attn.to_q": "fp8dqrow",
        r"re:blocks\.\d+\.ff\..*": "fp6_e3m2",
        "blocks.1.attn.to_out": None,
        "_default": "int8wo",
    })
    assert m.blocks[0].attn["to_q"].scheme.name == "fp8dqrow"
    assert m.blocks[1].attn["to_q"].scheme.name == "int8wo"
    assert m.blocks[0].ff[2].scheme.name == "fp6_e3m2"
    assert type(m.blocks[1].attn["to_out"]) is torch.nn.Linear
    s = cquant.summary(m)
    row = next(r for r in s.rows if r.name == "blocks.1.attn.to_out")
    assert row.status == "excluded" and "mapped to None" in row.note
    # no default: unmatched layers stay float, reported as excluded
    m2 = net()
    quantize_quiet(m2, cquant.FqnToConfig({"re:.*ff.*": "int8dq"}))
    assert isinstance(m2.blocks[0].ff[0], QuantizedLinear) and type(m2.blocks[0].attn["to_q"]) is torch.nn.Linear
    assert "no entry" in next(r.note for r in cquant.summary(m2).rows if r.name == "blocks.0.attn.to_q")


def test_mapping_keys_that_match_no_linear_layer_are_named():
    m = net()
    with pytest.warns(cquant.UnmatchedKeysWarning, match=r"2 keys .* 'blocks\.0\.atn\.to_q', 'blocks\.0'; keys are full"):
        quantize_quiet(m, {"blocks.0.atn.to_q": "fp8dqrow", "blocks.0": "int8wo", r"re:blocks\.\d+\.ff\..*": "int8wo"})
    assert type(m.blocks[0].attn["to_q"]) is torch.nn.Linear and isinstance(m.blocks[0].ff[0], QuantizedLinear)
    # keys that match, even of layers filter_fn or a scheme leaves out, are not warned about
    with warnings.catch_warnings():
        warnings.simplefilter("error", cquant.UnmatchedKeysWarning)
        quantize_quiet(net(), {"proj_in": "int8wo", "blocks.0.attn.to_q": "int8wo", "_default": None},
                       filter_fn=lambda mod, fqn: fqn != "blocks.0.attn.to_q")


@pytest.mark.parametrize("mapping", [{}, {"_default": None}, {"proj_in": None}])
def test_a_mapping_that_quantizes_nothing_says_so(mapping):
    m = net()
    with pytest.warns(cquant.UnmatchedKeysWarning, match="the mapping quantizes no layer of"):
        quantize_quiet(m, mapping)
    assert not any(isinstance(mod, QuantizedLinear) for mod in m.modules())


def test_filter_fn_sees_module_and_fqn():
    m = net()
    seen = []

    def only_ff(mod, fqn):
        seen.append((type(mod).__name__, fqn))
        return ".ff." in fqn

    quantize_quiet(m, "int8wo", filter_fn=only_ff)
    assert ("Linear", "blocks.0.ff.0") in seen and all(t == "Linear" for t, _ in seen)
    assert isinstance(m.blocks[1].ff[2], QuantizedLinear)
    assert type(m.blocks[1].attn["to_q"]) is torch.nn.Linear
    assert next(r.note for r in cquant.summary(m).rows if r.name == "blocks.1.attn.to_q") == "excluded by filter_fn"


def test_keep_in_fp32_modules_are_left_alone():
    m = net()
    m._keep_in_fp32_modules = ["ff"]
    quantize_quiet(m, "int8wo")
    assert type(m.blocks[0].ff[0]) is torch.nn.Linear and isinstance(m.blocks[0].attn["to_q"], QuantizedLinear)


def test_shared_modules_are_quantized_once():
    m = net()
    m.blocks[1].ff = m.blocks[0].ff  # one module reachable twice
    quantize_quiet(m, "int8wo")
    assert m.blocks[1].ff[0] is m.blocks[0].ff[0] and isinstance(m.blocks[0].ff[0], QuantizedLinear)


def test_quantizing_again_with_the_same_scheme_changes_nothing():
    m = net()
    quantize_quiet(m, "int8wo")
    q = m.blocks[0].ff[0]
    quantize_quiet(m, "int8wo")
    assert m.blocks[0].ff[0] is q


def test_quantizing_again_with_another_scheme_is_refused():
    # requantizing stored codes would round the weights twice; it must not pass silently either
    m = net()
    quantize_quiet(m, "int8wo")
    q = m.blocks[0].ff[0]
    with pytest.raises(ValueError, match=r"already quantized with another scheme: .*blocks\.0\.ff\.0 \(int8wo, asked "
                                         r"fp8dqrow\).*dequantize_"):
        cquant.quantize_(m, "fp8dqrow")
    assert m.blocks[0].ff[0] is q and q.scheme.name == "int8wo"
    # the quantized layers can be left out explicitly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
        cquant.quantize_(m, "fp8dqrow", filter_fn=lambda mod, fqn: not isinstance(mod, cquant.QuantizedLinear))


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2", "int4wo"])
def test_quantized_under_inference_mode_runs_where_autograd_records(scheme):
    # a float layer made under inference_mode runs outside it; its quantized twin must too
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 64))
    twin = copy.deepcopy(m)
    with torch.inference_mode():
        cquant.quantize_(m, scheme)
    cquant.quantize_(twin, scheme)
    assert not any(t.is_inference() for t in m.state_dict().values())
    x = torch.randn(3, 256, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert torch.equal(y, twin(x)) and m[0].bias.grad is not None and x.grad is not None


def test_multihead_attention_out_proj_stays_float():
    # torch.nn.MultiheadAttention passes out_proj.weight to its functional form: codes there would crash
    torch.manual_seed(0)
    m = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True).eval()
    x = torch.randn(2, 5, 64)
    ref = m(x)
    with pytest.warns(cquant.SkippedLayersWarning, match=r"reads its float weight directly.*self_attn\.out_proj"):
        cquant.quantize_(m, "int8wo")
    assert type(m.self_attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(m.linear1, QuantizedLinear) and isinstance(m.linear2, QuantizedLinear)
    assert sqnr_db(ref, m(x)) > MODEL_SQNR_FLOOR_DB["int8wo"]  # the float out_proj does run


class ScaledLinear(torch.nn.Linear):
    """A linear subclass with a forward of its own (as diffusers' LoRACompatibleLinear adds its adapter)."""

    def forward(self, x):
        return 2 * super().forward(x)


class PlainSubclass(torch.nn.Linear):
    pass


def test_linear_subclasses_with_their_own_forward_stay_float():
    torch.manual_seed(0)
    m = torch.nn.Sequential(ScaledLinear(64, 64), PlainSubclass(64, 64))
    x = torch.randn(3, 64)
    ref = m(x)
    with pytest.warns(cquant.SkippedLayersWarning, match=r"ScaledLinear has its own forward.*: 0\n"):
        cquant.quantize_(m, "int8wo")
    assert type(m[0]) is ScaledLinear and isinstance(m[1], QuantizedLinear)
    assert sqnr_db(ref, m(x)) > MODEL_SQNR_FLOOR_DB["int8wo"]
    # nor does a list of layers to load (a checkpoint's) turn it into one
    with pytest.raises(ValueError, match="0 cannot become a QuantizedLinear: ScaledLinear has its own forward"):
        swap_in(m, {"0": cquant.schemes.scheme("int8wo")}, empty=True)
    assert type(m[0]) is ScaledLinear


def test_device_argument_on_cpu_and_dtype_of_layers():
    m = net().to(torch.bfloat16)
    quantize_quiet(m, "fp8wo", device="cpu")
    assert m.blocks[0].ff[0].compute_dtype == torch.bfloat16
    assert m(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_progress_bar_for_many_layers(capsys):
    m = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(80)])
    cquant.quantize_(m, "int8wo")
    err = capsys.readouterr().err
    assert "cquant int8wo" in err and "80/80" in err
    m2 = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(80)])
    cquant.quantize_(m2, "int8wo", progress=False)
    assert "80/80" not in capsys.readouterr().err


def test_memory_and_parameter_counts():
    m = net()
    f_params = sum(p.numel() for p in m.parameters())
    q8 = quantize_quiet(copy.deepcopy(m), "int8wo")
    # 8-bit codes: one stored element per weight, so parameter counts match the float model
    assert sum(p.numel() for p in q8.parameters()) == f_params
    bytes_q = sum(t.nbytes for t in list(q8.parameters()) + list(q8.buffers()))
    assert bytes_q < sum(p.nbytes for p in m.parameters()) / 3
    q6 = quantize_quiet(copy.deepcopy(m), "fp6_e3m2")
    # packed fpX: one parameter per weight too, while the stored bytes are 6 bits a weight
    # (rows padded to 16 bytes)
    ff0 = q6.blocks[0].ff[0]
    assert ff0.weight.numel() == 256 * 64 and ff0.weight.nbytes == ff0.weight.nelement() == 256 * 48
    assert ff0.weight.dtype == torch.uint8 and sum(p.numel() for p in q6.parameters()) == f_params
    s = cquant.summary(q6)
    assert s.bytes_after < s.bytes_before / 4


def test_dequantize_restores_float_layers():
    m = net()
    x = torch.randn(3, 8)
    quantize_quiet(m, "int8wo")
    y = m(x)
    cquant.dequantize_(m)
    assert not any(isinstance(mod, QuantizedLinear) for mod in m.modules())
    assert torch.allclose(m(x), y, rtol=1e-4, atol=1e-4)


def test_dequantize_with_a_bad_dtype_changes_nothing():
    FeedForward = pytest.importorskip("diffusers.models.attention").FeedForward

    torch.manual_seed(0)
    m = FeedForward(64, activation_fn="gelu-approximate")
    cquant.quantize_(m, "int8wo")
    assert m.net[0].proj.activation == "gelu_tanh"  # the GELU fused into the layer before it
    for bad in (torch.float64, "float16"):
        with pytest.raises(TypeError, match="dtype must be torch.float32, torch.float16 or torch.bfloat16"):
            cquant.dequantize_(m, bad)
    assert m.net[0].proj.activation == "gelu_tanh" and isinstance(m.net[2], QuantizedLinear)


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cquant.quantize_("model", "int8wo")
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        cquant.quantize_(net(), "int8wo", filter_fn="ff")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        cquant.quantize_(net(), "int2")
    with pytest.raises(TypeError, match="config must be"):
        cquant.quantize_(net(), 8)


def test_non_float_and_wrapped_weights_are_skipped_not_crashed():
    m = net()
    m.blocks[0].ff[0].double()
    with pytest.warns(cquant.SkippedLayersWarning, match="float64"):
        cquant.quantize_(m, "int8wo")
    assert type(m.blocks[0].ff[0]) is torch.nn.Linear


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_quantize_a_bare_linear_in_place(scheme):
    # torchao's quantize_ works on a single layer; the layer itself must become the quantized one
    lin = torch.nn.Linear(64, 32)
    hook_calls = []
    lin.register_forward_hook(lambda mod, args, out: hook_calls.append(1))
    x = torch.randn(5, 64)
    ref = lin(x).detach()
    assert cquant.quantize_(lin, scheme) is lin
    assert isinstance(lin, QuantizedLinear) and lin.scheme.name == scheme
    y = lin(x)
    assert len(hook_calls) == 2  # the user's hooks stay
    assert sqnr_db(ref, y.detach()) > 15
    w = lin.dequantize()
    cquant.dequantize_(lin)
    assert type(lin) is torch.nn.Linear and lin.weight.dtype == torch.float32
    assert torch.equal(lin.weight, w)


@pytest.mark.parametrize("scheme", ["int8wo", "fp8dqrow", "fp6_e3m2"])
def test_hooks_on_a_replaced_layer_move_with_it_and_their_handles_still_remove_them(scheme):
    """quantize_ puts a new module in a child layer's slot; torch's forward and backward hooks
    registered on the float layer ran no more."""
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    calls = []
    post = m[0].register_forward_hook(lambda mod, args, out: calls.append(("post", type(mod).__name__)))
    m[0].register_forward_pre_hook(lambda mod, args, kwargs: calls.append(("pre", kwargs)), with_kwargs=True)
    m[2].register_forward_hook(lambda mod, args, out: out * 2)  # a hook that changes the output
    x = torch.randn(3, 64)
    cquant.quantize_(m, scheme)
    assert all(isinstance(m[i], QuantizedLinear) for i in (0, 2))
    y = m(x)
    assert calls == [("pre", {}), ("post", "QuantizedLinear")]
    assert torch.equal(y, 2 * QuantizedLinear.forward(m[2], m[1](m[0](x))))
    post.remove()  # the handle from the float layer
    calls.clear()
    m(x)
    assert calls == [("pre", {})]
    cquant.dequantize_(m)  # and back to float layers
    calls.clear()
    m(x)
    assert type(m[0]) is torch.nn.Linear and calls == [("pre", {})]


def test_a_layer_under_an_accelerate_hook_stays_float():
    """accelerate's add_hook_to_module wraps the layer's bound forward (dispatch_model, cpu offloading);
    a new module in its slot would drop it without a word."""
    hooks = pytest.importorskip("accelerate.hooks")
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    hooks.add_hook_to_module(m[1], hooks.ModelHook())
    with pytest.warns(cquant.SkippedLayersWarning, match=r"accelerate hook \(ModelHook.*apply cquant's change "
                                                         r"before accelerate's"):
        cquant.quantize_(m, "int8wo")
    assert isinstance(m[0], QuantizedLinear) and type(m[1]) is torch.nn.Linear
    assert isinstance(m[1]._hf_hook, hooks.ModelHook)


def test_summary_of_a_model_without_linear_layers():
    line = cquant.summary(torch.nn.Sequential(torch.nn.GELU())).totals_line()
    assert line.startswith("0 linear layers") and "nan" not in line


def test_summary_of_a_pipeline_points_at_its_denoiser():
    class Pipe:  # what a diffusers pipeline looks like to summary: components, a transformer
        def __init__(self):
            self.transformer = torch.nn.Sequential(torch.nn.Linear(4, 4))
            self.components = {"transformer": self.transformer}

    with pytest.raises(TypeError, match=r"got Pipe; for a pipeline, pass its denoiser \(pipe.transformer\)"):
        cquant.summary(Pipe())
    with pytest.raises(TypeError, match="got list$"):
        cquant.summary([torch.nn.Linear(4, 4)])
