"""`python -m cquant demo`: a Flux pipeline in its float dtype and in each cquant scheme, side by side.

By default the pipeline is a small Flux-architecture one built from a config bundled with
cquant (python/cquant/data/flux_mini.json) with random weights and random prompt embeddings, so
nothing is downloaded; it runs in about a minute on a 2-core CPU. `--model` takes a diffusers
checkpoint (hub id or local directory) instead, with `--prompt`.

For each variant it prints the transformer's weight memory, the median denoising-step latency
and the SQNR of the final latents against a float32 run of the same weights (or against the
float run, for checkpoints too large to hold in float32), and saves the decoded images side by
side in one PNG.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

DEFAULT_SCHEMES = ("int8wo", "int8dq", "fp8dqrow", "fp8wo", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1")


def _require(module, extra="diffusers"):
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"cquant demo needs {module}: pip install \"cquant[{extra}]\"")


def best_device():
    import torch

    from . import _C

    if torch.cuda.is_available() and _C.built_with_cuda():
        return "cuda"
    return "cpu"


def _data_path(name):
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", name)


def build_mini_pipeline(seed=0):
    """The bundled small Flux pipeline (random weights) and its description dict."""
    import diffusers
    import torch

    with open(_data_path("flux_mini.json")) as f:
        spec = json.load(f)
    torch.manual_seed(seed)
    parts = {name: getattr(diffusers, spec[name]["class"])(**spec[name]["config"])
             for name in ("transformer", "vae", "scheduler")}
    with torch.no_grad():  # diffusers zero-initialises output projections; random weights everywhere
        for mod in parts["transformer"].modules():
            if isinstance(mod, torch.nn.Linear) and not mod.weight.abs().sum():
                torch.nn.init.normal_(mod.weight, std=mod.in_features ** -0.5)
    pipe = diffusers.FluxPipeline(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, **parts)
    return pipe, spec


class StepTimer:
    """Median wall time of the transformer's forward calls (synchronized on CUDA)."""

    def __init__(self, module, device):
        import torch

        self.times, self._t0 = [], None
        self._sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *args):
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, *args):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)

    def close(self):
        for h in self._handles:
            h.remove()

    @property
    def median_ms(self):
        return 1e3 * statistics.median(self.times) if self.times else float("nan")


def weight_bytes(model):
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))


def sqnr_db(ref, x):
    import torch

    ref = ref.detach().double().cpu()
    err = (ref - x.detach().double().cpu()).norm()
    return float("inf") if err == 0 else float(20 * torch.log10(ref.norm() / err))


def run_pipeline(pipe, inputs, device, steps, height, width, seed):
    """Final latents of one generation and the median step time in ms."""
    import torch

    timer = StepTimer(pipe.transformer, device)
    try:
        g = torch.Generator("cpu").manual_seed(seed)
        with torch.no_grad():
            # guidance 4: Flux embeds 1000 * guidance in the activation dtype, and 4000 is exact in
            # bfloat16 where 3500 (the default 3.5) is not
            latents = pipe(**inputs, num_inference_steps=steps, height=height, width=width, generator=g,
                           guidance_scale=4.0, output_type="latent").images
    finally:
        timer.close()
    return latents, timer.median_ms


def decode(pipe, latents, height, width):
    """PIL image of packed Flux latents, decoded by the pipeline's VAE in float32."""
    import torch

    vae = pipe.vae
    with torch.no_grad():
        lat = pipe._unpack_latents(latents.float(), height, width, pipe.vae_scale_factor)
        lat = lat.to(next(vae.parameters()).device, next(vae.parameters()).dtype)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
    return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


def side_by_side(images, labels, path):
    from PIL import Image, ImageDraw

    w, h = images[0].size
    band = 18
    sheet = Image.new("RGB", (w * len(images), h + band), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (img, label) in enumerate(zip(images, labels)):
        sheet.paste(img, (i * w, band))
        draw.text((i * w + 4, 3), label, fill="black")
    sheet.save(path)


def format_table(rows, ref_name):
    head = ("variant", "weights", "step (ms)", f"SQNR vs {ref_name} (dB)")
    lines = [head] + [(r["variant"], f"{r['weight_bytes'] / 1e6:.2f} MB", f"{r['step_ms']:.1f}",
                       "inf" if r["sqnr_db"] == float("inf") else f"{r['sqnr_db']:.1f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(line)))
        if i == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="cquant demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="diffusers Flux checkpoint (hub id or local dir); default: the bundled small pipeline")
    p.add_argument("--quant", default=",".join(DEFAULT_SCHEMES),
                   help="comma-separated scheme names, or 'all' (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best present)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--prompt", default="a photo of a dog surfing on the moon", help="prompt (with --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="cquant_demo.png", help="where to save the images (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    from .configs import SCHEME_NAMES, config_from_name

    args.schemes = list(SCHEME_NAMES) if args.quant == "all" else [s for s in args.quant.split(",") if s]
    for s in args.schemes:
        try:
            config_from_name(s)
        except ValueError as e:
            p.error(f"--quant: {e}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    for name in ("height", "width"):
        if getattr(args, name) < 16 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch = _require("torch", "torch")
    _require("diffusers")
    import cquant

    schemes = args.schemes
    device = torch.device(args.device or best_device())
    if device.type == "cuda" and not cquant._C.built_with_cuda():
        sys.exit("cquant was built without CUDA kernels; use --device cpu or rebuild with nvcc")
    # torch's bfloat16 matmuls are slow on most CPUs; cquant's kernels take float32 there as well
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
    import diffusers

    diffusers.utils.logging.set_verbosity_error()

    t_start = time.perf_counter()
    if args.model is None:
        pipe, spec = build_mini_pipeline(args.seed)
        g = torch.Generator().manual_seed(args.seed + 1)
        tc = pipe.transformer.config
        inputs = {"prompt_embeds": torch.randn(1, spec["text_tokens"], tc.joint_attention_dim, generator=g),
                  "pooled_prompt_embeds": torch.randn(1, tc.pooled_projection_dim, generator=g)}
        source = "bundled small Flux pipeline (random weights)"
        float_transformer = pipe.transformer.float()
        ref_dtype = torch.float32
    else:
        pipe = diffusers.DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        inputs = {"prompt": args.prompt}
        source = args.model
        float_transformer = pipe.transformer  # bfloat16: too large to copy to float32 in general
        ref_dtype = torch.bfloat16
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.to(device, torch.float32)
    for name in ("text_encoder", "text_encoder_2"):
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).to(device)
    inputs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    float_transformer.to("cpu")

    def use(transformer):
        pipe.transformer = transformer

    gen = dict(device=device, steps=args.steps, height=args.height, width=args.width, seed=args.seed)
    results, images = [], []

    # the reference: float32 for the bundled pipeline, else the checkpoint's own bfloat16
    ref_model = copy.deepcopy(float_transformer).to(device, ref_dtype) if args.model is None else \
        float_transformer.to(device)
    use(ref_model)
    ref_inputs = {k: v.to(ref_dtype) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ref_latents, ref_ms = run_pipeline(pipe, ref_inputs, **gen)
    ref_name = str(ref_dtype).replace("torch.", "")
    results.append(dict(variant=ref_name, scheme=None, weight_bytes=weight_bytes(ref_model), step_ms=ref_ms,
                        sqnr_db=float("inf")))
    images.append(decode(pipe, ref_latents, args.height, args.width))
    if dtype != ref_dtype:  # the float run in the dtype the quantized runs use
        base = copy.deepcopy(float_transformer).to(device, dtype)
        use(base)
        latents, ms = run_pipeline(pipe, inputs, **gen)
        results.append(dict(variant=str(dtype).replace("torch.", ""), scheme=None, weight_bytes=weight_bytes(base),
                            step_ms=ms, sqnr_db=sqnr_db(ref_latents, latents)))
        images.append(decode(pipe, latents, args.height, args.width))
        del base
    if args.model is not None:
        ref_model.to("cpu")
    else:
        del ref_model

    for scheme in schemes:
        model = copy.deepcopy(float_transformer).to(dtype)
        cquant.quantize_(model, scheme, device=device, progress=False)
        use(model)
        latents, ms = run_pipeline(pipe, inputs, **gen)
        s = cquant.summary(model)
        results.append(dict(variant=scheme, scheme=scheme, weight_bytes=weight_bytes(model), step_ms=ms,
                            sqnr_db=sqnr_db(ref_latents, latents), skipped=len(s.skipped)))
        images.append(decode(pipe, latents, args.height, args.width))
        del model

    side_by_side(images, [r["variant"] for r in results], args.out)
    elapsed = time.perf_counter() - t_start
    print(f"cquant {cquant.__version__} demo: {source}")
    print(f"device {device}, activations {str(dtype).replace('torch.', '')}, {args.steps} steps at "
          f"{args.width}x{args.height}; SQNR of the final latents against the {ref_name} model")
    print()
    print(format_table(results, ref_name))
    print()
    print(f"images: {os.path.abspath(args.out)} ({', '.join(r['variant'] for r in results)}), {elapsed:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(source=source, device=str(device), dtype=str(dtype), steps=args.steps, height=args.height,
                           width=args.width, reference=ref_name, results=results), f, indent=2)
    return results
