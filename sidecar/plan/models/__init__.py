"""The model registry, as data: which tensors are routed experts and what a model's checkpoint holds.

Each supported ``model_type`` is one :class:`ModelSpec` row in :data:`MODELS` (``registry.py``). A row
says how to find the text settings inside a Hugging Face ``config.json`` (Qwen3.5 nests them under
``text_config``), which regexes pick out the routed experts (SPEC §2.1, ``experts.py``), and how to list
every parameter of the checkpoint from the config alone (names, shapes and each tensor's dtype as
Hugging Face writes them: BF16, except the FP32 router ``e_score_correction_bias`` of the DeepSeek-V3
and GLM-4.5 families). The listers live one file per architecture family (``qwen.py``,
``deepseek.py``) on the shared building blocks of ``params.py``.

This package re-exports the names most callers use; the rest are imported from their own module.
"""

from sidecar.plan.models.experts import PER_EXPERT_RE, SLAB_RE, ExpertForm
from sidecar.plan.models.registry import MODELS, ModelSpec, get_model, model_type_of, normalize_hf_config

__all__ = [
    "MODELS",
    "PER_EXPERT_RE",
    "SLAB_RE",
    "ExpertForm",
    "ModelSpec",
    "get_model",
    "model_type_of",
    "normalize_hf_config",
]
