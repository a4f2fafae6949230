"""Modules named after the function they export (cquant.optimize, cquant.summary, cquant.verify).

`import cquant.optimize` (or any import of the submodule) binds cquant.optimize to the module,
whatever cquant exports under that name, so the module itself must take the call:
cquant.optimize(model) then works however the user imported it."""

import sys
import types


def make_callable(module_name, get_function):
    """Calling module `module_name` calls get_function()(...): get_function returns the function,
    so that it may be imported on first use."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return get_function()(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
