"""streaming imported without its dataset zoo (pipeline/data/streaming_import.py): each check runs in a fresh
interpreter, since the placeholders only matter before streaming is first imported."""

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
