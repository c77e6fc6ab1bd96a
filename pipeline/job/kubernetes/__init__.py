"""The Kubernetes place (``launch.kind = kubernetes``): an indexed Job of torchrun pods and a headless Service."""
