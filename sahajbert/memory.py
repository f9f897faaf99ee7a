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
import gc
import os
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch

from sahajbert.cli import UserError
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


def set_up_peer_process() -> None:
    """What every peer that holds the model sets before it allocates: large blocks returned to the system as they are
    freed, and large tensors left out of the processes it forks."""
    return_large_frees()
    keep_large_tensors_out_of_forks()


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Give allocations of `threshold` bytes and more their own mappings in this process and the ones it forks
    later (glibc only); True where it was set. Processes already running keep their setting."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


# madvise(2)'s advice that a range is not inherited by processes forked later (Linux): <sys/mman.h>
_MADV_DONTFORK = 10
_SIZE_BIT_MMAPPED = 0x2  # glibc: the bit of a chunk's size word that says it has a mapping of its own
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FORK_HOOK = False  # set once the fork hook is registered in this process


def keep_large_tensors_out_of_forks() -> bool:
    """From now on, every process this one forks (hivemind's DHT and averagers) starts without this process's large
    tensors; True where it was set up (Linux with glibc).

    A forked child shares its parent's pages until either writes them. The parent rewrites its parameters, gradients
    and accumulators every step, and each page it rewrites stays behind as the child's private copy of the old one:
    about 2 copies of the parameters per trainer (sahajbert-xl: 660 MiB of private pages in the forked processes).
    The children never read those tensors (hivemind's averagers work on the shared-memory tensors they are given, and
    ask the parent for its current state over a pipe). So just before each fork the parent marks the mappings of its
    tensors of MMAP_THRESHOLD_BYTES and more that are not in shared memory as not to be inherited. A child that read
    one anyway would crash on it, not compute with stale values."""
    global _FORK_HOOK
    libc = _libc()
    if libc is None or not hasattr(os, "register_at_fork") or not Path("/proc/self/maps").exists():
        return False
    if not _FORK_HOOK:  # a hook cannot be taken back: one per process
        os.register_at_fork(before=lambda: _advise_quietly(libc, _MADV_DONTFORK))
        _FORK_HOOK = True
    return True


def _advise_quietly(libc, advice: int) -> None:
    # before a fork: whatever goes wrong here costs memory, never the fork (Python would print its traceback)
    try:
        _advise_large_tensors(libc, advice)
    except Exception:  # noqa: BLE001
        pass


def _libc():
    """glibc, or None (musl, macOS: their allocators are left as they are)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mallopt, libc.madvise  # noqa: B018 (a libc that is not glibc lacks mallopt)
    except (OSError, AttributeError, TypeError):
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _advise_large_tensors(libc, advice: int) -> int:
    """madvise the mapping of every CPU tensor of MMAP_THRESHOLD_BYTES or more that has one of its own and is not in
    shared memory; the bytes advised."""
    gc.collect()  # garbage still to be collected holds no tensor a child would free
    mappings = _anonymous_mappings()
    seen, advised = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # not isinstance: it would read some objects' __class__
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, meta, or a tensor subclass without one
            continue
        if storage.device.type != "cpu" or storage.nbytes() < MMAP_THRESHOLD_BYTES or storage.is_shared():
            continue
        pointer = storage.data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        span = _own_mapping(pointer, storage.nbytes(), mappings)
        if span is not None and libc.madvise(span[0], span[1], advice) == 0:
            advised += span[1]
    return advised


def _anonymous_mappings() -> list[tuple[int, int]]:
    """This process's private, writable, anonymous mappings as (start, end), from /proc/self/maps."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p":  # no path: anonymous ([heap] and [stack] have one)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def _own_mapping(pointer: int, nbytes: int, mappings: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(start, length) of the mapping glibc made for the one allocation at `pointer` alone, or None where it is not
    one: the chunk's size word (8 bytes before the pointer) has the mmapped bit, and its start (the previous word back
    from the chunk's header) and length are whole pages inside one anonymous mapping, with the tensor's bytes in it."""
    inside = next(((start, end) for start, end in mappings if start + 16 <= pointer < end), None)
    if inside is None:
        return None
    size_word = ctypes.c_size_t.from_address(pointer - 8).value
    if not size_word & _SIZE_BIT_MMAPPED:
        return None
    offset = ctypes.c_size_t.from_address(pointer - 16).value  # from the mapping's start to the chunk's header
    start, length = pointer - 16 - offset, offset + (size_word & ~0x7)
    if start % _PAGE or length % _PAGE or start < inside[0] or start + length > inside[1]:
        return None
    if pointer + nbytes > start + length:
        return None
    return start, length


# Copies of the parameters (fp32) a CPU trainer holds at its peak: a plain PyTorch loop's 4 (weights, gradients, LAMB's
# two moments); the offloaded master parameters and their gradients (2), hivemind's gradient accumulators and
# averaging buffer (2), the state averager's buffer (1), less what the estimate's other terms overlap; and what grows
# with the model beyond them: LAMB's per-step temporaries, DiLoCo's outer and inner state. Fitted by least squares with
# the activation factor below on 8 measured peaks (bench_overhead.py at 451b6ef-4468371: the last good state on disk,
# large tensors kept out of forked processes; both modes, sahajbert at 4 and sahajbert-xl at 2 examples of 128
# tokens): 8.5 copies and 1.23x the saved activations, every one of the 8 within 6.3% of its estimate (DiLoCo 2-6%
# above it, data parallel 1-4% below). Before those two changes: 18.5 copies and 1.05x, within 3.0%.
TRAINER_COPIES_CPU = 8.5
# the last good state for rollback, where --keep_good_state memory keeps it: the parameters and LAMB's two moments
GOOD_STATE_COPIES = 3
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
# slack), as a factor: fitted above, with the trainer's allocator setting (glibc's default kept up to 1.8x the saved
# bytes in a plain loop at sahajbert-xl).
ACTIVATION_PEAK_FACTOR = 1.23


class _FusedAttention(torch.autograd.Function):
    """scaled_dot_product_attention as the fused kernels that compute it on CPUs and GPUs keep it for the backward
    pass: queries, keys, values, output and one log-sum-exp per query (no batch x heads x seq x seq probabilities,
    which the meta device's reference decomposition would keep). Shapes only: it runs on the meta device."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        ctx.save_for_backward(query, key, value, output, query.new_empty(query.shape[:-1]))
        return output


def _fused_attention(query, key, value, *args, **kwargs):
    return _FusedAttention.apply(query, key, value)


def saved_activation_bytes(config, batch: int, seq: int) -> int:
    """Bytes autograd keeps for the backward pass of one pretraining forward pass of `batch` x `seq` tokens in fp32,
    counted on the meta device: each storage once (views of one tensor share it), the parameters' own not at all
    (a layer keeps its weight for the backward pass; that is a copy counted apart)."""
    model = _meta_model(config).train()
    weights = {parameter.untyped_storage()._cdata for parameter in model.parameters()}
    with torch.device("meta"):
        ids = torch.randint(5, config.vocab_size, (batch, seq))
        order = torch.zeros(batch, dtype=torch.long)
    storages: dict[int, int] = {}
    kept = []  # holds every saved tensor until counted, so that no storage's address is reused meanwhile

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            storages[storage._cdata] = storage.nbytes()
        kept.append(tensor)
        return tensor

    # no attention mask: a full batch of `seq` tokens is the largest a pass takes, and the meta device cannot decide
    # whether a mask is all ones
    fused = mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _fused_attention)
    with fused, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, sentence_order_label=order)
    return sum(storages.values())


@dataclass(frozen=True)
class MemoryEstimate:
    host_bytes: int
    device_bytes: int | None  # on the accelerator; None where the activations live in host memory (CPU) or are not
    # estimated (a TPU's own memory)
    parameters: int
    activation_bytes: int  # of one pass, at its peak, on the device that computes

    def describe(self) -> str:
        text = f"host {self.host_bytes / GIB:.1f} GiB"
        if self.device_bytes is not None:
            text += f", GPU {self.device_bytes / GIB:.1f} GiB"
        return text


def estimate_peak(
    config,
    batch: int,
    seq: int,
    device_kind: str = "cpu",
    precision: str = "fp32",
    checkpointing: bool = False,
    good_state_in_memory: bool = False,
) -> MemoryEstimate:
    """A trainer's peak memory with `config`, `batch` examples of `seq` tokens per pass, on `device_kind` ("cpu",
    "cuda", "tpu": a TPU host keeps the model's copies in host memory, its activations on the TPU, not estimated), in
    `precision`, with gradient checkpointing or not (a model that cannot recompute is refused by the trainer), its
    last good state on disk or in memory (--keep_good_state)."""
    parameters = sum(p.numel() for p in _meta_model(config).parameters())
    one_copy = parameters * 4  # fp32: what every copy of the parameters is kept in, whatever the compute precision
    half = HALF_PRECISION_ACTIVATION_SHARE if precision in ("fp16", "bf16") else 1.0
    if checkpointing:  # the embeddings', the head's and one layer's activations, and every other layer's input (fp32)
        one_layer = copy.deepcopy(config)
        one_layer.num_hidden_layers = 1
        inputs = (config.num_hidden_layers - 1) * batch * seq * config.hidden_size * 4
        saved = saved_activation_bytes(one_layer, batch, seq) * half + inputs
    else:
        saved = saved_activation_bytes(config, batch, seq) * half
    activations = int(saved * ACTIVATION_PEAK_FACTOR)
    runtime = RUNTIME_BYTES + TRAINER_RUNTIME_BYTES
    good_state = GOOD_STATE_COPIES * one_copy if good_state_in_memory else 0  # on disk: none
    if device_kind == "cuda":
        host = CUDA_HOST_RUNTIME_BYTES + runtime + HOST_COPIES_ACCELERATOR * one_copy + good_state
        device = CUDA_CONTEXT_BYTES + DEVICE_COPIES_ACCELERATOR * one_copy + activations
        return MemoryEstimate(int(host), int(device), parameters, activations)
    host = runtime + TRAINER_COPIES_CPU * one_copy + good_state + (activations if device_kind == "cpu" else 0)
    return MemoryEstimate(int(host), None, parameters, activations)


def _meta_model(config):
    from sahajbert.model import model_class

    with torch.device("meta"):
        return model_class(config)(config)


def trainer_estimate(
    peer_args: PeerArguments, device: DeviceInfo, precision: str, batch: int | None = None
) -> MemoryEstimate:
    """The estimate for a trainer with `peer_args` on `device` in `precision`; `batch` examples per core instead of
    --per_device_train_batch_size where given."""
    return _estimate(_trainer_config(peer_args), peer_args, device, precision, batch)


def _trainer_config(peer_args: PeerArguments):
    """The model's config as the trainer builds it: its vocabulary follows the tokenizer."""
    from sahajbert.model import read_config
    from sahajbert.tokenization import load_tokenizer

    config = read_config(peer_args.model_args.model)
    try:
        config.vocab_size = len(load_tokenizer(peer_args.corpus_args.tokenizer_path))
    except UserError:  # not loadable here (a Hub name, offline): the preset's is the run tokenizer's (32,000)
        pass
    return config


def _estimate(config, peer_args: PeerArguments, device: DeviceInfo, precision: str, batch: int | None):
    training_args = peer_args.training_args
    per_core = batch or training_args.per_device_train_batch_size
    seq, checkpointing = peer_args.corpus_args.max_seq_length, training_args.gradient_checkpointing
    in_memory = training_args.keep_good_state == "memory"
    return estimate_peak(config, per_core * device.cores, seq, device.kind, precision, checkpointing, in_memory)


@dataclass(frozen=True)
class Fit:
    """Whether a trainer's estimated peak fits the memory a machine has free, and what to change where it does not."""

    estimate: MemoryEstimate
    host_free: int
    device_free: int | None
    advice: str = ""  # one line; empty where it fits

    @property
    def fits(self) -> bool:
        return not _short_of(self.estimate, self.host_free, self.device_free)

    def line(self) -> str:
        free = f"{self.host_free / GIB:.1f} GiB free on the host"
        if self.device_free is not None:
            free += f", {self.device_free / GIB:.1f} GiB on the GPU"
        return f"estimated peak {self.estimate.describe()}; {free}"


# An estimate fits where it plus this fraction of itself is free: the estimate's own error (within 15% of the peaks
# measured, tests/test_memory.py) must not turn a fit into the system stopping the trainer.
HEADROOM = 0.15


def _short_of(estimate: MemoryEstimate, host_free: int, device_free: int | None) -> list[str]:
    """Which memories ("host", "GPU") the estimate with its headroom does not fit."""
    if (estimate.device_bytes is None) != (device_free is None):
        raise ValueError("an estimate of GPU memory needs the GPU's free memory, and only then")
    short = ["host"] if estimate.host_bytes * (1 + HEADROOM) > host_free else []
    if device_free is not None and estimate.device_bytes * (1 + HEADROOM) > device_free:
        short.append("GPU")
    return short


def check_fit(
    peer_args: PeerArguments, device: DeviceInfo, precision: str, host_free: int, device_free: int | None = None
) -> Fit:
    """The estimate against `host_free` and `device_free` bytes; where it does not fit, one line of advice: the largest
    --per_device_train_batch_size that fits with the same samples per pass, else what else would."""
    from sahajbert.model import supports_gradient_checkpointing

    config = _trainer_config(peer_args)  # read once: each batch tried below only changes the activations
    estimate = _estimate(config, peer_args, device, precision, None)
    short = _short_of(estimate, host_free, device_free)
    if not short:
        return Fit(estimate, host_free, device_free)
    training_args = peer_args.training_args
    if "host" in short and training_args.keep_good_state == "memory":
        on_disk = replace(peer_args, training_args=replace(training_args, keep_good_state="disk"))
        if not _short_of(_estimate(config, on_disk, device, precision, None), host_free, device_free):
            advice = "leave out --keep_good_state memory (the state a rollback restores is then kept on disk)"
            return Fit(estimate, host_free, device_free, advice)
    per_core, accumulation = training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps
    samples = per_core * accumulation  # per core and pass: kept, so that the run's step is what it was
    batch_matters = device.kind == "cpu" or short == ["GPU"]  # on an accelerator the host holds no activations
    for batch in range(per_core - 1, 0, -1) if batch_matters else ():
        if samples % batch:
            continue  # it would change the samples per pass
        if not _short_of(_estimate(config, peer_args, device, precision, batch), host_free, device_free):
            advice = (
                f"pass --per_device_train_batch_size {batch} --gradient_accumulation_steps {samples // batch} "
                "(the same samples per pass, in smaller forward passes)"
            )
            return Fit(estimate, host_free, device_free, advice)
    if short == ["GPU"] and not training_args.gradient_checkpointing:
        if supports_gradient_checkpointing(config):
            advice = "add --gradient_checkpointing (activations recomputed in the backward pass), then --check again"
            return Fit(estimate, host_free, device_free, advice)
    where = " and ".join(short)
    advice = f"this model does not fit the {where} memory free here: use a machine with more, or a smaller --model"
    if "GPU" in short:
        advice += " or --max_seq_length"
    return Fit(estimate, host_free, device_free, advice)


def free_memory(device: DeviceInfo) -> tuple[int, int | None]:
    """Bytes free now on the host (what can be taken without swapping, within this container's limit where one is
    set) and, for a CUDA peer, on its GPU."""
    import psutil

    host = psutil.virtual_memory().available
    try:  # cgroup v2: a container's limit, which psutil's machine-wide figures do not see
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            host = min(host, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    device_free = torch.cuda.mem_get_info()[0] if device.kind == "cuda" else None
    return host, device_free
