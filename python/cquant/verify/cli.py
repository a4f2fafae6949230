"""`cquant verify`: one forward of a model from cquant.bench's registry (or a diffusers transformer
from the hub or a local directory), every linear layer measured by cquant.verify.

    cquant verify --model flux-dev --scheme fp8dqrow --out report.json
    cquant verify --model flux-dev --tiny --candidates int4wo,fp8dqrow,int8wo --floor 30 --mapping-out m.json
    cquant verify --model black-forest-labs/FLUX.1-schnell --candidates fp8dqrow,int8wo --floor 35

--scheme quantizes the model (cquant.quantize_) and measures it against a copy of its float
weights; --candidates tries each scheme on every float layer and, with --floor, suggests the
cheapest per layer (a quantize_ mapping, --mapping-out). Both may be given together.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

__all__ = ["main", "parse_args"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="cquant verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a cquant.bench.models name, a hub id or a local directory of a "
                   "diffusers transformer (or of a pipeline with a transformer/ subfolder)")
    p.add_argument("--tiny", action="store_true", help="the registry's tiny variant (CPU-fast) and small inputs")
    p.add_argument("--scheme", help="quantize the model with this scheme and measure it against its float weights")
    p.add_argument("--candidates", help="comma-separated schemes to try on every float layer")
    p.add_argument("--floor", type=float, help="suggest per layer the cheapest candidate with SQNR >= FLOOR dB")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when usable, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="the model's dtype (default: bfloat16 on CUDA, float32 on the CPU, where torch's bfloat16 "
                   "matmuls are slow)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the inputs (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the whole result as JSON here")
    p.add_argument("--mapping-out", help="write the suggested quantize_ mapping as JSON here (needs --floor)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of text")
    p.add_argument("--top", type=int, help="print only the TOP worst layers")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if args.top is not None and args.top < 1:
        p.error(f"--top must be >= 1, got {args.top}")
    if args.floor is not None and not math.isfinite(args.floor):
        p.error(f"--floor must be a finite number of dB, got {args.floor}")
    from ..demo import check_output, comma_list

    for option, path in (("--out", args.out), ("--mapping-out", args.mapping_out)):
        if path is not None:
            check_output(p, option, path)
    from ..schemes import scheme_names

    # checked here, not after the model has been built or downloaded
    try:
        if args.scheme is not None:
            args.scheme = scheme_names(args.scheme, f"--scheme {args.scheme!r}")[0]
        args.candidates = [] if args.candidates is None else scheme_names(comma_list(
            args.candidates, "--candidates", "scheme", "comma-separated scheme names"),
            f"--candidates {args.candidates!r}")
    except ValueError as e:
        p.error(str(e))
    if not args.scheme and not args.candidates:
        p.error("give --scheme (measure a quantized model) or --candidates (try schemes on the float model)")
    if args.floor is not None and not args.candidates:
        p.error("--floor needs --candidates (the schemes to choose from)")
    if args.mapping_out and args.floor is None:
        p.error("--mapping-out needs --floor and --candidates (it writes the suggestion)")
    return args


def _exit(msg):
    sys.exit(f"cquant verify: {msg}")


def _float_weights(model, device):
    """A state_dict of the linear layers' weights and biases, copied (kept on `device` while it has
    room for them, else on the CPU)."""
    import torch

    tensors = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            tensors[f"{name}.weight"] = mod.weight
            if mod.bias is not None:
                tensors[f"{name}.bias"] = mod.bias
    where = device
    if device.type == "cuda":
        need = sum(t.nbytes for t in tensors.values())
        free, _ = torch.cuda.mem_get_info(device)
        where = device if free > 2 * need else torch.device("cpu")
    return {k: t.detach().to(where, copy=True) for k, t in tensors.items()}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from ..demo import best_device, check_device
    from ..quantize import quantize_
    from .runner import verify

    try:
        device = torch.device(args.device or best_device())
    except RuntimeError as e:
        _exit(f"--device {args.device}: {e}")
    check_device(device, "cquant verify")
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, args.dtype)
    from ..bench import models

    if args.model in models.MODEL_NAMES:
        name = args.model
        model = models.build_transformer(name, dtype=dtype, device=device, tiny=args.tiny, seed=args.seed)
    else:
        try:
            model = models.load_pretrained(args.model, dtype=dtype, device=device)
        except ValueError as e:
            _exit(f"--model {args.model!r}: not a registry name ({', '.join(models.MODEL_NAMES)}); {e}")
        name = args.model
    try:
        inputs = models.make_inputs(name, model, batch=args.batch, dtype=dtype, device=device, tiny=args.tiny,
                                    seed=args.seed)
    except ValueError as e:
        _exit(f"--model {args.model!r}: {e}")
    reference = None
    if args.scheme:
        reference = _float_weights(model, device)
        quantize_(model, args.scheme)
    result = verify(model, inputs, reference=reference, schemes=args.candidates or None, floor_db=args.floor)
    print(f"cquant verify: {args.model}{' (tiny)' if args.tiny else ''}, {args.dtype} on {device}"
          + (f", quantized with {args.scheme}" if args.scheme else ""))
    print(result.table("markdown" if args.markdown else "text", limit=args.top))
    if args.out:
        result.to_json(args.out)
        print(f"result written to {args.out}")
    if args.mapping_out:
        result.save_mapping(args.mapping_out)
        print(f"mapping written to {args.mapping_out} (cquant.verify.load_mapping reads it for cquant.quantize_)")
    return 0
