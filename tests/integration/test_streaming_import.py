"""streaming imported without its dataset zoo and without transformers (pipeline/data/streaming_import.py): each
check runs in a fresh interpreter, since the placeholders only matter before streaming is first imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_zoo_is_not_imported_until_used_and_then_is_the_real_one():
    out = _run("""
        import inspect, sys
        import pipeline.data
        from streaming import MDSWriter, StreamingDataset
        import streaming
        zoo = ("streaming.text", "streaming.vision", "streaming.multimodal")
        print("deferred", [type(sys.modules[name]).__name__ for name in zoo])
        print("c4 module", "streaming.text.c4" in sys.modules)
        inspect.getmodule(StreamingDataset)  # walks sys.modules: must load nothing
        print("after inspect", type(sys.modules["streaming.text"]).__name__)
        print("used", streaming.text.StreamingC4.__module__, streaming.vision.StreamingCIFAR10.__name__)
        import streaming.text
        print("now", type(sys.modules["streaming.text"]).__name__, hasattr(sys.modules["streaming.text"], "StreamingPile"))
    """)
    assert "deferred ['_Deferred', '_Deferred', '_Deferred']" in out
    assert "c4 module False" in out
    assert "after inspect _Deferred" in out
    assert "used streaming.text.c4 StreamingCIFAR10" in out
    assert "now module True" in out


def test_without_the_placeholders_streaming_imports_its_zoo():
    # What the placeholders avoid (if upstream stops importing its zoo, the module can go).
    out = _run("""
        import sys
        import streaming
        print("c4 module", "streaming.text.c4" in sys.modules)
    """)
    assert "c4 module True" in out


def test_streaming_is_imported_without_transformers_and_counts_its_batches_the_same():
    # StreamingDataLoader counts the samples of a dict-like batch by its first value: BatchEncoding and
    # BatchFeature (UserDicts, not dicts) must still count so once transformers is imported.
    out = _run("""
        import sys, torch
        import pipeline.data
        from streaming import StreamingDataLoader
        print("transformers imported", "transformers" in sys.modules)
        size = StreamingDataLoader._get_batch_size
        print("sizes", size(None, {"x": [1, 2, 3]}), size(None, torch.ones(4, 2)), size(None, [[1, 2], [3]]))
        from transformers import BatchEncoding, BatchFeature
        print("transformers sizes", size(None, BatchEncoding({"x": [1, 2, 3, 4, 5]})),
              size(None, BatchFeature({"x": [1, 2]})))
        import streaming.base.dataloader as module
        print("stand-ins", isinstance({}, module.BatchEncoding), issubclass(BatchFeature, module.BatchFeature))
    """)
    assert "transformers imported False" in out
    assert "sizes 3 4 2" in out
    assert "transformers sizes 5 2" in out
    assert "stand-ins False True" in out


def test_the_real_classes_where_transformers_is_imported_first_or_the_module_is_not_the_expected_one():
    out = _run("""
        import sys
        import transformers.feature_extraction_utils
        import pipeline.data
        import streaming.base.dataloader as module
        print("real", module.BatchFeature is transformers.feature_extraction_utils.BatchFeature)
    """)
    assert "real True" in out
    out = _run("""
        import sys
        import pipeline.data.streaming_import as edit
        edit.TRANSFORMERS_IMPORTS = (("from transformers.other import Nothing\\n", "transformers.other", "Nothing"),)
        import streaming
        print("loaded as it is", "transformers" in sys.modules)
    """)
    assert "loaded as it is True" in out
