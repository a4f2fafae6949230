"""Tiny random-weight diffusion transformers for tests: the real diffusers classes at toy sizes.

Every width is a multiple of 16 and at least 16, so every linear layer is one each scheme
takes; inputs are fixed by a seed so two calls give the same tensors.
"""

import torch

from cquant.metrics import sqnr_db  # noqa: F401  (tests call tm.sqnr_db)

# name -> (diffusers class name, constructor kwargs)
CONFIGS = {
    "flux": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=[8, 12, 12])),
    "sd3": ("SD3Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=32)),
    "pixart-sigma": ("PixArtTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=64, sample_size=8, patch_size=2, norm_type="ada_norm_single", caption_channels=64,
        use_additional_conditions=False)),
    "cogvideox": ("CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=64, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8)),
    "qwen-image": ("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=64, axes_dims_rope=(8, 12, 12))),
}


def build(name, dtype=torch.float32, seed=0, **config):
    """A tiny model of one family, random weights (seeded), eval mode; `config` overrides
    constructor arguments."""
    import diffusers

    cls_name, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    model = getattr(diffusers, cls_name)(**{**kwargs, **config}).eval()
    # diffusers zero-initialises some output projections; give every layer real weights
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and not mod.weight.abs().sum():
                torch.nn.init.normal_(mod.weight, std=mod.in_features ** -0.5)
    return model.to(dtype) if dtype != torch.float32 else model


def inputs(name, dtype=torch.float32, seed=1, device="cpu"):
    """Keyword arguments of one forward call of the tiny model `name`."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    t = torch.tensor([0.6], device=device, dtype=dtype)
    if name == "flux":
        return dict(hidden_states=randn(1, 16, 16), encoder_hidden_states=randn(1, 8, 64), pooled_projections=randn(1, 32),
                    timestep=t, img_ids=torch.zeros(16, 3, device=device), txt_ids=torch.zeros(8, 3, device=device),
                    return_dict=False)
    if name == "sd3":
        return dict(hidden_states=randn(1, 4, 16, 16), encoder_hidden_states=randn(1, 8, 64),
                    pooled_projections=randn(1, 32), timestep=t * 1000, return_dict=False)
    if name == "pixart-sigma":
        return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 64), timestep=t * 1000,
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    if name == "cogvideox":
        return dict(hidden_states=randn(1, 3, 4, 8, 8), encoder_hidden_states=randn(1, 8, 64), timestep=t * 1000,
                    return_dict=False)
    if name == "qwen-image":
        return dict(hidden_states=randn(1, 16, 16), encoder_hidden_states=randn(1, 8, 64),
                    encoder_hidden_states_mask=torch.ones(1, 8, device=device, dtype=dtype), timestep=t,
                    img_shapes=[(1, 4, 4)], return_dict=False)
    raise KeyError(name)


@torch.no_grad()
def run(model, name, dtype=None, device="cpu"):
    dtype = dtype or next(p for p in model.parameters() if p.is_floating_point()).dtype
    return model(**inputs(name, dtype=dtype, device=device))[0]




def clip_text_encoder(seed=0):
    """A tiny CLIPTextModel (hidden 32: Flux's pooled projection of the tiny Flux above)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    return CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2,
                                        vocab_size=100, max_position_embeddings=77, projection_dim=32, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=1)).eval()


def t5_text_encoder(seed=0):
    """A tiny T5EncoderModel (d_model 64: the tiny Flux's joint attention width)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(d_model=64, d_ff=128, d_kv=32, num_heads=2, num_layers=2, vocab_size=100)).eval()


def flux_pipeline(with_text_encoders=True, seed=0):
    """A tiny FluxPipeline without tokenizers (prompts go in as embeddings)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(16,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                        text_encoder=clip_text_encoder(seed) if with_text_encoders else None, tokenizer=None,
                        text_encoder_2=t5_text_encoder(seed) if with_text_encoders else None, tokenizer_2=None,
                        transformer=build("flux", seed=seed))


class native_attention:
    """Run with diffusers' default (native) attention backend, restoring the previous one after.

    model.set_attention_backend() sets a process-wide active backend too, so a test elsewhere
    that enabled another backend would otherwise change what these tests run."""

    def __enter__(self):
        try:
            from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
        except ImportError:
            self.registry = None
            return self
        self.registry = _AttentionBackendRegistry
        self.previous = getattr(_AttentionBackendRegistry, "_active_backend", None)
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        return self

    def __exit__(self, *exc):
        if self.registry is not None and self.previous is not None:
            self.registry.set_active_backend(self.previous)
        return False
