"""Whole-pipeline mode of `cquant bench`: text encoders, the denoising loop and the VAE decode,
timed and compared as one call, so a quantized denoiser is judged by the images it gives.

Registry models (cquant.bench.models.MODEL_NAMES) are built full size with random weights (no
download): the denoiser by models.build_transformer, the text encoders and the VAE from the
published configs in python/cquant/data/pipeline_configs.json. Their prompts are fixed random
token ids of the real lengths (no tokenizer exists without a download), encoded by the text
encoders exactly as the diffusers pipeline's encode_prompt would, then the pipeline class
(FluxPipeline, StableDiffusion3Pipeline, ...) runs on those embeddings. A hub id or a local
directory is a real checkpoint: DiffusionPipeline.from_pretrained, called with a text prompt.

    pipe = build_pipeline("flux-dev", device="cuda", steps=4)
    ref = pipe.generate(seed=0)                        # [1, 3, 1024, 1024] float32 in [0, 1]
    cquant.quantize_(pipe.transformer, "fp8dqrow")
    psnr_db(ref, pipe.generate(seed=0))
"""

from __future__ import annotations

import gc
import json
import os
import warnings

import torch

from . import components

# Steps of the denoising loop unless asked: enough to time the loop's per-step cost and to see a
# quantized denoiser's error build up over steps, few enough to keep a GPU sweep short (the
# published defaults, e.g. Flux-dev's 28, are in pipeline_configs.json as published_steps).
BENCH_STEPS = 4
DEFAULT_PROMPT = "a red fox sitting in the snow at sunrise, detailed fur, soft light, photograph"
_TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
_UNSUPPORTED: dict[str, str] = {}  # registry models this mode cannot build, with the reason


def _is_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not any(c.isspace() for c in model)


def pipeline_support(model: str) -> str | None:
    """None when whole-pipeline mode works for `model` (a registry name, a hub id or a local
    diffusers directory), else the reason it does not."""
    if not isinstance(model, str) or not model:
        return f"model must be a registry name, a hub id or a local directory, got {model!r}"
    if model in _UNSUPPORTED:
        return _UNSUPPORTED[model]
    if model in components.pipeline_names():
        return None
    if os.path.isdir(model):
        index = os.path.join(model, "model_index.json")
        if not os.path.isfile(index):
            return f"{model} has no model_index.json (not a diffusers pipeline directory)"
        with open(index) as f:
            parts = json.load(f)
        if "transformer" not in parts:
            return f"{model}'s pipeline ({parts.get('_class_name', '?')}) has no transformer denoiser"
        return None
    if _is_hub_id(model):
        return None  # whether the repository exists is known only when from_pretrained asks the hub
    names = ", ".join(components.pipeline_names())
    return f"unknown model {model!r}: expected one of {names}, a hub id (owner/name) or a local directory"


def _module_bytes(module) -> int:
    return sum(t.nbytes for t in list(module.parameters()) + list(module.buffers()))


class BenchPipeline:
    """A diffusers pipeline with its parts named for benchmarking; generate() runs all of it."""

    def __init__(self, *, model, pipe, transformer, text_encoders, vae, call_kwargs, device, dtype,
                 encode=None, prompt=None, video=False):
        self.model = model
        self.pipe = pipe
        self.transformer = transformer
        self.text_encoders = dict(text_encoders)
        self.vae = vae
        self.call_kwargs = dict(call_kwargs)
        self.device = torch.device(device)
        self.dtype = dtype
        self.video = video
        self.notes: dict[str, str] = {}
        self._encode = encode  # batch -> the pipeline's prompt-embedding kwargs (random-weight models)
        self._prompt = prompt

    def __repr__(self):
        return (f"BenchPipeline({self.model!r}, {type(self.pipe).__name__}, device={self.device}, "
                f"dtype={self.dtype}, {self.call_kwargs})")

    def _prompt_kwargs(self, batch):
        if self._encode is not None:
            return self._encode(batch)
        return {"prompt": [self._prompt] * batch}

    def generate(self, seed: int = 0, batch: int = 1) -> torch.Tensor:
        """Text encoding, the denoising loop and the VAE decode: float32 images in [0, 1] on the
        CPU, [batch, 3, H, W] (video: [batch, 3, F, H, W]). The same seed gives the same images."""
        if self.pipe is None:
            raise RuntimeError("generate: this pipeline was freed")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        with torch.no_grad():
            kwargs = self._prompt_kwargs(batch)
            out = self.pipe(**kwargs, **self.call_kwargs, generator=generator, output_type="pt", return_dict=False)[0]
        out = out.detach().float().cpu()
        if self.video:
            out = out.permute(0, 2, 1, 3, 4)  # diffusers' [B, F, C, H, W] to [B, C, F, H, W]
        return out.clamp_(0.0, 1.0).contiguous()

    def enable_cache(self, threshold: float = 0.05) -> str | None:
        """diffusers' First Block Cache on the denoiser: None when on, else why it cannot be."""
        try:
            from diffusers.hooks import FirstBlockCacheConfig
        except ImportError:
            import diffusers

            return f"diffusers {diffusers.__version__} has no FirstBlockCacheConfig"
        if not hasattr(self.transformer, "enable_cache"):
            return f"{type(self.transformer).__name__} has no enable_cache (not a diffusers CacheMixin model)"
        try:
            self.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        except Exception as e:  # the block classes are not registered with diffusers' cache hooks, ...
            return f"FirstBlockCache does not apply to {type(self.transformer).__name__}: {e}"
        return None

    def free(self) -> None:
        """Drop every component and give the GPU memory back."""
        self.pipe = self.transformer = self.vae = None
        self.text_encoders = {}
        self._encode = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- random-weight registry models


def _tiny_sizes(family, cfg):
    """(text encoder widths by kind, VAE latent channels) that fit the tiny denoiser's config."""
    if family == "flux":
        return {"clip-l": cfg["pooled_projection_dim"], "t5-v1.1-xxl": cfg["joint_attention_dim"]}, cfg["in_channels"] // 4
    if family == "sd3":
        pooled = cfg["pooled_projection_dim"]
        if pooled > cfg["joint_attention_dim"]:
            raise ValueError(f"tiny sd3 denoiser: pooled_projection_dim {pooled} > joint_attention_dim")
        return ({"clip-l": pooled // 2, "clip-g": pooled - pooled // 2, "t5-v1.1-xxl": cfg["joint_attention_dim"]},
                cfg["in_channels"])
    if family == "pixart":
        return {"t5-v1.1-xxl": cfg["caption_channels"]}, cfg["in_channels"]
    if family == "cogvideox":
        return {"t5-v1.1-xxl": cfg["text_embed_dim"]}, cfg["in_channels"]
    if family == "qwen":
        return {"qwen2.5-vl-7b": cfg["joint_attention_dim"]}, cfg["in_channels"] // 4
    raise ValueError(f"no tiny sizes for the {family} family")


def _check_size(name, value, multiple):
    if not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value!r}")


def _resolution(family, spec, cfg, vsf, quick, height, width, frames):
    patch = cfg.get("patch_size") or 1
    multiple = vsf * (2 if family == "flux" else patch)  # Flux packs 2x2 latents into one token, Qwen 2x2 patches
    if quick:
        if family == "cogvideox":
            side_h, side_w = min(cfg.get("sample_height", 8), 8), min(cfg.get("sample_width", 8), 8)
        else:
            side_h = side_w = min(cfg.get("sample_size") or 8, 8)
        side_h, side_w = max(side_h, patch * 2), max(side_w, patch * 2)
        height, width = height or side_h * vsf, width or side_w * vsf
    else:
        height, width = height or spec["height"], width or spec["width"]
    _check_size("height", height, multiple)
    _check_size("width", width, multiple)
    if family != "cogvideox":
        if frames is not None:
            raise ValueError(f"frames: {spec['pipeline']} makes images, not videos; leave frames=None")
        return height, width, None
    ratio = int(cfg.get("temporal_compression_ratio", 4))
    frames = frames or (2 * ratio + 1 if quick else spec["frames"])  # quick: 3 latent frames
    # the VAE decodes an odd number n of latent frames into 1 + (n - 1) * ratio frames (an even
    # number into more than asked), as 49 = 1 + 12 * 4 frames come from 13
    if not isinstance(frames, int) or frames < 1 or (frames - 1) % (2 * ratio):
        raise ValueError(f"frames must be 1 + a multiple of {2 * ratio} (an odd number of latent frames, "
                         f"the VAE compressing time {ratio}x), got {frames!r}")
    return height, width, frames


def _encoder(encoder, kind, family, length, seed):
    """(batch, empty) -> {"embeds", "pooled", "mask"} of the random prompt or of the empty one."""

    def run(batch, empty):
        ids = components.token_ids(kind, length, batch, seed=seed, empty=empty)
        return components.encoder_outputs(encoder, kind, family, ids)

    return run


def _prompt_encoder(family, spec, encoders, lengths, dtype, seed, guided):
    """batch -> the prompt-embedding kwargs of `family`'s pipeline, encoded as its encode_prompt does."""
    runs = {name: _encoder(encoders[name], kind, family, lengths[name], seed)
            for name, kind in spec["text_encoders"].items()}

    def cast(t):
        return t.to(dtype)

    def flux(batch):
        clip, t5 = runs["text_encoder"](batch, False), runs["text_encoder_2"](batch, False)
        return {"prompt_embeds": cast(t5["embeds"]), "pooled_prompt_embeds": cast(clip["pooled"])}

    def sd3_one(batch, empty):
        l, g, t5 = (runs[n](batch, empty) for n in ("text_encoder", "text_encoder_2", "text_encoder_3"))
        clip = torch.cat([l["embeds"], g["embeds"]], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5["embeds"].shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip, t5["embeds"]], dim=-2)
        return cast(embeds), cast(torch.cat([l["pooled"], g["pooled"]], dim=-1))

    def sd3(batch):
        out = dict(zip(("prompt_embeds", "pooled_prompt_embeds"), sd3_one(batch, False)))
        if guided:
            out.update(zip(("negative_prompt_embeds", "negative_pooled_prompt_embeds"), sd3_one(batch, True)))
        return out

    def masked(mask_key):  # one encoder whose mask the pipeline takes as prompt_<mask_key>
        def run(batch):
            out = {}
            for prefix, negative in (("", False), ("negative_", True))[:2 if guided else 1]:
                enc = runs["text_encoder"](batch, negative)
                out.update({f"{prefix}prompt_embeds": cast(enc["embeds"]), f"{prefix}prompt_{mask_key}": enc["mask"]})
            return out
        return run

    pixart, qwen = masked("attention_mask"), masked("embeds_mask")

    def cogvideox(batch):
        out = {"prompt_embeds": cast(runs["text_encoder"](batch, False)["embeds"])}
        if guided:
            out["negative_prompt_embeds"] = cast(runs["text_encoder"](batch, True)["embeds"])
        return out

    return {"flux": flux, "sd3": sd3, "pixart": pixart, "cogvideox": cogvideox, "qwen": qwen}[family]


def build_text_encoders(model, *, dtype, device, seed=0, tiny_config=None) -> dict:
    """{"text_encoder": ..., ...} of registry `model`'s pipeline with random weights; tiny_config
    (the tiny denoiser's config) sizes 2-layer variants to fit it."""
    spec = components.pipeline_spec(model)
    widths = _tiny_sizes(spec["family"], tiny_config)[0] if tiny_config is not None else {}
    return {name: components.build_text_encoder(kind, spec["family"], dtype=dtype, device=device,
                                                seed=seed + 1 + i, width=widths.get(kind))
            for i, (name, kind) in enumerate(spec["text_encoders"].items())}


def text_lengths(model, transformer_config=None) -> dict:
    """Tokens each text encoder of registry `model` takes (CogVideoX: what its denoiser was built for)."""
    spec = components.pipeline_spec(model)
    lengths = dict(spec["text_lengths"])
    if spec["family"] == "cogvideox" and transformer_config is not None:
        lengths["text_encoder"] = int(transformer_config.get("max_text_seq_length", lengths["text_encoder"]))
    return lengths


def _build_registry(model, *, dtype, device, quick, seed, height, width, frames, steps):
    import diffusers

    from . import models

    spec = components.pipeline_spec(model)
    family = spec["family"]
    transformer = models.build_transformer(model, dtype=dtype, device=device, tiny=quick, seed=seed)
    cfg = dict(transformer.config)
    latent_channels = _tiny_sizes(family, cfg)[1] if quick else None
    encoders = build_text_encoders(model, dtype=dtype, device=device, seed=seed, tiny_config=cfg if quick else None)
    vae = components.build_vae(spec["vae"], dtype=dtype, device=device, seed=seed + 7,
                               tiny_latent_channels=latent_channels,
                               temporal_ratio=cfg.get("temporal_compression_ratio"))
    parts = dict(encoders, transformer=transformer, vae=vae, scheduler=components.build_scheduler(model))
    for name in list(parts):
        if name.startswith("text_encoder"):
            parts[name.replace("text_encoder", "tokenizer")] = None
    cls = getattr(diffusers, spec["pipeline"])
    extra = {"image_encoder": None, "feature_extractor": None} if family in ("flux", "sd3") else {}
    pipe = cls(**parts, **extra)
    pipe.set_progress_bar_config(disable=True)
    vsf = getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor  # as the pipeline sizes latents
    height, width, frames = _resolution(family, spec, cfg, vsf, quick, height, width, frames)

    guidance = spec["guidance_scale"]
    call = {"height": height, "width": width, "num_inference_steps": steps}
    # Qwen-Image's classifier-free guidance is true_cfg_scale (its guidance_scale is for distilled models)
    call["true_cfg_scale" if family == "qwen" else "guidance_scale"] = guidance
    if family == "pixart":
        call.update(use_resolution_binning=False, negative_prompt=None)  # its default "" clashes with the embeds
    if family == "cogvideox":
        call.update(num_frames=frames, use_dynamic_cfg=False)
    # the pipelines guide with a negative prompt when guidance_scale > 1 (Flux-dev distils its
    # guidance into the denoiser and takes no negative prompt)
    guided = family != "flux" and guidance > 1
    lengths = text_lengths(model, cfg)
    named = {name: encoders[name] for name in spec["text_encoders"]}
    encode = _prompt_encoder(family, spec, named, lengths, dtype, seed, guided)
    return BenchPipeline(model=model, pipe=pipe, transformer=transformer, text_encoders=encoders, vae=vae,
                         call_kwargs=call, device=device, dtype=dtype, encode=encode, video=family == "cogvideox")


def _load_checkpoint(model, *, dtype, device, height, width, frames, steps, prompt):
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(model)
    # parts saved as null (a pipeline saved without its tokenizers, say) are passed as None, or
    # from_pretrained refuses the pipeline as incomplete
    absent = {k: None for k, v in index.items() if not k.startswith("_") and isinstance(v, (list, tuple)) and v[0] is None}
    pipe = diffusers.DiffusionPipeline.from_pretrained(model, torch_dtype=dtype, **absent).to(device)
    pipe.set_progress_bar_config(disable=True)
    encoders = {n: getattr(pipe, n) for n in _TEXT_ENCODER_NAMES if isinstance(getattr(pipe, n, None), torch.nn.Module)}
    call = {"num_inference_steps": steps}
    for key, value in (("height", height), ("width", width), ("num_frames", frames)):
        if value is not None:
            call[key] = value
    video = "num_frames" in call or "Video" in type(pipe).__name__ or hasattr(pipe, "video_processor")
    return BenchPipeline(model=model, pipe=pipe, transformer=pipe.transformer, text_encoders=encoders,
                         vae=getattr(pipe, "vae", None), call_kwargs=call, device=device, dtype=dtype,
                         prompt=prompt or DEFAULT_PROMPT, video=video)


def build_pipeline(model, *, dtype=torch.bfloat16, device="cpu", quick=False, seed=0, height=None, width=None,
                   frames=None, steps=None, prompt=None) -> BenchPipeline:
    """The whole pipeline of `model` (see the module docstring). quick=True: tiny versions of every
    component (CPU, seconds). steps: denoising steps (default BENCH_STEPS); height / width /
    frames: the output size (default: the model's published resolution, or a tiny one when quick);
    prompt: the text prompt of a real checkpoint (registry models use fixed random token ids)."""
    reason = pipeline_support(model)
    if reason is not None:
        raise ValueError(f"model: {reason}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    steps = BENCH_STEPS if steps is None else steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if model in components.pipeline_names():
        if prompt is not None:
            raise ValueError("prompt: registry models have no tokenizer (random token ids stand in); "
                             "pass a hub id or a local directory to use a text prompt")
        return _build_registry(model, dtype=dtype, device=device, quick=quick, seed=seed, height=height,
                               width=width, frames=frames, steps=steps)
    if quick:
        raise ValueError(f"quick: {model!r} is a real checkpoint; quick=True applies to registry models only")
    return _load_checkpoint(model, dtype=dtype, device=device, height=height, width=width, frames=frames,
                            steps=steps, prompt=prompt)


# ---------------------------------------------------------------- quantized text encoders


T5_FLOAT16 = "T5 kept unquantized"


def text_encoder_note(encoder) -> str | None:
    """What quantizing `encoder` leaves out, and why (None: nothing)."""
    if not type(encoder).__name__.startswith("T5"):
        return None
    if encoder.dtype == torch.float16:
        return (f"{T5_FLOAT16}: its activations overflow float16 unless its FFN output layers run in "
                "float32; use bfloat16 to quantize it")
    return "T5's FFN output layers (wo) kept in their dtype (its _keep_in_fp32_modules)"


def quantize_text_encoders(pipe: BenchPipeline, scheme: str) -> dict:
    """cquant.quantize_ on every text encoder of `pipe`, in place: {name: bytes after}.

    T5 keeps its FFN output layers ("wo") in their float dtype, as quantize_ does for every
    model's _keep_in_fp32_modules: transformers' T5 casts wo's input to wo.weight.dtype, which
    a quantized layer's stored codes are not (about a fifth of T5-XXL's weights). In float16
    the T5 encoders are left unquantized: T5's activations overflow float16 unless wo runs in
    float32 (transformers keeps it there when loading in float16), which a random-weight model
    in float16 does not do; pipe.notes says so."""
    from .. import quantize as _quantize
    from ..schemes import SCHEME_NAMES, scheme as lookup

    try:
        lookup(scheme)
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"scheme: unknown scheme {scheme!r}; expected one of {', '.join(SCHEME_NAMES)}") from None
    sizes = {}
    for name, encoder in pipe.text_encoders.items():
        note = text_encoder_note(encoder)
        if note:
            pipe.notes[name] = note
        if note and note.startswith(T5_FLOAT16):
            warnings.warn(f"quantize_text_encoders: {name}: {note}", stacklevel=2)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", _quantize.SkippedLayersWarning)
                _quantize.quantize_(encoder, scheme)
        sizes[name] = _module_bytes(encoder)
    return sizes
