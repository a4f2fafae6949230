"""The parts of a registry model's pipeline around its denoiser: text encoders, VAE and scheduler,
built from the published configs (python/cquant/data/pipeline_configs.json) with random weights,
tiny variants sized to a tiny denoiser, and the token ids and prompt encoding each pipeline uses.

No tokenizer exists without a download, so prompts are fixed random token ids of the real lengths
(and the ids the tokenizer gives an empty prompt, for the negative prompt of guided pipelines);
the encoders then run exactly as the diffusers pipeline's own encode_prompt runs them.
"""

from __future__ import annotations

import functools
import json
import math
import os

import torch

# Linear / conv / embedding weights N(0, INIT_STD^2): small enough that the 24 unscaled-attention
# layers of T5-XXL keep their residual stream well inside bfloat16's range, large enough that
# every layer changes its input.
INIT_STD = 0.02

_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "pipeline_configs.json")


@functools.lru_cache(maxsize=1)
def configs() -> dict:
    with open(_DATA) as f:
        return json.load(f)


def pipeline_names() -> tuple[str, ...]:
    return tuple(configs()["pipelines"])


def pipeline_spec(model: str) -> dict:
    specs = configs()["pipelines"]
    if model not in specs:
        raise ValueError(f"model: no whole-pipeline config for {model!r}; expected one of {', '.join(specs)}")
    return specs[model]


# ---------------------------------------------------------------- random weights


def init_random_(module: torch.nn.Module, *, seed: int, std: float = INIT_STD, std_of=None) -> torch.nn.Module:
    """Give every parameter of `module` (already materialized, e.g. by to_empty) a value: norm
    scales 1 and shifts 0, other biases 0, every other tensor N(0, s^2) drawn on the parameter's
    own device (a GPU draws billions of normals in a second; the CPU generator is serial), where
    s = std_of(module's qualified name) when that gives a number, else `std`. Buffers the meta
    device left empty are rebuilt by transformers' own _init_weights (CLIP's position ids, rotary
    inverse frequencies); a buffer elsewhere is an error."""
    gens = {}

    def gen(device):
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(seed)
        return gens[device]

    rebuild_buffers = getattr(module, "_init_weights", None)  # transformers models only
    with torch.no_grad():
        for qualname, mod in module.named_modules():
            buffers = [name for name, _ in mod.named_buffers(recurse=False)]
            if buffers:
                if rebuild_buffers is None:
                    raise NotImplementedError(f"init_random_: no rule for the buffers {buffers} of {type(mod).__name__}")
                rebuild_buffers(mod)  # may draw this module's parameters too: they are drawn again below
            is_norm = "norm" in type(mod).__name__.lower()  # LayerNorm, T5LayerNorm, QwenImageRMS_norm, ...
            s = (std_of(qualname) if std_of else None) or std
            for name, p in mod.named_parameters(recurse=False):
                if is_norm:
                    p.fill_(1.0 if name in ("weight", "gamma", "scale") else 0.0)
                elif name == "bias":
                    p.zero_()
                else:
                    p.normal_(0.0, s, generator=gen(p.device))
    return module


def _materialize(make, *, dtype, device, seed, std_of=None):
    """make() built on the meta device (no memory, no init), then allocated on `device` and drawn."""
    with torch.device("meta"):
        module = make()
    # torch's own .to: diffusers' override warns about _keep_in_fp32_modules, which random weights lack
    module = torch.nn.Module.to(module, dtype).to_empty(device=device).eval()
    # to_empty gives each module its own tensor, which unties shared weights (T5's input embedding
    # is `shared` and `encoder.embed_tokens`): tie them again, or they cost twice the memory
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    module.requires_grad_(False)
    return init_random_(module, seed=seed, std_of=std_of)


# ---------------------------------------------------------------- text encoders


def _tiny_text_config(kind: str, width: int) -> dict:
    heads = 2 if width % 2 == 0 else 1
    if kind.startswith("qwen"):
        base = json.loads(json.dumps(configs()["text_encoders"][kind]["config"]))
        half = width // heads // 2  # mrope splits each head's rotary half over (time, height, width)
        base.update(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=heads,
                    num_key_value_heads=1, max_window_layers=2)
        base["rope_scaling"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
        base["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                     out_hidden_size=width, fullatt_block_indexes=[0])
        return base
    if kind.startswith("t5"):
        base = dict(configs()["text_encoders"][kind]["config"])
        base.update(d_model=width, d_ff=2 * width, d_kv=width // heads, num_heads=heads, num_layers=2)
        return base
    base = dict(configs()["text_encoders"][kind]["config"])
    base.update(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=heads,
                projection_dim=width)
    return base


def text_encoder_class(family: str, kind: str) -> str:
    if kind.startswith("qwen"):
        return "Qwen2_5_VLForConditionalGeneration"  # the whole VLM, as Qwen-Image loads it
    if kind.startswith("t5"):
        return "T5EncoderModel"
    # Flux pools CLIP-L's pooler output; SD3 takes the projected text_embeds of both CLIPs
    return "CLIPTextModel" if family == "flux" else "CLIPTextModelWithProjection"


def t5_init_std(config: dict):
    """T5's own initialization (as in its paper's code and transformers' T5PreTrainedModel), by
    the module's name. T5 does not scale its attention logits by 1/sqrt(d_kv): the query weights
    carry that factor. Drawn at the common N(0, 0.02^2) instead, each logit has a standard
    deviation near 13, every softmax is one-hot, and a bit of rounding anywhere flips which key
    each query picks: the embeddings of a bfloat16 and a quantized encoder then share nothing
    (SQNR below 0 dB), which says nothing about the quantization."""
    d, d_kv, heads, d_ff = config["d_model"], config["d_kv"], config["num_heads"], config["d_ff"]
    by_leaf = {"q": (d * d_kv) ** -0.5, "k": d ** -0.5, "v": d ** -0.5, "o": (heads * d_kv) ** -0.5,
               "wi": d ** -0.5, "wi_0": d ** -0.5, "wi_1": d ** -0.5, "wo": d_ff ** -0.5,
               "shared": 1.0, "embed_tokens": 1.0, "relative_attention_bias": d ** -0.5}
    return lambda qualname: by_leaf.get(qualname.rsplit(".", 1)[-1])


def build_text_encoder(kind: str, family: str, *, dtype, device, seed: int, width: int | None = None):
    """A transformers text encoder of `kind` ("t5-v1.1-xxl", "clip-l", "clip-g") as `family`'s
    pipeline loads it; width=None: the published size, else a 2-layer variant of that width."""
    import transformers

    entry = configs()["text_encoders"][kind]
    cfg_dict = entry["config"] if width is None else _tiny_text_config(kind, width)
    config = getattr(transformers, entry["config_class"]).from_dict(cfg_dict)
    cls = getattr(transformers, text_encoder_class(family, kind))
    std_of = t5_init_std(cfg_dict) if kind.startswith("t5") else None
    return _materialize(lambda: cls(config), dtype=dtype, device=device, seed=seed, std_of=std_of)


def token_ids(kind: str, length: int, batch: int, *, seed: int, empty: bool = False) -> torch.Tensor:
    """[batch, length] int64 ids: a random prompt filling the whole length (ending in the end
    token, as a long prompt does), or with empty=True what the tokenizer gives for ""."""
    info = configs()["text_encoders"][kind]
    if kind.startswith("qwen"):
        return _qwen_ids(info, length, batch, seed=seed, empty=empty)
    eos, pad = info["eos_id"], info["pad_id"]
    if kind.startswith("t5"):
        lo, hi, head = 2, 32000, []  # sentencepiece's 32000 pieces; 0 pad, 1 </s>
    else:
        lo, hi, head = 1, info["bos_id"], [info["bos_id"]]
    if empty:
        row = head + [eos] + [pad] * (length - len(head) - 1)
        return torch.tensor([row] * batch, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(lo, hi, (batch, length - len(head) - 1), generator=g)
    parts = [torch.full((batch, len(head)), head[0]) if head else None, body, torch.full((batch, 1), eos)]
    return torch.cat([p for p in parts if p is not None], dim=1)


def _qwen_ids(info, length, batch, *, seed, empty):
    """Qwen-Image's chat template around the prompt: a fixed 34-token system part (dropped from
    the embeddings), the prompt, and the closing tokens; `length` counts all of them."""
    n_template, suffix = info["template_tokens"], info["suffix_ids"]
    template = torch.randint(0, info["vocab_text"], (n_template - 1,), generator=torch.Generator().manual_seed(1234))
    head = torch.cat([torch.tensor([info["bos_id"]]), template])
    if empty:
        body = torch.tensor(info["empty_ids"])
    else:
        n = length - n_template - len(suffix)
        body = torch.randint(0, info["vocab_text"], (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([head, body, torch.tensor(suffix)]).expand(batch, -1).clone()


def encoder_outputs(encoder, kind: str, family: str, ids: torch.Tensor) -> dict:
    """The tensors `family`'s pipeline takes from this encoder, run as its encode_prompt runs it:
    {"embeds": [B, L, D]} and, for CLIP, {"pooled": [B, P]}."""
    ids = ids.to(encoder.device)
    if kind.startswith("qwen"):  # last hidden state without the template's system part
        out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        embeds = out.hidden_states[-1][:, configs()["text_encoders"][kind]["template_tokens"]:]
        return {"embeds": embeds, "mask": torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)}
    if kind.startswith("t5"):
        mask = (ids != configs()["text_encoders"][kind]["pad_id"]).long() if family == "pixart" else None
        out = {"embeds": encoder(ids, attention_mask=mask)[0]}
        if mask is not None:  # PixArt masks the padding (the others feed the padded prompt as is)
            out["mask"] = mask
        return out
    if family == "flux":
        out = encoder(ids, output_hidden_states=False)
        return {"pooled": out.pooler_output}
    out = encoder(ids, output_hidden_states=True)  # SD3: penultimate layer, projected pooling
    return {"embeds": out.hidden_states[-2], "pooled": out[0]}


# ---------------------------------------------------------------- VAE and scheduler


def _tiny_vae_config(key: str, latent_channels: int, temporal_ratio: int | None) -> dict:
    if key == "qwen-image":
        return dict(base_dim=16, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                    temperal_downsample=[False], latents_mean=[0.0] * latent_channels,
                    latents_std=[1.0] * latent_channels)
    if key == "cogvideox":
        levels = int(math.log2(temporal_ratio or 4))
        n = max(2, levels + 1)  # time is halved in the first `levels` blocks, which must downsample
        return dict(block_out_channels=(16,) + (32,) * (n - 1), down_block_types=("CogVideoXDownBlock3D",) * n,
                    up_block_types=("CogVideoXUpBlock3D",) * n, latent_channels=latent_channels, layers_per_block=1,
                    norm_num_groups=8, temporal_compression_ratio=temporal_ratio or 4, scaling_factor=0.7,
                    use_quant_conv=False, use_post_quant_conv=False)
    cfg = dict(configs()["vaes"][key]["config"])
    cfg.update(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
               up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8,
               latent_channels=latent_channels, sample_size=32)
    return cfg


def build_vae(key: str, *, dtype, device, seed: int, tiny_latent_channels: int | None = None,
              temporal_ratio: int | None = None):
    """The published VAE `key` ("flux", "sd3", "sdxl", "cogvideox"), or with tiny_latent_channels
    a 2-3 block variant with that many latent channels (spatial factor 2, CogVideoX's 4x time)."""
    import diffusers

    entry = configs()["vaes"][key]
    if tiny_latent_channels is None:
        cfg = entry["config"]
    else:
        cfg = _tiny_vae_config(key, tiny_latent_channels, temporal_ratio)
    cls = getattr(diffusers, entry["class"])
    return _materialize(lambda: cls(**cfg), dtype=dtype, device=device, seed=seed)


def build_scheduler(model: str):
    import diffusers

    sched = pipeline_spec(model)["scheduler"]
    return getattr(diffusers, sched["class"])(**sched["config"])
