"""Formats, the torch reference quantizers and the GPU kernels; imports nothing else of sidecar."""
