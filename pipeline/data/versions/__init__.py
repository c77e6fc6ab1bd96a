"""Published dataset versions and their checks: the manifest, preprocessing and statistics read back
(``manifest``, ``stats``), every file's digest verified where it is read (``integrity``), and versions found by
data interval for a training window (``windows``)."""
