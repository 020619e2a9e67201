"""The public surface as it stood at 93b491a: the ``__all__`` of ``fastload``,
``fastload.decode`` and ``fastload.testing`` with each name's signature, and the command
line's subcommands and options. A layout change keeps every one of them; a deliberate API
change updates ``fixtures/api_93b491a.json`` in the same commit and says why.

Regenerate (only for a deliberate change):
``python tests/test_api_snapshot.py > tests/fixtures/api_93b491a.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).parent / "fixtures" / "api_93b491a.json"
MODULES = ("fastload", "fastload.decode", "fastload.testing")


def _describe(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    kind = "class" if inspect.isclass(obj) else type(obj).__name__
    try:
        return f"{kind}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return kind


def _cli() -> dict[str, list[str]]:
    from fastload.cli import build_parser

    parser = build_parser()
    commands: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands[name] = sorted(
                    opt if opt.startswith("-") else f"{opt}"
                    for a in sub._actions
                    for opt in (a.option_strings or [a.dest])
                )
    return commands


def surface() -> dict[str, Any]:
    import importlib

    out: dict[str, Any] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        out[name] = {n: _describe(getattr(module, n)) for n in sorted(module.__all__)}
    out["cli"] = _cli()
    return out


def test_the_public_surface_is_unchanged() -> None:
    expected = json.loads(SNAPSHOT.read_text())
    actual = surface()
    for module in expected:
        assert actual[module] == expected[module], module


if __name__ == "__main__":
    json.dump(surface(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
