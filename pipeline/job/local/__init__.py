"""The local place (``launch.kind = local``): torchrun as a child of the worker, under a guard process."""
