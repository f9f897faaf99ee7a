"""The memory estimate --check and --auto_config print (sahajbert.memory): the activations it counts on the meta device
are the ones a real pass keeps, and a machine too small gets one line that names settings that fit. Against measured
peaks at the real sizes: test_the_estimate_is_within_15_percent_of_a_measured_trainer (make test-scale)."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sahajbert.devices import DeviceInfo
from sahajbert.flags import CorpusArguments, LocalTrainingArguments, ModelArguments, PeerArguments
from sahajbert.memory import (
    GIB,
    MIB,
    check_fit,
    estimate_peak,
    return_large_frees,
    saved_activation_bytes,
    trainer_estimate,
)
from sahajbert.model import load_config, model_class

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo("cpu", "cpu")
T4 = DeviceInfo("cuda", "Tesla T4", (7, 5), 15.0)


def saved_by_a_real_pass(config, batch: int, seq: int) -> int:
    """Bytes autograd keeps in a real forward pass on the CPU, each storage once (by its address), the parameters'
    own not counted."""
    torch.manual_seed(0)
    model = model_class(config)(config).train()
    weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    storages, kept = {}, []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        kept.append(tensor)
        return tensor

    ids = torch.randint(5, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, sentence_order_label=torch.zeros(batch, dtype=torch.long))
    return sum(storages.values())


@pytest.mark.parametrize("model,batch,seq", [("tiny", 4, 128), ("tiny-xl", 2, 256)])
def test_activations_counted_on_the_meta_device_are_what_a_real_pass_keeps(tokenizer, model, batch, seq):
    config = load_config(model, tokenizer)
    counted = saved_activation_bytes(config, batch, seq)
    real = saved_by_a_real_pass(config, batch, seq)
    assert counted == pytest.approx(real, rel=0.05)
    # and they grow with the batch as a pass's activations do
    assert saved_activation_bytes(config, 2 * batch, seq) == pytest.approx(2 * counted, rel=0.05)


def peer_args(model: str, batch: int, seq: int = 512, accumulate: int = 1, checkpointing: bool = False):
    return PeerArguments(
        model_args=ModelArguments(model=model),
        training_args=LocalTrainingArguments(
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate,
            gradient_checkpointing=checkpointing,
        ),
        corpus_args=CorpusArguments(tokenizer_path="sample", max_seq_length=seq),
    )


def test_a_trainer_too_big_for_the_host_is_told_the_batch_that_fits():
    args = peer_args("sahajbert", batch=16, accumulate=2)
    big = trainer_estimate(args, CPU, "fp32")
    fit = check_fit(args, CPU, "fp32", host_free=big.host_bytes // 2)
    assert not fit.fits and fit.estimate == big
    assert "--per_device_train_batch_size" in fit.advice and "\n" not in fit.advice
    batch = int(fit.advice.split("--per_device_train_batch_size ")[1].split()[0])
    accumulate = int(fit.advice.split("--gradient_accumulation_steps ")[1].split()[0])
    assert batch < 16 and batch * accumulate == 16 * 2  # the same samples per pass
    smaller = trainer_estimate(args, CPU, "fp32", batch=batch)
    assert smaller.host_bytes * 1.15 <= big.host_bytes // 2  # the advice's settings fit where the asked ones did not
    larger = trainer_estimate(args, CPU, "fp32", batch=next(b for b in range(batch + 1, 17) if 32 % b == 0))
    assert larger.host_bytes * 1.15 > big.host_bytes // 2  # and it is the largest batch that does
    assert check_fit(args, CPU, "fp32", host_free=100 * GIB).fits
    too_small = check_fit(args, CPU, "fp32", host_free=100 * MIB)
    assert "use a machine with more" in too_small.advice and "--per_device" not in too_small.advice


def test_a_good_state_kept_in_memory_costs_three_copies_and_is_the_first_advice_where_dropping_it_fits():
    from dataclasses import replace

    on_disk = peer_args("sahajbert-xl", batch=2, seq=128)
    in_memory = replace(on_disk, training_args=replace(on_disk.training_args, keep_good_state="memory"))
    disk, memory = (trainer_estimate(args, CPU, "fp32") for args in (on_disk, in_memory))
    assert memory.host_bytes - disk.host_bytes == 3 * 4 * disk.parameters  # the parameters and two moments, fp32
    fit = check_fit(in_memory, CPU, "fp32", host_free=int(disk.host_bytes * 1.15) + 1)
    assert not fit.fits and fit.advice.startswith("leave out --keep_good_state memory"), fit.advice
    assert check_fit(on_disk, CPU, "fp32", host_free=int(disk.host_bytes * 1.15) + 1).fits


def test_the_advice_keeps_the_samples_per_pass_also_where_the_batch_is_no_power_of_two():
    args = peer_args("sahajbert", batch=6, accumulate=1)
    six, three = (trainer_estimate(args, CPU, "fp32", batch=b).host_bytes for b in (6, 3))
    fit = check_fit(args, CPU, "fp32", host_free=int(three * 1.15) + 1)
    assert not fit.fits and six * 1.15 > three * 1.15 + 1
    assert "--per_device_train_batch_size 3 --gradient_accumulation_steps 2 " in fit.advice  # not 4 or 5: 6 samples


def test_on_a_gpu_the_estimate_splits_host_and_device_and_checkpointing_lowers_the_device_part():
    plain = trainer_estimate(peer_args("sahajbert", batch=16), T4, "fp16")
    recomputed = trainer_estimate(peer_args("sahajbert", batch=16, checkpointing=True), T4, "fp16")
    assert plain.device_bytes is not None and recomputed.device_bytes < plain.device_bytes / 2
    assert recomputed.host_bytes == plain.host_bytes  # activations live on the GPU: the host part does not change
    # a device that holds the asked batch only when recomputing is told a smaller batch that fits as it is
    fit = check_fit(peer_args("sahajbert", batch=16), T4, "fp16", host_free=100 * GIB, device_free=plain.device_bytes)
    assert not fit.fits and "--per_device_train_batch_size 8 --gradient_accumulation_steps 2" in fit.advice
    # at batch 1 on a device of 0 bytes nothing fits: recomputing is the last thing to suggest on a GPU, for a model
    # that can (LeanALBERT), never for one the trainer would refuse it for (transformers' ALBERT)
    nothing = check_fit(peer_args("sahajbert-xl", batch=1), T4, "fp16", host_free=100 * GIB, device_free=0)
    assert "--gradient_checkpointing" in nothing.advice
    nothing = check_fit(peer_args("sahajbert", batch=1), T4, "fp16", host_free=100 * GIB, device_free=0)
    assert "--gradient_checkpointing" not in nothing.advice and "a smaller --model" in nothing.advice
    # a host too small on a GPU peer: a smaller batch does not help (its activations are on the GPU)
    host_short = check_fit(peer_args("sahajbert", batch=16), T4, "fp16", host_free=GIB, device_free=100 * GIB)
    assert not host_short.fits and "host memory" in host_short.advice and "--per_device" not in host_short.advice
    with pytest.raises(ValueError):  # a GPU estimate is checked against the GPU's free memory, never without it
        check_fit(peer_args("sahajbert", batch=16), T4, "fp16", host_free=100 * GIB)


def test_the_allocator_setting_is_made_where_glibc_allocates():
    assert return_large_frees() == (platform.libc_ver()[0] == "glibc")


FORKED_WITHOUT_LARGE_TENSORS = """
import multiprocessing, os, sys, torch
from sahajbert import memory
memory.set_up_peer_process()
private = torch.ones(4 * 2**20)  # 16 MiB: its own mapping
shared = torch.full((4 * 2**20,), 3.0).share_memory_()  # what hivemind's averagers average: shared with the child
small = torch.full((1000,), 2.0)  # in the heap, with other objects: inherited as it is
address = private.untyped_storage().data_ptr()

def child():
    inherited = any(start <= address < end for start, end in memory._anonymous_mappings())
    print(inherited, float(shared[0]), float(shared[-1]), float(small[-1]), flush=True)
    shared[0] = 5.0

process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(60)
private += 1
print(process.exitcode, float(shared[0]), float(private[-1]), flush=True)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator, Linux's madvise")
def test_a_forked_process_starts_without_the_peers_large_private_tensors_and_shares_the_shared_ones():
    # in a process of its own: the fork hook stays for the life of the process that sets it
    result = subprocess.run(
        [sys.executable, "-c", FORKED_WITHOUT_LARGE_TENSORS], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    child, parent = result.stdout.split("\n")[:2]
    # the child: no mapping where the parent's private tensor is; the shared tensor and the small one as they were
    assert child.split() == ["False", "3.0", "3.0", "2.0"], child
    # the parent: the child ended cleanly, its write to the shared tensor arrived, its own tensor is intact
    assert parent.split() == ["0", "5.0", "2.0"], parent


def test_the_larger_preset_is_estimated_larger_at_every_part(tokenizer):
    small, large = (estimate_peak(load_config(m, tokenizer), 2, 128) for m in ("sahajbert", "sahajbert-xl"))
    assert large.parameters > 4 * small.parameters
    assert large.host_bytes > small.host_bytes and large.activation_bytes > small.activation_bytes


@pytest.mark.scale
@pytest.mark.timeout(1200)
def test_the_estimate_is_within_15_percent_of_a_measured_trainer(tmp_path):
    """benchmarks/bench_overhead.py measures a real trainer alone at the sahajbert preset (peak PSS of its process
    tree); the estimate of the same settings is within 15% of it."""
    output = tmp_path / "overhead.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_overhead.py"), "--models", "sahajbert"]
    command += ["--batch_size", "2", "--passes_per_step", "2", "--steps", "3", "--output_json", str(output)]
    command += ["--throughput_from", "sampled"]  # only its memory is asserted
    done = subprocess.run(command, capture_output=True, text=True, timeout=1150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for row in json.loads(output.read_text()):
        assert abs(row["estimate_error"]) <= 0.15, row
