"""Which device a peer computes on and in what precision: one policy function, unit-tested on described devices."""

from dataclasses import dataclass

import torch

from sahajbert.cli import UserError


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" | "cuda"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    memory_gib: float | None = None


def describe_device(requested: str = "auto") -> DeviceInfo:
    """Detect the device to use: CUDA when present (or asked for), else the CPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo("cuda", props.name, (props.major, props.minor), props.total_memory / 2**30)
    return DeviceInfo("cpu", "cpu")


def choose_precision(device: DeviceInfo, requested: str = "auto") -> str:
    """fp16 on CUDA >= 7.0 (tensor cores), fp32 on older CUDA and on the CPU; bf16 only where it is fast."""
    if requested == "auto":
        return "fp16" if device.kind == "cuda" and device.capability >= (7, 0) else "fp32"
    if requested == "fp16" and device.kind != "cuda":
        raise UserError(f"--precision fp16 needs a CUDA GPU, this peer computes on {device.name}; use fp32 or bf16")
    if requested == "bf16" and device.kind == "cuda" and device.capability < (8, 0):
        raise UserError(
            f"--precision bf16 needs an Ampere or newer GPU (compute capability >= 8.0), "
            f"{device.name} has {device.capability[0]}.{device.capability[1]}; use fp16 or fp32"
        )
    return requested


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
