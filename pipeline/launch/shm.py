"""Moved to ``pipeline.data.shm`` (beside the reader whose shared memory it cleans); kept for old imports."""

from pipeline.data.shm import SHM_DIR, clean_stale_shared_memory  # noqa: F401
