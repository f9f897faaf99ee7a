"""A plain `hivemind.Optimizer` peer in a sahajBERT run, written without any of this project's code: what an old
example script, a misconfigured volunteer or an attacker looks like. `python tests/plain_hivemind_peer.py --run_id
RUN --initial_peers ADDR [--claim_epoch N]`.

It joins the run's keys (hivemind's `<run_id>_progress`, `_state_averager`, `_grad_averager`) with the tiny preset's
parameters in the trainers' order (matrices, then biases and LayerNorm weights), SGD at learning rate 0 (so no
optimizer statistics to share), NaN gradients, one pass of 8 samples about every 0.8 s. `--claim_epoch N` makes its
first progress record claim global step N; with `--start_file PATH` it trains (and claims) only once PATH exists. It
prints `plain peer id <id>`, then `plain peer ready`, then `plain peer at epoch <n>` at each step it makes; it ends
on SIGTERM or after --max_seconds.
"""

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import hivemind
import torch
from transformers import AlbertConfig, AlbertForPreTraining

TINY_CONFIG = Path(__file__).resolve().parents[1] / "sahajbert" / "presets" / "tiny.json"  # the data, not the code


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--claim_epoch", type=int, default=0)
    parser.add_argument("--target_batch_size", type=int, default=96)
    parser.add_argument("--max_seconds", type=float, default=900.0)
    parser.add_argument("--start_file", default=None, help="once ready, wait until this file exists to train")
    args = parser.parse_args()

    config = {k: v for k, v in json.loads(TINY_CONFIG.read_text()).items() if k not in ("architectures", "model_type")}
    model = AlbertForPreTraining(AlbertConfig(**config))
    layer_norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    no_decay = {id(p) for m in layer_norms for p in m.parameters(recurse=False)}
    no_decay |= {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    groups = [
        {"params": [p for p in model.parameters() if id(p) not in no_decay]},
        {"params": [p for p in model.parameters() if id(p) in no_decay]},
    ]
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    print(f"plain peer id {dht.peer_id}", flush=True)
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        params=groups,
        matchmaking_time=5.0,
        averaging_timeout=30.0,
    )
    stopping = []
    # set after the optimizer: hivemind's averagers ignore SIGINT in this process as they start
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print("plain peer ready", flush=True)
    while args.start_file and not Path(args.start_file).exists() and not stopping:
        time.sleep(0.2)  # it has reported nothing yet: hivemind publishes progress once a peer has samples or a step
    if args.claim_epoch:
        optimizer.state_averager.local_epoch = args.claim_epoch
        optimizer.tracker.report_local_progress(args.claim_epoch, 0)
    started = time.monotonic()
    try:
        while not stopping and time.monotonic() - started < args.max_seconds:
            began = time.monotonic()
            for parameter in model.parameters():
                parameter.grad = torch.full_like(parameter, float("nan"))
            epoch = optimizer.local_epoch
            optimizer.step()
            if optimizer.local_epoch != epoch:
                print(f"plain peer at epoch {optimizer.local_epoch}", flush=True)
            time.sleep(max(0.0, 0.8 - (time.monotonic() - began)))
        print(f"plain peer stops at epoch {optimizer.local_epoch}", flush=True)
    finally:
        optimizer.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
