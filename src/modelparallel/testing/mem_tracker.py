"""A run's peak tensor memory as torch's own ``MemTracker`` counts it: the measurement
the planner's peak is checked against (``docs/planner.md#accuracy``), independent of the
planner's ``StepTracker`` and of the library's ``PeakTensorMemory``.

``MemTracker`` (``torch.distributed._tools.mem_tracker``, private in torch 2.13) is a
dispatch mode: it counts every tensor storage the operations inside it return, follows
``UntypedStorage.resize_`` (FSDP2's gathered parameters) and optimizer state, until each
storage is freed. What it cannot see is memory no tensor operation on this thread
returns: gloo's working copies in collectives (allocated by gloo's own threads) are not
counted, so its peak is the peak of tensors alone, the planner's ``peak_tensor_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker


class _NoModuleTracking:
    """Stands in for ``MemTracker``'s module tracker, whose module hooks would refuse a
    module called again in a step (every pipeline microbatch calls it), put gradient
    hooks on module outputs that fail under the pipeline's ``autograd.grad``, and read
    parameters that the pipeline's partition trace takes for the model's own reads.
    Only per-module statistics come from it; the peak does not."""

    is_bw = False  # MemTracker files memory made in backward as temporary: same total
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class RunPeakTracker(MemTracker):
    """``MemTracker``'s accounting (its dispatch mode, its ``resize_`` hook, its optimizer
    hooks) without its per-module statistics (``_NoModuleTracking``)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleTracking()  # type: ignore[assignment]

    def peak_bytes(self, device: torch.device) -> int:
        """The peak of tensor bytes on ``device`` since the tracker was last entered."""
        snapshot = self.get_tracker_snapshot("peak")
        return next((s["Total"] for d, s in snapshot.items() if d.type == device.type), 0)


def run_peaks(script_of: Any, steps: int, device: torch.device) -> list[int]:
    """The peaks of a training run under ``RunPeakTracker``: building it
    (``script_of()`` returns an object with ``step()``), then each of ``steps`` steps.
    Storages made before the call are not counted (nor are they by the planner)."""
    tracker = RunPeakTracker()
    with tracker:
        script = script_of()
    peaks = [tracker.peak_bytes(device)]
    for _ in range(steps):
        with tracker:  # entering starts the peak from the bytes live now
            script.step()
        peaks.append(tracker.peak_bytes(device))
    return peaks
