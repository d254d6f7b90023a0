"""Real English text that ships with Python: the standard library's docstrings.

Used by ``cacheseek demo`` and ``benchmarks/quality.py`` so that neither downloads a data
set. A document is one module's docstring followed by the docstrings of its public classes,
functions and methods, in sorted order. The text depends on the Python version (docstrings
change between releases); ``fingerprint`` names exactly which text was used.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

MODULES = ("argparse", "subprocess", "pathlib", "logging", "unittest", "json", "zipfile", "threading")


def stdlib_document(module_name: str) -> str:
    """The docstrings of ``module_name`` and its public members, as one text."""
    module = importlib.import_module(module_name)
    parts = [f"Module {module_name}\n\n{inspect.getdoc(module) or ''}"]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{module_name}.{name}\n\n{doc}")
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") or not inspect.isfunction(member):
                    continue
                doc = inspect.getdoc(member)
                if doc:
                    parts.append(f"{module_name}.{name}.{attr}\n\n{doc}")
    return "\n\n".join(parts)


def fingerprint(text: str) -> str:
    """A short sha256 of a text, to record which one a result was measured on."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
