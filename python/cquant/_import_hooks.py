"""Run a function right after a module is imported, or now if it already is.

cquant registers its torch custom op and its diffusers attention backends this way, so that
neither torch nor diffusers is imported by ``import cquant``, yet both are set up before the
first call (a first call inside torch.compile could not register anything)."""

import importlib.machinery
import sys
import warnings

_pending = {}  # module name -> callbacks


def _run(name, callbacks):
    for fn in callbacks:
        try:
            fn()
        except Exception as e:  # never break the other package's import
            warnings.warn(f"cquant: setting up after importing {name} failed: {e}", RuntimeWarning)


class _Finder:
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_run(module):
            exec_module(module)
            _run(fullname, _pending.pop(fullname, []))

        spec.loader.exec_module = exec_and_run
        return spec


_finder = _Finder()


def after_import(name, fn):
    """Call fn() once `name` has been imported (now, if it has)."""
    if name in sys.modules:
        _run(name, [fn])
        return
    _pending.setdefault(name, []).append(fn)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
