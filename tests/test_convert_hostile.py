"""``refitd convert`` refuses what is broken and never writes outside OUT (issue 31).

Each case runs the real command (``sidecar.cli.main``) on a real BF16 checkpoint directory
(tests/test_convert.py's two shards + index) broken one way: it must exit non-zero with a one-line
message saying what is wrong (no traceback), and leave nothing at OUT that looks like a checkpoint
(nor a temporary directory beside it); where OUT held something, it is as it was. Also: the
progress lines printed when stderr is not a terminal, and ``--quiet``.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sidecar.cli.main import main
from sidecar.cli.progress import Progress
from tests.test_convert import CONFIG, _bf16_dir, _read_dir, _weights

FORMATS = ["block_fp8", "fp8_per_tensor", "mxfp8", "nvfp4", "mxfp4", "int4_w4a16", "bf16"]
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _convert(src: Path, out: Path, *flags: str, fmt: str = "block_fp8") -> int:
    return main(["convert", str(src), str(out), "--format", fmt, "--engine", "vllm", *flags])


def _refused(capsys, out: Path, *expected: str) -> str:
    err = "\n".join(
        line for line in capsys.readouterr().err.splitlines() if " done (" not in line
    )  # progress
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())
    assert not [p.name for p in out.parent.iterdir() if ".refitd-" in p.name]  # no temporary left
    return err


@pytest.fixture
def src(tmp_path):
    return _bf16_dir(tmp_path, _weights(31))


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


# ---- the files against the index (item 4)


def test_a_shard_the_index_lists_that_is_missing_is_refused(src, tmp_path, capsys):
    lost = len([f for f in _index(src)["weight_map"].values() if f == SHARDS[1]])
    (src / SHARDS[1]).unlink()
    out = tmp_path / "out"
    assert _convert(src, out) == 1
    _refused(capsys, out, SHARDS[1], f"{lost} tensors", "not there")


def test_a_shard_the_index_does_not_list_is_refused(src, tmp_path, capsys):
    save_file({"stray.weight": torch.zeros(2, dtype=torch.bfloat16)}, str(src / "extra.safetensors"))
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", "extra.safetensors", "does not list")


def test_a_name_the_index_lists_twice_is_refused(src, tmp_path, capsys):
    text = (src / "model.safetensors.index.json").read_text()
    name = "model.norm.weight"
    file = _index(src)["weight_map"][name]
    text = text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{file}", ', 1)
    (src / "model.safetensors.index.json").write_text(text)
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", name, "twice")


def test_an_index_and_shards_that_disagree_are_refused(src, tmp_path, capsys):
    index = _index(src)
    name = next(n for n, f in index["weight_map"].items() if f == SHARDS[0])
    index["weight_map"][name] = SHARDS[1]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", name, "disagree")


# ---- the tensors against the config (item 4)


@pytest.mark.parametrize(
    "change",
    [
        {"num_hidden_layers": 10**12},
        {"num_experts": 10**9},
        {"num_hidden_layers": 10**12, "num_experts": 10**9},
    ],
)
def test_a_config_claiming_absurd_counts_is_refused_before_any_listing(src, tmp_path, capsys, change):
    (src / "config.json").write_text(json.dumps({**CONFIG, **change}))
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", next(iter(change)), "the checkpoint's tensors hold")


def test_a_checkpoint_lacking_tensors_the_config_describes_is_refused(tmp_path, capsys):
    weights = _weights(32)
    gone = [n for n in weights if ".layers.1.mlp.experts.3." in n]
    for n in gone:
        del weights[n]
    single = tmp_path / "single"
    single.mkdir()
    save_file(weights, str(single / "model.safetensors"))  # no index: only the config can tell
    (single / "config.json").write_text(json.dumps(CONFIG))
    assert _convert(single, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", f"disagree on {len(gone)} tensor(s)", "is missing", gone[0])


def test_tensors_whose_shapes_the_config_does_not_describe_are_refused(src, tmp_path, capsys):
    (src / "config.json").write_text(json.dumps({**CONFIG, "moe_intermediate_size": 64}))
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", "the config says", "experts.0.up_proj.weight")


# ---- corrupt headers (item 5)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    blob = json.dumps(edit(header)).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + length :])


def test_a_header_length_of_2_to_the_40_is_a_one_line_error(src, tmp_path, capsys):
    path = src / SHARDS[0]
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", SHARDS[0], str(1 << 40))


def test_data_offsets_beyond_the_file_are_a_one_line_error(src, tmp_path, capsys):
    def beyond(header):
        name = next(n for n in header if n != "__metadata__")
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + (1 << 30), end + (1 << 30)]
        return header

    _rewrite_header(src / SHARDS[0], beyond)
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", SHARDS[0], "data_offsets")


def test_a_truncated_shard_is_a_one_line_error(src, tmp_path, capsys):
    path = src / SHARDS[1]
    path.write_bytes(path.read_bytes()[:-1000])
    assert _convert(src, tmp_path / "out") == 1
    _refused(capsys, tmp_path / "out", SHARDS[1])


# ---- non-finite passthroughs (item 6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_nan_or_inf_in_a_passthrough_tensor_is_refused_in_every_format(tmp_path, capsys, fmt, name):
    weights = _weights(33)
    weights[name].view(-1)[7] = float("nan") if "norm" in name else float("inf")
    src, out = _bf16_dir(tmp_path, weights), tmp_path / "out"
    assert _convert(src, out, fmt=fmt) == 1
    _refused(capsys, out, name, "NaN or Inf")
    assert not out.exists()


# ---- never outside OUT, never a partial OUT (item 7)


def test_a_config_json_symlink_in_out_is_never_written_through(src, tmp_path, capsys):
    outside = tmp_path / "precious.json"
    outside.write_text("keep me\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to(outside)
    assert _convert(src, out) == 1
    _refused(capsys, out, "already holds", "--force")
    assert outside.read_text() == "keep me\n" and (out / "config.json").is_symlink()
    assert _convert(src, out, "--force") == 0  # replaced whole: the link removed, never followed
    assert outside.read_text() == "keep me\n"
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text())
    assert _read_dir(out)


def test_a_config_json_directory_in_out_leaves_out_as_it_was(src, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)
    assert _convert(src, out) == 1
    _refused(capsys, out, "already holds")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # no shards, no index placed
    assert _convert(src, out, "--force") == 0 and _read_dir(out)


def test_out_itself_a_symlink_is_refused(src, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    assert _convert(src, tmp_path / "out", "--force") == 1
    _refused(capsys, tmp_path / "out", "symlink")
    assert list(real.iterdir()) == []


def test_an_empty_out_directory_is_written(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert _convert(src, out, "--quiet") == 0 and _read_dir(out)


# ---- progress (issue 35)


def test_progress_is_one_line_a_source_shard_when_not_a_terminal(src, tmp_path, capsys):
    assert _convert(src, tmp_path / "out") == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "shard " in line]
    assert len(lines) == 2, lines
    for i, (line, shard) in enumerate(zip(lines, sorted(SHARDS)), start=1):
        assert line.startswith(f"refitd convert: shard {i}/2 done ({shard}): "), line
        assert "tensors written" in line and "/s" in line and " of " in line
    assert "0s left" in lines[-1]


def test_quiet_prints_no_progress(src, tmp_path, capsys):
    assert _convert(src, tmp_path / "out", "--quiet") == 0
    captured = capsys.readouterr()
    assert "shard" not in captured.err and "refitd convert: wrote" in captured.out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_tqdm_bar():
    term = _Terminal()
    with Progress("convert", 1 << 20, units=2, stream=term) as progress:
        progress.advance(1 << 19)
        progress.count("tensors written", 3)
        progress.unit_done("a")
    shown = term.getvalue()
    assert "convert" in shown and "512k" in shown.lower() and "3 tensors written" in shown
    assert "1/2 shards" in shown and "done (" not in shown  # the bar, not the log lines
