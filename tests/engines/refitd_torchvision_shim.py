"""Installed into .venv-engines and .venv-live (tests/setup_engines.sh, setup_live.sh) with a ``.pth`` line that imports it.

The CUDA torchvision wheel's compiled ops (``torchvision._C``) do not load against the CPU torch of
``.venv``; torchvision then registers fake kernels for ``torchvision::nms`` / ``qnms`` at import time,
which fails because the operators were never defined. This finder defines the two schemas (no
kernels) just before torchvision is first imported, in every process of the venv (vLLM inspects
model classes in subprocesses). Nothing else of torchvision is touched, and torch is imported only
when torchvision is.
"""

import importlib.abc
import sys


class _DefineNmsFirst(importlib.abc.MetaPathFinder):
    lib = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        try:
            torch.ops.torchvision.nms  # noqa: B018 - torchvision's own ops are loaded already
        except (AttributeError, RuntimeError):
            type(self).lib = torch.library.Library("torchvision", "DEF")
            self.lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            self.lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


if not any(type(f).__name__ == "_DefineNmsFirst" for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineNmsFirst())
