#!/usr/bin/env python
"""The organizer's aux peer: `python run_aux_peer.py --run_id sahajbert --initial_peers ... --output_dir outputs/aux`.

Monitors the swarm (log, wandb, dashboard), saves its state as checkpoints, uploads them to the Hub, can assist
all-reduce without training, and can serve a saved state to rescue a run whose peers all left.
"""

from sahajbert.cli import Flags, parse_args, run, setup_logging
from sahajbert.flags import RECIPE_EXPANSION, AuxPeerArguments, PeerArguments

# The aux peer trains nothing: batch, device and data flags, and the final round (the trainers' ending), are not
# listed. They are accepted and ignored, so that one settings file or command line serves the trainers and the aux
# peer alike.
TRAINER_ONLY = {
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "precision",
    "device",
    "gradient_checkpointing",
    "save_steps",
    "log_every_seconds",
    "final_averaging_window",
    "sources",
    "source_probabilities",
    "data_files",
    "shuffle_buffer",
    "max_seq_length",
    "short_seq_prob",
    "mlm_probability",
    "masking",
    "pad_to_multiple_of",
    "sentence_boundaries",
    "chunking",
}
FLAGS = Flags(
    (PeerArguments, AuxPeerArguments),
    description="The organizer's aux peer: monitor the swarm, checkpoint its state, upload it, assist averaging.",
    hidden=frozenset(TRAINER_ONLY),
    defaults={"output_dir": "outputs/aux"},
    expansions=RECIPE_EXPANSION,
)


def main(argv=None) -> int:
    setup_logging()
    peer_args, aux_args = parse_args(FLAGS, argv)
    from sahajbert.auxiliary import run_aux_peer

    run_aux_peer(peer_args, aux_args)
    return 0


if __name__ == "__main__":
    run(main)
