"""Refuse cquant checkpoints on diffusers' and transformers' float loading path.

When config.json has no cquant quantization_config (deleted, or replaced by hand), the libraries
never call cquant's quantizer: they load the stored int8 / fp8 codes into float layers (cast to
float values) and drop the scales as unexpected keys, and the model runs on garbage. The one
place both libraries pass through with the checkpoint's files and the quantizer in hand is the
model class's `_load_pretrained_model`, called by from_pretrained once the empty model is built
and before any weight is read:

    diffusers    ModelMixin._load_pretrained_model(model, state_dict, resolved_model_file, ...,
                                                   hf_quantizer=...)            (classmethod)
    transformers PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files,
                                                        load_config)            (staticmethod)

cquant wraps that one method, once the module defining it is imported: it reads the metadata
in each safetensors file's header (no tensor data) and raises a ValueError when a file says it
holds cquant-quantized layers and the quantizer is not cquant's. Everything else passes through
unchanged. A library version that moved this method gets a RegistrationWarning instead, and
loads as it always did.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["install", "check_files", "WRAPPED_MARK"]

# Set on a wrapper, so that wrapping twice is a no-op.
WRAPPED_MARK = "__cquant_float_loading_guard__"


def _is_cquant(hf_quantizer):
    method = getattr(getattr(hf_quantizer, "quantization_config", None), "quant_method", None)
    return str(getattr(method, "value", method)) == "cquant"


def check_files(files, hf_quantizer, model):
    """Raise a ValueError if a safetensors file among `files` holds cquant codes and `hf_quantizer`
    (None, or another library's) is not cquant's."""
    if _is_cquant(hf_quantizer):
        return  # cquant's quantizer checks the files itself
    from ..checkpoint import META_LAYERS, META_TENSORS, read_metadata, stored_layer_names

    for f in files or ():
        if not isinstance(f, str) or not f.endswith(".safetensors"):
            continue
        try:
            meta = read_metadata(f)
        except ValueError:
            continue  # an unreadable file: the library reports it in its own words
        if META_LAYERS not in meta and META_TENSORS not in meta:
            continue
        try:
            layers = stored_layer_names(meta, f)
        except ValueError:
            layers = {"(an unreadable list)": None}
        if not layers:
            continue
        shown = ", ".join(list(layers)[:3]) + (", ..." if len(layers) > 3 else "")
        if hf_quantizer is None:
            why = "its config.json has no cquant quantization_config"
        else:
            method = getattr(hf_quantizer.quantization_config, "quant_method", "?")
            why = f"it is being loaded with the {getattr(method, 'value', method)} quantizer"
        raise ValueError(
            f"{f} holds {len(layers)} cquant-quantized layers ({shown}), but {why}, so "
            f"{type(model).__name__}.from_pretrained would load their int8 / fp8 codes as float weights. Restore the "
            "quantization_config (quant_method 'cquant', with its quantized_layers) that save_pretrained wrote into "
            "config.json, or load the file with cquant.load_quantized(model, path).")


def _wrap(owner, name, files_arg, quantizer_of, kind):
    """Wrap owner.<name> (a classmethod or staticmethod) so that check_files runs before it."""
    raw = owner.__dict__.get(name)
    if not isinstance(raw, kind):
        raise RuntimeError(f"{owner.__qualname__}.{name} is not a {kind.__name__}")
    original = raw.__func__
    if getattr(original, WRAPPED_MARK, False):
        return
    signature = inspect.signature(original)
    missing = {files_arg, "model"} - set(signature.parameters)
    if missing:
        raise RuntimeError(f"{owner.__qualname__}.{name} takes no {', '.join(sorted(missing))} argument")

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        model = bound.arguments.get("model")
        check_files(bound.arguments.get(files_arg), quantizer_of(bound.arguments), model)
        return original(*args, **kwargs)

    setattr(guarded, WRAPPED_MARK, True)
    setattr(owner, name, kind(guarded))


def _diffusers_quantizer(arguments):
    return arguments.get("hf_quantizer")


def _transformers_quantizer(arguments):
    return getattr(arguments.get("load_config"), "hf_quantizer", None)


def install(module_name, module):
    """Wrap the _load_pretrained_model of diffusers.models.modeling_utils or transformers.modeling_utils;
    raises if the library's layout is not the one cquant knows (the caller warns)."""
    if module_name == "diffusers.models.modeling_utils":
        _wrap(module.ModelMixin, "_load_pretrained_model", "resolved_model_file", _diffusers_quantizer, classmethod)
    elif module_name == "transformers.modeling_utils":
        _wrap(module.PreTrainedModel, "_load_pretrained_model", "checkpoint_files", _transformers_quantizer,
              staticmethod)
