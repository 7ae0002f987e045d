"""The measured cost curve of a model, kept on disk between processes.

Measuring `CostCurve` takes seconds (3 s for the default model in float16 on two cores, tens of
seconds in float32), and every `specfork generate` with the goodput gate paid it before its
first token. The curve is stored as JSON under the cache folder (`cost/`), keyed by the weight
file's identity and by everything the timings depend on: the backend and precision
(`describe()`), the compiled kernels' build (a new specfork with faster kernels measures
afresh), the device and its name, the thread count and torch's version. A stored curve
older than `MAX_AGE_DAYS` is measured again (a curve timed while the machine was busy does not
stay forever); deleting the folder re-measures at once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specfork.atomic import atomic_file
from specfork.host import cpu_name, source_digest
from specfork.models.cost import ROWS, CostCurve, lower_hull

if TYPE_CHECKING:
    from specfork.models.target import TargetModel

log = logging.getLogger(__name__)

FORMAT = 2  # bump when the measurement changes (2: a far context's curve too)
MAX_AGE_DAYS = 7


def curve_file(model: TargetModel, source: Path, folder: Path) -> Path:
    """Where the curve of `model` (loaded from `source`) on this machine is stored."""
    device = model.device
    identity = (
        model.describe(),
        model.dtype,
        _kernels_build(model),
        _device_name(device),
        model.thread_use().threads,
        torch.__version__,
        ROWS,
        FORMAT,
    )
    return folder / f"{source.stem}-cost-{source_digest(source, *identity)}.json"


def _kernels_build(model: TargetModel) -> str:
    """The compiled kernels' module name (it carries a digest of their sources); '' without."""
    return getattr(getattr(model, "kernels", None), "__name__", "")


def load_or_measure(model: TargetModel, source: Path | None, folder: Path) -> CostCurve:
    """The stored curve when one is fresh, else a new measurement (stored when it can be)."""
    path = curve_file(model, source, folder) if source is not None and source.exists() else None
    if path is not None:
        stored = read_curve(path)
        if stored is not None:
            return stored
    threads_before = model.thread_use()
    curve = CostCurve.measure(model)
    threads = model.thread_use().since(threads_before)
    fewer = threads.reduced >= threads.NOTABLE  # the pool backed off: not the key's count
    if fewer:
        log.warning(
            "the cost curve was measured on fewer threads while other jobs kept the "
            "cores busy: this process uses it, later ones measure again"
        )
    if path is not None and not fewer:
        write_curve(curve, path)
    return curve


def read_curve(path: Path, max_age_days: float | None = MAX_AGE_DAYS) -> CostCurve | None:
    """The curve stored at `path` (lowered to its hull), or None when it is missing, older
    than `max_age_days` (None: any age), unreadable or another version's."""
    try:
        if max_age_days is not None and time.time() - path.stat().st_mtime > max_age_days * 86400:
            return None
        data = json.loads(path.read_text())
        near = _curve(data["rows"], data["cost"], data.get("context", 0))
        far = None if data.get("far") is None else _curve(ROWS, data["far"], data["far_context"])
        step = float(data.get("far_step", 1.0))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("measuring the cost curve again: %s is unreadable (%s)", path, exc)
        return None
    if near is None or (far is not None and not (far.context > near.context and step > 0)):
        log.warning("measuring the cost curve again: %s holds another curve", path)
        return None
    return CostCurve(near.rows, near.cost, near.context, far, step if far else 1.0)


def _curve(rows: list, cost: list, context: object) -> CostCurve | None:
    """A stored curve's sizes, costs and context, if they are this version's sizes and sane."""
    rows_t, cost_t = tuple(rows), tuple(float(c) for c in cost)
    if rows_t != ROWS or len(cost_t) != len(rows_t) or not all(c >= 1.0 for c in cost_t):
        return None
    if not isinstance(context, int) or context < 0:
        return None
    return CostCurve(rows_t, lower_hull(rows_t, cost_t), context)  # one stored before it


def write_curve(curve: CostCurve, path: Path) -> None:
    """Store `curve` at `path` atomically; a failure only logs a warning (the curve is measured
    next time)."""
    data = {"rows": curve.rows, "cost": curve.cost, "context": curve.context}
    if curve.far is not None:
        data |= {
            "far": curve.far.cost,
            "far_context": curve.far.context,
            "far_step": curve.far_step,
        }
    try:
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(data))
    except OSError as exc:
        log.warning("cannot store the cost curve in %s (%s)", path.parent, exc)


def _device_name(device: torch.device) -> str:
    """The processor's model name (the GPU's for CUDA): timings differ between machines."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
