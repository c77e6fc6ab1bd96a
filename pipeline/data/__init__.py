"""Data preparation: raw sources -> validated, versioned MDS datasets with a manifest."""
