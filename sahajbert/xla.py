"""The TPU path: one hivemind peer drives every XLA device of its host with torch_xla SPMD.

One process, one copy of the model on the XLA device, each batch sharded over a mesh of all cores; XLA reduces the
gradients over the cores inside the compiled step. hivemind.Optimizer keeps the host model (it offloads to host RAM
anyway): after each pass the device gradients are copied into the host model's `.grad`, where hivemind accumulates
and averages them, and whenever hivemind changes the host parameters they are pushed back to the device.

Shapes are fixed (the collator pads every batch to max_seq_length), so the step compiles once; a later compilation
is reported with a warning, since each one costs seconds to minutes on a TPU.

torch_xla is imported only inside these functions: the rest of the suite runs without it, and SPMD must be switched
on (`use_spmd()`) before the first XLA tensor exists, which `spmd_devices()` does first thing.
"""

import copy
import glob
import importlib.util
import logging
import os
from contextlib import nullcontext

import torch

from sahajbert.cli import UserError

logger = logging.getLogger(__name__)
INSTALL = "pip install -r requirements-tpu.txt (torch_xla 2.9 and the torch 2.9 it is built for)"
WARMUP_PASSES = 2  # measured: pass 1 compiles forward+backward (2 graphs), pass 2 once more (state now on device)


def available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def on_tpu_host() -> bool:
    """A TPU VM: torch_xla installed and TPU chips present (/dev/accel* or VFIO devices), or PJRT_DEVICE=TPU."""
    if not available():
        return False
    return os.environ.get("PJRT_DEVICE") == "TPU" or bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def spmd_devices() -> tuple[str, int]:
    """Switch on SPMD and name this host's XLA devices: (name, count); one clear line if torch_xla is missing."""
    if not available():
        raise UserError(f"--device tpu needs torch_xla, which is not installed here: {INSTALL}")
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()  # before any XLA tensor exists: afterwards the runtime cannot switch to SPMD
    kind = xr.device_type()
    cores = xr.global_runtime_device_count()
    return f"XLA {kind} x{cores}", cores


class SpmdReplica:
    """The device copy of the host model; computes a data-parallel pass over all cores and returns gradients.

    A `sahajbert.compute.Compute` backend.
    """

    def __init__(self, host_model: torch.nn.Module, dtype: torch.dtype | None):
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        self._torch_xla = torch_xla
        self._mark_sharding = xs.mark_sharding
        self.device = torch_xla.device()
        self.cores = xr.global_runtime_device_count()
        # one mesh axis over every core: the batch is split along it, parameters are replicated on all cores
        self.mesh = xs.Mesh(np.arange(self.cores), (self.cores,), ("data",))
        self.replica = copy.deepcopy(host_model).to(self.device)
        self.replica.tie_weights()  # moving to XLA unties shared tensors (ALBERT's embeddings and MLM decoder)
        self.replica.zero_grad(set_to_none=True)  # gradients start on the device from nothing, never the host's
        self.replica.set_attn_implementation("eager")  # plain matmuls and softmax, which XLA fuses itself
        self.replica.train()
        host, device = dict(host_model.named_parameters()), dict(self.replica.named_parameters())
        if host.keys() != device.keys():
            raise RuntimeError(f"the XLA copy has other parameters than the host model: {host.keys() ^ device.keys()}")
        self.host_parameters = list(host.values())
        self.device_parameters = [device[name] for name in host]
        self.autocast = torch.autocast("xla", dtype=dtype) if dtype is not None else nullcontext()
        self.scaler = None  # loss scaling is for fp16, which only CUDA peers compute in
        self.passes = 0
        self.input_sharding = None  # XLA's sharding spec of the first batch, e.g. {devices=[4,1]0,1,2,3}
        self.recompilations = 0  # graphs compiled in a pass after the warm-up passes: each one is a stall
        self._compiled_before_pass = None

    def backward(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        """Queue forward and backward of one batch (traced lazily; `finish_pass` runs them). Returns the loss."""
        if self._compiled_before_pass is None:
            self._compiled_before_pass = self.compilations()
        if next(iter(batch.values())).shape[0] % self.cores:
            raise UserError(f"a batch of {next(iter(batch.values())).shape[0]} does not split over {self.cores} cores")
        if "attention_mask" in batch:
            # an additive (batch, 1, 1, length) mask, which transformers uses as given: from the 2D mask it would
            # first ask whether any token is padded (a host round trip) and build another graph when none is
            padding = 1.0 - batch["attention_mask"][:, None, None, :].float()
            batch = {**batch, "attention_mask": padding * torch.finfo(torch.float32).min}
        inputs = {}
        for name, tensor in batch.items():
            tensor = tensor.to(self.device)
            self._mark_sharding(tensor, self.mesh, ("data",) + (None,) * (tensor.dim() - 1))
            inputs[name] = tensor
        if self.input_sharding is None:
            self.input_sharding = self._torch_xla._XLAC._get_xla_sharding_spec(inputs["input_ids"])
            logger.info(f"each batch is split over {self.cores} XLA devices (input sharding {self.input_sharding})")
        with self.autocast:
            loss = self.replica(**inputs).loss * scale
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def finish_pass(self) -> None:
        """Run the traced pass on the devices, then hand the (all-reduced) gradients to the host model as fp32."""
        self._torch_xla.sync()
        for host, device in zip(self.host_parameters, self.device_parameters):
            host.grad = None if device.grad is None else device.grad.to("cpu", torch.float32)
            device.grad = None  # the next pass starts from nothing, so every pass traces the same graph
        self.passes += 1
        self._check_compilations()
        self._compiled_before_pass = None

    @torch.no_grad()
    def push_parameters(self) -> None:
        """Copy the host parameters (after hivemind's step, averaging, a download or a rollback) to the device."""
        for host, device in zip(self.host_parameters, self.device_parameters):
            device.copy_(host.detach().to(self.device))
        self._torch_xla.sync()

    def finish(self) -> None:
        """At the end of a run: the device copy takes the final (averaged) parameters, and the log shows they match."""
        self.push_parameters()
        logger.info(f"device copy vs host parameters: max difference {self.max_difference():.3g}")

    @torch.no_grad()
    def max_difference(self) -> float:
        """Largest absolute difference between the device copy and the host parameters (a consistency check)."""
        return max(
            (device.cpu() - host.detach()).abs().max().item()
            for host, device in zip(self.host_parameters, self.device_parameters)
        )

    def compilations(self) -> int:
        """Graphs XLA has compiled in this process so far (torch_xla's CompileTime metric)."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def _check_compilations(self) -> None:
        # only compilations inside a pass count: pushing parameters compiles its own small graph once
        count = self.compilations()
        new = count - self._compiled_before_pass
        if self.passes == WARMUP_PASSES:
            logger.info(f"XLA step compiled ({count} graph(s) in all); later passes reuse it")
        elif self.passes > WARMUP_PASSES and new:
            self.recompilations += new
            logger.warning(
                f"XLA recompiled at pass {self.passes} ({new} new graph(s)): shapes or control flow changed "
                f"between steps, and every recompilation stalls this peer"
            )
