"""A pure-torch reference engine that loads published generations: Qwen3.5-MoE (:mod:`.qwen`) and
DeepSeek-V3-style MLA models (:mod:`.mla`), over shared parts (:mod:`.parts`).

``ReferenceEngine.from_config(config)`` picks the engine for the config's model family.
"""

from adapters.reference.mla import MODEL as _MLA_MODEL
from adapters.reference.mla import DeepseekReferenceEngine
from adapters.reference.qwen import (
    ENGINE_VERSION,
    MOE_BACKEND,
    ReferenceEngine,
    next_token_kl,
    sample_inputs,
)

ReferenceEngine.families[_MLA_MODEL] = DeepseekReferenceEngine

__all__ = [
    "ENGINE_VERSION",
    "MOE_BACKEND",
    "DeepseekReferenceEngine",
    "ReferenceEngine",
    "next_token_kl",
    "sample_inputs",
]
