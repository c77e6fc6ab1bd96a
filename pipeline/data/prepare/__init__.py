"""Writing a dataset version from raw sources: the entry (``version``: one pass, converted in parallel, published
atomically), the input's files and work units (``sources``, ``idx``), the plan of every column (``schema``,
``plan``), row validation (``rows``), split assignment (``splits``), recipes' row transforms (``transform``), the
conversion workers (``convert``), the MDS writer (``mds_writer``), publication (``publish``) and publishing a
damaged version again (``republish``)."""
