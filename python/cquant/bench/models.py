"""Full-size diffusion transformers with random weights: configs, builders and one step's inputs.

The configs (python/cquant/data/model_configs.json) are the diffusers constructor arguments of
public checkpoints; built with random weights they have the published architecture and size, so
a benchmark needs no download. tiny=True gives the same class with 1-2 blocks and small widths
(CPU-fast) for tests and smoke runs.

    model = build_transformer("flux-dev", dtype=torch.bfloat16, device="cuda")
    out = model(**make_inputs("flux-dev", model, device="cuda"))[0]

Random weights (build_master): Linear and convolution weights N(0, init_std^2), their biases
N(0, (init_std / 2)^2), norm weights 1 and biases 0, any other parameter (PixArt's
scale_shift_table, ...) N(0, init_std^2). Position tables the model computes in its constructor
(SD3's and PixArt's pos_embed buffers) are kept as computed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

__all__ = ["MODEL_NAMES", "model_info", "param_count", "build_transformer", "make_inputs", "load_config",
           "build_master", "materialize", "flux_inputs", "load_pretrained", "resolve_name", "DEFAULT_INPUTS",
           "enable_parallelism"]

CONFIG_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "model_configs.json")
MODEL_NAMES = ("flux-dev", "flux-schnell", "sd3-medium", "pixart-sigma", "cogvideox-5b", "qwen-image")
# short names -> keys of model_configs.json (the json keeps the checkpoint's longer name)
_ALIASES = {"pixart-sigma": "pixart-sigma-xl-1024"}
INIT_STD = 0.02

# One step's default inputs, as the model's pipeline makes them at its usual size:
# pixels (height x width, frames for video) and text tokens.
DEFAULT_INPUTS = {
    "FluxTransformer2DModel": dict(height=1024, width=1024, text_tokens=512),        # 4096 image tokens
    "SD3Transformer2DModel": dict(height=1024, width=1024, text_tokens=333),         # 77 CLIP + 256 T5
    "PixArtTransformer2DModel": dict(height=1024, width=1024, text_tokens=300),      # T5, 300 tokens
    "CogVideoXTransformer3DModel": dict(height=480, width=720, frames=49, text_tokens=226),
    "QwenImageTransformer2DModel": dict(height=1024, width=1024, text_tokens=512),
}
# tiny=True: the same classes at toy sizes (every width a multiple of 16: every scheme takes every layer)
_TINY_CONFIG = {
    "FluxTransformer2DModel": dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                                   num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
                                   axes_dims_rope=[8, 12, 12]),
    "SD3Transformer2DModel": dict(sample_size=16, in_channels=4, num_layers=2, attention_head_dim=32,
                                  num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=64,
                                  pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32),
    "PixArtTransformer2DModel": dict(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                     num_layers=2, cross_attention_dim=64, sample_size=8, caption_channels=64),
    "CogVideoXTransformer3DModel": dict(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                                        time_embed_dim=32, text_embed_dim=64, num_layers=2, sample_width=8,
                                        sample_height=8, sample_frames=9, max_text_seq_length=8),
    "QwenImageTransformer2DModel": dict(in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
                                        num_attention_heads=2, joint_attention_dim=64, axes_dims_rope=[8, 12, 12]),
}
_TINY_INPUTS = dict(height=64, width=64, frames=9, text_tokens=8)


@functools.lru_cache(maxsize=1)
def _configs():
    with open(CONFIG_FILE) as f:
        return json.load(f)


def resolve_name(name):
    """The model_configs.json key of `name` (a MODEL_NAMES name or a json key); ValueError naming
    `model` and listing MODEL_NAMES when it is neither."""
    if not isinstance(name, str):
        raise TypeError(f"model must be a string, got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    if key == "about" or key not in _configs():
        raise ValueError(f"model {name!r} is not a known model; expected one of {', '.join(MODEL_NAMES)} "
                         "(or a Hugging Face hub id / local directory where a real checkpoint is accepted)")
    return key


def model_info(name):
    """{"name", "key", "class", "config", "params_b", "inputs"} of a model (a copy: safe to change)."""
    key = resolve_name(name)
    entry = _configs()[key]
    short = next((n for n in MODEL_NAMES if _ALIASES.get(n, n) == key), key)
    return {"name": short, "key": key, "class": entry["class"], "config": dict(entry["config"]),
            "params_b": entry["params_b"], "inputs": dict(DEFAULT_INPUTS[entry["class"]])}


def load_config(name, overrides=(), *, tiny=False):
    """The constructor arguments of `name`, tiny-sized when asked, then changed by `overrides`
    ("key=JSON" strings, e.g. "num_layers=1"); ValueError naming the override when the config
    has no such key."""
    info = model_info(name)
    config = info["config"]
    if tiny:
        config.update(_TINY_CONFIG[info["class"]])
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in config:
            raise ValueError(f"override {item!r}: the {info['name']} config has no {key!r}")
        config[key] = json.loads(value)
    return config


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers logs a warning for every .to(dtype) of a model (about modules to keep in float32,
    of which these models have none)."""
    try:
        from diffusers.utils import logging
    except ImportError:
        yield
        return
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _diffusers_class(cls):
    import diffusers

    return getattr(diffusers, cls) if isinstance(cls, str) else cls


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters on the meta device, buffers computed for real (diffusers' position tables):
    accelerate's init_empty_weights(include_buffers=False) with torch's init functions skipped."""
    try:
        from accelerate import init_empty_weights
        from diffusers.models.modeling_utils import no_init_weights
    except ImportError:  # no accelerate: buffers are re-made after to_empty from a CPU build (slower)
        with torch.device("meta"):
            yield
        return
    with no_init_weights(), init_empty_weights(include_buffers=False):
        yield


def param_count(name):
    """Parameters of the full-size model `name`, counted on the meta device (seconds, no memory)."""
    info = model_info(name)
    with torch.device("meta"):
        model = _diffusers_class(info["class"])(**info["config"])
    return sum(p.numel() for p in model.parameters())


def _fill_random(model, gen, draw_device, init_std):
    """Linear / conv weights N(0, std^2), biases N(0, (std/2)^2); norm weights 1, biases 0; any
    other parameter N(0, std^2). Drawn in float32 on draw_device, then cast into each tensor."""

    def randn(t, std):
        t.copy_((torch.randn(t.shape, generator=gen, device=draw_device) * std).to(t.dtype))

    with torch.no_grad():
        for mod in model.modules():
            own = dict(mod.named_parameters(recurse=False))
            if not own:
                continue
            if isinstance(mod, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
                randn(mod.weight, init_std)
                if mod.bias is not None:
                    randn(mod.bias, init_std / 2)
                continue
            for pname, p in own.items():
                if pname == "weight":  # RMSNorm / LayerNorm / GroupNorm scales
                    p.fill_(1.0)
                elif pname == "bias":
                    p.zero_()
                else:
                    randn(p, init_std)


def build_master(config, seed=0, init_std=INIT_STD, device="cpu", *, cls="FluxTransformer2DModel",
                 dtype=torch.bfloat16, store=None):
    """The transformer `cls` built from `config` on the meta device, then given random weights
    (see the module docstring) in `dtype`, eval().

    Weights are drawn on `device` (a GPU draws 12 B normals in seconds; the CPU generator is
    serial) and stored on `store` (default: the CPU, so copies in other dtypes or quantized
    variants can be made from it without holding two on the GPU)."""
    device = torch.device(device)
    store = torch.device(store) if store is not None else torch.device("cpu")
    with _parameters_on_meta():
        model = _diffusers_class(cls)(**config)
    buffers = {n: b for n, b in model.named_buffers() if b.device.type != "meta"}
    with _quiet_diffusers():
        model = model.to(dtype).to_empty(device=store).eval()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])
    gen = torch.Generator(device=device).manual_seed(seed)
    _fill_random(model, gen, device, init_std)
    return model


def materialize(master, device, dtype):
    """A copy of `master` on `device` in `dtype`, built tensor by tensor (no full host copy)."""
    with _parameters_on_meta():
        model = type(master).from_config(master.config)
    with _quiet_diffusers():
        model = model.to(dtype).to_empty(device=device).eval()
    src = dict(master.named_parameters())
    src.update(master.named_buffers())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(src[name])
    return model


def build_transformer(name, *, dtype=torch.bfloat16, device="cpu", tiny=False, seed=0, init_std=INIT_STD):
    """The model `name` (MODEL_NAMES) with random weights in `dtype` on `device`, eval().

    Weights are drawn on `device` and stored there directly (one copy, no host round trip); the
    same seed gives the same bfloat16 values whatever the device's dtype (drawn in float32, cast)."""
    info = model_info(name)
    config = load_config(name, tiny=tiny)
    return build_master(config, seed, init_std, device, cls=info["class"], dtype=dtype, store=device)


def enable_parallelism(model, config):
    """model.enable_parallelism(config=config) on this machine. diffusers 0.42.1 picks the rank's
    device as torch.device(accelerator, rank % torch.accelerator.device_count())
    (models/modeling_utils.py, _resolve_parallel_config), a division by zero on a machine with no
    accelerator; with one "device" there, every rank gets cpu:0, which is what it is."""
    count = torch.accelerator.device_count
    if count() == 0:
        torch.accelerator.device_count = lambda: 1
    try:
        model.enable_parallelism(config=config)
    finally:
        torch.accelerator.device_count = count


def load_pretrained(path, *, dtype=torch.bfloat16, device="cpu"):
    """The transformer of a real checkpoint: a hub id or a local directory holding a pipeline (its
    "transformer" subfolder) or a transformer alone, loaded by diffusers' from_pretrained."""
    import diffusers

    errors = []
    for subfolder in ("transformer", None):
        try:
            model = diffusers.AutoModel.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
        except (OSError, ValueError) as e:  # not there, not a transformer, no access
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        return model.to(device).eval()
    raise ValueError(f"model {path!r}: no diffusers transformer could be loaded from it ({'; '.join(errors)})")


def _family(model):
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    cls = type(model).__name__
    for family in DEFAULT_INPUTS:
        if any(c.__name__ == family for c in type(model).__mro__):
            return family
    raise ValueError(f"model: no inputs are known for a {cls}; expected one of {', '.join(DEFAULT_INPUTS)}")


def timesteps(batch):
    """Each sample's timestep on the 0-1000 scale: 500, 250, 125, 1000, repeating. Models embed
    the timestep (times 1000 where they take t / 1000) in the activation dtype; 125 * 2^k is exact
    in bfloat16 and float16 both, so the float32 reference sees the same timesteps (375, say,
    rounds to 376 in bfloat16 and that sample's embedding, and so its SQNR, changes completely)."""
    return torch.tensor([(500.0, 250.0, 125.0, 1000.0)[i % 4] for i in range(batch)])


def flux_inputs(config, height, width, text_tokens, device, dtype, seed, batch=1):
    """Flux's forward kwargs: packed latents (2x2 patches of the VAE's 1/8 latents), text, ids."""
    import diffusers

    g = torch.Generator().manual_seed(seed)
    h, w = height // 16, width // 16  # VAE factor 8, then 2x2 packing
    inputs = dict(
        hidden_states=torch.randn(batch, h * w, config["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g),
        timestep=timesteps(batch) / 1000,  # Flux multiplies by 1000 in the activation dtype
        img_ids=diffusers.FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32),
        txt_ids=torch.zeros(text_tokens, 3),
    )
    if config.get("guidance_embeds"):
        # Flux embeds 1000 * guidance in the activation dtype: 3500 (guidance 3.5) rounds to 3504 in
        # bfloat16 and its sinusoidal embedding changes completely, which would swamp every
        # bfloat16 SQNR; 4000, like 1000 * timestep = 500, is exact in bfloat16
        inputs["guidance"] = torch.full((batch,), 4.0)
    out = {}
    for k, v in inputs.items():
        v = v.to(device)
        out[k] = v.to(dtype) if k not in ("img_ids", "txt_ids") else v
    out["return_dict"] = False
    return out


def _cogvideox_rotary(config, height, width, latent_frames, device):
    """(cos, sin) of CogVideoX 1.0's 3D rotary embedding, as CogVideoXPipeline makes them."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p = config["patch_size"]
    grid_h, grid_w = height // (8 * p), width // (8 * p)
    if config.get("patch_size_t") is None:
        crops = get_resize_crop_region_for_grid((grid_h, grid_w), config["sample_width"] // p,
                                                config["sample_height"] // p)
        return get_3d_rotary_pos_embed(embed_dim=config["attention_head_dim"], crops_coords=crops,
                                       grid_size=(grid_h, grid_w), temporal_size=latent_frames, device=device)
    p_t = config["patch_size_t"]
    return get_3d_rotary_pos_embed(embed_dim=config["attention_head_dim"], crops_coords=None,
                                   grid_size=(grid_h, grid_w), temporal_size=(latent_frames + p_t - 1) // p_t,
                                   grid_type="slice", max_size=(config["sample_height"] // p,
                                                                config["sample_width"] // p), device=device)


def make_inputs(name, model, *, batch=1, dtype=torch.bfloat16, device="cpu", tiny=False, seed=0, height=None,
                width=None, frames=None, text_tokens=None):
    """kwargs of one denoising step, model(**kwargs) (return_dict=False), as the model's pipeline
    builds them: random latents and text embeddings (seeded, the same on every device), each
    sample of a batch at its own timestep. height / width in pixels (frames for video), default
    the model's usual size (DEFAULT_INPUTS; 64x64 with tiny=True). `name` picks the defaults of a
    MODEL_NAMES model; the inputs' form follows the model's class (a real checkpoint works too)."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    family = _family(model)
    defaults = dict(_TINY_INPUTS if tiny else DEFAULT_INPUTS[family])
    height = height or defaults["height"]
    width = width or defaults["width"]
    frames = frames or defaults.get("frames", 1)
    tokens = text_tokens or defaults["text_tokens"]
    if height % 16 or width % 16:
        raise ValueError(f"height and width must be multiples of 16, got {height}x{width}")
    config = dict(getattr(model, "_orig_mod", model).config)
    if family == "FluxTransformer2DModel":
        return flux_inputs(config, height, width, tokens, device, dtype, seed, batch)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    steps = timesteps(batch)
    lh, lw = height // 8, width // 8  # the VAE's latents
    if family == "SD3Transformer2DModel":
        return dict(hidden_states=randn(batch, config["in_channels"], lh, lw),
                    encoder_hidden_states=randn(batch, tokens, config["joint_attention_dim"]),
                    pooled_projections=randn(batch, config["pooled_projection_dim"]),
                    timestep=steps.to(device=device, dtype=dtype), return_dict=False)
    if family == "PixArtTransformer2DModel":
        return dict(hidden_states=randn(batch, config["in_channels"], lh, lw),
                    encoder_hidden_states=randn(batch, tokens, config["caption_channels"]),
                    timestep=steps.to(device=device, dtype=torch.long),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    if family == "CogVideoXTransformer3DModel":
        latent_frames = (frames - 1) // config["temporal_compression_ratio"] + 1
        out = dict(hidden_states=randn(batch, latent_frames, config["in_channels"], lh, lw),
                   encoder_hidden_states=randn(batch, tokens, config["text_embed_dim"]),
                   timestep=steps.to(device=device, dtype=torch.long), return_dict=False)
        if config.get("use_rotary_positional_embeddings"):
            out["image_rotary_emb"] = _cogvideox_rotary(config, height, width, latent_frames, device)
        return out
    if family == "QwenImageTransformer2DModel":
        # latents packed in 2x2 patches; no text mask: every token is a real one, as when the
        # pipeline's prompt fills its embedding (a mask of ones would only add masking work)
        p = config["patch_size"]
        return dict(hidden_states=randn(batch, (lh // p) * (lw // p), config["in_channels"]),
                    encoder_hidden_states=randn(batch, tokens, config["joint_attention_dim"]),
                    timestep=(steps / 1000).to(device=device, dtype=dtype),
                    img_shapes=[[(1, lh // p, lw // p)]] * batch, return_dict=False)
    raise AssertionError(family)  # _family only returns DEFAULT_INPUTS keys
