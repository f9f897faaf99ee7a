"""A trainer's peak memory, estimated before it joins, and the host allocator setting that lowers it.

The estimate (`estimate_peak`) adds up what a trainer holds at its peak: the runtime (Python, torch, the tokenizer,
the data pipeline; hivemind's forked processes and p2p daemon), copies of the parameters, and the activations one
forward pass keeps for its backward pass. Activations are counted, not modeled: the model is built on torch's meta
device (no memory, no compute) and one forward pass of the chosen batch records the bytes of every tensor autograd
saves. The copies and runtime are what benchmarks/bench_overhead.py measured; benchmarks/README.md has the estimate
beside the measured peaks of both presets.
"""

import copy
import ctypes
import ctypes.util
from dataclasses import dataclass

import torch

from sahajbert.devices import DeviceInfo
from sahajbert.flags import PeerArguments

MIB = 2**20
GIB = 2**30

# Tensors of this size and more get their own memory mapping, returned to the system when freed. glibc's default
# (a threshold that rises to 32 MiB as large blocks are freed) keeps freed activations in the heap, where the next
# pass's differently padded batch cannot reuse all of them: measured on a plain sahajbert loop (batch 4 x 128 tokens,
# 2 threads), peak PSS 3,201 -> 2,507 MiB at 8 MiB, samples/s 0.51 -> 0.54; a 1 MiB threshold saved 1,000 MiB but
# cost 28% of the samples/s (every activation's pages faulted in fresh each pass).
MMAP_THRESHOLD_BYTES = 8 * MIB
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Give allocations of `threshold` bytes and more their own mappings in this process and the ones it forks
    later (glibc only); True where it was set. Processes already running keep their setting."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its allocator stays as it is
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


# Copies of the parameters (fp32) a CPU trainer holds at its peak: a plain PyTorch loop's 4 (weights, gradients, LAMB's
# two moments); the offloaded master parameters and their gradients (2), hivemind's gradient accumulators and
# averaging buffer (2), the state averager's buffer (1), the last good state for rollback (3); and what grows with the
# model beyond them: LAMB's per-step temporaries, DiLoCo's outer state, the forked processes' private pages. Fitted
# with the activation term below on both presets and both modes (bench_overhead.py, batch 4 and 2 x 128 tokens):
# 17.3 copies in data-parallel mode, 18.5 with DiLoCo; each of the 4 measured peaks within 5% of the estimate.
TRAINER_COPIES_CPU = 17.5
# With the model on an accelerator, the accelerator holds its parameters and gradients, the host the other copies.
# Not yet measured on a GPU (benchmarks/gpu_check.py prints the estimate beside nvidia-smi's peak).
DEVICE_COPIES_ACCELERATOR = 2
HOST_COPIES_ACCELERATOR = TRAINER_COPIES_CPU - DEVICE_COPIES_ACCELERATOR
# Python, torch, transformers, the tokenizer and the data pipeline (a plain loop with the tiny model: 592 MiB), and a
# trainer's DHT, averager processes and p2p daemon beyond them.
RUNTIME_BYTES = 600 * MIB
TRAINER_RUNTIME_BYTES = 350 * MIB
# A CUDA process's host pages for CUDA's libraries, and its context on the GPU (both vary by driver and GPU).
CUDA_HOST_RUNTIME_BYTES = 1500 * MIB
CUDA_CONTEXT_BYTES = 500 * MIB
# Autocast keeps most saved activations in 16 bits, softmax, norms and the loss in 32: about 0.6 of fp32's bytes.
HALF_PRECISION_ACTIVATION_SHARE = 0.6
# A pass's peak beyond the activations autograd saved (the backward pass's gradients of activations, the allocator's
# slack), as a factor: 0.98-1.03 in the fit above, with the trainer's allocator setting (glibc's default kept up to
# 1.8x the saved bytes in a plain loop at sahajbert-xl).
ACTIVATION_PEAK_FACTOR = 1.0


def saved_activation_bytes(config, batch: int, seq: int) -> int:
    """Bytes autograd keeps for the backward pass of one pretraining forward pass of `batch` x `seq` tokens in fp32,
    counted on the meta device (each storage once: views of one tensor share it)."""
    model = _meta_model(config).train()
    with torch.device("meta"):
        ids = torch.randint(5, config.vocab_size, (batch, seq))
        order = torch.zeros(batch, dtype=torch.long)
    storages: dict[int, int] = {}
    kept = []  # holds every saved tensor until counted, so that no storage's address is reused meanwhile

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
        kept.append(tensor)
        return tensor

    # no attention mask: a full batch of `seq` tokens is the largest a pass takes, and the meta device cannot decide
    # whether a mask is all ones
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, sentence_order_label=order)
    return sum(storages.values())


@dataclass(frozen=True)
class MemoryEstimate:
    host_bytes: int
    device_bytes: int | None  # on the accelerator; None for a CPU peer
    parameters: int
    activation_bytes: int  # of one pass, at its peak, on the device that computes

    def describe(self) -> str:
        text = f"host {self.host_bytes / GIB:.1f} GiB"
        if self.device_bytes is not None:
            text += f", GPU {self.device_bytes / GIB:.1f} GiB"
        return text


def estimate_peak(
    config, batch: int, seq: int, device_kind: str = "cpu", precision: str = "fp32", checkpointing: bool = False
) -> MemoryEstimate:
    """A trainer's peak memory with `config`, `batch` examples of `seq` tokens per pass, on `device_kind` ("cpu",
    "cuda"; a TPU host is estimated as a CPU peer), in `precision`, with gradient checkpointing or not."""
    parameters = sum(p.numel() for p in _meta_model(config).parameters())
    one_copy = parameters * 4  # fp32: what every copy of the parameters is kept in, whatever the compute precision
    if checkpointing:  # each layer's input kept; the embeddings', the head's and one layer's activations at a time
        one_layer = copy.deepcopy(config)
        one_layer.num_hidden_layers = 1
        saved = (
            saved_activation_bytes(one_layer, batch, seq)
            + config.num_hidden_layers * batch * seq * config.hidden_size * 4
        )
    else:
        saved = saved_activation_bytes(config, batch, seq)
    if precision in ("fp16", "bf16"):
        saved = int(saved * HALF_PRECISION_ACTIVATION_SHARE)
    activations = int(saved * ACTIVATION_PEAK_FACTOR)
    if device_kind == "cuda":
        host = CUDA_HOST_RUNTIME_BYTES + TRAINER_RUNTIME_BYTES + HOST_COPIES_ACCELERATOR * one_copy
        device = CUDA_CONTEXT_BYTES + DEVICE_COPIES_ACCELERATOR * one_copy + activations
        return MemoryEstimate(int(host), int(device), parameters, activations)
    host = RUNTIME_BYTES + TRAINER_RUNTIME_BYTES + TRAINER_COPIES_CPU * one_copy + activations
    return MemoryEstimate(int(host), None, parameters, activations)


def _meta_model(config):
    from sahajbert.model import model_class

    with torch.device("meta"):
        return model_class(config)(config)


def trainer_estimate(
    peer_args: PeerArguments, device: DeviceInfo, precision: str, batch: int | None = None
) -> MemoryEstimate:
    """The estimate for a trainer with `peer_args` on `device` in `precision`; `batch`
    examples per core instead of --per_device_train_batch_size where given."""
    from sahajbert.model import read_config
    from sahajbert.tokenization import load_tokenizer

    model_args, training_args = peer_args.model_args, peer_args.training_args
    config = read_config(model_args.model)
    config.vocab_size = len(load_tokenizer(peer_args.corpus_args.tokenizer_path))  # as the trainer builds it
    per_core = batch or training_args.per_device_train_batch_size
    kind = "cuda" if device.kind == "cuda" else "cpu"  # a TPU host keeps the model and optimizer in host memory
    seq, checkpointing = peer_args.corpus_args.max_seq_length, training_args.gradient_checkpointing
    return estimate_peak(config, per_core * device.cores, seq, kind, precision, checkpointing)


@dataclass(frozen=True)
class Fit:
    """Whether a trainer's estimated peak fits the memory a machine has free, and what to change where it does not."""

    estimate: MemoryEstimate
    host_free: int
    device_free: int | None
    advice: str = ""  # one line; empty where it fits

    @property
    def fits(self) -> bool:
        return _fits(self.estimate, self.host_free, self.device_free)

    def line(self) -> str:
        free = f"{self.host_free / GIB:.1f} GiB free on the host"
        if self.device_free is not None:
            free += f", {self.device_free / GIB:.1f} GiB on the GPU"
        return f"estimated peak {self.estimate.describe()}; {free}"


# what is left free at the estimated peak, for the estimate's error (within 15% of measured peaks) and the system
HEADROOM = 0.15


def _fits(estimate: MemoryEstimate, host_free: int, device_free: int | None) -> bool:
    if estimate.host_bytes * (1 + HEADROOM) > host_free:
        return False
    return device_free is None or estimate.device_bytes * (1 + HEADROOM) <= device_free


def check_fit(
    peer_args: PeerArguments, device: DeviceInfo, precision: str, host_free: int, device_free: int | None = None
) -> Fit:
    """The estimate against `host_free` and `device_free` bytes; where it does not fit, the advice names the largest
    --per_device_train_batch_size that does (and, on a GPU, --gradient_checkpointing if that is what it takes)."""
    estimate = trainer_estimate(peer_args, device, precision)
    if _fits(estimate, host_free, device_free):
        return Fit(estimate, host_free, device_free)
    training_args = peer_args.training_args
    batch = training_args.per_device_train_batch_size
    while batch > 1:
        batch //= 2
        if _fits(trainer_estimate(peer_args, device, precision, batch), host_free, device_free):
            accumulate = training_args.gradient_accumulation_steps * training_args.per_device_train_batch_size // batch
            advice = (
                f"pass --per_device_train_batch_size {batch} --gradient_accumulation_steps {accumulate} "
                "(the same samples per pass, in smaller forward passes)"
            )
            return Fit(estimate, host_free, device_free, advice)
    if device.kind == "cuda" and not training_args.gradient_checkpointing:
        advice = "add --gradient_checkpointing (activations recomputed in the backward pass), then run --check again"
    else:
        advice = "at one example per pass it still does not fit: use a machine with more memory or a smaller --model"
    return Fit(estimate, host_free, device_free, advice)


def free_memory(device: DeviceInfo) -> tuple[int, int | None]:
    """Bytes free now on the host (what can be taken without swapping) and, for a CUDA peer, on its GPU."""
    import psutil

    device_free = torch.cuda.mem_get_info()[0] if device.kind == "cuda" else None
    return psutil.virtual_memory().available, device_free
