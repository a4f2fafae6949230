"""Let diffusers and transformers load a cquant checkpoint before `import cquant`.

A checkpoint saved by cquant names quant_method "cquant" in its config.json. Until cquant is
imported, neither library knows the name: diffusers raised "Unknown quantization type, got
cquant", and transformers logged a warning and loaded the stored int8 / fp8 codes as float
weights. cquant's wheel installs `cquant-autoload.pth` into site-packages, whose one line runs
install() at interpreter start. install() imports nothing beyond the standard library and puts
one finder at the front of sys.meta_path, which answers None at once for every module but
diffusers.quantizers.auto and transformers.quantizers.auto (one set lookup per import). After
either of those executes, the finder puts placeholders under "cquant" in its quantizer tables
(unless cquant registered its own classes already) and removes itself once both are done.

A placeholder imports cquant when the library first uses it (from_dict, or constructing it),
which replaces the placeholders by cquant's classes, and hands the call on: the checkpoint loads
as if cquant had been imported. If cquant cannot be imported or registered, the error says so
and says to `import cquant`. Nothing here can fail the library's import: any error leaves the
tables as they were (the library's own message then applies).
"""

import sys  # the only import at start-up: importlib comes in when a library module is found

_TABLES = {"diffusers.quantizers.auto": ("AUTO_QUANTIZER_MAPPING", "AUTO_QUANTIZATION_CONFIG_MAPPING"),
           "transformers.quantizers.auto": ("AUTO_QUANTIZER_MAPPING", "AUTO_QUANTIZATION_CONFIG_MAPPING")}
QUANT_METHOD = "cquant"


def _real(module_name, table_name):
    """cquant's class in one table, importing cquant (which replaces the placeholders) first."""
    try:
        __import__("cquant")
    except Exception as e:
        raise ImportError(f"this checkpoint is quantized with cquant (quant_method '{QUANT_METHOD}'), and importing "
                          f"cquant failed ({type(e).__name__}: {e}). Install cquant and `import cquant` before "
                          "loading it.") from e
    cls = getattr(sys.modules[module_name], table_name).get(QUANT_METHOD)
    if cls is None or getattr(cls, "_cquant_placeholder", False):
        raise ImportError(f"cquant is installed but did not register its quantizer with {module_name.split('.')[0]} "
                          "(see its RegistrationWarning); `import cquant` and check that warning before loading a "
                          "cquant checkpoint.")
    return cls


def _placeholder(module_name, table_name):
    class Placeholder:
        """Stands for cquant's class until cquant is imported (see _cquant_autoload)."""

        _cquant_placeholder = True

        def __new__(cls, *args, **kwargs):
            return _real(module_name, table_name)(*args, **kwargs)

        @classmethod
        def from_dict(cls, *args, **kwargs):
            return _real(module_name, table_name).from_dict(*args, **kwargs)

    Placeholder.__qualname__ = Placeholder.__name__ = f"CQuantPlaceholder[{table_name}]"
    return Placeholder


def add_placeholders(module):
    """Put placeholders under "cquant" in a library's quantizer tables where nothing is yet."""
    try:
        for table_name in _TABLES[module.__name__]:
            table = getattr(module, table_name, None)
            if isinstance(table, dict) and QUANT_METHOD not in table:
                table[QUANT_METHOD] = _placeholder(module.__name__, table_name)
    except Exception:  # never break the library's import
        pass


class _Finder:
    def __init__(self):
        self.pending = set(_TABLES)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        try:
            import importlib.machinery

            self.pending.discard(fullname)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            if sys.modules.get("cquant") is not None:
                return None  # cquant's own import hooks register its classes
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_add(module):
                exec_module(module)
                add_placeholders(module)

            spec.loader.exec_module = exec_and_add
            return spec
        except Exception:
            return None


def install():
    """Called by cquant-autoload.pth at interpreter start (and harmless to call again)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    for name in _TABLES:
        if name in sys.modules:
            add_placeholders(sys.modules[name])
    finder = _Finder()
    finder.pending -= set(sys.modules)
    if finder.pending:
        sys.meta_path.insert(0, finder)
