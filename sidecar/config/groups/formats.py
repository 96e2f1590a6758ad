"""What the daemon publishes: the model, the routed experts' format and its parameters, what stays BF16.

``model_type`` is a registry key (``qwen3_5_moe``, ``qwen3_moe``); ``hf_config`` a Hugging Face
config.json (or the folder holding it) from which the plan and the arena sizes are made at start.
``format`` is the routed experts' target format (docs/spec.md); ``int4_group``, ``int4_scale_dtype``
and ``nvfp4_names`` are its parameters until an engine attaches (docs/formats.md). The layer counts
and ``ignore_patterns`` (fnmatch over module names) keep routed experts in BF16; without
``num_hidden_layers`` the count comes from the config or the tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sidecar.config import values as v
from sidecar.config.groups.common import OPT_COUNT as _OPT_COUNT
from sidecar.config.groups.common import OPT_TEXT as _OPT_TEXT
from sidecar.config.values import knob
from sidecar.numerics.formats import INT4_GROUP, Format, FormatParams, Nvfp4Names

_FORMATS = ", ".join(f.value for f in Format)


@dataclass(frozen=True, kw_only=True)
class FormatSettings:
    """What the daemon publishes: the model, the routed experts' format and its parameters, what stays BF16. (one group of :class:`sidecar.config.settings.DaemonConfig`)"""

    TITLE: ClassVar[str] = "formats"

    model_type: str | None = field(
        default=None,
        metadata=knob(
            "--model-type",
            _OPT_TEXT,
            "TYPE",
            "model family: qwen3_5_moe, qwen3_moe",
            example='"qwen3_5_moe"',
            commented=False,
        ),
    )
    hf_config: Path | None = field(
        default=None,
        metadata=knob(
            "--hf-config",
            v.optional(v.hf_config_path),
            "PATH",
            "Hugging Face config.json",
            is_path=True,
            example='"/models/qwen3.5-35b-a3b/config.json"',
        ),
    )
    format: Format = field(
        default=Format.BLOCK_FP8,
        metadata=knob("--format", v.fmt, "FMT", f"routed experts' format: {_FORMATS}", note=_FORMATS),
    )
    #: the format's parameters for a plan made before any engine attaches (and for what a forwarder
    #: sends to engines on other nodes): an engine's manifest decides at attach (SPEC §1.7, §2.3)
    int4_group: int = field(
        default=INT4_GROUP,
        metadata=knob(
            "--int4-group",
            v.count,
            "G",
            "int4_w4a16 group size along K (an attached engine's manifest decides)",
            note="32, 64 or 128; an attached engine's manifest decides",
        ),
    )
    int4_scale_dtype: str = field(
        default="bfloat16",
        metadata=knob(
            "--int4-scale-dtype",
            v.text,
            "DTYPE",
            "int4_w4a16 scale dtype: bfloat16 or float32 (an attached engine's manifest decides)",
            note="bfloat16 or float32; an attached engine's manifest decides",
        ),
    )
    nvfp4_names: Nvfp4Names = field(
        default=Nvfp4Names.MODELOPT,
        metadata=knob(
            "--nvfp4-names",
            v.choice(Nvfp4Names),
            "NAMES",
            "nvfp4 names: modelopt or compressed_tensors (an attached engine's manifest decides)",
            note="modelopt or compressed_tensors; an attached engine's manifest decides",
        ),
    )
    num_hidden_layers: int | None = field(
        default=None,
        metadata=knob(
            "--num-hidden-layers",
            _OPT_COUNT,
            "N",
            "decoder layers (default: inferred)",
            example="40",
            note="default: from hf_config or the tensor names",
        ),
    )
    num_first_layers_in_bf16: int = field(
        default=0, metadata=knob("--first-bf16", v.count, "N", "first N layers' experts stay BF16")
    )
    num_last_layers_in_bf16: int = field(
        default=0, metadata=knob("--last-bf16", v.count, "N", "last N layers' experts stay BF16")
    )
    ignore_patterns: tuple[str, ...] = field(
        default=(),
        metadata=knob(
            "--ignore",
            v.patterns,
            "PATTERN",
            "fnmatch of modules kept BF16 (repeatable)",
            note='fnmatch over module names, e.g. ["*.layers.0.mlp"]',
        ),
    )

    @property
    def format_params(self) -> FormatParams:
        """The format's parameters these settings give (``int4_group``, ``int4_scale_dtype``,
        ``nvfp4_names``); the config checks made sure they are valid for ``format``."""
        return FormatParams(
            int4_group=self.int4_group, int4_scale_dtype=self.int4_scale_dtype, nvfp4_names=self.nvfp4_names
        )
