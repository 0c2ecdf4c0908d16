"""A package's public names, imported on first use (PEP 562), so that importing one part does not load the rest."""

from __future__ import annotations

import importlib
import sys
from typing import Any, List, Mapping


class LazyExports:
    """Resolves a package's ``__getattr__`` from a map of each public name to the module that defines it."""

    def __init__(self, package: str, exports: Mapping[str, str]) -> None:
        self.package = package
        self.exports = dict(exports)

    def get(self, name: str) -> Any:
        """The named attribute, imported from its module and kept in the package for the next lookup."""
        module = self.exports.get(name)
        if module is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[self.package], name, value)
        return value

    def names(self) -> List[str]:
        """What ``dir(package)`` lists: what is loaded already and every lazy name."""
        return sorted(set(vars(sys.modules[self.package])) | set(self.exports))
