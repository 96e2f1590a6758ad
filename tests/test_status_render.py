"""``refitd status``'s table: generations, engines, peers, last steps with phase times, GPUs."""

from __future__ import annotations

from sidecar.cli.serve import render_status


def test_status_table_names_everything_an_operator_asks_about():
    status = {
        "instance": "abc",
        "pid": 7,
        "host": "node1",
        "listen": "ipc:///run/refitd/control.sock",
        "format": "block_fp8",
        "world_size": 2,
        "last_step": 12,
        "live": {"generation": 1, "step": 12},
        "step_in_progress": {"step": 13, "begun": [0], "committed": []},
        "generations": [
            {"generation": 0, "step": 11, "holders": 0, "segment": "seg0", "bytes": 10},
            {"generation": 1, "step": 12, "holders": 2, "segment": "seg1", "bytes": 10},
        ],
        "trainers": [0, 1],
        "readers": ["vllm-tp0"],
        "engines": [
            {
                "name": "vllm-tp0",
                "engine": "vllm",
                "version": "0.25",
                "moe_backend": "CutlassFusedMoE",
                "expert_format": "block_fp8",
            }
        ],
        "peers": {"tcp://10.0.0.2:5555": {"step": 12, "in_flight": None}},
        "history": [
            {"step": 12, "bytes_in": 100, "bytes_out": 50, "seconds": {"receive": 0.5, "total": 1.0}}
        ],
        "gpus": [],
        "gpus_reason": "NVML is not available",
        "arenas": [],
    }
    text = render_status(status)
    assert "step 13 in progress: begun [0], committed []" in text
    assert "seg1 (live)" in text
    assert "engine vllm-tp0: vllm 0.25, MoE backend CutlassFusedMoE, experts block_fp8" in text
    assert "peer tcp://10.0.0.2:5555" in text
    assert "step 12: 100 B in, 50 B out; receive=0.500s total=1.000s" in text
    assert "NVML is not available" in text


def test_status_says_how_staging_is_held():
    base = {
        "instance": "abc",
        "pid": 7,
        "host": "node1",
        "listen": "ipc:///x",
        "format": "block_fp8",
        "world_size": 1,
        "last_step": None,
        "gpus": [],
        "arenas": [],
    }
    ring = {"regions": 4, "region_bytes": 3 << 20, "groups": 48, "held": ["layer 7", "layer 8"]}
    text = render_status({**base, "staging": {"segment": "s", "bytes": 12 << 20, "ring": ring}})
    assert "staging: ring of 4 x 3.0 MiB for 48 layer groups (12.0 MiB); held now: layer 7, layer 8" in text
    text = render_status({**base, "staging": {"segment": "s", "bytes": 5 << 20, "ring": None}})
    assert "staging: whole steps (5.0 MiB)" in text


def test_status_table_counts_revoked_holds_only_when_there_were_some():
    """A daemon that revoked reader holds (after reader_timeout_s) says how many; none, no line."""
    base = {"generations": [], "trainers": [], "readers": [], "engines": [], "history": []}
    base |= {"instance": "abc", "pid": 7, "host": "n", "listen": "ipc://x", "format": "block_fp8"}
    base |= {"world_size": 1, "last_step": 3, "live": None, "step_in_progress": None}
    assert "revoked" not in render_status({**base, "revoked_holds": 0})
    text = render_status({**base, "revoked_holds": 2})
    assert "holds revoked after reader_timeout_s: 2" in text and "torn" in text


def test_status_says_what_the_device_holds_within_its_budget():
    """GPU arenas: the device tier against the budget, and where the generations live; none on shm."""
    base = {"instance": "abc", "pid": 7, "host": "n", "listen": "ipc://x", "format": "block_fp8"}
    base |= {"world_size": 1, "last_step": None, "gpus": [], "arenas": []}
    tiers = {"generations": "shm", "device_bytes": 8 << 20, "device_budget": 4 << 30, "pinned_bytes": 6 << 20}
    text = render_status({**base, "tiers": tiers})
    assert (
        "device memory: 8.0 MiB of a 4096.0 MiB budget; generations in host memory (6.0 MiB page-locked)"
        in text
    )
    text = render_status({**base, "tiers": {**tiers, "generations": "cuda_ipc"}})
    assert "generations in GPU memory" in text
    assert "device memory" not in render_status({**base, "tiers": {**tiers, "device_budget": None}})


def test_status_shows_the_format_parameters_published_and_each_engine_holds():
    """The live plan's format with the parameters that apply to it (INT4 group and scale dtype, NVFP4
    names), and each engine's; none for a format they do not apply to, or a status without them."""
    base = {"generations": [], "trainers": [], "readers": [], "history": [], "gpus": [], "arenas": []}
    base |= {"instance": "abc", "pid": 7, "host": "n", "listen": "ipc://x", "world_size": 1, "last_step": 3}
    int4 = {"int4_group": 128, "int4_scale_dtype": "float32", "nvfp4_names": "modelopt"}
    engine = {"name": "e0", "engine": "vllm", "version": "0.33.0", "moe_backend": "Marlin"}
    text = render_status(
        {
            **base,
            "format": "int4_w4a16",
            "format_params": int4,
            "engines": [{**engine, "expert_format": "int4_w4a16", "format_params": int4}],
        }
    )
    assert "format int4_w4a16 (group 128, float32 scales), world_size 1" in text
    assert "MoE backend Marlin, experts int4_w4a16 (group 128, float32 scales)" in text
    ct = {"int4_group": 32, "int4_scale_dtype": "bfloat16", "nvfp4_names": "compressed_tensors"}
    text = render_status({**base, "format": "nvfp4", "format_params": ct, "engines": []})
    assert "format nvfp4 (compressed_tensors names), world_size 1" in text
    text = render_status({**base, "format": "block_fp8", "format_params": ct | {"nvfp4_names": "modelopt"}})
    assert "format block_fp8, world_size 1" in text
    assert "format int4_w4a16, world_size 1" in render_status(
        {**base, "format": "int4_w4a16"}
    )  # an older daemon
