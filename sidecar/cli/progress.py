"""Progress of the CLI's long commands (``refitd convert``, ``refitd demo``'s phases) on stderr.

On a terminal: a tqdm bar (bytes done of the total, rate, time left, and what else the command
counts: shards read, tensors written; or, without a byte count, the units: a demo's steps). Not on
a terminal (a log file, a CI job): one plain line each time a unit of work finishes (a shard read; a
demo step), with the same figures. A long phase (a demo starting its daemon) is a line of its own
either way. ``quiet``: nothing.

    with Progress("convert", total_bytes, units=163, unit_name="shard", quiet=args.quiet) as progress:
        progress.advance(nbytes)                   # bytes done
        progress.count("tensors written")          # a counter shown beside them
        progress.unit_done("model-00003-of-00163.safetensors")  # a log line when not a terminal
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(
        self,
        what: str,
        total_bytes: int,
        *,
        units: int | None = None,
        unit_name: str = "shard",
        quiet: bool = False,
        stream: TextIO | None = None,
        clock=time.monotonic,
    ):
        self.what, self.total, self.units, self.unit_name = what, max(int(total_bytes), 0), units, unit_name
        self.stream = sys.stderr if stream is None else stream
        self.quiet, self.clock = quiet, clock
        self.done = 0
        self.units_done = 0
        self.counters: dict[str, int] = {}
        self.t0 = self.t_units = clock()  # t_units: since the last phase began (units' rate)
        self.bar: Any = None
        isatty = getattr(self.stream, "isatty", None)
        if not quiet and callable(isatty) and isatty():
            from tqdm import tqdm

            if self.total:  # bytes, with the units beside them
                self.bar = tqdm(
                    total=self.total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=what,
                    file=self.stream,
                    dynamic_ncols=True,
                )
            else:  # no byte count: the units themselves
                self.bar = tqdm(
                    total=units, unit=f" {unit_name}", desc=what, file=self.stream, dynamic_ncols=True
                )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)

    def count(self, counter: str, n: int = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + n

    def unit_done(self, label: str) -> None:
        """One unit of work finished: the bar's figures refreshed, or (not a terminal) a log line."""
        self.units_done += 1
        if self.quiet:
            return
        if self.bar is not None:
            if not self.total:
                self.bar.update(1)
            self.bar.set_postfix_str(self._counts(), refresh=True)
            return
        print(f"refitd {self.what}: {self.line(label)}", file=self.stream, flush=True)

    def line(self, label: str) -> str:
        """``shard 3/163 read (label): 12.0 GiB of 680.0 GiB, 1234 tensors written, 210.0 MiB/s, 52m10s left``."""
        elapsed = max(self.clock() - self.t0, 1e-9)
        of = f"/{self.units}" if self.units is not None else ""
        parts = [f"{human_bytes(self.done)} of {human_bytes(self.total)}"] if self.total else []
        if self._counts():
            parts.append(self._counts())
        if self.total:
            rate = self.done / elapsed
            parts.append(f"{human_bytes(rate)}/s")
            if rate > 0 and self.total >= self.done:
                parts.append(f"{_duration((self.total - self.done) / rate)} left")
        else:
            parts.append(f"{_duration(elapsed)} so far")
            if self.units is not None and self.units >= self.units_done:
                each = (self.clock() - self.t_units) / self.units_done
                parts.append(f"{_duration(each * (self.units - self.units_done))} left")
        return f"{self.unit_name} {self.units_done}{of} done ({label}): " + ", ".join(parts)

    def phase(self, text: str) -> None:
        """A long phase begins (starting a daemon, an engine): one line, on a terminal too."""
        if self.quiet:
            return
        self.t_units = self.clock()
        line = f"refitd {self.what}: {text} ({_duration(self.t_units - self.t0)} in)"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def _counts(self) -> str:
        of = f"/{self.units}" if self.units is not None else ""
        head = [f"{self.units_done}{of} {self.unit_name}s"] if self.bar is not None and self.total else []
        return ", ".join(head + [f"{v} {k}" for k, v in self.counters.items()])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
