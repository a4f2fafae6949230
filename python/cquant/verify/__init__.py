"""cquant.verify: run a model or pipeline once and measure every linear layer on its real inputs.

    result = cquant.verify(pipe, lambda: pipe("a prompt", num_inference_steps=4))
    result = cquant.verify(qmodel, inputs, reference=float_model)           # weight error included
    result = cquant.verify(float_model, inputs, schemes=["fp8dqrow", "int8wo", "int4wo"], floor_db=30)
    print(result)                       # worst layers first; result.suggestion is a quantize_ mapping
    cquant.quantize_(float_model, result.suggestion)

The same from a shell: `cquant verify --help`. Layout: targets (which modules are hooked, under
which names, against which weights), probe (the forward hook of one layer), report (VerifyResult,
the suggestion, mapping files), runner (verify(): the hooked run, built on those three) and cli
(`cquant verify`, which calls the runner). Each imports only modules listed before it.

cquant.verify is this package and is also callable: cquant.verify(model, call, ...) is
cquant.verify.verify(model, call, ...). Both spellings are public (cquant.verify.load_mapping
too), and the import system binds cquant.verify to the package whatever cquant exports under
that name, so the package itself takes the call.
"""

from .. import _callable_module

__all__ = ["verify", "VerifyResult", "LayerResult", "ShapeCount", "load_mapping", "save_mapping", "main"]

# public name -> the module that defines it (imported on first use: `cquant verify --help` and
# `import cquant.verify.report` need no torch model code)
_HOMES = {"verify": "runner", "VerifyResult": "report", "LayerResult": "report", "ShapeCount": "report",
          "load_mapping": "report", "save_mapping": "report", "main": "cli"}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'cquant.verify' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _runner_verify():
    from .runner import verify

    return verify


_callable_module.make_callable(__name__, _runner_verify)
