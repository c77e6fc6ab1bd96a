"""The published dataset layout under the names the training code has imported from here.

Preparation lives in ``pipeline.data.prep`` (every source format), reading in ``pipeline.data.reading``.
"""

from pipeline.data.prep import MANIFEST, PREPROCESSING, prepare, read_manifest, read_preprocessing  # noqa: F401
from pipeline.data.reading import load_split  # noqa: F401
