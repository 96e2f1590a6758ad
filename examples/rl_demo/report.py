"""The demo's results: one row a step and format, written as ``rl_demo.json`` and ``rl_demo.csv``,
and ``rl_demo_kl.png`` (gen_kl_error per step, one line per format, NeMo-RL's bar drawn). The plot
needs matplotlib (``pip install -e '.[rl-demo]'``), never a core dependency of refitd."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.rl_demo.policy import GEN_KL_BAR

COLUMNS = (
    "format", "engine", "step", "gen_kl_error", "mean_lp_diff", "reward", "refit_s", "pause_s", "load_s",
    "tokens", "bytes_out", "stale_kl",
)  # fmt: skip
FP8 = ("block_fp8", "mxfp8", "fp8_per_tensor")


def write_tables(rows: list[dict[str, Any]], out: Path, notes: Sequence[str] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"gen_kl_bar": GEN_KL_BAR, "notes": list(notes), "rows": rows}
    (out / "rl_demo.json").write_text(json.dumps(doc, indent=1) + "\n")
    with (out / "rl_demo.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per format: the largest and mean gen_kl_error, the first and last step's reward, the median
    refit and pause."""
    out = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        kls = [r["gen_kl_error"] for r in mine]

        def median(key: str, mine=mine) -> float:
            v = sorted(r[key] for r in mine)
            return v[len(v) // 2]

        out.append(
            {
                "format": fmt,
                "engine": mine[0]["engine"],
                "steps": len(mine),
                "max_gen_kl": max(kls),
                "mean_gen_kl": sum(kls) / len(kls),
                "reward_first": mine[0]["reward"],
                "reward_last": mine[-1]["reward"],
                "max_stale_kl": max(
                    (r["stale_kl"] for r in mine if r.get("stale_kl") is not None), default=None
                ),
                "refit_s": median("refit_s"),
                "pause_s": median("pause_s"),
            }
        )
    return out


def print_summary(table: list[dict[str, Any]]) -> None:
    print(
        f"{'format':<11} {'engine':<10} {'steps':>5} {'max gen_kl':>11} {'mean gen_kl':>11} "
        f"{'reward':>13} {'refit s':>8} {'pause s':>8}"
    )
    for s in table:
        print(
            f"{s['format']:<11} {s['engine']:<10} {s['steps']:>5} {s['max_gen_kl']:>11.2e} "
            f"{s['mean_gen_kl']:>11.2e} {s['reward_first']:>6.3f}->{s['reward_last']:<6.3f} "
            f"{s['refit_s']:>8.3f} {s['pause_s']:>8.3f}"
        )
    print(f"NeMo-RL's bar for gen_kl_error: {GEN_KL_BAR}")


def over_bar(table: list[dict[str, Any]]) -> list[str]:
    """The FP8 formats whose gen_kl_error went over NeMo-RL's bar at some step."""
    return [s["format"] for s in table if s["format"] in FP8 and s["max_gen_kl"] >= GEN_KL_BAR]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            f"the KL plot needs matplotlib ({exc}): pip install -e '.[rl-demo]' (the tables are written)"
        ) from None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        ax.plot([r["step"] for r in mine], [r["gen_kl_error"] for r in mine], marker="o", ms=3,
                label=f"{fmt} ({mine[0]['engine']})")  # fmt: skip
    stale = [r for r in rows if r.get("stale_kl") is not None]
    if stale:  # the contrast, for one format: its engine left on the first step's weights
        fmt = "block_fp8" if any(r["format"] == "block_fp8" for r in stale) else stale[0]["format"]
        mine = [r for r in stale if r["format"] == fmt]
        ax.plot([r["step"] for r in mine], [r["stale_kl"] for r in mine], color="gray", ls=":", marker="x",
                label=f"{fmt} engine never refitted (kept step 0)")  # fmt: skip
    ax.axhline(GEN_KL_BAR, color="red", ls="--", lw=1, label=f"NeMo-RL bar {GEN_KL_BAR}")
    ax.set_yscale("log")
    ax.set_xlabel("GRPO step (engine refitted through refitd before each)")
    ax.set_ylabel("gen_kl_error (trainer vs engine, k3)")
    ax.set_title("Trainer-vs-engine KL on the sampled tokens, per expert format")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
