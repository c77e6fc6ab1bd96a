"""The private attributes of other libraries that ``pipeline.private_apis`` calls are still there: an upgrade that
removes one fails here, naming the library, the version installed and the version they were checked against,
rather than deep inside a training run or a worker's start."""

import importlib
from importlib import metadata

import pytest

from pipeline import private_apis


def _resolve(dotted: str):
    """The module or the object inside a module that ``dotted`` names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


@pytest.mark.parametrize("library, dotted, attribute", private_apis.REQUIRED,
                         ids=[f"{dotted}.{attribute}" for _, dotted, attribute in private_apis.REQUIRED])
def test_each_private_attribute_the_pipeline_calls_still_exists(library, dotted, attribute):
    installed = metadata.version(library)
    checked = private_apis.CHECKED[library]
    where = (f"{library} {installed} (pipeline/private_apis.py was checked against {library} {checked}): find the "
             f"public way or the new private name, and update pipeline/private_apis.py")
    try:
        owner = _resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{dotted} is gone in {where} ({type(exc).__name__}: {exc})")
    if not callable(getattr(owner, attribute, None)):
        pytest.fail(f"{dotted} has no callable {attribute} in {where}")


def test_every_library_named_has_a_checked_version():
    assert {library for library, _, _ in private_apis.REQUIRED} == set(private_apis.CHECKED)
