"""torch.profiler tables of what a piece of work launches: the one formatter of the benchmarks and the train step.

* :func:`profiled`: one call under the profiler, its top operators by their own device time (CPU: operator time) as
  the profiler's table — what ``benchmarks/capacity.py --profile`` writes.
* :func:`kernel_count`: the kernels a profile saw launched — on CUDA the device events; on CPU the outermost aten
  operators that compute (looking through views and conversions to what they call), ~ what would launch on a GPU.
* :class:`StepProfiler`: the same profiler around chosen steps of a training loop (collection paused between them),
  plus what a step waits on: per step the host time to issue it, its wall time and the device's busy time, the
  host reads of tensor values (``.item()``, ``bool(tensor)``, ``nonzero``…: a device→host sync where the tensor is on
  the device; AdamW's reads of its host-side step counts are not), counted from the profile, and on CUDA the syncs
  themselves, counted and located by source line through ``torch.cuda.set_sync_debug_mode("warn")``. :meth:`StepProfiler.markdown`
  is the report (a train run's ``step_profile.md`` artifact).

Profiling slows the host down (each operator is recorded): read the profiled steps' host times as an upper bound,
their operator counts and sync sites as exact.
"""
from __future__ import annotations

import collections
import contextlib
import time
import warnings

import torch

# aten operators that launch no kernel of their own (views, allocation, dispatch helpers)
NO_KERNEL = {"alias", "as_strided", "as_strided_", "chunk", "contiguous", "detach", "empty", "empty_like",
             "empty_strided", "expand", "expand_as", "flatten", "lift_fresh", "narrow", "permute", "reshape",
             "_reshape_alias", "resolve_conj", "resolve_neg", "result_type", "select", "slice", "split",
             "split_with_sizes", "squeeze", "t", "to", "_to_copy", "transpose", "unbind", "unflatten", "unsqueeze",
             "_unsafe_view", "view", "view_as"}
# aten operators whose result the host reads (a device→host sync on CUDA): .item() / bool() / int() and the ops
# whose output size depends on the values
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
              "aten::unique_consecutive", "aten::repeat_interleave")
SYNC_WARNING = "synchroniz"  # torch.cuda.set_sync_debug_mode("warn")'s message: "called a synchronizing CUDA operation"


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def activities(device) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])


def sort_key(events, device) -> str:
    """The profiler's column of operators' own device time on CUDA, of their CPU time elsewhere."""
    return next((key for key in ("self_device_time_total", "self_cuda_time_total")
                 if torch.device(device).type == "cuda" and events and hasattr(events[0], key)),
                "self_cpu_time_total")


def profiled(call, device, rows: int):
    """``(profiler, sort key, table)`` of one ``call()``: its top ``rows`` kernels by their own device time (CPU:
    operator time)."""
    from torch.profiler import profile

    with profile(activities=activities(device)) as prof:
        call()
        synchronize(device)
    events = prof.key_averages()
    sort = sort_key(events, device)
    return prof, sort, events.table(sort_by=sort, row_limit=rows)


def kernel_count(prof, device) -> int:
    """The kernels ``prof`` saw launched (see the module docstring)."""
    events = prof.events()
    if torch.device(device).type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

    def computing(event):
        if event.name.removeprefix("aten::") not in NO_KERNEL:
            return 1
        return sum(computing(c) for c in event.cpu_children if c.name.startswith("aten::"))

    outermost = [e for e in events if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return sum(computing(e) for e in outermost)


def check_profile_steps(value) -> tuple[int, int] | None:
    """``[first, count]`` (both ints >= 1) as a tuple, ``None`` for an empty one; else a one-line ``ValueError``."""
    value = tuple(value or ())
    if not value:
        return None
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        raise ValueError(f"profile steps are [first step, number of steps], both integers >= 1; got {list(value)}")
    return value[0], value[1]


class StepProfiler:
    """torch.profiler (CPU, and CUDA activities on CUDA) around steps ``first … first + count - 1`` of a loop.

    ``with profiler.step(step):`` wraps one step's work; outside the chosen steps it does nothing, between them
    collection is paused (the loop's logging and checkpoints are not counted). Inside, :meth:`issued` marks when the
    host has queued the step (before the loop's own synchronize): the host time. :attr:`done` is true once the last
    chosen step has been recorded; :meth:`markdown` is then the report."""

    def __init__(self, device, first: int, count: int, rows: int = 30):
        self.device, self.first, self.count, self.rows = torch.device(device), first, count, rows
        self.last = first + count - 1
        self.prof = None
        self.steps: list[dict] = []  # per recorded step: step, host_s, wall_s
        self.sync_sites: collections.Counter = collections.Counter()
        self._issued = None
        self.done = False

    def wants(self, step: int) -> bool:
        return not self.done and self.first <= step <= self.last

    def issued(self) -> None:
        """The host has queued the step's work (call it before the loop's synchronize)."""
        self._issued = time.perf_counter()

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.wants(step):
            yield
            return
        from torch.profiler import profile

        acts = activities(self.device)
        if self.prof is None:
            self.prof = profile(activities=acts)
            self.prof.start()
        else:
            self.prof.toggle_collection_dynamic(True, acts)
        cuda = self.device.type == "cuda"
        previous = torch.cuda.get_sync_debug_mode() if cuda else None
        self._issued = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            try:
                yield
            finally:
                synchronize(self.device)
                wall = time.perf_counter() - t0
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous)
        for w in caught:  # where each device→host sync came from (the Python line that asked for a value)
            if SYNC_WARNING in str(w.message):
                self.sync_sites[f"{w.filename}:{w.lineno}"] += 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.steps.append({"step": step, "host_s": (self._issued or time.perf_counter()) - t0, "wall_s": wall})
        if step >= self.last:
            self.prof.stop()
            self.done = True
        else:
            self.prof.toggle_collection_dynamic(False, acts)

    def summary(self) -> dict:
        """Per-step figures of the recorded steps: ``ops`` (aten operators dispatched), ``kernels``
        (:func:`kernel_count`), ``host_reads`` (:data:`HOST_READS`), ``syncs`` (CUDA sync-debug warnings; None
        elsewhere), ``host_s``, ``wall_s`` and ``device_s`` (the device's busy time: its kernels' own time; None on
        CPU)."""
        n = max(1, len(self.steps))
        events = self.prof.key_averages()
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        reads = sum(e.count for e in events if e.key in HOST_READS)
        cuda = self.device.type == "cuda"
        device_us = None
        if cuda:  # kernels, copies and fills (on several streams at once they overlap: an upper bound)
            device_us = sum(e.device_time_total for e in self.prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA)
        return {"steps": len(self.steps), "ops": ops / n, "kernels": kernel_count(self.prof, self.device) / n,
                "host_reads": reads / n, "syncs": sum(self.sync_sites.values()) / n if cuda else None,
                "host_s": sum(s["host_s"] for s in self.steps) / n, "wall_s": sum(s["wall_s"] for s in self.steps) / n,
                "device_s": device_us / 1e6 / n if device_us is not None else None}

    def markdown(self, title: str) -> str:
        """The report: per-step figures, each recorded step's times, the sync sites, and the profiler's tables of
        the top operators by their own device time (CPU: operator time) and by count."""
        events = self.prof.key_averages()
        sort = sort_key(events, self.device)
        s = self.summary()
        fmt = lambda v, unit="": "n/a" if v is None else f"{v:.4g}{unit}"  # noqa: E731
        lines = [f"# {title}", "",
                 f"{s['steps']} profiled steps on {self.device.type}"
                 + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else "")
                 + f", torch {torch.__version__}. Per step (mean):", "",
                 "| figure | per step |", "|---|---:|",
                 f"| aten operators dispatched | {s['ops']:.0f} |",
                 f"| kernels launched (CPU: computing operators) | {s['kernels']:.0f} |",
                 f"| host reads of tensor values ({', '.join(h.removeprefix('aten::') for h in HOST_READS)}; "
                 f"a sync where the tensor is on the device) | {s['host_reads']:.1f} |",
                 f"| device→host syncs (CUDA sync debug mode) | {fmt(s['syncs'])} |",
                 f"| host time to issue the step | {fmt(s['host_s'], ' s')} |",
                 f"| wall time (to the step's synchronize) | {fmt(s['wall_s'], ' s')} |",
                 f"| device busy (kernels' own time) | {fmt(s['device_s'], ' s')} |", "",
                 "Profiling slows the host down: host and wall times are upper bounds; counts are exact.", "",
                 "| step | host s | wall s |", "|---:|---:|---:|"]
        lines += [f"| {r['step']} | {r['host_s']:.4f} | {r['wall_s']:.4f} |" for r in self.steps]
        if self.device.type == "cuda":
            lines += ["", "## device→host syncs by source line (all profiled steps)", ""]
            lines += [f"- {n} × `{site}`" for site, n in self.sync_sites.most_common()] or ["- none"]
        lines += ["", f"## top {self.rows} operators by {sort} (all profiled steps)", "", "```",
                  events.table(sort_by=sort, row_limit=self.rows), "```", "",
                  f"## top {self.rows} operators by count (all profiled steps)", "", "```",
                  events.table(sort_by="count", row_limit=self.rows), "```", ""]
        return "\n".join(lines)
