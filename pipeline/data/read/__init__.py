"""Reading published versions for training and evaluation: one or more versions as one dataset with the window's
preprocessing (``training_data``), each rank's share of a split in whole batches, resumable (``loader``, reading ahead on a thread: ``ahead``), over
memory-mapped MDS shards decoded by column (``shards``); Ray Data as the reader under Ray Train (``ray_data``);
tabular encoding for the recipes that need it (``tabular``)."""
