"""Run by tests/test_xla.py in the TPU virtualenv (.venv-tpu) with PJRT_DEVICE=CPU and CPU_NUM_DEVICES=4.

One SPMD pass of the tiny ALBERT on the XLA devices against the same pass on the plain CPU, on the same batch; then
parameters changed on the host (as hivemind's step changes them) are pushed to the device and a second pass is
compared again; then the same first comparison for the tiny LeanALBERT. Prints one JSON object of measurements; the
test judges them.
"""

import copy
import json

import torch

from sahajbert.collators import PretrainingCollator
from sahajbert.compute import Compute
from sahajbert.devices import describe_device
from sahajbert.flags import CorpusArguments
from sahajbert.model import build_model
from sahajbert.samples import SAMPLE_FILES, SAMPLE_TOKENIZER
from sahajbert.stream import batched, iterate_examples
from sahajbert.tokenization import load_tokenizer
from sahajbert.xla import SpmdReplica

SEQ = 64


def cpu_pass(model, batch):
    """Loss and gradients of one plain-CPU pass in fp32 (a fresh copy of `model`, its gradients returned)."""
    model = copy.deepcopy(model)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def compare(reference, grads) -> float:
    """Largest |difference| over all gradient entries, relative to the largest reference gradient entry.

    A parameter the forward never uses (LeanALBERT's full_layer_layer_norm) has no reference gradient: the other
    side must send none, or zeros, for it."""
    unused = [b for a, b in zip(reference, grads) if a is None]
    assert all(b is None or not b.any() for b in unused), "a gradient for a parameter the forward does not use"
    pairs = [(a, b) for a, b in zip(reference, grads) if a is not None]
    scale = max(a.abs().max().item() for a, _ in pairs)
    return max((a - b).abs().max().item() for a, b in pairs) / scale


def main() -> None:
    device = describe_device("tpu")  # switches on SPMD before any XLA tensor exists
    tokenizer = load_tokenizer(str(SAMPLE_TOKENIZER))
    corpus = CorpusArguments(tokenizer_path=str(SAMPLE_TOKENIZER), data_files=SAMPLE_FILES, max_seq_length=SEQ)
    collator = PretrainingCollator.from_tokenizer(tokenizer, pad_to_multiple_of=SEQ, seed=1)
    batches = batched(iterate_examples(corpus, tokenizer, seed=1), 2 * device.cores, collator)
    batch, next_batch = next(batches), next(batches)

    host = build_model("tiny", tokenizer, seed=0).eval()  # eval: the SOP head's dropout would differ per device
    report = {"device": device.name, "cores": device.cores, "batch": int(batch["input_ids"].shape[0])}

    replica = SpmdReplica(host, dtype=None)
    report["implements_compute"] = isinstance(replica, Compute)
    replica.replica.eval()
    loss = replica.backward(batch, 1.0)
    replica.finish_pass()
    cpu_loss, cpu_grads = cpu_pass(host, batch)
    grads = [p.grad for p in host.parameters()]
    report.update(
        xla_loss=loss.item(),
        cpu_loss=cpu_loss,
        grad_rel_diff=compare(cpu_grads, grads),
        host_grad_dtypes=sorted({str(g.dtype) for g in grads}),
        input_sharding=replica.input_sharding,
    )

    # hivemind's step changes the host parameters; the device copy must follow exactly
    with torch.no_grad():
        for parameter, gradient in zip(host.parameters(), grads):
            parameter.sub_(0.5 * gradient)
    report["diff_before_push"] = replica.max_difference()
    replica.push_parameters()
    report["diff_after_push"] = replica.max_difference()
    loss = replica.backward(next_batch, 1.0)
    replica.finish_pass()
    cpu_loss, cpu_grads = cpu_pass(host, next_batch)
    report.update(
        xla_loss_after_push=loss.item(),
        cpu_loss_after_push=cpu_loss,
        grad_rel_diff_after_push=compare(cpu_grads, [p.grad for p in host.parameters()]),
    )

    # bf16 autocast on the device: what reaches the host is still unscaled fp32 gradients of the same pass
    bf16 = SpmdReplica(host, dtype=torch.bfloat16)
    bf16.replica.eval()
    loss = bf16.backward(next_batch, 1.0)
    bf16.finish_pass()
    report.update(
        bf16_loss=loss.item(),
        bf16_grad_dtypes=sorted({str(p.grad.dtype) for p in host.parameters()}),
        bf16_grad_rel_diff=compare(cpu_grads, [p.grad for p in host.parameters()]),
        recompilations=replica.recompilations + bf16.recompilations,
    )

    # LeanALBERT (sahajBERT-XL's architecture, tiny sizes): its rotary attention and GeGLU through the same path
    lean_host = build_model("tiny-xl", tokenizer, seed=0).eval()
    lean = SpmdReplica(lean_host, dtype=None)
    lean.replica.eval()
    loss = lean.backward(batch, 1.0)
    lean.finish_pass()
    cpu_loss, cpu_grads = cpu_pass(lean_host, batch)
    report.update(
        lean_model=type(lean_host).__name__,
        lean_xla_loss=loss.item(),
        lean_cpu_loss=cpu_loss,
        lean_grad_rel_diff=compare(cpu_grads, [p.grad for p in lean_host.parameters()]),
        lean_recompilations=lean.recompilations,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
