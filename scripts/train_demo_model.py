"""Train the small Flux model of `cquant demo` on procedurally drawn images; nothing is downloaded.

    python scripts/train_demo_model.py --out python/cquant/data        # 4 minutes on the best device
    python scripts/train_demo_model.py --quick --device cpu --out /tmp/m  # a few steps, for tests

The model is a diffusers FluxTransformer2DModel (double + single blocks, RoPE ids, pooled
projection) in pixel space: 32x32 RGB images, each 4x4 patch one packed token (64 tokens), no VAE;
captions ("red circle on blue", "white digit 7 on black", "green stripes on black") go through a
learned embedding table (cquant/demo_model.py). The objective is Flux's rectified flow: x_t =
(1 - t) x_0 + t noise with t logit-normal, the model predicting noise - x_0. Images are drawn by
torch on the training device each step (shapes, digits from a 5x7 bitmap font, stripes,
checkerboards, gradients), so data never limits the step rate.

Writes into --out: demo_model.safetensors (EMA weights, bfloat16), demo_model.json (architecture,
vocabulary, image size, sampler settings, training record) and demo_model_samples.png (a grid
sampled from the trained weights, one caption per cell, listed in the JSON and printed).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import struct
import sys
import time
import zlib

import torch


def _load_demo_model():
    """cquant/demo_model.py by path: training needs neither a built cquant nor an installed one."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "cquant", "demo_model.py")
    spec = importlib.util.spec_from_file_location("cquant_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dm = _load_demo_model()

PALETTE = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.2), "blue": (0.15, 0.25, 0.9),
           "yellow": (0.95, 0.85, 0.1), "cyan": (0.1, 0.85, 0.9), "magenta": (0.85, 0.15, 0.8),
           "white": (0.95, 0.95, 0.95), "black": (0.05, 0.05, 0.05)}
assert tuple(PALETTE) == dm.COLORS

# 5x7 bitmap font, one string of 7 rows of 5 pixels per digit
FONT = ("01110 10001 10011 10101 11001 10001 01110", "00100 01100 00100 00100 00100 00100 01110",
        "01110 10001 00001 00010 00100 01000 11111", "11111 00010 00100 00010 00001 10001 01110",
        "00010 00110 01010 10010 11111 00010 00010", "11111 10000 11110 00001 00001 10001 01110",
        "00110 01000 10000 11110 10001 10001 01110", "11111 00001 00010 00100 01000 01000 01000",
        "01110 10001 10001 01110 10001 10001 01110", "01110 10001 10001 01111 00001 00010 01100")

# what a caption can name: the shapes and textures, then "digit 0" ... "digit 9"
THINGS = dm.SHAPES + dm.TEXTURES + tuple(f"digit {d}" for d in dm.DIGITS)

GRID_CAPTIONS = ["red circle on blue", "yellow square on black", "cyan triangle on magenta", "white ring on red",
                 "green cross on white", "yellow star on black", "blue star on yellow", "magenta circle on green",
                 "white digit 7 on magenta", "black digit 3 on white", "red digit 0 on cyan", "yellow digit 5 on blue",
                 "green stripes on black", "red checkerboard on white", "blue gradient on yellow",
                 "white stripes on blue"]


def draw(n, size, gen, device):
    """n random images [n, 3, size, size] in [-1, 1] and their caption token ids [n, MAX_TOKENS]."""
    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    def randint(high, *shape):
        return torch.randint(high, shape, generator=gen, device=device)

    thing, fg = randint(len(THINGS), n), randint(len(dm.COLORS), n)
    bg = (fg + 1 + randint(len(dm.COLORS) - 1, n)) % len(dm.COLORS)
    # pixel centres in [-1, 1], y downward
    c = (torch.arange(size, device=device) + 0.5) / size * 2 - 1
    v, u = torch.meshgrid(c, c, indexing="ij")
    u, v = u.expand(n, size, size), v.expand(n, size, size)

    def per(x):
        return x.view(n, 1, 1)

    cx, cy, r = per(rand(n) * 0.7 - 0.35), per(rand(n) * 0.7 - 0.35), per(0.3 + 0.3 * rand(n))
    dx, dy = u - cx, v - cy
    d = torch.sqrt(dx * dx + dy * dy)
    star_arm = torch.acos(torch.cos(5 * (torch.atan2(dy, dx) + math.pi / 2)).clamp(-1, 1)) / math.pi  # 0 on the points
    shapes = [d < r,                                                                     # circle
              torch.maximum(dx.abs(), dy.abs()) < 0.85 * r,                              # square
              (dy > -r) & (dy < 0.6 * r) & (dx.abs() < 0.6 * (dy + r)),                  # triangle
              (d < r) & (d > 0.6 * r),                                                   # ring
              ((dx.abs() < 0.3 * r) & (dy.abs() < r)) | ((dy.abs() < 0.3 * r) & (dx.abs() < r)),  # cross
              d < r * (1 - 0.55 * star_arm)]                                             # star
    angle = per(randint(4, n) * (math.pi / 4))
    along = u * torch.cos(angle) + v * torch.sin(angle)
    period, phase = per(0.25 + 0.25 * rand(n)), per(rand(n))
    cell = per(0.25 * (1 + randint(2, n)))
    checker = (torch.floor(u / cell + per(rand(n))) + torch.floor(v / cell + per(rand(n)))) % 2
    textures = [torch.frac(along / period + phase) < 0.5, checker > 0.5, (0.5 + along / 2).clamp(0, 1)]
    # digits: font pixel (fy, fx) of each image pixel, for a glyph of scale s pixels at (x0, y0)
    font = torch.tensor([[[float(ch) for ch in row] for row in glyph.split()] for glyph in FONT], device=device)
    s = per(2.5 + 1.5 * rand(n))
    x0, y0 = per(rand(n)) * (size - 5 * s), per(rand(n)) * (size - 7 * s)
    px, py = (u + 1) / 2 * size, (v + 1) / 2 * size
    fx, fy = torch.floor((px - x0) / s).long(), torch.floor((py - y0) / s).long()
    inside = (fx >= 0) & (fx < 5) & (fy >= 0) & (fy < 7)
    digit = (thing - len(dm.SHAPES) - len(dm.TEXTURES)).clamp(min=0)
    glyph = font[per(digit).expand(n, size, size), fy.clamp(0, 6), fx.clamp(0, 4)] * inside
    masks = torch.stack([m.float() for m in shapes + textures] + [glyph])  # [kinds, n, S, S]
    mask = masks[thing.clamp(max=masks.shape[0] - 1), torch.arange(n, device=device)].unsqueeze(1)
    palette = torch.tensor(list(PALETTE.values()), device=device)
    jitter = lambda: (rand(n, 3) - 0.5) * 0.1  # noqa: E731
    fgc, bgc = (palette[fg] + jitter()).clamp(0, 1), (palette[bg] + jitter()).clamp(0, 1)
    images = bgc.view(n, 3, 1, 1) * (1 - mask) + fgc.view(n, 3, 1, 1) * mask
    return images * 2 - 1, caption_ids(thing, fg, bg)


def caption_ids(thing, fg, bg):
    """Token ids of "<fg> <thing> on <bg>" ("<fg> digit <d> on <bg>" for digits), padded."""
    index = {w: i for i, w in enumerate(dm.VOCAB)}
    n, dev = thing.shape[0], thing.device
    color = torch.tensor([index[c] for c in dm.COLORS], device=dev)
    word = torch.tensor([index[t] for t in dm.SHAPES + dm.TEXTURES] + [index[d] for d in dm.DIGITS], device=dev)
    is_digit = thing >= len(dm.SHAPES) + len(dm.TEXTURES)
    ids = torch.full((n, dm.MAX_TOKENS), index[dm.PAD], dtype=torch.long, device=dev)
    ids[:, 0] = color[fg]
    ids[:, 1] = torch.where(is_digit, index["digit"], word[thing])
    ids[:, 2] = torch.where(is_digit, word[thing], index["on"])
    ids[:, 3] = torch.where(is_digit, index["on"], color[bg])
    ids[:, 4] = torch.where(is_digit, color[bg], index[dm.PAD])
    return ids


def write_png(path, pixels):
    """uint8 [H, W, 3] tensor as an RGB PNG, with zlib only (no PIL / matplotlib needed)."""
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + bytes(pixels[y].flatten().tolist()) for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def grid(images, columns, scale=4, gap=2):
    """[B, 3, S, S] images in [0, 1] as one uint8 [H, W, 3] sheet, nearest-neighbour upscaled."""
    b, _, s, _ = images.shape
    rows = math.ceil(b / columns)
    cell = s * scale + gap
    sheet = torch.full((rows * cell + gap, columns * cell + gap, 3), 255, dtype=torch.uint8)
    big = (images.repeat_interleave(scale, 2).repeat_interleave(scale, 3) * 255).round().to(torch.uint8)
    for i in range(b):
        y, x = gap + (i // columns) * cell, gap + (i % columns) * cell
        sheet[y:y + s * scale, x:x + s * scale] = big[i].permute(1, 2, 0)
    return sheet


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for demo_model.safetensors / .json / _samples.png")
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100_000, help="step cap (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="images per step (default: 512 on CUDA, 32 on the CPU)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps (default: %(default)s)")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=100, help="print the mean loss every N steps")
    p.add_argument("--quick", action="store_true", help="a few tiny steps (tests): 3 steps, batch 4, 4 samples")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.warmup, args.log_every = min(args.steps, 3), args.batch or 4, 1, 1
    for name in ("minutes", "steps", "lr", "warmup", "log_every"):
        if getattr(args, name) <= 0 and name != "warmup":
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.batch is not None and args.batch < 1:
        p.error("--batch must be >= 1")
    if not 0 <= args.ema < 1:
        p.error("--ema must be in [0, 1)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = device.partition(":")
    if kind not in ("cuda", "cpu") or (index and (kind == "cpu" or not index.isdigit())):
        p.error(f"--device {device}: expected cpu or cuda[:N]")
    args.device = torch.device(device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch finds no CUDA GPU; use --device cpu")
    args.batch = args.batch or (512 if args.device.type == "cuda" else 32)
    return args


def learning_rate(args, step, progress):
    """Linear warm-up, then cosine decay to a tenth over the run (progress: 0 to 1 of steps or time)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    device, cuda = args.device, args.device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # cuDNN's attention backward fails on this model's shapes (72 tokens, head dim 32) with torch
        # 2.11 on an H200 ("mha_graph.execute ... is_good()"); the flash / efficient kernels train it
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(args.seed)
    spec = dm.default_config()
    model, encoder = dm.build(spec)
    model.to(device).train()
    encoder.to(device).train()
    ema = [copy.deepcopy(model).eval().requires_grad_(False), copy.deepcopy(encoder).eval().requires_grad_(False)]
    params = list(model.parameters()) + list(encoder.parameters())
    ema_params = list(ema[0].parameters()) + list(ema[1].parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    gen = torch.Generator(device).manual_seed(args.seed)
    patch, size = spec["patch"], spec["image_size"]
    img_ids = dm.image_ids(spec, device)
    txt_ids = torch.zeros(spec["max_tokens"], 3, device=device)
    pad = dm.VOCAB.index(dm.PAD)
    n_params = sum(p.numel() for p in params)
    print(f"demo model: {n_params / 1e6:.2f} M parameters, {size}x{size} images, {(size // patch) ** 2} tokens; "
          f"device {device}, batch {args.batch}, up to {args.steps} steps / {args.minutes} min", flush=True)

    budget, t0, step, window, log = args.minutes * 60, time.perf_counter(), 0, [], []
    while step < args.steps and (args.quick or time.perf_counter() - t0 < budget):
        progress = max(step / args.steps, (time.perf_counter() - t0) / budget)
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step, progress)
        with torch.no_grad():
            images, ids = draw(args.batch, size, gen, device)
            drop = torch.rand(args.batch, 1, generator=gen, device=device) < 0.1  # unconditioned, for guidance
            ids = torch.where(drop, pad, ids)  # (not ids[drop] = pad: a boolean index syncs with the GPU)
            x0 = dm.pack(images, patch)
            t = torch.sigmoid(torch.randn(args.batch, generator=gen, device=device))  # logit-normal, as SD3 / Flux
            noise = torch.randn(x0.shape, generator=gen, device=device)
            xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            text, pooled = encoder(ids)
            pred = model(hidden_states=xt, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                         img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        window.append(loss.detach())
        step += 1
        if step % args.log_every == 0:
            mean = torch.stack(window).mean().item()
            window = []
            log.append([step, round(mean, 5)])
            print(f"step {step:6d}  loss {mean:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{time.perf_counter() - t0:6.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    if window:
        log.append([step, round(torch.stack(window).mean().item(), 5)])

    ema_model, ema_encoder = ema
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in dm.state_dict(ema_model, ema_encoder).items()}
    from safetensors.torch import save_file

    weights_path = os.path.join(args.out, "demo_model.safetensors")
    save_file(tensors, weights_path)
    captions = GRID_CAPTIONS[:4] if args.quick else GRID_CAPTIONS
    spec["training"] = {"script": "scripts/train_demo_model.py", "device": str(device), "seed": args.seed,
                        "steps": step, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "ema": args.ema,
                        "seconds": round(seconds), "final_loss": log[-1][1] if log else None, "loss_log": log,
                        "parameters": n_params, "torch": torch.__version__, "grid_captions": captions}
    with open(os.path.join(args.out, "demo_model.json"), "w") as f:
        json.dump(spec, f, indent=2)
        f.write("\n")

    # the grid comes from the saved (bfloat16) weights, as the demo loads them
    model, encoder, spec = dm.load(weights_path, os.path.join(args.out, "demo_model.json"))
    model.to(device)
    encoder.to(device)
    rows = [dm.sample(model, encoder, spec, captions, seed=args.seed + k, device=device, steps=2 if args.quick else None)
            for k in range(2)]
    png = os.path.join(args.out, "demo_model_samples.png")
    write_png(png, grid(torch.cat(rows), columns=len(captions) // 2 if not args.quick else len(captions)))
    print(f"{step} steps in {seconds:.0f} s, final loss {spec['training']['final_loss']}; "
          f"{os.path.getsize(weights_path) / 1e6:.1f} MB of weights in {weights_path}")
    print(f"samples: {png} (two seeds, rows of {len(captions) // 2 if not args.quick else len(captions)}): "
          + "; ".join(captions))
    return spec


if __name__ == "__main__":
    main()
