"""``refitd demo`` (what ``make demo`` runs) end to end: daemon, two trainers, a reference engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fmt", "regions"), [("mxfp8", 0), ("block_fp8", 2)])
def test_demo_verifies_and_reports_kl(fmt, regions):
    """Whole-step staging, and a ring of two regions (what GPU arenas use, with four)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.cli.main",
            "demo",
            "--format",
            fmt,
            "--steps",
            "2",
            "--layers",
            "2",
            "--staging-regions",
            str(regions),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2 and summary["format"] == fmt
    assert summary["bytes_published"] < summary["bytes_in"]
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"]
        assert 0 < row["kl"] < 0.05
        assert set(row["seconds"]) >= {"receive", "quantize", "publish", "total", "engine_load"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8", "fp8_per_tensor", "bf16"])
def test_deepseek_v3_demo_verifies_in_every_format(fmt):
    """A DeepSeek-V3-shaped model (MLA, a dense first layer, shared experts, the FP32 router bias, an
    MTP layer with its own embedding and head, block-FP8 linears from its quantization_config):
    every generation byte for byte through the daemon into the MLA reference engine, KL per step."""
    argv = ["--model", "deepseek_v3", "--format", fmt, "--steps", "2", "--layers", "2", "--experts", "4"]
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2 and summary["format"] == fmt
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"]
        assert (row["kl"] == 0.0) if fmt == "bf16" else (0 < row["kl"] < 0.05)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4_w4a16"])
def test_demo_verifies_in_the_four_bit_formats(fmt):
    """The 4-bit formats end to end: packed experts through the daemon, byte for byte into the
    reference engine, which decodes them; KL per step against BF16 (about 4e-4 here)."""
    argv = ["demo", "--format", fmt, "--steps", "2", "--layers", "2", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli.main", *argv], capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] and summary["steps"] == 2 and summary["format"] == fmt
    assert summary["bytes_published"] < 0.6 * summary["bytes_in"]
    for row in summary["per_step"]:
        assert row["published_exact"] and row["engine_exact"]
        assert 0 < row["kl"] < 0.05


@pytest.mark.timeout(120)
def test_a_model_the_reference_engine_cannot_hold_is_refused_before_anything_starts():
    """The MLA reference engine holds FP8 or BF16 experts: ``--model deepseek_v3 --format nvfp4`` is
    a usage error naming why, at once (it used to wait 120 s for an engine that had died)."""
    argv = ["demo", "--model", "deepseek_v3", "--format", "nvfp4", "--steps", "1", "--layers", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli.main", *argv], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "holds FP8 or BF16 experts, not nvfp4" in out.stderr


class _Exited:
    """A process that has already exited (what ``multiprocessing`` reports for a dead engine)."""

    exitcode = 1

    def is_alive(self) -> bool:
        return False


def test_waiting_for_an_engine_that_exited_fails_at_once_naming_its_exit_code():
    import threading

    from sidecar.cli.demo.colocated import wait_attached

    with pytest.raises(RuntimeError, match="the reference engine exited with code 1 before attaching"):
        wait_attached(threading.Event(), _Exited(), "the reference engine", timeout=60)
