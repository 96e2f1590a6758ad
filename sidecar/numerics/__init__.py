"""Formats, the torch reference quantizers, the GPU kernels and the native CPU kernels; imports
nothing else of sidecar but its environment knobs (sidecar.config.environment: NativeBuild, TRITON_INTERPRET),
read where refitd reads its environment."""
