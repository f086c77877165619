"""Split rules, one module per family of primitives.

Importing this package imports every module in it, and each registers its rules with
:func:`memsafe.split.registry.split_rule`: supporting a new primitive is one new module here (or a
line in a family's module), nothing else.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
