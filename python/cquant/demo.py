"""`python -m cquant demo`: a Flux model in its float dtype and in each cquant scheme, side by side.

By default the model is a small Flux-architecture transformer trained on procedurally drawn
32x32 images (shapes, digits, textures) by scripts/train_demo_model.py, bundled with cquant
(python/cquant/data/demo_model.*, see cquant.demo_model), so nothing is downloaded; it samples a
few captions ("red circle on blue", ...) with a few Euler flow-matching steps, in about a minute
on a 2-core CPU. `--model` takes a diffusers Flux checkpoint (hub id or local directory) instead,
with `--prompt`.

For each variant it prints the transformer's weight memory, the median denoising-step latency,
the SQNR of the final latents (the images, for the pixel-space bundled model) against a float32
run of the same weights (or against the float run, for checkpoints too large to hold in float32)
and the PSNR of the images against the reference's, and saves the images side by side in one
PNG. The schemes are DEMO_SCHEMES by default (the README's list, with the 4-bit int4wo and int4dq
at torchao's group size 128), or every one of cquant.schemes.SCHEME_NAMES with --quant all; any
name works ("int4wo_g64", "fp6_e3m2_r16", ...).
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

from .metrics import psnr_db, sqnr_db
from .schemes import SCHEME_NAMES, scheme, scheme_names

# The default variants: every scheme of SCHEME_NAMES except the 4-bit variants that differ from
# int4wo / int4dq only in their codes' sign, their scale layout or the activation format (--quant
# all adds them).
DEMO_SCHEMES = tuple(s for s in SCHEME_NAMES if s not in ("int4wo_sym", "int4dq_2l", "fp8da_int4w"))
DEFAULT_PROMPT = "a photo of a dog surfing on the moon"

SQNR_NOTE = """\
SQNR = 20 log10(|ref| / |ref - x|) over the final {what}, ref being the {ref} run from the same
seed: about 6 dB per bit of precision; 40 dB means an error of 1% of the signal, 30 dB 3%,
20 dB 10%. PSNR = 10 log10(1 / MSE) of the images in [0, 1] against the {ref} images: above
about 40 dB the eye sees no difference, below about 25 dB it sees one. Both compare each scheme
with the unquantized model, not with a good image."""

BUNDLED_NOTE = """\
The bundled model is small (a few MB) and trained for minutes on drawn shapes, digits and
textures: its float images are rough, and a scheme's error shows as colour shifts, blur or a
changed shape. For a real model: --model black-forest-labs/FLUX.1-dev --prompt "..." (a 24 GB
download) or a local Flux checkpoint."""


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


def check_device(device, prog="cquant demo"):
    """Exit with a message (from `prog`, the command the user ran) saying what to do where `device`
    (a torch.device) cannot run the demo."""
    import torch

    from . import _C

    if device.type == "cpu":
        return
    if device.type != "cuda":
        sys.exit(f"{prog}: --device {device}: expected cpu or cuda[:N]")
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA GPU or driver")
        sys.exit(f"{prog}: --device {device}: {why}. Run on the CPU instead: leave --device out, or --device cpu.")
    if device.index is not None and device.index >= torch.cuda.device_count():
        sys.exit(f"{prog}: --device {device}: there are {torch.cuda.device_count()} CUDA devices "
                 f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if not _C.built_with_cuda():
        sys.exit(f"{prog}: --device {device}: this cquant was built CPU-only (no CUDA kernels), although "
                 "torch sees a GPU. Reinstall it where nvcc is found (pip install . builds for the GPUs present; "
                 "see the README's Build section), or run with --device cpu.")


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


class BundledModel:
    """The trained demo model of cquant.demo_model (pixel space: its final latents are the images)."""

    what = "images"

    def __init__(self, captions, steps, seed):
        from . import demo_model

        self._dm = demo_model
        self.transformer, self.encoder, self.spec = demo_model.load_bundled()
        self.captions = list(captions or self.spec["captions"])
        try:
            demo_model.tokenize(self.captions, self.spec["vocab"], self.spec["max_tokens"])
        except ValueError as e:
            sys.exit(f"cquant demo: --prompt: {e}")
        self.steps, self.seed = steps or self.spec["sampler"]["steps"], seed
        self.height = self.width = self.spec["image_size"]
        t = self.spec.get("training", {})
        self.source = (f"bundled demo model ({sum(p.numel() for p in self.transformer.parameters()) / 1e6:.1f} M "
                       f"parameters, trained {t.get('steps', '?')} steps on {t.get('device', '?')})")

    def generate(self, model, device, dtype):
        """(final images, images [B, 3, H, W] in [0, 1] on the CPU, median step ms)."""
        timer = StepTimer(model, device)
        try:
            images = self._dm.sample(model, self.encoder, self.spec, self.captions, seed=self.seed, steps=self.steps,
                                     device=device, dtype=dtype)
        finally:
            timer.close()
        return images, images, timer.median_ms


class CheckpointPipeline:
    """A diffusers Flux checkpoint (--model), its prompt encoded once by its text encoders."""

    what = "latents"

    def __init__(self, args, device):
        import diffusers
        import torch

        try:
            index = diffusers.DiffusionPipeline.load_config(args.model)
        except (OSError, ValueError) as e:  # no such directory or Hub id, no model_index.json
            sys.exit(f"cquant demo: --model {args.model!r}: {str(e).splitlines()[0]}")
        if index.get("_class_name") != "FluxPipeline":
            sys.exit(f"cquant demo runs Flux pipelines; {args.model} is a {index.get('_class_name')}")
        # a checkpoint saved without text encoders / tokenizers: load it with those left out
        absent = {n: None for n in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
                  if index.get(n) in (None, [None, None])}
        self.pipe = diffusers.FluxPipeline.from_pretrained(args.model, dtype=torch.bfloat16, **absent)
        self.pipe.set_progress_bar_config(disable=True)
        self.prompt = args.prompt or DEFAULT_PROMPT
        self.captions = [self.prompt]
        self.steps, self.seed = args.steps or 4, args.seed
        self.height, self.width = args.height or 256, args.width or 256
        embeds = prompt_embeddings(self.pipe, self.prompt, args.seed, device, 512)
        self.embeds = embeds["tensors"]
        self.source = args.model + (" (no text encoders: random prompt embeddings)" if embeds["random"] else "")
        self.pipe.vae.to(device, torch.float32)
        self.transformer = self.pipe.transformer.to("cpu")

    def generate(self, model, device, dtype):
        """(final latents, decoded images [1, 3, H, W] in [0, 1] on the CPU, median step ms)."""
        self.pipe.transformer = model
        inputs = {k: v.to(device, dtype) for k, v in self.embeds.items()}
        latents, ms = run_pipeline(self.pipe, inputs, device, self.steps, self.height, self.width, self.seed)
        return latents, decode(self.pipe, latents, self.height, self.width), ms


def prompt_embeddings(pipe, prompt, seed, device, text_tokens):
    """{"tensors": prompt_embeds / pooled_prompt_embeds (float32, CPU), "random": bool}.

    Encoded once with the pipeline's text encoders (then moved off the device), or random
    tensors of the transformer's widths when it has none."""
    import torch

    if getattr(pipe, "text_encoder", None) is not None and getattr(pipe, "tokenizer", None) is not None:
        for name in ("text_encoder", "text_encoder_2"):
            getattr(pipe, name).to(device)
        with torch.no_grad():
            prompt_embeds, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None, device=device,
                                                          max_sequence_length=text_tokens)
        for name in ("text_encoder", "text_encoder_2"):
            getattr(pipe, name).to("cpu")
        return {"tensors": {"prompt_embeds": prompt_embeds.float().cpu(),
                            "pooled_prompt_embeds": pooled.float().cpu()}, "random": False}
    g = torch.Generator().manual_seed(seed + 1)
    tc = pipe.transformer.config
    return {"tensors": {"prompt_embeds": torch.randn(1, text_tokens, tc.joint_attention_dim, generator=g),
                        "pooled_prompt_embeds": torch.randn(1, tc.pooled_projection_dim, generator=g)},
            "random": True}


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
    """Images [1, 3, H, W] in [0, 1] (CPU) of packed Flux latents, decoded by the pipeline's VAE in float32."""
    import torch

    vae = pipe.vae
    with torch.no_grad():
        lat = pipe._unpack_latents(latents.float(), height, width, pipe.vae_scale_factor)
        lat = lat.to(next(vae.parameters()).device, next(vae.parameters()).dtype)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
    return pipe.image_processor.postprocess(image.float(), output_type="pt").cpu()


def side_by_side(images, labels, row_labels, path):
    """One PNG: a column per variant ([B, 3, H, W] images in [0, 1], rows = the B captions), each
    column's labels (lines of text) below it, the captions at the left; small images are upscaled
    with nearest-neighbour (so pixels stay pixels) to at least 128 pixels."""
    from PIL import Image, ImageDraw

    b, _, h, w = images[0].shape
    zoom = max(1, 128 // max(h, w))
    cw, ch, gap = w * zoom, h * zoom, 4
    left = 10 + 5 * max(len(r) for r in row_labels) if row_labels else 0
    band = 6 + 12 * max(len(lines) for lines in labels)
    sheet = Image.new("RGB", (left + len(images) * (cw + gap), b * (ch + gap) + band), "white")
    draw = ImageDraw.Draw(sheet)
    for j, (batch, lines) in enumerate(zip(images, labels)):
        x = left + j * (cw + gap)
        for i, img in enumerate(batch):
            pixels = (img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).contiguous().numpy()
            sheet.paste(Image.fromarray(pixels).resize((cw, ch), Image.NEAREST), (x, i * (ch + gap)))
        for k, line in enumerate(lines):
            draw.text((x + 2, b * (ch + gap) + 2 + 12 * k), line, fill="black")
    for i, label in enumerate(row_labels or []):
        draw.text((4, i * (ch + gap) + ch // 2 - 6), label, fill="black")
    sheet.save(path)


def _db(x):
    return "inf" if x == float("inf") else f"{x:.1f}"


def text_table(lines):
    """Rows of strings, the first a header, as aligned text: names left, numbers right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(line)))
        if i == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def scales_of(name):
    """How a scheme's weight scales are laid out, for the table: "row", "tensor", "group 128",
    "two-level 128"."""
    s = scheme(name)
    kind = "two-level" if s.weight_granularity == "two_level" else "group"
    text = f"{kind} {s.weight_group_size}" if s.weight_group_size else s.weight_granularity
    return text + (f", rank {s.lowrank_rank}" if s.lowrank_rank else "")


def format_table(rows, ref_name):
    head = ("variant", "scales", "weights (MB)", "skipped", "step (ms)", f"SQNR vs {ref_name} (dB)", "PSNR (dB)")
    return text_table([head] + [(r["variant"], scales_of(r["scheme"]) if r["scheme"] else "-",
                                 f"{r['weight_bytes'] / 1e6:.2f}", str(r.get("skipped", "-")), f"{r['step_ms']:.1f}",
                                 _db(r["sqnr_db"]), _db(r["psnr_db"])) for r in rows])


def comma_list(text, option, noun, expected):
    """The entries of a comma list given to `option`, stripped: "int8wo, fp8dqrow" -> ["int8wo",
    "fp8dqrow"]. ValueError, one line naming the option and `expected`, when it names nothing
    ("", ",,": names no `noun`) or has an empty entry ("a,,b", "a,", ",a"): a doubled or stray
    comma is a typo, and running without the entry would measure less than was asked. Every
    command line of the project (demo, verify, bench, the benchmark scripts) parses its lists here."""
    entries = [s.strip() for s in text.split(",")]
    if not any(entries):
        raise ValueError(f"{option} {text!r} names no {noun}; expected {expected}")
    if "" in entries:
        raise ValueError(f"{option} {text!r} has an empty entry; expected {expected}")
    return entries


def check_output(p, option, path, image=False):
    """Refuse, before the minutes of the run, an output path that could not be written at its end."""
    if os.path.isdir(path):
        p.error(f"{option} {path!r} is a directory; expected a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{option} {path!r}: {parent!r} is not an existing directory")
    if not os.access(parent, os.W_OK):
        p.error(f"{option} {path!r}: the directory {parent!r} is not writable")
    if image:
        try:
            from PIL import Image
        except ImportError:  # side_by_side says so itself
            return
        Image.init()
        ext = os.path.splitext(path)[1].lower()
        if ext not in Image.registered_extensions():
            p.error(f"{option} {path!r}: expected an image file name (.png, .jpg, .webp, ...), got the extension "
                    f"{ext or 'none'!r}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="cquant demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="diffusers Flux checkpoint (hub id or local dir); default: the bundled trained demo model")
    p.add_argument("--quant", default="default",
                   help="comma-separated scheme names (int8wo, fp8dqrow, fp6_e3m2, int4wo, int4wo_g64, any fpB_eEmM, "
                        f"...), 'default' ({', '.join(DEMO_SCHEMES)}) or 'all' ({', '.join(SCHEME_NAMES)}) "
                        "(default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best present)")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps (default: the bundled model's sampler setting; 4 with --model)")
    p.add_argument("--height", type=int, default=None, help="with --model (default: 256); the bundled model's is fixed")
    p.add_argument("--width", type=int, default=None, help="with --model (default: 256); the bundled model's is fixed")
    p.add_argument("--prompt", default=None,
                   help=f"with --model: the prompt (default: {DEFAULT_PROMPT!r}); with the bundled model: "
                        "comma-separated captions of its vocabulary, one row each, such as "
                        "'red circle on blue,white digit 3 on black,green stripes on yellow' (default: 4 of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="cquant_demo.png", help="where to save the images (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    check_output(p, "--out", args.out, image=True)
    if args.json is not None:
        check_output(p, "--json", args.json)
    named = {"all": SCHEME_NAMES, "default": DEMO_SCHEMES}
    try:
        listed = list(named[args.quant]) if args.quant in named else comma_list(
            args.quant, "--quant", "scheme", "'default', 'all' or comma-separated names")
        scheme_names(listed, f"--quant {args.quant!r}")
        args.schemes = listed  # as the user spells them, for the table
        args.captions = None  # the bundled model's rows; a checkpoint's --prompt is one free-text prompt
        if args.model is None and args.prompt is not None:
            args.captions = comma_list(args.prompt, "--prompt", "caption", "comma-separated captions")
    except ValueError as e:
        p.error(str(e))
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value < 16 or value % 16):
            p.error(f"--{name} must be a positive multiple of 16")
        if value is not None and args.model is None:
            p.error(f"--{name} applies with --model: the bundled model makes images of the one size it was trained at")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # transformers warns at import about optional packages the demo does not use (torchvision)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch = _require("torch", "torch")
    _require("diffusers")
    import cquant

    try:
        device = torch.device(args.device or best_device())
    except RuntimeError as e:
        sys.exit(f"cquant demo: --device {args.device}: {e}")
    check_device(device)
    schemes, too_new = args.schemes, []
    if device.type == "cuda":  # schemes whose kernels this GPU generation lacks
        major, minor = torch.cuda.get_device_capability(device)
        too_new = [s for s in schemes if scheme(s).min_compute_capability > 10 * major + minor]
        schemes = [s for s in schemes if s not in too_new]
    # torch's bfloat16 matmuls are slow on most CPUs; cquant's kernels take float32 there as well
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    warnings.simplefilter("ignore", cquant.SkippedLayersWarning)
    import diffusers

    diffusers.utils.logging.set_verbosity_error()

    t_start = time.perf_counter()
    if args.model is None:
        source = BundledModel(args.captions, args.steps, args.seed)
    else:
        source = CheckpointPipeline(args, device)
    float_transformer = source.transformer

    # The reference: float32, except a checkpoint on a GPU, which runs against its own bfloat16
    # (a float32 copy of a 12 B transformer would not fit beside the quantized ones).
    ref_dtype = torch.float32 if args.model is None or device.type == "cpu" else torch.bfloat16
    results, images = [], []
    ref = {}

    def run(name, model, run_dtype, scheme=None):
        final, pictures, ms = source.generate(model, device, run_dtype)
        if not ref:
            ref.update(final=final, images=pictures)
        row = dict(variant=name, scheme=scheme, weight_bytes=weight_bytes(model), step_ms=ms,
                   sqnr_db=sqnr_db(ref["final"], final), psnr_db=psnr_db(ref["images"], pictures))
        if scheme is not None:
            row["skipped"] = len(cquant.summary(model).skipped)
        results.append(row)
        images.append(pictures)

    in_place = float_transformer.dtype == ref_dtype and args.model is not None  # no second copy of a big model
    ref_model = float_transformer.to(device) if in_place else copy.deepcopy(float_transformer).to(device, ref_dtype)
    ref_name = str(ref_dtype).replace("torch.", "")
    run(ref_name, ref_model, ref_dtype)
    if in_place:
        float_transformer.to("cpu")
    del ref_model
    if dtype != ref_dtype:  # the float model in the dtype the quantized runs use
        base = copy.deepcopy(float_transformer).to(device, dtype)
        run(str(dtype).replace("torch.", ""), base, dtype)
        del base

    for name in schemes:
        model = copy.deepcopy(float_transformer).to(dtype)
        cquant.quantize_(model, name, device=device, progress=False)
        run(name, model, dtype, scheme=name)
        del model

    labels = [[r["variant"], f"SQNR {_db(r['sqnr_db'])} dB", f"PSNR {_db(r['psnr_db'])} dB"] for r in results]
    side_by_side(images, labels, source.captions if args.model is None else None, args.out)
    elapsed = time.perf_counter() - t_start
    print(f"cquant {cquant.__version__} demo: {source.source}")
    print(f"device {device}, activations {str(dtype).replace('torch.', '')}, {source.steps} steps at "
          f"{source.width}x{source.height}; SQNR of the final {source.what} and PSNR of the images against the "
          f"{ref_name} model")
    if device.type == "cpu":
        print("(on the CPU cquant runs its plain C reference kernels, written for clarity rather than speed: "
              "the step times of the schemes are not those of its GPU kernels)")
    for s in too_new:
        print(f"({s} skipped: its kernels need sm_{scheme(s).min_compute_capability}+)")
    print()
    print(format_table(results, ref_name))
    print()
    print(SQNR_NOTE.format(ref=ref_name, what=source.what))
    if args.model is None:
        print(BUNDLED_NOTE)
    print()
    print(f"images: {os.path.abspath(args.out)} (columns {', '.join(r['variant'] for r in results)}; rows: "
          f"{'; '.join(source.captions)}), {elapsed:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(source=source.source, device=str(device), dtype=str(dtype), steps=source.steps,
                           height=source.height, width=source.width, captions=source.captions,
                           reference=ref_name, results=results), f, indent=2)
    return results
