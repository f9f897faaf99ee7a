"""The averaging's flags: matchmaking, timeouts and compression of the rounds, and the collaborative optimizer's
global step (target batch, delayed updates, state averaging)."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

DILOCO_OUTER_LR = 0.7  # DiLoCo's and OpenDiLoCo's, with Nesterov momentum 0.9
# SparseLoCo's outer step has no momentum (its error feedback carries the rest): see benchmarks/README.md's sweep
SPARSE_OUTER_LR = 2.0


@dataclass
class AveragingArguments:
    """How peers all-reduce gradients and parameters."""

    TITLE: ClassVar[str] = "averaging"

    # None: automatic (sahajbert.adaptive.plan_timing), from this peer's measured link and the model's size
    matchmaking_time: Optional[float] = field(
        default=None,
        metadata={
            "help": "Seconds spent gathering a group of peers for each all-reduce (default: automatic, 5-30 s by the "
            "measured round trip)."
        },
    )
    averaging_timeout: Optional[float] = field(
        default=None,
        metadata={
            "help": "Seconds after which an unfinished all-reduce round is abandoned (default: automatic, 3x the "
            "round's estimated time from the model's size and the measured bandwidth, 30-1800 s)."
        },
    )
    next_chunk_timeout: Optional[float] = field(
        default=None,
        metadata={
            "help": "Seconds to wait for a peer's next chunk before averaging without it (default: automatic, "
            "10 s up to half the averaging timeout)."
        },
    )
    target_group_size: Optional[int] = field(
        default=None, metadata={"help": "Most peers in one all-reduce group (default: everyone)."}
    )
    bandwidth: Optional[float] = field(
        default=None,
        metadata={
            "help": "This peer's bandwidth in Mbit/s, declared to both averagers: faster peers reduce larger parts "
            "(default: measured at start against an initial peer, the lower of upload and download)."
        },
    )
    compression: str = field(
        default="fp16",
        metadata={"help": "Compression of averaged tensors.", "choices": ["none", "fp16", "8bit", "adaptive"]},
    )
    load_state_timeout: Optional[float] = field(
        default=None,
        metadata={
            "help": "Seconds one download of the swarm's state may take before it is retried (default: automatic, "
            "3x the download's estimated time at the measured bandwidth plus 30 s: a full-size state over a slow "
            "link needs minutes). hivemind 1.1 can lose a download whose first dial hangs: it is retried after this."
        },
    )
    final_averaging_window: Optional[float] = field(
        default=None,
        metadata={
            "help": "Seconds the trainers that reach --max_steps wait for each other to average their parameters "
            "once more, so they all end with the same model (with delayed updates each applies the last update on "
            "its own). Peers finishing within this window of the first one join it; 0 skips the round (default: "
            "automatic, the averaging timeout plus 20 s, at least 30 s, plus --diloco_wait with --diloco_inner_steps: "
            "a peer lagging one step behind waits out one round that the others skip before it gets there)."
        },
    )
    measure_link: bool = field(
        default=True,
        metadata={
            "help": "Measure round trip, upload and download against an initial peer at start (a few seconds), for "
            "the bandwidth and the automatic timing.",
            "negative_help": "Do not measure the link: the automatic timing assumes 10 Mbit/s and 200 ms.",
        },
    )
    aggregation: str = field(
        default="centered_clip",
        metadata={
            "help": "How a peer combines the contributions to the all-reduce parts it reduces (gradients, "
            "parameters): non-finite ones are always dropped and each claimed weight is capped at the median; "
            "centered_clip: CenteredClip (BTARD, Gorbunov et al. 2022) from the coordinate-wise median; "
            "norm_clip: each norm clipped to --clip_tau x the median norm (cheaper); plain: hivemind's weighted "
            "mean, no checks.",
            "choices": ["centered_clip", "norm_clip", "plain"],
        },
    )
    clip_tau: float = field(
        default=1.0,
        metadata={
            "help": "CenteredClip's radius as a multiple of the contributions' median distance from their median "
            "(norm_clip: of their median norm)."
        },
    )
    clip_iterations: int = field(default=3, metadata={"help": "CenteredClip's iterations per part."})
    link_check_every: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds between two measurements of the link after the first (in the background, between "
            "averaging rounds); the new bandwidth is declared to both averagers."
        },
    )

    def __post_init__(self):
        for name in (
            "matchmaking_time",
            "averaging_timeout",
            "next_chunk_timeout",
            "bandwidth",
            "link_check_every",
            "load_state_timeout",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name} must be positive, got {value}")
        # imported here: the rules import torch, and a script's --help reads this module without it
        from sahajbert import robust

        robust.Aggregation(self.aggregation, self.clip_tau, self.clip_iterations)  # checks the three
        if self.final_averaging_window is not None and self.final_averaging_window < 0:
            raise ValueError(f"--final_averaging_window must be >= 0 seconds, got {self.final_averaging_window}")


@dataclass
class CollaborativeOptimizerArguments:
    """When the swarm makes a global step, and how hivemind.Optimizer overlaps it with compute."""

    TITLE: ClassVar[str] = "collaborative optimizer"

    target_batch_size: int = field(
        default=4096,
        metadata={
            "help": "Samples the whole swarm accumulates per global optimizer step (not used with "
            "--diloco_inner_steps)."
        },
    )
    batch_size_lead: int = field(
        default=0, metadata={"help": "Start averaging this many samples before the target, to hide latency."}
    )
    offload_optimizer: bool = field(
        default=True,
        metadata={
            "help": "Keep optimizer state and the master parameters in host RAM.",
            "negative_help": "Keep optimizer state beside the model (on the accelerator): faster, more memory.",
        },
    )
    delay_optimizer_step: bool = field(
        default=True,
        metadata={
            "help": "Run the optimizer step in the background while the next batch computes.",
            "negative_help": "Step in the foreground: every peer waits for each update (needs "
            "--no_delay_grad_averaging too).",
        },
    )
    delay_grad_averaging: bool = field(
        default=True,
        metadata={
            "help": "Average gradients in the background (with delay_optimizer_step: DPU).",
            "negative_help": "Average gradients in the foreground, before the next batch (lockstep).",
        },
    )
    average_state_every: int = field(
        default=1, metadata={"help": "Average parameters with peers every this many global steps."}
    )
    use_local_updates: bool = field(
        default=False,
        metadata={"help": "Step locally every batch and only average parameters (no gradient averaging)."},
    )
    diloco_inner_steps: int = field(
        default=0,
        metadata={
            "help": "DiLoCo: each trainer makes this many local steps with LAMB, then the swarm averages the "
            "pseudo-gradients (its parameters at the last outer step minus its parameters now, weighted by its "
            "samples) and makes one outer Nesterov step; a global step is an outer step, --target_batch_size is not "
            "used, and --warmup_steps/--total_steps count inner steps. 0: synchronous training, a global step per "
            "--target_batch_size samples."
        },
    )
    diloco_inner_optimizer: str = field(
        default="lamb",
        metadata={
            "help": "DiLoCo: the inner optimizer, lamb or adamw (torch's, the DiLoCo papers'); both take the "
            "LAMB flags.",
            "choices": ["lamb", "adamw"],
        },
    )
    outer_lr: Optional[float] = field(
        default=None,
        metadata={"help": "DiLoCo: the outer SGD's learning rate (constant; default 0.7, or 2.0 with sparse)."},
    )
    outer_momentum: float = field(
        default=0.9, metadata={"help": "DiLoCo: the outer SGD's Nesterov momentum (none with sparse)."}
    )
    pseudo_gradient_compression: str = field(
        default="8bit",
        metadata={
            "help": "DiLoCo: compression of the averaged pseudo-gradients (8bit: INTELLECT-1's int8 all-reduce, fp16 "
            "for parts under 1,033 values; sparse: SparseLoCo's top-k in 2 bits, with error feedback).",
            "choices": ["none", "fp16", "8bit", "sparse"],
        },
    )
    diloco_overlap: bool = field(
        default=False,
        metadata={
            "help": "DiLoCo: average each round in the background while the next inner steps run, and add its "
            "outer step when it ends, keeping the progress made meanwhile (Streaming DiLoCo's one-round delay); a "
            "round still in flight at the next H-th inner step is awaited at H + H/10 at the latest. Off: every "
            "trainer waits for its round after its inner steps."
        },
    )
    diloco_wait: float = field(
        default=60.0,
        metadata={
            "help": "DiLoCo stragglers: seconds a trainer that made its inner steps waits for every other trainer "
            "to make theirs (the round starts as soon as all are in it); a trainer that misses the round downloads "
            "the swarm's state and starts its next inner steps from it. 0: the trainers that are ready go on "
            "without waiting (within the matchmaking time)."
        },
    )
    max_refresh_period: Optional[float] = field(
        default=None,
        metadata={
            "help": "Most seconds between two reads of the swarm's progress from the DHT (default: automatic, a "
            "fifth of the last global step's time, 1-10 s; a peer also reads the progress afresh before every "
            "global step it would start)."
        },
    )
    metadata_expiration: float = field(
        default=60.0,
        metadata={
            "help": "Seconds a peer's progress report lives in the DHT. Peers extrapolate a silent peer's "
            "samples until it expires, so with frequent churn a shorter value avoids early global steps."
        },
    )

    def __post_init__(self):
        if self.target_batch_size < 1:
            raise ValueError(f"--target_batch_size must be positive, got {self.target_batch_size}")
        if not 0 <= self.batch_size_lead < self.target_batch_size:
            raise ValueError("--batch_size_lead must be at least 0 and below --target_batch_size")
        if (
            self.max_refresh_period is not None and self.max_refresh_period < 0.5
        ):  # hivemind's own floor between two reads
            raise ValueError(f"--max_refresh_period must be at least 0.5 seconds, got {self.max_refresh_period}")
        if self.diloco_inner_steps < 0:
            raise ValueError(f"--diloco_inner_steps must be >= 0 (0: off), got {self.diloco_inner_steps}")
        if self.diloco_inner_steps and self.use_local_updates:
            raise ValueError("--diloco_inner_steps and --use_local_updates are two different modes: choose one")
        if self.diloco_overlap and not self.diloco_inner_steps:
            raise ValueError("--diloco_overlap overlaps DiLoCo's outer rounds: it needs --diloco_inner_steps")
        if self.diloco_inner_optimizer not in ("lamb", "adamw"):
            raise ValueError(f"--diloco_inner_optimizer is lamb or adamw, got {self.diloco_inner_optimizer!r}")
        if self.diloco_inner_optimizer != "lamb" and not self.diloco_inner_steps:
            raise ValueError("--diloco_inner_optimizer is DiLoCo's: it needs --diloco_inner_steps")
        if self.pseudo_gradient_compression == "sparse" and not self.diloco_inner_steps:
            raise ValueError("--pseudo_gradient_compression sparse is DiLoCo's: it needs --diloco_inner_steps")
        if self.outer_lr is None:
            self.outer_lr = SPARSE_OUTER_LR if self.pseudo_gradient_compression == "sparse" else DILOCO_OUTER_LR
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1 or self.diloco_wait < 0:
            raise ValueError(
                f"DiLoCo needs --outer_lr > 0, 0 <= --outer_momentum < 1 and --diloco_wait >= 0; got "
                f"{self.outer_lr}, {self.outer_momentum}, {self.diloco_wait}"
            )


@dataclass
class SparseDiLoCoArguments:
    """DiLoCo's rounds with --pseudo_gradient_compression sparse: SparseLoCo's pseudo-gradients, streamed fragments."""

    TITLE: ClassVar[str] = "sparse DiLoCo"

    sparse_density: float = field(
        default=1 / 64,
        metadata={"help": "The share of each chunk's values a trainer sends per round (64 of 4,096)."},
    )
    sparse_chunk_size: int = field(default=4096, metadata={"help": "Values per chunk whose top share is sent."})
    error_feedback_decay: float = field(
        default=1.0,
        metadata={
            "help": "The share of what a trainer did not send that stays in its model for later "
            "rounds (error feedback; below 1 the rest is dropped and the model moves toward the swarm's)."
        },
    )
    diloco_fragments: int = field(
        default=1,
        metadata={
            "help": "Split the parameters into this many fragments (consecutive tensors, about equal in "
            "size), each averaged every --diloco_inner_steps at its own offset, so that a round every H / F inner "
            "steps sends one fragment (Streaming DiLoCo); a global step is then one fragment's round. The other "
            "fragments go as zeros, a few bytes a part."
        },
    )

    def __post_init__(self):
        if not 0 < self.sparse_density <= 1 or self.sparse_chunk_size < 1 or not 0 <= self.error_feedback_decay <= 1:
            raise ValueError(
                f"--sparse_density must be in (0, 1], --sparse_chunk_size positive and --error_feedback_decay in "
                f"[0, 1]; got {self.sparse_density}, {self.sparse_chunk_size}, {self.error_feedback_decay}"
            )
        if self.diloco_fragments < 1:
            raise ValueError(f"--diloco_fragments must be at least 1, got {self.diloco_fragments}")
