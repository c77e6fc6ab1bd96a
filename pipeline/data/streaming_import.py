"""``import streaming`` without its dataset zoo.

mosaicml-streaming's package ``__init__`` imports ``streaming.text``, ``streaming.vision`` and
``streaming.multimodal`` (C4, ImageNet, WebVid... classes), and ``streaming.text`` imports transformers:
about 4 s of the 8 s ``import streaming`` takes on 2 cores (``bench/latency.py`` prints both), for modules
the pipeline never uses. ``defer_zoo()`` puts a placeholder for each of the three in ``sys.modules`` first, so
the package's ``import streaming.text as text`` binds the placeholder; the real subpackage is imported the
first time anything reads an attribute of it. (``streaming.base.dataloader`` still imports two classes from
transformers, about 1.2 s, which only a change upstream removes.)
"""

from __future__ import annotations

import importlib
import sys
import types

ZOO = ("text", "vision", "multimodal")


class _Deferred(types.ModuleType):
    """Stands in for ``streaming.<name>`` until an attribute of it is read."""

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):  # introspection (inspect walks sys.modules) loads nothing
            raise AttributeError(attr)
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)  # now the real one, in sys.modules and on the parent
        return getattr(real, attr)


def defer_zoo() -> None:
    """Placeholders for the zoo's subpackages, so that a later ``import streaming`` skips them; nothing is
    imported here. Called when ``pipeline.data`` is imported, before anything in the pipeline imports
    streaming; a no-op once streaming is imported."""
    if "streaming" in sys.modules:
        return
    for name in ZOO:
        sys.modules.setdefault(f"streaming.{name}", _Deferred(f"streaming.{name}"))
