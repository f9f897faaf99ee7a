"""The flag groups of each peer script: a peer that holds the model (all the groups together), the demo swarm, the
aux peer and the trainer's own switches."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from sahajbert.flags.averaging import AveragingArguments, CollaborativeOptimizerArguments, SparseDiLoCoArguments
from sahajbert.flags.data import CorpusArguments
from sahajbert.flags.swarm import SwarmArguments
from sahajbert.flags.training import LocalTrainingArguments, ModelArguments
from sahajbert.recipes import RECIPES


@dataclass
class PeerArguments:
    """Every setting of a peer that holds the model (a trainer, the aux peer), one group per concern.

    Scripts parse the groups' flags together (`sahajbert.cli.parse_args` builds this from them); the aux peer is
    built from the same groups as the trainers, so it never re-types a hyperparameter.
    """

    swarm_args: SwarmArguments = field(default_factory=SwarmArguments)
    averaging_args: AveragingArguments = field(default_factory=AveragingArguments)
    optimizer_args: CollaborativeOptimizerArguments = field(default_factory=CollaborativeOptimizerArguments)
    sparse_args: SparseDiLoCoArguments = field(default_factory=SparseDiLoCoArguments)
    model_args: ModelArguments = field(default_factory=ModelArguments)
    training_args: LocalTrainingArguments = field(default_factory=LocalTrainingArguments)
    corpus_args: CorpusArguments = field(default_factory=CorpusArguments)

    # the field types in field order: what the parser fills, one group after the other
    GROUPS: ClassVar[tuple[type, ...]] = (
        SwarmArguments,
        AveragingArguments,
        CollaborativeOptimizerArguments,
        SparseDiLoCoArguments,
        ModelArguments,
        LocalTrainingArguments,
        CorpusArguments,
    )

    def __post_init__(self):
        optimizer, fragments = self.optimizer_args, self.sparse_args.diloco_fragments
        if fragments > 1 and (
            optimizer.pseudo_gradient_compression != "sparse" or fragments > optimizer.diloco_inner_steps
        ):
            raise ValueError(
                f"--diloco_fragments {fragments} needs --pseudo_gradient_compression sparse and at most "
                f"--diloco_inner_steps fragments (got {optimizer.diloco_inner_steps})"
            )


@dataclass
class LocalSwarmArguments:
    """run_local_swarm.py (make demo): a first peer and trainers on this machine, on the bundled sample."""

    TITLE: ClassVar[str] = "demo"

    num_trainers: int = field(default=2, metadata={"help": "Trainer processes to start."})
    max_steps: int = field(default=10, metadata={"help": "Global steps to train before stopping."})
    target_batch_size: int = field(default=384, metadata={"help": "Samples per global step, all trainers together."})
    output_dir: str = field(default="outputs/demo", metadata={"help": "Logs and each trainer's checkpoints go here."})
    run_id: str = field(default="demo", metadata={"help": "Run name inside the local swarm."})
    timeout: float = field(
        default=600.0, metadata={"help": "Give up (and stop every process) after this many seconds."}
    )


@dataclass
class AuxPeerArguments:
    """run_aux_peer.py: watch the swarm, save and publish its state, help it average."""

    TITLE: ClassVar[str] = "aux peer"

    refresh_period: float = field(default=10.0, metadata={"help": "Seconds between reads of the peers' metrics."})
    checkpoint_every: int = field(
        default=100,
        metadata={"help": "Download the swarm's state and save a checkpoint every this many global steps."},
    )
    wandb_project: Optional[str] = field(
        default=None, metadata={"help": "Log the swarm's metrics to this wandb project (WANDB_MODE=offline works)."}
    )
    push_to_hub: bool = field(
        default=False, metadata={"help": "Upload the latest checkpoint to the Hugging Face Hub."}
    )
    hub_model_id: Optional[str] = field(default=None, metadata={"help": "Hub repo to upload to, as org/name."})
    upload_interval: float = field(default=3600.0, metadata={"help": "Seconds between Hub uploads (and retries)."})
    assist_in_averaging: bool = field(
        default=False, metadata={"help": "Take part in all-reduce without training (needs incoming connections)."}
    )
    initial_state: Optional[str] = field(
        default=None,
        metadata={"help": "Checkpoint folder to serve to joining trainers (seed or rescue a run), at its step."},
    )
    dashboard_port: Optional[int] = field(
        default=None, metadata={"help": "Serve the live dashboard on this port (0: any free port)."}
    )
    dashboard_host: str = field(default="127.0.0.1", metadata={"help": "Address the dashboard listens on."})

    def __post_init__(self):
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id org/name")
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint_every must be at least 1, got {self.checkpoint_every}")


@dataclass
class TrainerScriptArguments:
    """run_trainer.py's own switches."""

    TITLE: ClassVar[str] = "trainer"

    auto_config: bool = field(
        default=False,
        metadata={
            "help": "Choose device, precision, batch size, gradient checkpointing and client mode from this "
            "machine's hardware; flags you give explicitly still win."
        },
    )
    check: bool = field(
        default=False, metadata={"help": "Run the preflight checklist (p2pd, peers, limits, versions, disk) and exit."}
    )


# the trainer and the aux peer take `--recipe`: one reference run's whole recipe, under the flags given
RECIPE_EXPANSION = {"recipe": RECIPES}
