#!/usr/bin/env python
"""A volunteer's trainer peer: `python run_trainer.py --run_id sahajbert --initial_peers <from run_first_peer.py>`.

`--auto_config` picks settings from the hardware; `--check` runs the preflight checklist instead of training.
"""

import sys

from sahajbert.cli import Flags, parse_args, run, setup_logging
from sahajbert.flags import RECIPE_EXPANSION, PeerArguments, TrainerScriptArguments

FLAGS = Flags(
    (PeerArguments, TrainerScriptArguments),
    description="A volunteer's trainer peer: join a run with the line run_first_peer.py printed, and train.",
    expansions=RECIPE_EXPANSION,
)


def main(argv=None) -> int:
    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    peer_args, script_args = parse_args(FLAGS, argv)
    if script_args.auto_config:
        from sahajbert.devices import auto_configure, describe_device, trainer_precision
        from sahajbert.memory import check_fit, free_memory
        from sahajbert.model import read_config, supports_gradient_checkpointing

        device = describe_device(peer_args.training_args.device)
        can_recompute = supports_gradient_checkpointing(read_config(peer_args.model_args.model))
        hardware = auto_configure(device, can_recompute, bool(peer_args.optimizer_args.diloco_inner_steps))
        # explicit flags come after the automatic ones, so they win (a settings file stays first)
        settings = argv[:1] if argv and argv[0].endswith(".json") else []
        peer_args, script_args = parse_args(FLAGS, settings + hardware.as_flags() + argv[len(settings) :])
        diloco = bool(peer_args.optimizer_args.diloco_inner_steps)
        precision = trainer_precision(device, peer_args.training_args.precision, diloco)
        fit = check_fit(peer_args, device, precision, *free_memory(device))
        print(f"auto config for {device.name}: {' '.join(hardware.as_flags())}; {fit.line()}", flush=True)
        if not fit.fits:
            print(f"it may not fit: {fit.advice}", flush=True)
    if script_args.check:
        from sahajbert.preflight import run_checks

        checks = run_checks(peer_args)
        print("\n".join(check.line() for check in checks), flush=True)
        failed = [check.name for check in checks if check.status == "fail"]
        warned = [check.name for check in checks if check.status == "warn"]
        summary = f"{len(checks) - len(failed) - len(warned)}/{len(checks)} checks passed"
        summary += f"; {len(warned)} with a warning: {', '.join(warned)}" if warned else ""
        print(summary + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
        return 1 if failed else 0
    from sahajbert.trainer import train  # heavy imports after parsing, so --help and bad flags answer at once

    result = train(peer_args)
    print(
        f"trainer stopped at global step {result.final_step}"
        + (f"; checkpoint {result.checkpoint}" if result.checkpoint else "")
    )
    return 0


if __name__ == "__main__":
    run(main)
