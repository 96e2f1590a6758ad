"""Formats, the torch reference quantizers, the GPU kernels and the native CPU kernels; imports
nothing else of sidecar."""
