"""Training inside a rank: the generic loop, its run context, checkpoints, preemption, throughput and distributed
set-up. The rank entrypoint that looks a recipe up and runs this loop is ``pipeline.rank``."""
