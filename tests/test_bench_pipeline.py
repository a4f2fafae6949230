"""Whole-pipeline mode of cquant bench: tiny random-weight pipelines on the CPU, component sizes
against the published ones, quantized text encoders, the cache, and what is refused and why."""

import json

import pytest

torch = pytest.importorskip("torch")
# transformers' text encoders ask torch whether a CUDA stream is capturing, and on a machine without
# a GPU torch answers through a C++ exception, which aborts the ASan run (scripts/sanitize.sh)
pytestmark = pytest.mark.raises_in_torch_op
pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("cquant.bench.models")

from cquant.bench import components  # noqa: E402
from cquant.bench.pipeline import (  # noqa: E402
    _module_bytes, build_pipeline, pipeline_support, quantize_text_encoders)

SUPPORTED = ("flux-dev", "flux-schnell", "sd3-medium", "pixart-sigma", "cogvideox-5b", "qwen-image")
F32 = torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread. Two OpenMP threads spinning for a 16x64 matmul on a busy machine
    made every op 10 ms (bfloat16 ones more)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params_m(module):
    return sum(p.numel() for p in module.parameters()) / 1e6


def test_full_size_components_have_the_published_sizes():
    """Built on the meta device from pipeline_configs.json: T5-v1.1-XXL encoder 4.76 B, CLIP-L
    text 123 M, CLIP-G text with projection 695 M, Qwen2.5-VL-7B 8.29 B, Flux VAE 84 M,
    CogVideoX VAE 216 M, Qwen-Image VAE 127 M."""
    import diffusers
    import transformers

    cfg = components.configs()
    with torch.device("meta"):
        t5 = transformers.T5EncoderModel(transformers.T5Config(**cfg["text_encoders"]["t5-v1.1-xxl"]["config"]))
        clip_l = transformers.CLIPTextModel(transformers.CLIPTextConfig(**cfg["text_encoders"]["clip-l"]["config"]))
        clip_g = transformers.CLIPTextModelWithProjection(
            transformers.CLIPTextConfig(**cfg["text_encoders"]["clip-g"]["config"]))
        qwen = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig.from_dict(cfg["text_encoders"]["qwen2.5-vl-7b"]["config"]))
        vaes = {k: getattr(diffusers, v["class"])(**v["config"]) for k, v in cfg["vaes"].items()}
    assert _params_m(t5) == pytest.approx(4762, rel=2e-3)
    assert _params_m(clip_l) == pytest.approx(123.1, rel=2e-3)
    assert _params_m(clip_g) == pytest.approx(694.7, rel=2e-3)
    assert _params_m(qwen) == pytest.approx(8292, rel=2e-3)
    assert _params_m(vaes["qwen-image"]) == pytest.approx(126.9, rel=2e-3)
    assert _params_m(vaes["flux"]) == pytest.approx(83.8, rel=2e-3)
    assert _params_m(vaes["sdxl"]) == pytest.approx(83.7, rel=2e-3)
    assert _params_m(vaes["cogvideox"]) == pytest.approx(215.6, rel=2e-3)
    for key, entry in list(cfg["text_encoders"].items()) + list(cfg["vaes"].items()):
        assert entry["source"] and entry["params_m"] > 0, key


def test_random_text_encoders_keep_their_tied_embeddings():
    # T5's input embedding is one tensor under two names; drawn apart, it would count twice
    enc = components.build_text_encoder("t5-v1.1-xxl", "flux", dtype=torch.float32, device="cpu", seed=0, width=64)
    assert enc.shared.weight is enc.encoder.embed_tokens.weight


def test_random_t5_is_well_conditioned():
    # T5 leaves 1/sqrt(d_kv) to its query weights: drawn N(0, 0.02^2) like the rest, a 1024-wide
    # 6-layer T5 loses its embedding to bfloat16 rounding alone (19 dB); with T5's own
    # initialization rounding is all that separates them
    import transformers

    from cquant.metrics import sqnr_db

    cfg = dict(components.configs()["text_encoders"]["t5-v1.1-xxl"]["config"], d_model=1024, d_ff=2560,
               num_heads=16, num_layers=6)
    config = transformers.T5Config.from_dict(cfg)
    ids = components.token_ids("t5-v1.1-xxl", 128, 1, seed=3)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        enc = components._materialize(lambda: transformers.T5EncoderModel(config), dtype=dtype, device="cpu",
                                      seed=0, std_of=components.t5_init_std(cfg))
        with torch.no_grad():
            out[dtype] = enc(input_ids=ids).last_hidden_state.float()
    assert sqnr_db(out[torch.bfloat16], out[torch.float32]) > 32


@pytest.mark.parametrize("model", SUPPORTED)
def test_quick_pipeline_generates_images_in_range_and_reproducibly(model):
    pipe = build_pipeline(model, quick=True)  # bfloat16: random weights keep activations finite
    assert pipeline_support(model) is None
    assert pipe.transformer.dtype == pipe.vae.dtype == torch.bfloat16
    assert set(pipe.text_encoders) == set(components.pipeline_spec(model)["text_encoders"])
    img = pipe.generate(seed=3)
    video = model.startswith("cogvideox")
    h, w = pipe.call_kwargs["height"], pipe.call_kwargs["width"]
    expected = (1, 3, pipe.call_kwargs["num_frames"], h, w) if video else (1, 3, h, w)
    assert tuple(img.shape) == expected
    assert img.dtype == torch.float32 and img.device.type == "cpu"
    assert torch.isfinite(img).all() and img.min() >= 0 and img.max() <= 1
    assert img.std() > 1e-3  # random weights still draw something, not a flat image
    assert torch.equal(img, pipe.generate(seed=3))
    assert not torch.equal(img, pipe.generate(seed=4))
    pipe.free()
    with pytest.raises(RuntimeError, match="freed"):
        pipe.generate()


def test_batch_and_sizes_in_bfloat16():
    pipe = build_pipeline("flux-schnell", quick=True, height=32, width=48, steps=2)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoders["text_encoder_2"].dtype == torch.bfloat16
    img = pipe.generate(seed=0, batch=2)
    assert tuple(img.shape) == (2, 3, 32, 48)
    assert torch.isfinite(img).all() and img.std() > 1e-3
    assert pipe.call_kwargs["num_inference_steps"] == 2
    with pytest.raises(ValueError, match="batch"):
        pipe.generate(batch=0)


def test_quantized_text_encoders_are_smaller_and_images_stay_finite():
    pipe = build_pipeline("sd3-medium", quick=True, dtype=F32)
    before = {n: _module_bytes(e) for n, e in pipe.text_encoders.items()}
    after = quantize_text_encoders(pipe, "int8wo")
    assert set(after) == set(before) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    for name in before:
        assert after[name] < before[name], name
        assert after[name] == _module_bytes(pipe.text_encoders[name])
    assert "wo" in pipe.notes["text_encoder_3"]
    img = pipe.generate(seed=0)
    assert torch.isfinite(img).all()


def test_float16_keeps_t5_unquantized_with_a_reason():
    pipe = build_pipeline("flux-schnell", quick=True, dtype=torch.float16)
    before = {n: _module_bytes(e) for n, e in pipe.text_encoders.items()}
    with pytest.warns(UserWarning, match="overflow float16"):
        after = quantize_text_encoders(pipe, "int8wo")
    assert after["text_encoder_2"] == before["text_encoder_2"]  # T5
    assert after["text_encoder"] < before["text_encoder"]  # CLIP-L
    assert "overflow" in pipe.notes["text_encoder_2"]
    with pytest.raises(ValueError, match="scheme: unknown scheme"):
        quantize_text_encoders(pipe, "int3")


def test_enable_cache_works_or_says_why():
    pipe = build_pipeline("flux-schnell", quick=True, dtype=F32)
    ref = pipe.generate(seed=0)
    assert pipe.enable_cache() is None
    cached = pipe.generate(seed=0)
    assert cached.shape == ref.shape and torch.isfinite(cached).all()
    reason = build_pipeline("pixart-sigma", quick=True, dtype=F32).enable_cache()
    assert isinstance(reason, str) and "PixArtTransformer2DModel" in reason


def test_support_reasons_and_argument_errors(tmp_path):
    assert "unknown model" in pipeline_support("flux-dve")
    assert pipeline_support("black-forest-labs/FLUX.1-schnell") is None
    assert "model_index.json" in pipeline_support(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    assert "no transformer" in pipeline_support(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                           "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    assert pipeline_support(str(tmp_path)) is None
    with pytest.raises(ValueError, match="model: unknown model"):
        build_pipeline("flux-dve", quick=True)
    for kwargs, match in ((dict(steps=0), "steps"), (dict(height=30), "height"), (dict(frames=9), "frames"),
                          (dict(prompt="a cat"), "prompt"), (dict(dtype=torch.int8), "dtype")):
        with pytest.raises(ValueError, match=match):
            build_pipeline("flux-schnell", quick=True, **kwargs)
    with pytest.raises(ValueError, match="frames"):
        build_pipeline("cogvideox-5b", quick=True, frames=6)


def test_qwen_prompt_drops_the_template():
    pipe = build_pipeline("qwen-image", quick=True, dtype=F32)
    kwargs = pipe._prompt_kwargs(1)
    assert kwargs["prompt_embeds"].shape[1] == 546 - 34  # the prompt and the closing tokens
    assert kwargs["negative_prompt_embeds"].shape[1] == 6  # " " and the closing tokens
    assert pipe.call_kwargs["true_cfg_scale"] == 4.0 and "guidance_scale" not in pipe.call_kwargs


def test_token_ids_look_like_tokenizer_output():
    t5 = components.token_ids("t5-v1.1-xxl", 16, 2, seed=0)
    assert t5.shape == (2, 16) and (t5[:, -1] == 1).all() and (t5[:, :-1] >= 2).all()
    assert torch.equal(t5, components.token_ids("t5-v1.1-xxl", 16, 2, seed=0))
    empty = components.token_ids("t5-v1.1-xxl", 8, 1, seed=0, empty=True)
    assert empty.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]]
    clip = components.token_ids("clip-l", 77, 1, seed=1)
    assert clip[0, 0] == 49406 and clip[0, -1] == 49407 and (clip[0, 1:-1] < 49406).all()


@pytest.mark.cuda
def test_quick_pipeline_on_the_gpu():
    pipe = build_pipeline("flux-schnell", quick=True, device="cuda")
    img = pipe.generate(seed=0)
    assert img.device.type == "cpu" and torch.isfinite(img).all() and 0 <= img.min() <= img.max() <= 1
    quantize_text_encoders(pipe, "fp8dqrow")
    assert torch.isfinite(pipe.generate(seed=0)).all()
    pipe.free()


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["sd3-medium", "pixart-sigma", "cogvideox-5b", "qwen-image"])
def test_quick_pipelines_on_the_gpu_match_shape(model):
    pipe = build_pipeline(model, quick=True, device="cuda")
    img = pipe.generate(seed=0, batch=2)
    assert img.shape[0] == 2 and torch.isfinite(img).all()
    pipe.free()


# full size at a small resolution: the published widths and depths keep bfloat16 activations finite
_FULL = {"flux-schnell": {}, "sd3-medium": {}, "pixart-sigma": {}, "cogvideox-5b": dict(frames=9),
         "qwen-image": {}}
_FULL_GB = {"qwen-image": 70}  # its 8.3 B text encoder and 20.4 B denoiser in bfloat16, with room to run


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(_FULL))
def test_full_size_pipeline_on_the_gpu_gives_finite_images(model):
    need = _FULL_GB.get(model, 40)
    if torch.cuda.get_device_properties(0).total_memory < need * 2**30:
        pytest.skip(f"{model} needs about {need} GiB of GPU memory")
    pipe = build_pipeline(model, device="cuda", steps=2, height=256, width=256, **_FULL[model])
    img = pipe.generate(seed=0)
    assert torch.isfinite(img).all() and img.std() > 1e-3
    assert img.shape[-2:] == (256, 256)
    pipe.free()


def test_a_saved_pipeline_directory_loads_as_a_real_checkpoint(tmp_path):
    built = build_pipeline("flux-schnell", quick=True, dtype=F32)
    built.pipe.save_pretrained(str(tmp_path))
    assert pipeline_support(str(tmp_path)) is None
    pipe = build_pipeline(str(tmp_path), dtype=F32, steps=2, height=16, width=16)
    assert type(pipe.transformer).__name__ == "FluxTransformer2DModel"
    assert set(pipe.text_encoders) == {"text_encoder", "text_encoder_2"}
    assert pipe.call_kwargs == {"num_inference_steps": 2, "height": 16, "width": 16} and not pipe.video
    for name, p in pipe.transformer.state_dict().items():
        assert torch.equal(p, built.transformer.state_dict()[name]), name
