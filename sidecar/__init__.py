"""refitd: BF16 trainer weights in, versioned FP8 checkpoint-format generations out.

``import sidecar`` works on any machine: GPU kernels and transports load lazily.
"""

from sidecar.numerics.formats import Format

__version__ = "0.1.0"
__all__ = ["Format", "__version__"]
