"""Progress of a benchmarks/bench_flash_mla.py run: a bar on a terminal, a line per 10% in a log."""
from __future__ import annotations

import sys
import time


class Progress:
    """tqdm when importable and stderr is a terminal; else a one-line bar of our own (terminal) or a line per 10%
    (logs). `write` prints a table line to stdout without tearing the bar."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0, self.desc = total, 0, time.time(), ""
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.bar = None
        self.last_decile = -1
        if self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="row", dynamic_ncols=True, leave=False)
            except ImportError:
                self.bar = None

    def _render(self):
        if not self.tty or self.bar is not None:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.time() - self.t0:6.0f}s {self.desc}")
        sys.stderr.write("\r\033[K" + line[:150])
        sys.stderr.flush()

    def set(self, desc: str):
        self.desc = desc
        if self.bar is not None:
            self.bar.set_description_str(desc)
        self._render()

    def update(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.tty:
            self._render()
        elif self.enabled:
            decile = 10 * self.done // max(self.total, 1)
            if decile != self.last_decile:
                self.last_decile = decile
                sys.stderr.write(f"progress: {self.done}/{self.total} workloads, {time.time() - self.t0:.0f} s\n")
                sys.stderr.flush()

    def write(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(line, flush=True)
        self._render()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
