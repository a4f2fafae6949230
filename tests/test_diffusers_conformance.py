"""diffusers' own quantizer test suite, adapted to cquant on the CPU with tiny models.

Adapted from diffusers' tests/models/testing_utils/quantization.py (QuantizationTesterMixin and
its TorchAo / BitsAndBytes mixins), tests/pipelines/testing_utils/quantization.py
(PipelineQuantizationConfig, offloading, compile) and the earlier tests/quantization/torchao and
bnb suites: the same calls and assertions, with CQuantConfig in place of TorchAoConfig and a
model saved to a temporary directory in place of a Hub repository. Where diffusers checks a
backend's tensor class, these check for cquant.nn.QuantizedLinear. Tests that need an
accelerator (offloading onto it, memory statistics) run with `-m cuda`.

Deliberate differences, each noted where it occurs: a reloaded model is compared bit for bit
(diffusers allows 1e-3), so it is loaded with the dtype it was saved in (diffusers loads float32
without dtype=, for a cquant checkpoint as for a float one); modules_to_not_convert follows
cquant's rule (a module name, a name prefix or a path component), where diffusers' torchao
quantizer matches substrings, so "transformer_blocks.0" there also excludes
"single_transformer_blocks.0"; cquant refuses disk offload instead of leaving offloaded
layers unquantized.
"""

import gc
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import cquant  # noqa: E402
import tiny_models as tm  # noqa: E402
from cquant.nn import QuantizedLinear  # noqa: E402

# diffusers' expected memory reductions (TORCHAO_EXPECTED_MEMORY_REDUCTIONS, BNB_...): 8-bit
# weights 1.5x, 4-bit 1.8x (torchao int4wo) to 3x (bnb nf4); cquant's fpX sit in between
EXPECTED_MEMORY_REDUCTION = {"int8wo": 1.5, "int8dq": 1.5, "fp8dqrow": 1.5, "fp8wo": 1.5, "fp6_e3m2": 1.8,
                             "fp4_e2m1": 2.5}
EIGHT_BIT = ["int8wo", "int8dq", "fp8dqrow"]
COMPILE_BACKEND = "aot_eager"  # one stored element per weight: num_parameters() unchanged

WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
           text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           rope_max_seq_len=32)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings(), tm.native_attention():
        warnings.simplefilter("ignore")
        yield


def _is_quantized(module):
    return isinstance(module, QuantizedLinear)


class QuantizationTester:
    """QuantizationTesterMixin for one model class: `build()` makes the float model, `inputs()` one call."""

    model_class = None
    torch_dtype = torch.bfloat16
    modules_to_not_convert_for_test = None
    memory_quant_types = list(EXPECTED_MEMORY_REDUCTION)
    compile_with_group_offload = True

    @pytest.fixture(autouse=True)
    def _checkpoint(self, tmp_path_factory):
        if not hasattr(type(self), "_path"):
            path = tmp_path_factory.mktemp(self.model_class.__name__)
            self.build().save_pretrained(path)
            type(self)._path = path
        self.pretrained_model_name_or_path = type(self)._path

    def _load_unquantized_model(self):
        return self.model_class.from_pretrained(self.pretrained_model_name_or_path, dtype=self.torch_dtype)

    def _create_quantized_model(self, quant_type="int8wo", modules_to_not_convert=None, **extra_kwargs):
        config = cquant.CQuantConfig(quant_type, modules_to_not_convert=modules_to_not_convert)
        kwargs = dict(quantization_config=config, dtype=self.torch_dtype)
        kwargs.update(extra_kwargs)
        return self.model_class.from_pretrained(self.pretrained_model_name_or_path, **kwargs)

    def get_dummy_inputs(self):
        return {k: v.to(self.torch_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.inputs().items() if k != "return_dict"}

    # ------------------------------------------------------------ QuantizationTesterMixin

    @pytest.mark.parametrize("quant_type", EIGHT_BIT)
    def test_quantization_num_parameters(self, quant_type):
        num_params = self._load_unquantized_model().num_parameters()
        assert self._create_quantized_model(quant_type).num_parameters() == num_params

    def test_quantization_memory_footprint(self):
        mem = self._load_unquantized_model().get_memory_footprint()
        for quant_type in self.memory_quant_types:
            mem_quantized = self._create_quantized_model(quant_type).get_memory_footprint()
            assert mem / mem_quantized >= EXPECTED_MEMORY_REDUCTION[quant_type], quant_type

    @pytest.mark.parametrize("quant_type", EIGHT_BIT + ["fp6_e3m2"])
    @torch.no_grad()
    def test_quantization_inference(self, quant_type):
        model = self._create_quantized_model(quant_type)
        model.to("cpu")
        output = model(**self.get_dummy_inputs(), return_dict=False)[0]
        assert output is not None and not torch.isnan(output).any()

    def test_quantization_dtype_assignment(self):
        model = self._create_quantized_model()
        with pytest.raises(ValueError):
            model.to(torch.float16)
        with pytest.raises(ValueError):
            model.to(device="cpu", dtype=torch.float16)
        with pytest.raises(ValueError):
            model.float()
        with pytest.raises(ValueError):
            model.half()
        model.to("cpu")

    @torch.no_grad()
    def test_quantization_lora_inference(self):
        from peft import LoraConfig

        model = self._create_quantized_model()
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights=False))
        model.to("cpu")
        output = model(**self.get_dummy_inputs(), return_dict=False)[0]
        assert output is not None and not torch.isnan(output).any()

    @pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
    @pytest.mark.parametrize("quant_type", ["int8wo", "fp8dqrow", "fp6_e3m2"])
    @torch.no_grad()
    def test_quantization_serialization(self, quant_type, sharded, tmp_path):
        model = self._create_quantized_model(quant_type)
        inputs = self.get_dummy_inputs()
        expected_output = model(**inputs, return_dict=False)[0]
        save_kwargs = {"safe_serialization": True}
        if sharded:
            save_kwargs["max_shard_size"] = max(int(model.get_memory_footprint() // 2), 1)
        model.save_pretrained(str(tmp_path), **save_kwargs)
        del model
        gc.collect()
        if sharded:
            assert len(list(tmp_path.glob("*.safetensors"))) > 1
            assert any(p.name.endswith(".index.json") for p in tmp_path.iterdir())
        loaded = self.model_class.from_pretrained(str(tmp_path), device_map="cpu", dtype=self.torch_dtype)
        assert torch.equal(loaded(**inputs, return_dict=False)[0], expected_output)  # the codes load bit for bit
        # a device_map diffusers resolves itself reached the quantizer as the string "auto"
        loaded = self.model_class.from_pretrained(str(tmp_path), device_map="auto", dtype=self.torch_dtype)
        assert torch.equal(loaded(**inputs, return_dict=False)[0], expected_output)

    def test_quantization_config_serialization(self):
        model = self._create_quantized_model()
        assert "quantization_config" in model.config
        _ = model.config["quantization_config"].to_dict()
        _ = model.config["quantization_config"].to_diff_dict()
        _ = model.config["quantization_config"].to_json_string()

    def test_original_dtype(self):
        model = self._create_quantized_model()
        assert "_pre_quantization_dtype" in model.config
        assert model.config["_pre_quantization_dtype"] in [torch.float16, torch.float32, torch.bfloat16]

    def test_quantized_layers(self):
        model_fp = self._load_unquantized_model()
        num_linear_layers = sum(1 for m in model_fp.modules() if isinstance(m, torch.nn.Linear))
        model = self._create_quantized_model()
        keep = getattr(model, "_keep_in_fp32_modules", None) or []
        num_fp32 = sum(1 for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(k in n for k in keep))
        quantized = 0
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not any(k in name for k in keep):
                assert _is_quantized(module), f"{name} is not quantized"
                quantized += 1
        assert quantized > 0 and quantized == num_linear_layers - num_fp32

    def test_keep_modules_in_fp32(self):
        fp32_modules = getattr(self.model_class, "_keep_in_fp32_modules", None)
        if not fp32_modules:
            pytest.skip(f"{self.model_class.__name__} does not declare _keep_in_fp32_modules")
        model = self._create_quantized_model()
        model.to("cpu")
        found = False
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and any(k in name for k in fp32_modules):
                assert module.weight.dtype == torch.float32, f"{name} should be float32, is {module.weight.dtype}"
                found = True
        assert found
        with torch.no_grad():
            assert not torch.isnan(model(**self.get_dummy_inputs(), return_dict=False)[0]).any()

    @torch.no_grad()
    def test_quantization_modules_to_not_convert(self):
        excluded = self.modules_to_not_convert_for_test
        model = self._create_quantized_model(modules_to_not_convert=excluded)
        rule = cquant.CQuantConfig("int8wo", modules_to_not_convert=excluded).excluded  # not substrings: see above
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert any(rule(n) for n, _ in linears)
        keep = getattr(model, "_keep_in_fp32_modules", None) or []
        for name, module in linears:
            if rule(name):
                assert not _is_quantized(module), f"{name} should not be quantized"
            elif not any(k in name.split(".") for k in keep):
                assert _is_quantized(module), f"{name} should be quantized"
        output = model(**self.get_dummy_inputs(), return_dict=False)[0]
        assert not torch.isnan(output).any()
        assert model.get_memory_footprint() > self._create_quantized_model().get_memory_footprint()
        with pytest.warns(cquant.UnmatchedKeysWarning, match=r"modules_to_not_convert name no module .*'no_such_block'"):
            self._create_quantized_model(modules_to_not_convert=list(excluded) + ["no_such_block"])

    @pytest.mark.parametrize("device_map", ["auto", "cpu"])
    @torch.no_grad()
    def test_quantization_device_map(self, device_map):
        model = self._create_quantized_model(device_map=device_map)
        assert getattr(model, "hf_device_map", None) is not None
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, tensor in named:
                assert tensor.device.type == "cpu", f"{kind} {name} is on {tensor.device}"
        assert model.device == torch.device("cpu")
        assert not torch.isnan(model(**self.get_dummy_inputs(), return_dict=False)[0]).any()

    def test_disk_offload_device_map_is_refused(self, tmp_path):
        # torchao leaves offloaded modules unquantized; cquant refuses disk offload outright
        children = [n for n, _ in self.build().named_children()]
        device_map = {n: "cpu" for n in children}
        device_map[children[-1]] = "disk"
        with pytest.raises(ValueError, match="disk offload"):
            self._create_quantized_model(device_map=device_map, offload_folder=str(tmp_path))

    @torch.no_grad()
    def test_dequantize(self):
        model = self._create_quantized_model()
        model.dequantize()
        for name, module in model.named_modules():
            assert not _is_quantized(module), f"{name} is still quantized after dequantize()"
        assert not torch.isnan(model(**self.get_dummy_inputs(), return_dict=False)[0]).any()

    def test_quantization_training(self):
        model = self._create_quantized_model()
        for param in model.parameters():
            param.requires_grad = False
            if param.ndim == 1:
                param.data = param.data.to(torch.float32)  # small parameters (norms, biases) in fp32
        adapters = 0
        for _, module in model.named_modules():
            if "Attention" in repr(type(module)):
                for name in ("to_k", "to_q", "to_v"):
                    if hasattr(module, name):
                        setattr(module, name, LoRALayer(getattr(module, name), rank=4))
                        adapters += 1
        assert adapters
        with torch.amp.autocast("cpu", dtype=torch.bfloat16):
            out = model(**self.get_dummy_inputs(), return_dict=False)[0]
            out.norm().backward()
        for module in model.modules():
            if isinstance(module, LoRALayer):
                assert module.adapter[1].weight.grad is not None
                assert module.adapter[1].weight.grad.norm().item() > 0

    def test_errors_loading_incorrect_state_dict(self, tmp_path):
        # bnb's test: a corrupted quantized weight gives an error that names it
        from safetensors.torch import load_file, save_file
        from safetensors import safe_open

        self._create_quantized_model().save_pretrained(str(tmp_path))
        f = str(tmp_path / "diffusion_pytorch_model.safetensors")
        with safe_open(f, "pt") as h:
            meta = h.metadata()
        state_dict = load_file(f)
        key = next(k for k in state_dict if k.endswith(".weight") and state_dict[k].dtype == torch.int8)
        state_dict[key] = torch.randint(-127, 127, (state_dict[key].shape[0] - 1, 1), dtype=torch.int8)
        save_file(state_dict, f, metadata=meta)
        with pytest.raises(ValueError) as err:
            self.model_class.from_pretrained(str(tmp_path))
        assert key in str(err.value)

    def test_device_assignment(self):
        model = self._create_quantized_model()
        mem_before = model.get_memory_footprint()
        model.to("cpu")
        assert model.device.type == "cpu" and model.get_memory_footprint() == pytest.approx(mem_before)

    # ------------------------------------------------------------ QuantizationCompileTesterMixin
    # with backend="aot_eager": the graph capture (fullgraph, no recompiles) is what these check;
    # inductor's code generation on the CPU takes minutes here and is test_compile.py's subject

    @torch.no_grad()
    def test_torch_compile(self):
        torch.compiler.reset()
        model = self._create_quantized_model()
        model.eval()
        model.compile(fullgraph=True, backend=COMPILE_BACKEND)
        try:
            with torch._dynamo.config.patch(error_on_recompile=True):
                output = model(**self.get_dummy_inputs(), return_dict=False)[0]
            assert not torch.isnan(output).any()
        finally:
            torch.compiler.reset()

    @torch.no_grad()
    def test_torch_compile_with_group_offload(self):
        if not self.compile_with_group_offload:
            pytest.skip("run on one model: leaf-level offload hooks make its graphs slow to capture")
        torch.compiler.reset()
        model = self._create_quantized_model()
        model.eval()
        model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=False)
        model.compile(backend=COMPILE_BACKEND)
        try:
            output = model(**self.get_dummy_inputs(), return_dict=False)[0]
            assert not torch.isnan(output).any()
        finally:
            torch.compiler.reset()


class LoRALayer(torch.nn.Module):
    """diffusers' test LoRALayer: a linear layer plus a trainable low-rank adapter."""

    def __init__(self, module, rank):
        super().__init__()
        self.module = module
        self.adapter = torch.nn.Sequential(torch.nn.Linear(module.in_features, rank, bias=False),
                                           torch.nn.Linear(rank, module.out_features, bias=False))
        small_std = (2.0 / (5 * min(module.in_features, module.out_features))) ** 0.5
        torch.nn.init.normal_(self.adapter[0].weight, std=small_std)
        torch.nn.init.zeros_(self.adapter[1].weight)

    def forward(self, input, *args, **kwargs):
        return self.module(input, *args, **kwargs) + self.adapter(input)


class TestFluxConformance(QuantizationTester):
    model_class = diffusers.FluxTransformer2DModel
    modules_to_not_convert_for_test = ["transformer_blocks.0"]

    def build(self):
        return tm.build("flux")

    def inputs(self):
        return tm.inputs("flux")


class TestWanConformance(QuantizationTester):
    """A model that declares _keep_in_fp32_modules (its time embedder and norms stay float32)."""

    model_class = diffusers.WanTransformer3DModel
    modules_to_not_convert_for_test = ["blocks.0"]
    # its float32 modules and 32-wide rows (padded to 16 bytes in fpX) leave less to gain than 8 bits do
    memory_quant_types = ["int8wo", "fp8wo"]
    compile_with_group_offload = False

    def build(self):
        torch.manual_seed(0)
        model = diffusers.WanTransformer3DModel(**WAN).eval()
        with torch.no_grad():  # real weights where diffusers zero-initialises
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and not m.weight.abs().sum():
                    torch.nn.init.normal_(m.weight, std=m.in_features ** -0.5)
        return model

    def inputs(self):
        g = torch.Generator().manual_seed(1)
        return dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),
                    encoder_hidden_states=torch.randn(1, 8, 32, generator=g), timestep=torch.tensor([500]))


# ---------------------------------------------------------------- the config (TorchAoConfigTest)


def test_config_to_dict_repr_and_wrong_config():
    config = cquant.CQuantConfig("int8wo", modules_to_not_convert=["proj_out"])
    d = config.to_dict()
    assert d["quant_method"] == "cquant" and d["quant_type"] == "int8wo" and d["modules_to_not_convert"] == ["proj_out"]
    assert cquant.CQuantConfig.from_dict(json.loads(config.to_json_string())) == config
    assert "int8wo" in repr(config)
    with pytest.raises(ValueError):
        cquant.CQuantConfig("int42")


# ---------------------------------------------------------------- pipelines (TestPipelineQuantization)


@pytest.fixture(scope="module")
def pipeline_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("flux_pipe")
    tm.flux_pipeline().save_pretrained(path)
    return path


def pipeline_inputs(device="cpu"):
    # on the device the pipeline runs on: FluxPipeline hands given pooled_prompt_embeds to the
    # transformer as they are (only offloading hooks move a model's inputs)
    g = torch.Generator().manual_seed(0)
    return dict(prompt_embeds=torch.randn(1, 8, 64, generator=g).to(device),
                pooled_prompt_embeds=torch.randn(1, 32, generator=g).to(device),
                num_inference_steps=2, height=32, width=32, output_type="latent")


def load_pipeline(path, **kwargs):
    return diffusers.FluxPipeline.from_pretrained(path, tokenizer=None, tokenizer_2=None, **kwargs)


@torch.no_grad()
def run_pipeline(pipe, device="cpu"):
    return pipe(**pipeline_inputs(device), generator=torch.Generator().manual_seed(0)).images


def test_quant_config_set_correctly_through_kwargs(pipeline_path):
    components = ["transformer", "text_encoder_2"]
    config = diffusers.PipelineQuantizationConfig(quant_backend="cquant", quant_kwargs={"quant_type": "int8wo"},
                                                  components_to_quantize=components)
    pipe = load_pipeline(pipeline_path, quantization_config=config, dtype=torch.bfloat16)
    for name, component in pipe.components.items():
        if name in components:
            qc = component.config.quantization_config
            assert qc.quant_method == "cquant" and qc.quant_type == cquant.CQuantConfig("int8wo").quant_type
        elif isinstance(component, torch.nn.Module):
            assert getattr(component.config, "quantization_config", None) is None
    assert torch.isfinite(run_pipeline(pipe)).all()


def test_quant_config_set_correctly_through_granular(pipeline_path):
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig("fp8dqrow"),
                                                                 "text_encoder_2": cquant.CQuantConfig("int8wo")})
    pipe = load_pipeline(pipeline_path, quantization_config=config, dtype=torch.bfloat16)
    assert pipe.transformer.config.quantization_config.quant_type.name == "fp8dqrow"
    assert pipe.text_encoder_2.config.quantization_config.quant_type.name == "int8wo"
    assert "transformer" in repr(pipe.quantization_config)
    assert torch.isfinite(run_pipeline(pipe)).all()


def test_pipeline_saving_loading(pipeline_path, tmp_path):
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig("int8wo"),
                                                                 "text_encoder_2": cquant.CQuantConfig("int8dq")})
    pipe = load_pipeline(pipeline_path, quantization_config=config, dtype=torch.bfloat16)
    output_1 = run_pipeline(pipe)
    pipe.save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path, dtype=torch.bfloat16)
    for name in ("transformer", "text_encoder_2"):
        assert getattr(loaded, name).config.quantization_config.quant_method == "cquant"
    assert loaded.text_encoder.config.quantization_config is None if hasattr(
        loaded.text_encoder.config, "quantization_config") else True
    assert torch.equal(run_pipeline(loaded), output_1)


def test_no_quantization_for_all_invalid_components(pipeline_path):
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"foo": cquant.CQuantConfig("int8wo")})
    pipe = load_pipeline(pipeline_path, quantization_config=config)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert not hasattr(component.config, "quantization_config") or \
                component.config.quantization_config is None


def test_model_cpu_offload(pipeline_path):
    # enable_model_cpu_offload installs accelerate's hooks, which move each model to the execution
    # device around its call; onto the CPU itself here (the GPU run is below). Sequential offload
    # onto the CPU fails inside accelerate for float pipelines too, so it only runs on the GPU.
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig("int8wo")})
    reference = run_pipeline(load_pipeline(pipeline_path, quantization_config=config))
    pipe = load_pipeline(pipeline_path, quantization_config=config)
    pipe.enable_model_cpu_offload(device="cpu")
    assert torch.equal(run_pipeline(pipe), reference)


@pytest.mark.cuda
def test_model_cpu_offload_onto_the_gpu(pipeline_path):
    config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig("fp8dqrow"),
                                                                 "text_encoder_2": cquant.CQuantConfig("int8wo")})
    reference = run_pipeline(
        load_pipeline(pipeline_path, quantization_config=config, dtype=torch.bfloat16).to("cuda"), "cuda")
    pipe = load_pipeline(pipeline_path, quantization_config=config, dtype=torch.bfloat16)
    pipe.enable_model_cpu_offload(device="cuda")
    assert torch.equal(run_pipeline(pipe, "cuda"), reference)
    assert pipe.transformer.proj_out.weight.device.type == "cpu"  # offloaded again after the call
    pipe.transformer.compile_repeated_blocks(fullgraph=True)  # as diffusers' test does under offloading
    assert torch.isfinite(run_pipeline(pipe, "cuda")).all()


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int8wo", "fp6_e3m2", "fp8dqrow", "int4wo"])
@pytest.mark.parametrize("quantized_by", ["quantization_config", "quantize_pipeline"])
def test_sequential_cpu_offload_onto_the_gpu(pipeline_path, scheme, quantized_by):
    """Quantize first, then offload layer by layer (accelerate's hooks bring each module's codes and
    scales to the GPU around its call), as low-memory users do: the images of the pipeline run on
    the GPU, bit for bit, for packed, dynamic and 4-bit schemes (onto the CPU accelerate fails for
    float pipelines too)."""
    def make():
        if quantized_by == "quantization_config":
            config = diffusers.PipelineQuantizationConfig(quant_mapping={"transformer": cquant.CQuantConfig(scheme)})
            return load_pipeline(pipeline_path, quantization_config=config)
        return cquant.quantize_pipeline(load_pipeline(pipeline_path), scheme)

    reference = run_pipeline(make().to("cuda"), "cuda")
    pipe = make()
    pipe.enable_sequential_cpu_offload(device="cuda")
    assert torch.equal(run_pipeline(pipe, "cuda"), reference)


@pytest.mark.cuda
def test_model_memory_usage_on_the_gpu(pipeline_path):
    # torchao's test_model_memory_usage: the weights take less GPU memory, and inference runs
    path = pipeline_path / "transformer"
    inputs = {k: v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else
              v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in tm.inputs("flux").items()}
    allocated = {}
    for name, config in (("bf16", None), ("int8wo", cquant.CQuantConfig("int8wo"))):
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        model = diffusers.FluxTransformer2DModel.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                                 quantization_config=config)
        allocated[name] = torch.cuda.memory_allocated() - before
        with torch.no_grad():
            assert torch.isfinite(model(**inputs)[0]).all()
        del model
    assert allocated["int8wo"] < allocated["bf16"]
