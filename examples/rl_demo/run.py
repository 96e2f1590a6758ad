"""``make rl-demo``: GRPO on a tiny MoE policy whose rollouts an engine samples, refitted through a
real ``refitd serve`` every step, in each expert format.

Per format: a daemon (``refitd serve --format F``, a subprocess), the engine in this process
(attached with its manifest), two trainer ranks (FSDP2 over gloo). Each step the ranks push their
shards (``push_step``), the engine loads the published generation and samples ``group`` responses
for each prompt, the rewards and GRPO advantages are computed here, and the ranks take one update on
their halves of the batch, measuring NeMo-RL's ``gen_kl_error`` between their own logprobs and the
engine's on the sampled tokens. Writes ``rl_demo.{json,csv}`` and ``rl_demo_kl.png`` to ``--out``;
exits 1 if an FP8 format's gen_kl_error reaches NeMo-RL's bar (0.004) at any step::

    PYTHONPATH=. python -m examples.rl_demo.run --steps 10 --out rl-demo-results
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from examples.rl_demo import policy, report

FORMATS = ("bf16", "block_fp8", "mxfp8", "nvfp4", "int4_w4a16")
WORLD = 2
#: how long the driver waits for a rank's report of a step (seconds)
STEP_TIMEOUT = 300.0


def run_format(fmt: str, args: argparse.Namespace, task: policy.Task) -> list[dict[str, Any]]:
    """``args.steps`` GRPO steps with ``fmt`` experts in the engine: one row a step."""
    import json

    from examples.rl_demo.engines import ReferenceRollouts, VllmRollouts
    from examples.rl_demo.trainer import run_rank
    from sidecar.cli.demo.colocated import start_daemon, wait_ready

    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"rl-demo-{fmt}-") as tmp, contextlib.ExitStack() as stack:
        tmp_path = Path(tmp)
        policy.config(args.vocab, args.model).save_pretrained(tmp_path / "model")
        config_path = tmp_path / "model" / "config.json"
        # the ranks push FP32 masters: twice the checkpoint's BF16 bytes of staging
        daemon, endpoint = start_daemon(
            tmp_path / "run", config_path, fmt, extra=("--staging-bytes", "16MiB")
        )
        stack.callback(_stop, daemon)
        wait_ready(endpoint, daemon)
        kind = "vllm" if fmt == "bf16" and args.bf16_engine in ("vllm", "auto") else "reference"
        if kind == "vllm":
            engine = VllmRollouts(endpoint, config_path.parent, fmt, args.vllm_python, tmp_path)
            try:
                engine.attach()
            except RuntimeError as exc:
                engine.close()
                if args.bf16_engine == "vllm":
                    raise
                note = f"{fmt}: the vLLM engine did not start ({exc}); rollouts from the reference engine"
                print(note, flush=True)
                args.notes.append(note)
                kind = "reference"
            else:
                stack.callback(engine.close)
        if kind == "reference":
            engine = ReferenceRollouts(endpoint, json.loads(config_path.read_text()), fmt)
            stack.callback(engine.close)
            engine.attach()
        job = {
            "endpoint": endpoint, "init_file": str(tmp_path / "gloo-init"), "task": task, "vocab": args.vocab,
            "seed": args.seed, "lr": args.lr, "steps": args.steps, "model": args.model,
        }  # fmt: skip
        inboxes = [ctx.Queue() for _ in range(WORLD)]
        outbox = ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, WORLD, job, inboxes[r], outbox)) for r in range(WORLD)]
        for p in procs:
            p.start()
        stack.callback(_join, procs, inboxes)
        reports = Reports(outbox, procs)
        t_start = time.perf_counter()
        for step in range(args.steps):
            with reports.interrupts():  # a rank that fails stops the wait for its push
                reports.published(step)  # then the engine's pause is the refit alone, not the push
                refit = engine.refit(min_step=step)
            if refit.step != step:
                raise RuntimeError(f"the engine loaded step {refit.step}, expected {step}")
            prompt_ids = policy.prompts(task, args.vocab, step, args.seed)
            out = engine.rollouts(prompt_ids, task, seed=args.seed * 7919 + step)
            rewards = policy.reward(out["tokens"][:, task.prompt_len :], args.vocab)
            adv = policy.advantages(rewards, task.group)
            half = len(rewards) // WORLD  # whole groups: prompts is even
            for r in range(WORLD):
                part = slice(r * half, (r + 1) * half)
                batch = {k: v[part] for k, v in out.items()}  # tokens, engine_lp (and stale_lp)
                inboxes[r].put({**batch, "adv": adv[part]})
            got = reports.next()
            rows.append(
                {
                    "format": fmt, "engine": kind, "step": step, "gen_kl_error": got["gen_kl_error"],
                    "mean_lp_diff": got["mean_lp_diff"], "reward": float(rewards.mean()), "refit_s": got["refit_s"],
                    "pause_s": refit.pause_s, "load_s": refit.load_s, "tokens": got["tokens"],
                    "bytes_out": got["bytes_out"], "stale_kl": got["stale_kl"] if kind == "reference" else None,
                }
            )  # fmt: skip
            if args.verbose:
                r = rows[-1]
                print(f"  {fmt} step {step}: gen_kl {r['gen_kl_error']:.2e}, reward {r['reward']:.3f}, "
                      f"refit {r['refit_s']:.3f} s, pause {r['pause_s']:.3f} s "
                      f"(at {time.perf_counter() - t_start:.1f} s)", flush=True)  # fmt: skip
    return rows


class Reports:
    """Rank 0's step reports, read on a thread; a rank's error (or a rank gone) interrupts the main
    thread while it waits in :meth:`interrupts` (the engine waiting for a push that will not come)."""

    def __init__(self, outbox, procs) -> None:
        self.outbox, self.procs = outbox, procs
        self.steps: queue.Queue = queue.Queue()
        self.pushes: queue.Queue = queue.Queue()
        self.error: str | None = None
        self._waiting = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while self.error is None:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    self._fail(f"a trainer rank exited with code {dead[0].exitcode} (its error is above)")
                continue
            except (EOFError, OSError):
                return
            if "error" in msg:
                self._fail(f"trainer rank {msg['rank']} failed:\n{msg['error']}")
            elif "pushed" in msg:
                self.pushes.put(msg["pushed"])
            elif "step" in msg:
                self.steps.put(msg)

    def _fail(self, error: str) -> None:
        self.error = error
        self.steps.put(None)
        self.pushes.put(None)
        if self._waiting:
            _thread.interrupt_main()

    @contextlib.contextmanager
    def interrupts(self):
        self._waiting = True
        try:
            if self.error is not None:
                raise RuntimeError(self.error)
            yield
        except KeyboardInterrupt:
            if self.error is None:
                raise
            raise RuntimeError(self.error) from None
        finally:
            self._waiting = False

    def published(self, step: int) -> None:
        """Wait until rank 0's push of ``step`` returned (the daemon published it)."""
        try:
            got = self.pushes.get(timeout=STEP_TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"step {step} was not published within {STEP_TIMEOUT:.0f} s") from None
        if got is None:
            raise RuntimeError(self.error)
        if got != step:
            raise RuntimeError(f"rank 0 pushed step {got}, expected {step}")

    def next(self) -> dict[str, Any]:
        try:
            msg = self.steps.get(timeout=STEP_TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"no trainer report within {STEP_TIMEOUT:.0f} s") from None
        if msg is None:
            raise RuntimeError(self.error)
        return msg


def _join(procs, inboxes) -> None:
    for box in inboxes:
        box.put(None)  # a rank still waiting for rollouts stops
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
            p.join(timeout=10)


def _stop(daemon) -> None:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except Exception:
            daemon.kill()
            daemon.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated (default {','.join(FORMATS)})"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("rl-demo-results"))
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument(
        "--model", choices=("qwen3_5_moe", "qwen3_moe"), default="qwen3_5_moe",
        help="the policy's family (qwen3_moe: BF16 on vLLM only; the reference engine holds Qwen3.5-MoE)",
    )  # fmt: skip
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--bf16-engine", choices=("vllm", "reference", "auto"), default="auto",
        help="the engine sampling BF16 rollouts: the live vLLM (--vllm-python's venv, tests/setup_live.sh), "
        "refitd's reference engine, or vLLM where that venv exists and the engine starts, else the reference "
        "engine, said in the output and the JSON's notes (default)",
    )  # fmt: skip
    ap.add_argument("--vllm-python", type=Path, default=Path(".venv-live/bin/python"))
    ap.add_argument("--no-plot", action="store_true", help="write the tables only (no matplotlib needed)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}: choose from {', '.join(FORMATS)}")
    args.notes = []
    if args.bf16_engine == "auto" and not args.vllm_python.exists():
        args.bf16_engine = "reference"
        if "bf16" in formats:
            args.notes.append(
                f"no {args.vllm_python} (tests/setup_live.sh): BF16 rollouts from the reference engine"
            )
            print(args.notes[-1])
    if "bf16" in formats and args.bf16_engine == "vllm" and not args.vllm_python.exists():
        ap.error(
            f"--bf16-engine vllm: no {args.vllm_python}; run tests/setup_live.sh (or give --vllm-python)"
        )
    torch.set_num_threads(1)
    task = policy.Task()
    rows: list[dict[str, Any]] = []
    for fmt in formats:
        t0 = time.perf_counter()
        rows += run_format(fmt, args, task)
        print(f"{fmt}: {args.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
        report.write_tables(rows, args.out, args.notes)  # what ran so far stays written
    table = report.summary(rows)
    report.print_summary(table)
    if not args.no_plot:
        report.plot(rows, args.out / "rl_demo_kl.png")
    print(f"wrote {args.out}/rl_demo.json, rl_demo.csv" + ("" if args.no_plot else ", rl_demo_kl.png"))
    over = report.over_bar(table)
    if over:
        print(f"FAIL: gen_kl_error reached {policy.GEN_KL_BAR} in {', '.join(over)}")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
