"""The Ray place (``launch.kind = ray``): each attempt is one Ray job, submitted through the Ray Jobs API, whose
driver runs Ray Train's ``TorchTrainer`` over the same entry a torchrun rank runs."""
