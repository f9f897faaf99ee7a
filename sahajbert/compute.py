"""Where a trainer's forward and backward passes run: one interface, a backend per kind of device.

The training loop sees only `Compute`: it hands each batch to `backward`, calls `finish_pass` once per pass, and
`push_parameters` whenever hivemind changed the host parameters. Gradients always end up in the host model's
`.grad`, unscaled and fp32 for every precision but fp16 (there hivemind's GradScaler unscales them), where
hivemind.Optimizer accumulates and averages them.
"""

from contextlib import nullcontext
from typing import Protocol, runtime_checkable

import hivemind
import torch

from sahajbert.devices import DeviceInfo, autocast_dtype
from sahajbert.xla import SpmdReplica


@runtime_checkable
class Compute(Protocol):
    """What the training loop needs from a compute backend (LocalCompute, sahajbert.xla.SpmdReplica)."""

    scaler: hivemind.GradScaler | None  # fp16 loss scaler that hivemind.Optimizer.step needs, else None

    def backward(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        """Forward and backward of one batch, its loss multiplied by `scale`; returns that loss (detached)."""

    def finish_pass(self) -> None:
        """After the last batch of a pass: the pass's gradients are in the host model's `.grad`."""

    def push_parameters(self) -> None:
        """The host parameters changed (step, averaging, download, rollback): compute with them from now on."""

    def finish(self) -> None:
        """At the end of a run: whatever computes ends with the final parameters."""


class LocalCompute:
    """The model computes where it lives (CPU or a CUDA GPU): its gradients are already where hivemind reads them."""

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str):
        self.model = model
        self.device = device
        dtype = autocast_dtype(precision)
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
        # fp16 only: hivemind's scaler unscales before averaging and drops a step whose gradients overflowed
        self.scaler = hivemind.GradScaler() if precision == "fp16" else None

    def backward(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with self.autocast:
            loss = self.model(**batch).loss * scale
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def finish_pass(self) -> None:
        pass  # the gradients were computed in the host model itself

    def push_parameters(self) -> None:
        pass  # hivemind updates these very parameters in place

    def finish(self) -> None:
        pass  # nothing to bring up to date: there is no device copy


def build_compute(model: torch.nn.Module, device_info: DeviceInfo, precision: str) -> Compute:
    """The backend for `device_info`: SPMD over an XLA host's devices, else the model's own device."""
    if device_info.kind == "tpu":
        return SpmdReplica(model, autocast_dtype(precision))
    return LocalCompute(model, next(model.parameters()).device, precision)
