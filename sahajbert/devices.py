"""Which device a peer computes on and in what precision: one policy function, unit-tested on described devices."""

from dataclasses import dataclass

import torch

from sahajbert import xla
from sahajbert.cli import UserError


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" | "cuda" | "tpu" (any XLA host driven with SPMD: TPU cores, or XLA CPU devices in tests)
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    memory_gib: float | None = None
    cores: int = 1  # devices this one peer drives: the per-step batch is per-core batch x cores x accumulation


def describe_device(requested: str = "auto") -> DeviceInfo:
    """Detect the device to use: a TPU host's cores, else CUDA when present (or asked for), else the CPU."""
    if requested == "tpu" or (requested == "auto" and xla.on_tpu_host()):
        name, cores = xla.spmd_devices()
        return DeviceInfo("tpu", name, cores=cores)
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo("cuda", props.name, (props.major, props.minor), props.total_memory / 2**30)
    return DeviceInfo("cpu", "cpu")


def choose_precision(device: DeviceInfo, requested: str = "auto") -> str:
    """The precision policy, for every kind of peer in one place.

    CUDA >= 7.0 (tensor cores): fp16 with hivemind's loss scaler, bf16 on Ampere and newer when asked; older CUDA:
    fp32. TPU: fp32 by default, as sahajBERT-XL's TPU peers had to (bf16 diverged there), bf16 opt-in. CPU: fp32,
    bf16 opt-in. Whatever a peer computes in, it sends unscaled fp32 gradients to the swarm.
    """
    if requested == "auto":
        return "fp16" if device.kind == "cuda" and device.capability >= (7, 0) else "fp32"
    if requested == "fp16" and device.kind != "cuda":
        raise UserError(
            f"--precision fp16 needs a CUDA GPU (loss scaling), this peer computes on {device.name}; "
            f"use --precision fp32 or bf16"
        )
    if requested == "bf16" and device.kind == "cuda" and device.capability < (8, 0):
        raise UserError(
            f"--precision bf16 needs an Ampere or newer GPU (compute capability >= 8.0), "
            f"{device.name} has {device.capability[0]}.{device.capability[1]}; use fp16 or fp32"
        )
    return requested


def trainer_precision(device: DeviceInfo, requested: str, diloco: bool) -> str:
    """choose_precision for a trainer: DiLoCo (`diloco`) steps its inner optimizer without hivemind's fp16 loss scaler,
    so it computes in fp32 where fp16 would be the automatic choice, and refuses fp16 asked for."""
    precision = choose_precision(device, requested)
    if diloco and precision == "fp16":
        if requested == "auto":
            return "fp32"
        raise UserError(
            "--diloco_inner_steps steps its inner optimizer without hivemind's fp16 gradient scaler: "
            "use --precision bf16 or fp32"
        )
    return precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


@dataclass(frozen=True)
class HardwareConfig:
    """Settings a volunteer's trainer gets from its hardware (run_trainer.py --auto_config, the notebook)."""

    device: str
    precision: str
    per_device_train_batch_size: int
    gradient_checkpointing: bool

    def as_flags(self) -> list[str]:
        flags = [
            "--device",
            self.device,
            "--precision",
            self.precision,
            "--per_device_train_batch_size",
            str(self.per_device_train_batch_size),
        ]
        if self.gradient_checkpointing:
            flags.append("--gradient_checkpointing")
        return flags


def auto_configure(device: DeviceInfo, can_recompute: bool = True, diloco: bool = False) -> HardwareConfig:
    """Pick precision, batch size and gradient checkpointing for sahajBERT (sequence 512) on `device`.

    Sizes follow accelerator memory (GiB): below 24 GiB activations are recomputed (gradient checkpointing) where the
    model can (`can_recompute`: sahajbert.model.supports_gradient_checkpointing); fp32 halves what fits; a DiLoCo
    trainer (`diloco`) takes no fp16. The memory estimate (sahajbert.memory) then says whether the choice fits.
    Reachability is not the hardware's: a trainer behind NAT (Colab, Kaggle, home) becomes reachable through a relay,
    or joins in client mode by itself when none takes it (sahajbert.swarm.reachability).
    A TPU host is described as kind "tpu" with its total memory; it computes in float32 (bf16 diverged in
    sahajBERT-XL), 8 examples per core.
    """
    if device.kind == "tpu":
        return HardwareConfig("tpu", "fp32", 8, False)
    if device.kind == "cpu":
        return HardwareConfig("cpu", "fp32", 2, False)
    precision = trainer_precision(device, "auto", diloco)  # DiLoCo: fp32 where fp16 would be chosen
    checkpointing = device.memory_gib < 24 and can_recompute
    budget = device.memory_gib * (1.0 if checkpointing else 0.75) * (1.0 if precision == "fp16" else 0.5)
    batch = 1
    while batch * 2 <= budget and batch < 64:  # the largest power of two that fits
        batch *= 2
    return HardwareConfig("cuda", precision, batch, checkpointing)
