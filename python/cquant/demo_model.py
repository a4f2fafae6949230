"""The small trained Flux model of `cquant demo`: caption vocabulary, caption encoder, pixel packing, sampler.

The model is a diffusers FluxTransformer2DModel (double- and single-stream blocks, RoPE, pooled
projection) trained by scripts/train_demo_model.py with Flux's rectified-flow objective on
procedurally drawn 32x32 images (shapes, digits, textures). It works in pixel space: each 4x4
patch of RGB pixels is one packed token, so there is no VAE. In place of a text encoder, a learned
table maps each caption word to a token embedding (encoder_hidden_states) and a pooled vector
(pooled_projections); both tables are part of the saved weights.

This module imports nothing from cquant, so the training script loads it by path and trains
without a built cquant.
"""

from __future__ import annotations

import json

import torch

PAD = "<pad>"
COLORS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "black")
SHAPES = ("circle", "square", "triangle", "ring", "cross", "star")
TEXTURES = ("stripes", "checkerboard", "gradient")
DIGITS = tuple(str(d) for d in range(10))
# Every caption reads "<colour> <thing> on <colour>", <thing> being a shape, a texture or "digit <d>".
VOCAB = (PAD, "on", "digit") + COLORS + SHAPES + TEXTURES + DIGITS
MAX_TOKENS = 8


def tokenize(captions, vocab=VOCAB, max_tokens=MAX_TOKENS):
    """Token ids [B, max_tokens] (padded with PAD) of whitespace-separated captions; "" is the empty caption."""
    index = {w: i for i, w in enumerate(vocab)}
    rows = []
    for caption in captions:
        words = caption.split()
        unknown = [w for w in words if w not in index or w == PAD]
        if unknown:
            raise ValueError(f"caption {caption!r}: unknown word(s) {unknown}; expected words of {list(vocab[1:])}, "
                             "e.g. 'red circle on blue', 'white digit 7 on black', 'green stripes on black'")
        if len(words) > max_tokens:
            raise ValueError(f"caption {caption!r}: {len(words)} words, expected at most {max_tokens}")
        rows.append([index[w] for w in words] + [index[PAD]] * (max_tokens - len(words)))
    return torch.tensor(rows, dtype=torch.long)


class CaptionEncoder(torch.nn.Module):
    """Learned stand-in for Flux's text encoders: per-word embeddings plus a position embedding
    (Flux gives text tokens no RoPE position, so without it "red on blue" = "blue on red"), and a
    pooled vector, the mean of per-word pooled embeddings."""

    def __init__(self, vocab_size, max_tokens, joint_attention_dim, pooled_projection_dim):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, joint_attention_dim)
        self.positions = torch.nn.Parameter(torch.zeros(max_tokens, joint_attention_dim))
        self.pooled = torch.nn.Embedding(vocab_size, pooled_projection_dim)
        for p in (self.tokens.weight, self.positions, self.pooled.weight):
            torch.nn.init.normal_(p, std=0.5)

    def forward(self, ids):
        return self.tokens(ids) + self.positions[: ids.shape[1]], self.pooled(ids).mean(1)


def default_config(image_size=32, patch=4):
    """The spec (JSON-able) of the demo model: transformer config, vocabulary, image and sampler settings."""
    return {
        "about": "cquant's demo model: a small FluxTransformer2DModel trained with rectified flow on procedurally "
                 "drawn images; pixel space (each patch x patch RGB patch is one token), learned caption embeddings.",
        "transformer": {"patch_size": 1, "in_channels": 3 * patch * patch, "out_channels": 3 * patch * patch,
                        "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 32,
                        "num_attention_heads": 4, "joint_attention_dim": 128, "pooled_projection_dim": 128,
                        "guidance_embeds": False, "axes_dims_rope": [8, 12, 12]},
        "vocab": list(VOCAB),
        "max_tokens": MAX_TOKENS,
        "image_size": image_size,
        "patch": patch,
        # classifier-free guidance 3 draws the shapes far more clearly than none (1.0) for twice the
        # sampling work (the default demo: 22 s on 2 CPU cores instead of about 13)
        "sampler": {"steps": 8, "guidance": 3.0, "shift": 1.0},
        "captions": ["red circle on blue", "yellow star on black", "white digit 7 on magenta",
                     "green stripes on black"],
    }


def build(spec):
    """(transformer, caption encoder) of a spec, with fresh weights."""
    import diffusers

    tc = spec["transformer"]
    model = diffusers.FluxTransformer2DModel(**tc)
    encoder = CaptionEncoder(len(spec["vocab"]), spec["max_tokens"], tc["joint_attention_dim"],
                             tc["pooled_projection_dim"])
    return model, encoder


def state_dict(model, encoder):
    """One flat dict of both modules' weights: "transformer.*" and "caption_encoder.*"."""
    out = {f"transformer.{k}": v for k, v in model.state_dict().items()}
    out.update({f"caption_encoder.{k}": v for k, v in encoder.state_dict().items()})
    return out


def load(weights_path, spec_path, dtype=torch.float32):
    """(transformer, caption encoder, spec) of saved weights (safetensors) and their JSON spec, eval()."""
    from safetensors.torch import load_file

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
    with open(spec_path) as f:
        spec = json.load(f)
    model, encoder = build(spec)
    tensors = load_file(weights_path)
    for prefix, module in (("transformer.", model), ("caption_encoder.", encoder)):
        part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict(part, strict=True)
    if dtype != torch.float32:  # (diffusers warns about any .to(dtype), needed or not)
        model.to(dtype)
    return model.eval(), encoder.float().eval(), spec


def load_bundled(dtype=torch.float32):
    """(transformer, caption encoder, spec) of the weights bundled with cquant (cquant/data/demo_model.*)."""
    import os

    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    return load(os.path.join(data, "demo_model.safetensors"), os.path.join(data, "demo_model.json"), dtype)


def image_ids(spec, device=None):
    """Flux's img_ids for the packed image: (0, row, column) of each patch."""
    n = spec["image_size"] // spec["patch"]
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(n * n, 3).float().to(device)


def pack(images, patch):
    """[B, 3, H, W] images -> [B, (H/p)(W/p), 3 p p] tokens."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens, patch, size):
    """Inverse of pack for square images of side `size`."""
    b, n = tokens.shape[:2]
    g = size // patch
    x = tokens.reshape(b, g, g, 3, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, 3, size, size)


def timesteps(steps, shift=1.0):
    """steps + 1 noise levels from 1 to 0, shifted toward 1 as in SD3 / Flux (shift 1: uniform)."""
    t = torch.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


@torch.no_grad()
def sample(model, encoder, spec, captions, *, seed=0, steps=None, guidance=None, device="cpu", dtype=torch.float32):
    """Images [B, 3, S, S] in [0, 1] (float32, CPU) for `captions`, by Euler steps of the flow
    x_t = (1 - t) x_0 + t noise from pure noise (t = 1) to t = 0; the model predicts noise - x_0.
    guidance > 1 mixes in the unconditioned prediction (classifier-free guidance, the empty caption)."""
    settings = spec["sampler"]
    steps = settings["steps"] if steps is None else steps
    guidance = settings["guidance"] if guidance is None else guidance
    patch, size = spec["patch"], spec["image_size"]
    b = len(captions)
    ids = tokenize(captions, spec["vocab"], spec["max_tokens"])
    if guidance != 1.0:
        ids = torch.cat([ids, tokenize([""] * b, spec["vocab"], spec["max_tokens"])])
    text, pooled = encoder(ids.to(next(encoder.parameters()).device))
    text, pooled = text.to(device, dtype), pooled.to(device, dtype)
    g = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(b, (size // patch) ** 2, 3 * patch * patch, generator=g).to(device, torch.float32)
    img_ids = image_ids(spec, device)
    txt_ids = torch.zeros(text.shape[1], 3, device=device)
    ts = timesteps(steps, settings.get("shift", 1.0))
    for i in range(steps):
        xin = x if guidance == 1.0 else torch.cat([x, x])
        t = torch.full((xin.shape[0],), float(ts[i]), device=device, dtype=dtype)
        v = model(hidden_states=xin.to(dtype), encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                  img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0].float()
        if guidance != 1.0:
            cond, uncond = v.chunk(2)
            v = uncond + guidance * (cond - uncond)
        x = x + float(ts[i + 1] - ts[i]) * v
    return ((unpack(x, patch, size) + 1) / 2).clamp(0, 1).cpu()
