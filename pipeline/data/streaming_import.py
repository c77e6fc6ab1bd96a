"""``import streaming`` without its dataset zoo and without transformers.

mosaicml-streaming's package ``__init__`` imports ``streaming.text``, ``streaming.vision`` and
``streaming.multimodal`` (C4, ImageNet, WebVid... classes), and ``streaming.text`` imports transformers:
about 4 s of the 8 s ``import streaming`` took on 2 cores, for modules the pipeline never uses. ``defer_zoo()`` puts a placeholder for each of the three in ``sys.modules`` first, so
the package's ``import streaming.text as text`` binds the placeholder; the real subpackage is imported the
first time anything reads an attribute of it.

``streaming.base.dataloader`` imports two classes from transformers (``BatchFeature``, ``BatchEncoding``) only
to recognise them in ``StreamingDataLoader._get_batch_size``: about 1.2 s of what is left, in every process
that reads a dataset, for a tabular MLP too. Where transformers is not imported yet, the module is loaded
with those two import lines replaced by stand-ins whose ``isinstance`` asks the real class once transformers is
imported (before that, no object can be an instance of either). If the lines are not found as expected (another
version of streaming), the module is loaded as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ZOO = ("text", "vision", "multimodal")
DATALOADER = "streaming.base.dataloader"
# The import lines replaced, each by a stand-in of the same name: (line, module, class).
TRANSFORMERS_IMPORTS = (
    ("from transformers.feature_extraction_utils import BatchFeature\n", "transformers.feature_extraction_utils",
     "BatchFeature"),
    ("from transformers.tokenization_utils_base import BatchEncoding\n", "transformers.tokenization_utils_base",
     "BatchEncoding"),
)


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


class _ClassOnceImported(type):
    """A stand-in class for ``isinstance``: true only of instances of the real class in ``module``, once
    something has imported that module."""

    def __instancecheck__(cls, obj) -> bool:
        real = cls.real()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub) -> bool:
        real = cls.real()
        return real is not None and issubclass(sub, real)

    def real(cls) -> type | None:
        found = getattr(sys.modules.get(cls.real_module), cls.__name__, None)
        return found if isinstance(found, type) else None


def stand_in(module: str, name: str) -> type:
    return _ClassOnceImported(name, (), {"real_module": module, "__module__": __name__})


class _DataloaderLoader(importlib.machinery.SourceFileLoader):
    """Loads ``streaming.base.dataloader`` with its transformers imports replaced by stand-ins."""

    def source_to_code(self, data, path, *, _optimize=-1):
        source = importlib.util.decode_source(data)
        for line, _, _ in TRANSFORMERS_IMPORTS:
            source = source.replace(line, "", 1)
        return compile(source, path, "exec", dont_inherit=True, optimize=_optimize)

    def exec_module(self, module) -> None:
        for _, real_module, name in TRANSFORMERS_IMPORTS:
            setattr(module, name, stand_in(real_module, name))
        super().exec_module(module)

    def get_code(self, fullname):
        # Compiled from the edited source each time, never from (or into) the module's bytecode cache,
        # which holds the unedited module.
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _WithoutTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != DATALOADER or "transformers" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None
        with open(spec.origin, encoding="utf-8") as source:
            text = source.read()
        if not all(text.count(line) == 1 for line, _, _ in TRANSFORMERS_IMPORTS):
            return None  # another version of the module: loaded as it is
        spec.loader = _DataloaderLoader(fullname, spec.origin)
        return spec


def defer_zoo() -> None:
    """Placeholders for the zoo's subpackages, so that a later ``import streaming`` skips them, and the finder
    that loads ``streaming.base.dataloader`` without transformers; nothing is imported here. Called when
    ``pipeline.data`` is imported, before anything in the pipeline imports streaming; a no-op once streaming
    is imported."""
    if "streaming" in sys.modules:
        return
    for name in ZOO:
        sys.modules.setdefault(f"streaming.{name}", _Deferred(f"streaming.{name}"))
    if not any(isinstance(finder, _WithoutTransformers) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WithoutTransformers())
