"""A package's names imported on first use (PEP 562), so that importing the package costs nothing.

``megaformer train``'s launching process checks a layout (``megaformer.parallel.layout``) and reads
a checkpoint's names and meta.json (``megaformer.checkpoint.format``) without importing torch (~1.5
CPU seconds a launch): the packages those modules live in must not import torch when they load.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(
    package: str, exports: dict[str, tuple[str, ...]]
) -> tuple[dict[str, str], Callable[[str], object], Callable[[], list[str]]]:
    """``package``'s module ``__getattr__`` and ``__dir__`` for ``exports`` (module -> names; a module may be
    relative to the package), and the module each name comes from."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # found once; later lookups do not come here
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(module_of))

    return module_of, getattr_, dir_
