"""Process memory for `sdiree bench`: RSS now, and the peak RSS over a block of work.

The peak of one call alone: the kernel's peak-RSS mark (``VmHWM``) reset before it
(``/proc/self/clear_refs`` <- 5) and read after it; where that is unavailable, a psutil
sampling thread (1 ms) stands in.
"""

from __future__ import annotations

import threading


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def rss_mb() -> float:
    v = _status_mb("VmRSS")
    if v is not None:
        return v
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_mb("VmHWM") is not None


class PeakRSS:
    """Peak RSS (MB) over a with-block: VmHWM after a reset, or a psutil sampling thread."""

    def __init__(self) -> None:
        self.method = "vmhwm-reset" if _can_reset_peak() else "psutil-sampling-1ms"
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        if self.method == "vmhwm-reset":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self.peak_mb = rss_mb()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def __exit__(self, *exc) -> None:
        if self.method == "vmhwm-reset":
            self.peak_mb = _status_mb("VmHWM") or 0.0
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, rss_mb())
