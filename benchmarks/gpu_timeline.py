"""GPU memory and utilization over a run, sampled by `nvidia-smi`, drawn as an SVG timeline.

    with GpuTimeline(Path("/tmp/timeline.csv")) as timeline:
        ...                                   # the run
    samples = read_samples(Path("/tmp/timeline.csv"))
    Path("timeline.svg").write_text(render_svg(samples, marks=[(t, "step 1"), ...]))
    busy_fraction(samples)                    # {gpu index: share of samples with utilization > 0}

Why `nvidia-smi` and not torch's counters: the trainer and vLLM are separate processes, and vLLM's memory
(weights, KV cache, CUDA graphs, and what sleep mode gives back) is only visible from outside. Per-process
lines are drawn when the driver reports processes whose pids this machine can see (not inside every
container); the per-device total and utilization are always there.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

GPU_QUERY = "timestamp,index,memory.used,memory.total,utilization.gpu"
APP_QUERY = "timestamp,pid,used_memory"


@dataclass
class Samples:
    """Seconds since the first sample; memory in MiB, utilization in percent."""

    devices: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)  # t, used, util
    memory_total: dict[int, float] = field(default_factory=dict)
    processes: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # role -> t, used
    t0: float = 0.0  # the first sample's wall-clock time (time.time()), to place other events on this axis


class GpuTimeline:
    """Samples every `interval_ms` into `csv_path` (devices) and `csv_path.apps.csv` (processes) while open.

    `roles` (pid -> role) is filled while the run is alive: a process's command line is gone once it exits, and
    `read_samples` runs after the run (the 2026-12-04 picture labelled its lines "pid N" for that reason)."""

    def __init__(self, csv_path: Path, interval_ms: int = 250) -> None:
        self.csv_path, self.interval_ms = csv_path, interval_ms
        self._procs: list[subprocess.Popen] = []
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> GpuTimeline:
        if shutil.which("nvidia-smi") is None:
            return self  # no GPU here: nothing to sample, the run goes on
        for query, flag, path in (
            (GPU_QUERY, "--query-gpu", self.csv_path),
            (APP_QUERY, "--query-compute-apps", apps_path(self.csv_path)),
        ):
            out = open(path, "w")
            cmd = ["nvidia-smi", f"{flag}={query}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"]
            self._procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL))
        self._watcher = threading.Thread(target=self._watch_roles, daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        for proc in self._procs:
            proc.terminate()
            proc.wait(timeout=10)

    def _watch_roles(self) -> None:
        while True:
            self.name_new_pids()
            if self._stop.wait(1.0):
                return

    def name_new_pids(self) -> None:
        """Gives every pid the apps file names for the first time its role, read from its command line now."""
        try:
            rows = csv.reader(apps_path(self.csv_path).read_text().splitlines())
        except OSError:
            return
        for row in rows:
            if len(row) == 3 and row[1].strip().isdigit() and int(row[1]) not in self.roles:
                self.roles[int(row[1])] = role_of(int(row[1]))


def apps_path(csv_path: Path) -> Path:
    return csv_path.with_suffix(".apps.csv")


def role_of(pid: int) -> str:
    """Role "trainer", "inference" or "pid N", from the process's command line where this machine can see it."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid}"
    if "prime_rl.trainer" in cmdline or "torchrun" in cmdline:
        return "trainer"
    if "vllm" in cmdline or "prime_rl.inference" in cmdline or "EngineCore" in cmdline:
        return "inference"
    return f"pid {pid}"


def _seconds(stamp: str) -> float:
    # nvidia-smi writes "2026/12/03 23:01:02.123"
    return datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def read_samples(csv_path: Path, roles: dict[int, str] | None = None) -> Samples:
    """Parses both files; `roles` maps pids to roles (default: `role_of`, read now)."""
    samples, t0 = Samples(), None
    for row in csv.reader(csv_path.read_text().splitlines()):
        if len(row) != 5 or not row[2].strip().isdigit():
            continue  # header, "[N/A]" or a line cut by terminate()
        t = _seconds(row[0])
        if t0 is None:
            t0 = samples.t0 = t
        index = int(row[1])
        samples.memory_total[index] = float(row[3])
        samples.devices.setdefault(index, []).append((t - t0, float(row[2]), float(row[4])))
    apps = apps_path(csv_path)
    if t0 is None or not apps.exists():
        return samples
    roles = dict(roles or {})
    for row in csv.reader(apps.read_text().splitlines()):
        if len(row) != 3 or not row[1].strip().isdigit() or not row[2].strip().isdigit():
            continue
        pid = int(row[1])
        role = roles.setdefault(pid, role_of(pid))
        samples.processes.setdefault(role, []).append((_seconds(row[0]) - t0, float(row[2])))
    return samples


def busy_fraction(samples: Samples, start: float = 0.0, end: float = float("inf")) -> dict[int, float]:
    """Per device: the share of samples in [start, end] (seconds on the samples' axis) in which the GPU ran a
    kernel (nvidia-smi's utilization > 0)."""
    out = {}
    for index, rows in samples.devices.items():
        window = [util for t, _, util in rows if start <= t <= end]
        if window:
            out[index] = sum(util > 0 for util in window) / len(window)
    return out


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def render_svg(samples: Samples, marks: list[tuple[float, str]] = (), title: str = "", width: int = 900) -> str:
    """Memory (GiB, left axis) per device and per process over time, utilization (%) shaded below, `marks` as
    labelled vertical lines (seconds since the first sample)."""
    height, left, right, top, bottom = 360, 60, 20, 30, 40
    rows = [r for d in samples.devices.values() for r in d]
    if not rows:
        raise ValueError("no GPU samples to draw: was the run sampled on a machine with nvidia-smi?")
    t_end = max(t for t, _, _ in rows) or 1.0
    mem_top = max(samples.memory_total.values() or [max(m for _, m, _ in rows)]) / 1024
    x = lambda t: left + (width - left - right) * t / t_end  # noqa: E731
    y = lambda gib: top + (height - top - bottom) * (1 - gib / mem_top)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{title}</text>']  # fmt: skip
    for gib in range(0, int(mem_top) + 1, max(1, int(mem_top) // 7 or 1)):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(gib):.1f}" y2="{y(gib):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y(gib) + 4:.1f}" text-anchor="end">{gib}</text>')  # fmt: skip
    out.append(f'<text x="14" y="{top + 100}" transform="rotate(-90 14 {top + 100})">GPU memory (GiB)</text>')
    out.append(f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">seconds</text>')
    for t in range(0, int(t_end) + 1, max(1, int(t_end) // 10)):
        out.append(f'<text x="{x(t):.1f}" y="{height - bottom + 14}" text-anchor="middle">{t}</text>')
    base = y(0)
    for _, dev in sorted(samples.devices.items()):
        util = " ".join(f"{x(t):.1f},{base - (base - top) * 0.25 * u / 100:.1f}" for t, _, u in dev)
        out.append(f'<polyline points="{x(dev[0][0]):.1f},{base} {util} {x(dev[-1][0]):.1f},{base}" '
                   f'fill="#ddd" stroke="none"/>')  # fmt: skip
    lines = [(f"GPU {i} used", d) for i, d in sorted(samples.devices.items())]
    lines += [(role, [(t, m, 0.0) for t, m in pts]) for role, pts in sorted(samples.processes.items())]
    for k, (name, pts) in enumerate(lines):
        color = COLORS[k % len(COLORS)]
        path = " ".join(f"{x(t):.1f},{y(m / 1024):.1f}" for t, m, _ in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out.append(
            f'<text x="{width - right - 4}" y="{top + 14 * (k + 1)}" text-anchor="end" fill="{color}">{name}</text>'
        )
    out.append(f'<text x="{width - right - 4}" y="{top + 14 * (len(lines) + 1)}" text-anchor="end" fill="#999">'
               "grey: utilization (0-100% in the bottom quarter)</text>")  # fmt: skip
    for t, label in marks:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{base}" stroke="#888" stroke-dasharray="3,3"/>'
                   f'<text x="{x(t) + 2:.1f}" y="{top + 10}" fill="#555">{label}</text>')  # fmt: skip
    return "\n".join(out + ["</svg>"])
