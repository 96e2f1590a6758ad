"""DaemonConfig: sources and their precedence, validation messages, and the runtime directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import stat
import sys
from pathlib import Path

import pytest

from sidecar.config.environment import NativeBuild, triton_interpret_env
from sidecar.config.example import EXAMPLE_TOML, example_toml
from sidecar.config.settings import (
    CONFIG_ENV,
    EXIT_CONFIG,
    MAX_IPC_PATH_BYTES,
    NON_SETTING_ENV,
    ConfigError,
    DaemonConfig,
    LogFormat,
    LogLevel,
    default_runtime_dir,
    is_loopback_host,
    parse_size,
    prepare_runtime_dir,
)
from sidecar.config.sources import (
    Setting,
    add_serve_arguments,
    args_to_values,
    config_from_args,
    config_from_sources,
    env_to_values,
    file_to_values,
    load_config,
)
from sidecar.numerics.formats import Format

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

GiB, MiB = 2**30, 2**20


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment whose default runtime_dir is inside the test's temp dir."""
    return {"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [str(p) for p in excinfo.value.problems]


# --------------------------------------------------------------------------------------------------
# defaults


def test_defaults(tmp_path: Path) -> None:
    """With only a runtime_dir, every default is the documented one and the endpoint is ipc in it."""
    c = DaemonConfig(runtime_dir=tmp_path)
    assert c.listen == f"ipc://{tmp_path}/control.sock"
    assert c.format is Format.BLOCK_FP8
    assert (c.world_size, c.num_first_layers_in_bf16, c.num_last_layers_in_bf16) == (1, 0, 0)
    assert (c.staging_bytes, c.publish_bytes, c.model_type, c.hf_config) == (None, None, None, None)
    assert (c.step_timeout_s, c.rank_timeout_s, c.heartbeat_interval_s) == (300.0, 10.0, 1.0)
    assert (c.reader_timeout_s, c.shutdown_timeout_s) == (30.0, 10.0)
    assert (c.max_frame_bytes, c.max_header_bytes, c.credit_frames) == (64 * MiB, 16 * MiB, 8)
    assert (c.log_format, c.log_level) == (LogFormat.TEXT, LogLevel.INFO)
    assert LogLevel.WARNING.level == 30


def test_exit_config_is_ex_config() -> None:
    assert EXIT_CONFIG == 78


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"RUNTIME_DIRECTORY": "/run/refitd", "XDG_RUNTIME_DIR": "/run/user/7"}, "/run/refitd"),
        ({"RUNTIME_DIRECTORY": "/run/a:/run/b"}, "/run/a"),
        ({"XDG_RUNTIME_DIR": "/run/user/7"}, "/run/user/7/refitd"),
        ({"XDG_RUNTIME_DIR": "relative/dir", "RUNTIME_DIRECTORY": ""}, "/tmp/refitd-7"),
        ({}, "/tmp/refitd-7"),
    ],
)
def test_default_runtime_dir(environ: dict[str, str], expected: str) -> None:
    """systemd's RuntimeDirectory wins, then XDG_RUNTIME_DIR/refitd, then a per-uid dir in /tmp."""
    assert default_runtime_dir(environ, uid=7) == Path(expected)


def test_default_listen_is_never_tcp(env: dict[str, str]) -> None:
    """Whatever the sources say about other settings, a listen nobody gave is ipc in runtime_dir."""
    c = load_config(["--world-size", "4"], env={**env, "REFITD_MODEL_TYPE": "qwen3_moe"})
    assert c.listen == f"ipc://{env['XDG_RUNTIME_DIR']}/refitd/control.sock"
    assert load_config(["--listen", "tcp://127.0.0.1:5555"], env=env).listen == "tcp://127.0.0.1:5555"


# --------------------------------------------------------------------------------------------------
# sources and precedence


def test_precedence_file_then_env_then_flags(tmp_path: Path, env: dict[str, str]) -> None:
    """Each source overrides only what it names: flags > REFITD_* > file > default."""
    path = write(tmp_path / "refitd.toml", "world_size = 2\nstep_timeout_s = 60\ncredit_frames = 3\n")
    env = {**env, CONFIG_ENV: str(path), "REFITD_WORLD_SIZE": "4", "REFITD_STEP_TIMEOUT_S": "90"}
    c = load_config(["--world-size", "8"], env=env)
    assert (c.world_size, c.step_timeout_s, c.credit_frames, c.rank_timeout_s) == (8, 90.0, 3, 10.0)


def test_config_flag_beats_config_env_and_file_argument(tmp_path: Path, env: dict[str, str]) -> None:
    a = write(tmp_path / "a.toml", "world_size = 2\n")
    b = write(tmp_path / "b.toml", "world_size = 3\n")
    c = write(tmp_path / "c.toml", "world_size = 5\n")
    assert load_config([], env=env, file=c).world_size == 5
    assert load_config([], env={**env, CONFIG_ENV: str(b)}, file=c).world_size == 3
    assert load_config(["--config", str(a)], env={**env, CONFIG_ENV: str(b)}, file=c).world_size == 2


def test_zero_is_a_value_not_unset(tmp_path: Path, env: dict[str, str]) -> None:
    """A 0 from a later source replaces the earlier value; a 0 size is refused, not read as 'auto'."""
    path = write(tmp_path / "r.toml", "num_first_layers_in_bf16 = 2\nnum_last_layers_in_bf16 = 3\n")
    env = {**env, CONFIG_ENV: str(path), "REFITD_NUM_LAST_LAYERS_IN_BF16": "0"}
    c = load_config(["--first-bf16", "0"], env=env)
    assert (c.num_first_layers_in_bf16, c.num_last_layers_in_bf16) == (0, 0)
    with pytest.raises(ConfigError, match=r"staging_bytes = 0: too small.*\(from flag --staging-bytes\)"):
        load_config(["--staging-bytes", "0"], env=env)


def test_flag_defaults_are_none() -> None:
    """Every flag defaults to None, so 'not given' differs from 0; --ignore repeats."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert {k: v for k, v in vars(args).items() if v is not None} == {}
    assert args_to_values(args) == {}
    args = parser.parse_args(["--ignore", "a*", "--ignore", "b", "--first-bf16", "0"])
    assert args_to_values(args)["ignore_patterns"] == Setting(["a*", "b"], "flag --ignore")
    assert config_from_args(args, {"XDG_RUNTIME_DIR": "/run/user/1"}).ignore_patterns == ("a*", "b")


def test_env_to_values() -> None:
    """REFITD_<FIELD> maps to the field; lists are comma-separated; other variables are ignored."""
    values = env_to_values(
        {"REFITD_WORLD_SIZE": "4", "REFITD_IGNORE_PATTERNS": "a,b", "REFITD_CONFIG": "/x", "HOME": "/root"}
    )
    assert values == {
        "world_size": Setting("4", "environment variable REFITD_WORLD_SIZE"),
        "ignore_patterns": Setting("a,b", "environment variable REFITD_IGNORE_PATTERNS"),
    }
    c = config_from_sources(values, env={"XDG_RUNTIME_DIR": "/run/user/1"})
    assert (c.world_size, c.ignore_patterns) == (4, ("a", "b"))


def test_relative_paths_in_file_are_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    write(tmp_path / "etc" / "config.json", "{}")
    path = write(tmp_path / "etc" / "r.toml", 'runtime_dir = "run"\nhf_config = "config.json"\n')
    c = config_from_sources(file_to_values(path), env={})
    assert (c.runtime_dir, c.hf_config) == (tmp_path / "etc" / "run", tmp_path / "etc" / "config.json")


def test_minimal_toml_file(tmp_path: Path) -> None:
    """The smallest useful file: a model, a format and the rank count."""
    path = write(tmp_path / "r.toml", 'model_type = "qwen3_moe"\nformat = "mxfp8"\nworld_size = 8\n')
    c = config_from_sources(file_to_values(path), env={"RUNTIME_DIRECTORY": str(tmp_path / "run")})
    assert (c.model_type, c.format, c.world_size) == ("qwen3_moe", Format.MXFP8, 8)
    assert c.runtime_dir == tmp_path / "run"


def test_example_toml_parses_and_names_every_field(tmp_path: Path) -> None:
    """EXAMPLE_TOML loads as given and, comments included, mentions every setting."""
    c = config_from_sources(file_to_values(write(tmp_path / "r.toml", EXAMPLE_TOML)), env={})
    assert c.model_type == "qwen3_5_moe"
    uncommented = EXAMPLE_TOML.replace("# ", "")
    for field in dataclasses.fields(DaemonConfig):
        assert f"\n{field.name} = " in uncommented, field.name


def test_every_setting_is_declared_once_with_its_field() -> None:
    """The field carries everything: a flag, a converter, help; the flags and the example file are
    made from it (so a new field cannot be forgotten in either)."""
    flags = set()
    for field in dataclasses.fields(DaemonConfig):
        knob = field.metadata["knob"]
        assert knob.flag.startswith("--") and knob.help and callable(knob.convert), field.name
        flags.add(knob.flag)
    assert len(flags) == len(dataclasses.fields(DaemonConfig))  # no flag declared twice


def test_example_toml_round_trips(tmp_path: Path) -> None:
    """The generated example loads; a config written back out with example_toml(config) loads to
    the same config, the values that differ from the defaults included."""
    first = config_from_sources(file_to_values(write(tmp_path / "a.toml", EXAMPLE_TOML)), env={})
    changed = first.replace(
        world_size=8,
        format=Format.MXFP8,
        arena="cuda",
        staging_regions=2,
        ignore_patterns=("*.layers.0.mlp",),
        max_frame_bytes=128 * 2**20,
        step_timeout_s=2.5,
        drain="finish",
    )
    again = config_from_sources(file_to_values(write(tmp_path / "b.toml", example_toml(changed))), env={})
    assert again == changed and again.to_dict() == changed.to_dict()
    assert 'arena = "cuda"' in example_toml(changed)  # the config's word, not the wire's cuda_ipc


# --------------------------------------------------------------------------------------------------
# conversions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("2GiB", 2 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5G", 3 * GiB // 2),
        ("4 KiB", 4096),
        ("1k", 1024),
        ("3M", 3 * MiB),
        ("0", 0),
        (2.0e9, 2_000_000_000),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2GB", "ambiguous: write 2GiB"),
        ("lots", "expected a size"),
        ("1.3K", "not a whole number"),
        ("-1", "expected a size"),
        ("2PiB", "unknown unit"),
        (True, "expected a size"),
    ],
)
def test_parse_size_refuses(text: str | bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text)


def test_human_sizes_from_every_source(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path / "r.toml", 'publish_bytes = "512MiB"\nmax_frame_bytes = 1048576\n')
    env = {**env, CONFIG_ENV: str(path), "REFITD_STAGING_BYTES": "2GiB"}
    c = load_config(["--max-header-bytes", "1.5K"], env=env)
    assert (c.staging_bytes, c.publish_bytes, c.max_frame_bytes, c.max_header_bytes) == (
        2 * GiB,
        512 * MiB,
        MiB,
        1536,
    )
    assert load_config(["--staging-bytes", "auto"], env=env).staging_bytes is None


def test_strings_converted_once(tmp_path: Path) -> None:
    """Format and log settings given as strings are stored as enums; paths as Paths."""
    c = DaemonConfig(runtime_dir=str(tmp_path), format="FP8-per-tensor", log_format="JSON", log_level="debug")
    assert (c.format, c.log_format, c.log_level) == (Format.FP8_PER_TENSOR, LogFormat.JSON, LogLevel.DEBUG)
    assert c.runtime_dir == tmp_path


# --------------------------------------------------------------------------------------------------
# validation


def check(tmp_path: Path, **changes: object) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        DaemonConfig(runtime_dir=tmp_path, **changes)
    return problems_of(excinfo)


def test_bad_format_lists_the_choices(tmp_path: Path) -> None:
    (message,) = check(tmp_path, format="fp4")
    assert "unknown format 'fp4'" in message and "block_fp8, mxfp8, fp8_per_tensor, bf16" in message


@pytest.mark.parametrize(
    "listen", ["inproc://refitd", "udp://1.2.3.4:5", "control.sock", "tcp://host", "tcp://:5"]
)
def test_listen_scheme_refused(tmp_path: Path, listen: str) -> None:
    (message,) = check(tmp_path, listen=listen)
    assert message.startswith(f"listen = {listen!r}")


def test_tcp_port_range(tmp_path: Path) -> None:
    assert "port from 1 to 65535" in check(tmp_path, listen="tcp://*:70000")[0]
    assert DaemonConfig(runtime_dir=tmp_path, listen="tcp://[::1]:5555").listen == "tcp://[::1]:5555"


@pytest.mark.parametrize("where", ["/elsewhere/control.sock", "{root}/../x.sock", "{root}", "relative.sock"])
def test_ipc_outside_runtime_dir(tmp_path: Path, where: str) -> None:
    """The socket must sit inside the 0700 runtime_dir, which is what keeps other users off it."""
    root = tmp_path / "run"
    (message,) = check(root, listen="ipc://" + where.format(root=root))
    assert "is outside runtime_dir" in message and f"ipc://{root}/control.sock" in message


def test_ipc_path_too_long(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * MAX_IPC_PATH_BYTES)
    (message,) = check(deep)
    assert f"at most {MAX_IPC_PATH_BYTES} bytes" in message and "shorter runtime_dir" in message


def test_relative_runtime_dir(tmp_path: Path) -> None:
    """A relative runtime_dir is one problem, not also a listen problem."""
    with pytest.raises(ConfigError) as excinfo:
        DaemonConfig(runtime_dir=Path("run"))
    assert problems_of(excinfo) == ["runtime_dir = 'run' is relative: give an absolute path"]


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "[::1]",
        "::ffff:127.0.0.1",
        "[::ffff:127.0.0.1]",
        "localhost",
        "LocalHost",
    ],
)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize(
    "host",
    [
        "127.attacker.example",  # a DNS name: its owner decides where it points
        "127.0.0.1.nip.io",
        "127.1",  # not a literal address ipaddress accepts: left to a resolver
        "localhost.",
        "localhost.attacker.example",
        "0.0.0.0",
        "*",
        "lo",  # an interface name
        "10.0.0.1",
        "::",
        "fe80::1",
        "[127.0.0.1",
        "",
    ],
)
def test_names_and_outside_addresses_are_not_loopback(host: str) -> None:
    assert not is_loopback_host(host)


def test_a_dns_name_that_starts_like_loopback_needs_curve(tmp_path: Path) -> None:
    """``tcp://127.attacker.example`` used to pass as loopback, as a listen address or a forwarding
    peer, and so went without CURVE."""
    (message,) = check(tmp_path, listen="tcp://127.attacker.example:5555")
    assert "without CURVE" in message
    (message,) = check(
        tmp_path, layout="disaggregated", role="trainer", peers=("tcp://127.attacker.example:5555",)
    )
    assert "peers ['tcp://127.attacker.example:5555'] are on other machines" in message
    loopback = ("tcp://127.0.0.2:5555", "tcp://[::1]:5556", "tcp://localhost:5557")
    assert (
        DaemonConfig(runtime_dir=tmp_path, layout="disaggregated", role="trainer", peers=loopback).peers
        == loopback
    )


@pytest.mark.parametrize("heartbeat", [10, 11])
def test_heartbeat_must_be_below_rank_timeout(tmp_path: Path, heartbeat: float) -> None:
    (message,) = check(tmp_path, heartbeat_interval_s=heartbeat, rank_timeout_s=10)
    assert "heartbeat_interval_s" in message and "must be less than rank_timeout_s (10)" in message


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"world_size": 0}, "world_size = 0: give the number of trainer ranks"),
        ({"step_timeout_s": 0}, "step_timeout_s = 0.0: give a positive"),
        ({"reader_timeout_s": float("inf")}, "reader_timeout_s = inf"),
        ({"shutdown_timeout_s": -1}, "shutdown_timeout_s = -1.0"),
        ({"credit_frames": 0}, "credit_frames = 0"),
        ({"max_frame_bytes": 0}, "max_frame_bytes = 0: too small"),
        ({"publish_bytes": 0}, "publish_bytes = 0: too small"),
        ({"num_first_layers_in_bf16": -1}, "num_first_layers_in_bf16 = -1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers = 0"),
        ({"num_hidden_layers": 4, "num_first_layers_in_bf16": 3, "num_last_layers_in_bf16": 2}, "exceeds"),
        ({"ignore_patterns": ["a", ""]}, "expected fnmatch patterns"),
        ({"world_size": True}, "expected a whole number"),
        ({"log_level": "loud"}, "choose one of debug, info, warning, error"),
        ({"log_format": "xml"}, "choose one of text, json"),
        ({"model_type": "llama"}, "model_type = 'llama': "),
        ({"hf_config": "/nonexistent/config.json"}, "is not a file"),
    ],
)
def test_value_problems(tmp_path: Path, changes: dict[str, object], needle: str) -> None:
    (message,) = check(tmp_path, **changes)
    assert needle in message


@pytest.mark.parametrize(
    ("listen", "needle"),
    [
        ("9464", "expected HOST:PORT with a port from 0 to 65535"),
        ("localhost:", "expected HOST:PORT"),
        (":9464", "expected HOST:PORT"),
        ("127.0.0.1:65536", "expected HOST:PORT"),
        ("http://127.0.0.1:9464", "expected HOST:PORT"),
        ("::1:9464", "write an IPv6 address in brackets"),
        (9464, "expected HOST:PORT, e.g. 127.0.0.1:9464"),
    ],
)
def test_metrics_listen_refused(tmp_path: Path, listen: object, needle: str) -> None:
    (message,) = check(tmp_path, metrics_listen=listen)
    assert message.startswith(f"metrics_listen = {listen!r}: ") and needle in message


def test_operations_settings_from_every_source(tmp_path: Path, env: dict[str, str]) -> None:
    """metrics_listen and timeline_dir are off by default; port 0 and IPv6 hosts are accepted; a
    relative timeline_dir in the file is relative to the file, in a flag to the working directory."""
    assert DaemonConfig(runtime_dir=tmp_path).metrics_listen is None
    assert DaemonConfig(runtime_dir=tmp_path).timeline_dir is None
    assert DaemonConfig(runtime_dir=tmp_path, metrics_listen=" [::1]:0 ").metrics_listen == "[::1]:0"
    path = write(tmp_path / "r.toml", 'metrics_listen = "0.0.0.0:9464"\ntimeline_dir = "traces"\n')
    c = load_config([], env={**env, CONFIG_ENV: str(path)})
    assert (c.metrics_listen, c.timeline_dir) == ("0.0.0.0:9464", tmp_path / "traces")
    c = load_config(["--metrics-listen", "127.0.0.1:0"], env={**env, "REFITD_TIMELINE_DIR": "/var/t"})
    assert (c.metrics_listen, c.timeline_dir) == ("127.0.0.1:0", Path("/var/t"))
    assert load_config(["--timeline-dir", "rel"], env=env).timeline_dir == Path.cwd() / "rel"


def test_timeline_dir_that_is_a_file_refused(tmp_path: Path) -> None:
    (message,) = check(tmp_path, timeline_dir=write(tmp_path / "f", ""))
    assert "timeline_dir = " in message and "is not a directory" in message


def test_hf_config_folder_means_its_config_json(tmp_path: Path) -> None:
    write(tmp_path / "config.json", "{}")
    assert DaemonConfig(runtime_dir=tmp_path, hf_config=tmp_path).hf_config == tmp_path / "config.json"


def test_unknown_file_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path / "r.toml", "wrold_size = 2\nzzz = 1\n")
    with pytest.raises(ConfigError) as excinfo:
        file_to_values(path)
    typo, other = problems_of(excinfo)
    assert typo.startswith(f"unknown key 'wrold_size' in {path}; did you mean world_size?")
    assert "valid: runtime_dir, listen," in typo
    assert other.startswith(f"unknown key 'zzz' in {path} (valid: ")


def test_unknown_env_var_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"REFITD_RANK_TIMEOUT; did you mean REFITD_RANK_TIMEOUT_S\?"):
        env_to_values({"REFITD_RANK_TIMEOUT": "5"})


def test_replace_unknown_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean world_size"):
        DaemonConfig(runtime_dir=tmp_path).replace(world_sise=2)


@pytest.mark.parametrize(
    ("source", "origin"),
    [
        ("file", "(from key 'world_size' in {path})"),
        ("env", "(from environment variable REFITD_WORLD_SIZE)"),
        ("flag", "(from flag --world-size)"),
    ],
)
def test_bad_type_names_its_source(tmp_path: Path, env: dict[str, str], source: str, origin: str) -> None:
    """The message says which source held the bad value and what was expected."""
    path = tmp_path / "r.toml"
    write(path, 'world_size = "four"\n' if source == "file" else "")
    env = {**env, CONFIG_ENV: str(path)}
    if source == "env":
        env["REFITD_WORLD_SIZE"] = "four"
    argv = ["--world-size", "four"] if source == "flag" else []
    with pytest.raises(ConfigError) as excinfo:
        load_config(argv, env=env)
    assert problems_of(excinfo) == [
        f"world_size = 'four': expected a whole number such as 4 {origin.format(path=path)}"
    ]


def test_every_problem_reported_at_once(tmp_path: Path, env: dict[str, str]) -> None:
    """Problems in the file, the environment and the flags come back together, one per line."""
    path = write(tmp_path / "r.toml", "bogus = 1\nformat = 'fp4'\n")
    env = {**env, CONFIG_ENV: str(path), "REFITD_CREDIT_FRAMES": "0"}
    with pytest.raises(ConfigError) as excinfo:
        load_config(["--listen", "udp://x:1", "--heartbeat-interval", "20"], env=env)
    lines = str(excinfo.value).splitlines()
    assert len(lines) == len(excinfo.value.problems) == 5
    assert lines[0].startswith("unknown key 'bogus'")
    assert any("from key 'format'" in line for line in lines)
    assert any("credit_frames = 0" in line and "REFITD_CREDIT_FRAMES" in line for line in lines)
    assert any("udp://x:1" in line and "flag --listen" in line for line in lines)
    assert any("heartbeat_interval_s" in line and "flag --heartbeat-interval" in line for line in lines)
    assert pickle.loads(pickle.dumps(excinfo.value)).problems == excinfo.value.problems


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        file_to_values(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        file_to_values(write(tmp_path / "bad.toml", "world_size = \n"))


# --------------------------------------------------------------------------------------------------
# to_dict and replace


def test_to_dict_round_trips_through_json_and_toml(tmp_path: Path) -> None:
    c = DaemonConfig(
        runtime_dir=tmp_path, format="mxfp8", ignore_patterns=["*.mlp"], staging_bytes="1GiB", world_size=4
    )
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["format"] == "mxfp8" and d["ignore_patterns"] == ["*.mlp"] and d["staging_bytes"] == GiB
    toml = "".join(f"{k} = {json.dumps(v)}\n" for k, v in d.items() if v is not None)
    assert (
        DaemonConfig(
            runtime_dir=tmp_path, **{k: v for k, v in tomllib.loads(toml).items() if k != "runtime_dir"}
        )
        == c
    )


def test_replace_revalidates(tmp_path: Path) -> None:
    c = DaemonConfig(runtime_dir=tmp_path)
    assert c.replace(world_size="3").world_size == 3
    with pytest.raises(ConfigError, match="world_size = 0"):
        c.replace(world_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.world_size = 2  # type: ignore[misc]


def test_replace_moves_a_default_listen_with_runtime_dir(tmp_path: Path) -> None:
    """A default endpoint follows runtime_dir; an explicit one stays and must still fit."""
    moved = DaemonConfig(runtime_dir=tmp_path / "a").replace(runtime_dir=tmp_path / "b")
    assert moved.listen == f"ipc://{tmp_path}/b/control.sock"
    explicit = DaemonConfig(runtime_dir=tmp_path / "a", listen=f"ipc://{tmp_path}/a/other.sock")
    with pytest.raises(ConfigError, match="outside runtime_dir"):
        explicit.replace(runtime_dir=tmp_path / "b")


# --------------------------------------------------------------------------------------------------
# runtime directory


def test_runtime_dir_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        path = prepare_runtime_dir(tmp_path / "run")
    finally:
        os.umask(old)
    assert path == tmp_path / "run"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert prepare_runtime_dir(path) == path  # existing and fine


@pytest.mark.parametrize("mode", [0o770, 0o705, 0o711])
def test_runtime_dir_open_to_others_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "run"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(ConfigError) as excinfo:
        prepare_runtime_dir(path)
    (message,) = problems_of(excinfo)
    assert f"has mode {mode:04o}" in message and f"chmod 700 {path}" in message


def test_runtime_dir_of_another_user_refused(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"is owned by uid \d+, not uid \d+ .*--runtime-dir"):
        prepare_runtime_dir(path, uid=os.geteuid() + 1)


def test_runtime_dir_not_a_directory_or_a_link(tmp_path: Path) -> None:
    write(tmp_path / "file", "")
    with pytest.raises(ConfigError, match="is not a directory"):
        prepare_runtime_dir(tmp_path / "file")
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        prepare_runtime_dir(tmp_path / "link")
    with pytest.raises(ConfigError, match="cannot create runtime_dir"):
        prepare_runtime_dir(tmp_path / "no" / "parent")


# --------------------------------------------------------------------------------------------------
# the environment outside the daemon's settings


def test_native_build_reads_its_documented_variables(tmp_path):
    """REFITD_NATIVE / REFITD_CC / REFITD_NATIVE_DIR (README, numerics/native) are read in one place:
    NativeBuild.from_env, which the native quantizers ask."""
    env = {"REFITD_NATIVE": " Off ", "REFITD_CC": "ccache gcc -O2", "REFITD_NATIVE_DIR": str(tmp_path)}
    assert NativeBuild.from_env(env) == NativeBuild(
        disabled=True, compiler=("ccache", "gcc", "-O2"), cache_dir=tmp_path
    )
    plain = NativeBuild.from_env({"XDG_CACHE_HOME": str(tmp_path), "REFITD_CC": ""})
    assert plain == NativeBuild(disabled=False, compiler=("cc",), cache_dir=tmp_path / "refitd")
    assert NativeBuild.from_env({"REFITD_NATIVE": "1"}).cache_dir == Path.home() / ".cache" / "refitd"
    assert {"REFITD_NATIVE", "REFITD_CC", "REFITD_NATIVE_DIR"} <= NON_SETTING_ENV


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("0", False), ("1", True)])
def test_triton_interpret_env(value, on):
    assert triton_interpret_env({} if value is None else {"TRITON_INTERPRET": value}) is on
