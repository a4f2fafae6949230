"""Command line of cquant: `python -m cquant demo [...]` (also installed as `cquant demo`)."""

import os
import sys

COMMANDS = {"demo": "run a small trained Flux model (or --model) in float and in each scheme; memory, latency, SQNR, PSNR",
            "verify": "run a model once, measure every linear layer (shapes, calls, SQNR); suggest schemes per layer",
            "bench": "measure a grid of schemes and toggles (memory, latency, quality); write JSONL, tables, plots",
            "info": "what this cquant was built with and what runs on the GPUs here (for bug reports)"}


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:  # `cquant info | head`: the reader has gone; no traceback, and none at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = ["usage: cquant <command> [options]", "", "commands:"]
        lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
        lines += ["", "`cquant <command> --help` describes a command's options."]
        print("\n".join(lines), file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ncquant: unknown command {argv[0]!r}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return _run(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (bench's --out keeps every finished cell)
        resume = " (rerun with the same --out to resume)" if argv[0] == "bench" and "--out" in " ".join(argv) else ""
        print(f"\ncquant {argv[0]}: interrupted{resume}", file=sys.stderr)
        return 130


def _run(command, argv):
    if command == "demo":
        from .demo import main as demo

        demo(argv)
        return 0
    if command == "info":
        from .info import main as info

        return info(argv)
    if command == "verify":
        from .verify.cli import main as verify

        return verify(argv)
    from .bench.cli import main as bench

    return bench(argv)


if __name__ == "__main__":
    sys.exit(main())
