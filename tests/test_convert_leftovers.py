"""``refitd convert`` failing part-way leaves no checkpoint behind (red-team check).

The config is worked out before anything is written, but two failures come only while tensors are
being written: a NaN/Inf in the BF16 checkpoint (found when its unit is quantized, after earlier
shards are on disk) and, with ``--from-daemon``, a generation the daemon rewrote during the copy
(found after every byte was copied). Either way the command must say why and leave the output
directory without shards, index or config.json, so that the fix it names ("convert again") works
in the same directory and no torn copy looks like a finished checkpoint."""

from __future__ import annotations

import pytest

from adapters.base import Generation
from sidecar.cli.convert import convert_generation
from sidecar.cli.main import main
from tests.test_convert import CONFIG, _bf16_dir, _read_dir, _weights


def _written(out):
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_w4a16"])
def test_a_nan_found_mid_write_leaves_no_partial_checkpoint(tmp_path, capsys, fmt):
    weights = _weights(21)
    bad = "model.layers.1.mlp.experts.2.up_proj.weight"  # a late unit: earlier shards already flushed
    weights[bad][3, 5] = float("nan")
    src, out = _bf16_dir(tmp_path, weights), tmp_path / "out"
    argv = ["convert", str(src), str(out), "--format", fmt, "--engine", "vllm", "--max-shard-size", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert bad in err and "NaN or Inf" in err
    assert _written(out) == []
    # fixed, converted again into the same directory
    weights[bad][3, 5] = 0.0
    (tmp_path / "fixed").mkdir()
    src2 = _bf16_dir(tmp_path / "fixed", weights)
    assert main(["convert", str(src2), str(out), "--format", fmt, "--engine", "vllm"]) == 0
    assert _read_dir(out)


def test_a_torn_live_generation_leaves_no_checkpoint(tmp_path, daemons, monkeypatch):
    from sidecar.client.client import RefitClient

    d = daemons(hf_config=CONFIG, format="mxfp4")
    client = RefitClient(d.endpoint, 0, 1, timeout=60)
    try:
        client.push_step(1, _weights(22))
    finally:
        client.close()
    out = tmp_path / "live"
    with monkeypatch.context() as m:
        m.setattr(Generation, "intact", lambda self: False)  # the daemon rewrote it during the copy
        with pytest.raises(ValueError, match="while it was being written"):
            convert_generation(d.endpoint, out, CONFIG, min_step=1, timeout=60, engine="vllm")
    assert _written(out) == []
    convert_generation(d.endpoint, out, CONFIG, min_step=1, timeout=60, engine="vllm")  # again: works
    assert _read_dir(out)
