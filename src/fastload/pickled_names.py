"""Modules that moved, under their old names, for what was pickled before the move.

A pickle names each class by module and qualified name, and a dataset pickled by an older
fastload (``fastload.stage.FetchConfig`` inside its store's settings) must unpickle in a
newer one (tests/test_fixtures_93b491a.py). Importing an old name here gives the module
that now holds those classes; nothing in fastload imports the old names itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

# old module -> the module whose namespace holds every class pickled under the old name
MOVED = {
    "fastload.stage": "fastload.staging",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module it stands for is imported already


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
