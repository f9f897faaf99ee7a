"""Every command-line flag of every script, one dataclass per concern.

Defaults are the real sahajBERT run's values, except where a field's help says otherwise (the demo's own flags, and
`--data_files sample` / `--tokenizer_path sample`, which name the bundled sample). Parsed by `sahajbert.cli`, one
help group per class (its TITLE); each script also accepts a settings `.json` file of these fields, which its flags
override. The library types its parameters with these classes; `arguments.py` at the repository root is the page
that lists them for users.
"""

import shlex
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import transformers

from sahajbert import robust
from sahajbert.cli import Flags
from sahajbert.corpus import DEFAULT_SOURCES, HUB_SOURCES, SAMPLE_NAME
from sahajbert.recipes import PROTOCOLS, RECIPES
from sahajbert.tokenization import REAL_TOKENIZER

# seconds: the longest a peer keeps a DHT record others store (hivemind_ext BoundedLocalStorage)
MAX_RECORD_LIFETIME = 3600.0


@dataclass
class CorpusArguments:
    """Where the text comes from and how it becomes ALBERT examples (data/)."""

    TITLE: ClassVar[str] = "data"
    sources: list[str] = field(
        default_factory=lambda: list(DEFAULT_SOURCES),
        metadata={"help": f"Hub sources to stream: presets {', '.join(HUB_SOURCES)} or 'owner/name[:config]'."},
    )
    source_probabilities: Optional[list[float]] = field(
        default=None,
        metadata={"help": "Sampling probability of each source, in order (default: 0.23 0.77 for two, else uniform)."},
    )
    data_files: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "Local .txt (blank-line separated documents), .jsonl/.json or .parquet files (or globs); "
            f"each one is a source and replaces --sources. Works offline. '{SAMPLE_NAME}': the bundled Bengali sample."
        },
    )
    shuffle_buffer: int = field(default=10_000, metadata={"help": "Documents held in each source's shuffle buffer."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per example, [CLS] and both [SEP] included."})
    short_seq_prob: float = field(
        default=0.1, metadata={"help": "Fraction of examples given a shorter random length (as in ALBERT)."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens to predict in masked LM."})
    masking: str = field(
        default="whole_word",
        metadata={
            "help": "Masked-LM masking unit: whole Bengali words, or tokens (as both references did in effect).",
            "choices": ["whole_word", "token"],
        },
    )
    sentence_boundaries: str = field(
        default="lines",
        metadata={
            "help": "Where sentences end: lines (\u0964, \u0965, ?, ! and line breaks) or punctuation (\u0964, ?, ! "
            "only, as both references split: a danda rewrite, then NLTK punkt).",
            "choices": ["lines", "punctuation"],
        },
    )
    chunking: str = field(
        default="albert",
        metadata={
            "help": "How sentences become an example: albert (up to a target length, --short_seq_prob of them "
            "shorter) or references (sentences added until --max_seq_length tokens, then truncated).",
            "choices": ["albert", "references"],
        },
    )
    pad_to_multiple_of: Optional[int] = field(
        default=8, metadata={"help": "Pad batches to a multiple of this many tokens (8 suits tensor cores)."}
    )
    tokenizer_path: str = field(
        default=REAL_TOKENIZER,
        metadata={
            "help": "Tokenizer folder (tokenizer/train_tokenizer.py) or Hub name; the default is the released "
            f"sahajBERT tokenizer. '{SAMPLE_NAME}': the bundled 2,000-piece sample tokenizer (for trying things out)."
        },
    )

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ValueError(f"--max_seq_length must be at least 8, got {self.max_seq_length}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}")


@dataclass
class TokenizerTrainingArguments:
    """tokenizer/train_tokenizer.py: the Unigram tokenizer every peer shares."""

    TITLE: ClassVar[str] = "tokenizer"

    vocab_size: int = field(default=32_000, metadata={"help": "Vocabulary size, the 5 special tokens included."})
    output_dir: str = field(default="tokenizer/sahajbert", metadata={"help": "Folder to write the tokenizer to."})
    max_texts: Optional[int] = field(
        default=None, metadata={"help": "Train on at most this many documents (default: the whole corpus)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the corpus shuffle."})


@dataclass
class PreviewArguments:
    """data/preview.py: show what the model trains on."""

    TITLE: ClassVar[str] = "preview"

    num_examples: int = field(default=5, metadata={"help": "How many examples to show."})
    seed: int = field(default=0, metadata={"help": "Stream seed (each peer derives its own)."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object per example instead of text."})


@dataclass
class SwarmArguments:
    """How this peer finds the others (hivemind DHT over libp2p)."""

    TITLE: ClassVar[str] = "swarm"

    run_id: str = field(default="sahajbert", metadata={"help": "Name of the training run; all its peers share it."})
    initial_peers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Multiaddrs of peers already in the run, as printed by run_first_peer.py, e.g. "
            "/ip4/1.2.3.4/tcp/31337/p2p/Qm... (empty: start a new swarm)."
        },
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        metadata={"help": "Multiaddrs to listen on; tcp/0 picks a free port. Use a fixed port to be reachable."},
    )
    announce_maddrs: list[str] = field(
        default_factory=list, metadata={"help": "Public multiaddrs to tell others (behind NAT or a proxy)."}
    )
    identity_path: Optional[str] = field(
        default=None,
        metadata={"help": "Private key file that keeps this peer's id across restarts (created if missing)."},
    )
    client_mode: bool = field(
        default=False,
        metadata={
            "help": "Accept no incoming connections at all; the peer still trains, but cannot average with other "
            "client-mode peers or serve the state to newcomers (behind NAT, --auto_relay usually does better)."
        },
    )
    auto_relay: bool = field(
        default=True,
        metadata={
            "help": "When libp2p finds this peer unreachable (behind NAT), book a slot on a relay (--relays) and "
            "take incoming connections through it: it then averages and serves the state like any peer."
        },
    )
    relays: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Multiaddrs of the peers that relay for NAT'd volunteers (default: the initial peers; every "
            "reachable peer of this run relays, up to 4 GiB each way and 1 hour per relayed connection)."
        },
    )
    reachability: str = field(
        default="auto",
        metadata={
            "help": "auto: libp2p's AutoNAT asks other peers to dial back (about 15 s); public or private: skip "
            "that test when you know (a relaying peer should leave it to AutoNAT: see docs/volunteers.md).",
            "choices": ["auto", "public", "private"],
        },
    )
    invite: Optional[str] = field(
        default=None,
        metadata={
            "help": "NAME:SECRET for an invite-only run, as the organizer sent it: the first peer then grants this "
            "peer a short-lived access token, renewed in the background (see docs/organizers.md, invite-only runs)."
        },
    )
    use_ipfs: bool = field(default=False, metadata={"help": "Also find peers through the public IPFS DHT."})
    join_timeout: float = field(
        default=60.0, metadata={"help": "Seconds to wait for the initial peers to answer before giving up."}
    )
    verbose: bool = field(
        default=False,
        metadata={"help": "Also show hivemind's own INFO lines (matchmaking, progress refreshes, start-up notes)."},
    )


@dataclass
class AuthorityArguments:
    """An invite-only run: the first peer admits only the volunteers of its allowlist."""

    TITLE: ClassVar[str] = "invite-only"

    allowlist: Optional[str] = field(
        default=None,
        metadata={
            "help": "File of 'NAME SECRET' lines: only these volunteers may join (each passes --invite NAME:SECRET). "
            "Read again whenever it changes; a name removed from it is out within one --token_lifetime."
        },
    )
    token_lifetime: float = field(
        default=600.0,
        metadata={"help": "Seconds an access token is valid; peers renew theirs at half of it."},
    )
    add_invite: Optional[str] = field(
        default=None,
        metadata={"help": "Add NAME with a random secret to --allowlist, print the --invite to send them, and exit."},
    )

    def __post_init__(self):
        # peers renew at half the lifetime, and a renewal must reach the first peer and come back before it ends
        if self.token_lifetime < 10:
            raise ValueError(f"--token_lifetime must be at least 10 seconds, got {self.token_lifetime}")
        # the token is a DHT record, and peers keep none longer than this
        if self.token_lifetime > MAX_RECORD_LIFETIME:
            raise ValueError(
                f"--token_lifetime must be at most {MAX_RECORD_LIFETIME:.0f} seconds, got {self.token_lifetime}"
            )
        if self.add_invite is not None and self.allowlist is None:
            raise ValueError("--add_invite needs --allowlist FILE (the file the name is added to)")


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
    outer_lr: float = field(default=0.7, metadata={"help": "DiLoCo: the outer SGD's learning rate (constant)."})
    outer_momentum: float = field(default=0.9, metadata={"help": "DiLoCo: the outer SGD's Nesterov momentum."})
    pseudo_gradient_compression: str = field(
        default="8bit",
        metadata={
            "help": "DiLoCo: compression of the averaged pseudo-gradients (8bit: buckets around the mean, as "
            "hivemind's Uniform8BitQuantization and INTELLECT-1's int8 all-reduce; fp16 for tensor parts under 1,033 "
            "values, where it takes fewer bytes).",
            "choices": ["none", "fp16", "8bit"],
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
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1 or self.diloco_wait < 0:
            raise ValueError(
                f"DiLoCo needs --outer_lr > 0, 0 <= --outer_momentum < 1 and --diloco_wait >= 0; got "
                f"{self.outer_lr}, {self.outer_momentum}, {self.diloco_wait}"
            )


@dataclass
class ModelArguments:
    """Which ALBERT to train."""

    TITLE: ClassVar[str] = "model"

    model: str = field(
        default="sahajbert",
        metadata={
            "help": "A preset: sahajbert (ALBERT-large, 18.1M parameters), sahajbert-xl (LeanALBERT, 76.0M), tiny or "
            "tiny-xl (for tests); or an ALBERT/LeanALBERT config .json or checkpoint folder."
        },
    )


@dataclass
class LocalTrainingArguments:
    """This peer's local training: batch, schedule, precision, checkpoints."""

    TITLE: ClassVar[str] = "training"

    per_device_train_batch_size: int = field(default=4, metadata={"help": "Examples per forward/backward pass."})
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Passes accumulated locally before reporting progress to the swarm."}
    )
    learning_rate: float = field(default=0.00176, metadata={"help": "Peak LAMB learning rate (sahajBERT: 0.00176)."})
    warmup_steps: int = field(default=5000, metadata={"help": "Global steps of linear warmup."})
    total_steps: int = field(
        default=125_000, metadata={"help": "Length of the linear-decay schedule, in global steps."}
    )
    max_steps: Optional[int] = field(
        default=None, metadata={"help": "Stop this peer cleanly once the swarm reaches this global step."}
    )
    weight_decay: float = field(
        default=0.01,
        metadata={"help": "LAMB's (or DiLoCo's inner AdamW's) weight decay (none on biases and LayerNorm)."},
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "LAMB's (or DiLoCo's inner AdamW's) beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "LAMB's (or DiLoCo's inner AdamW's) beta2."})
    adam_epsilon: float = field(default=1e-6, metadata={"help": "LAMB's (or DiLoCo's inner AdamW's) epsilon."})
    clamp_value: float = field(
        default=10_000.0, metadata={"help": "LAMB: clamp of the weight norm in the trust ratio."}
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip gradients to this total norm (0: no clipping); both references: 1.0."}
    )
    clip_gradients: str = field(
        default="averaged",
        metadata={
            "help": "What --max_grad_norm clips: averaged (the gradients the optimizer applies, after the swarm "
            "averaged them; sahajBERT-XL) or local (each peer's own pass, before averaging; DeDLOC's sahajBERT).",
            "choices": ["averaged", "local"],
        },
    )
    recipe: Optional[str] = field(
        default=None,
        metadata={
            "help": "Train as a reference run trained: its whole recipe (optimizer, schedule, batch, clipping, "
            "compression, averaging timing, data); flags you give win. See the recipe table in "
            "docs/models-and-evaluation.md.",
            "choices": ["sahajbert", "sahajbert-xl"],
        },
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "Compute precision; auto picks fp16 on CUDA >= 7.0, else fp32 (TPU and CPU: bf16 is opt-in).",
            "choices": ["auto", "fp32", "fp16", "bf16"],
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "Where to compute; auto: a TPU host's cores (with torch_xla), else a CUDA GPU, else the CPU. "
            "tpu drives every XLA device of the host as one peer (needs requirements-tpu.txt).",
            "choices": ["auto", "cpu", "cuda", "tpu"],
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward to save accelerator memory."}
    )
    seed: int = field(
        default=0,
        metadata={"help": "Model init seed, shared by the run; each peer's data order also mixes in its own id."},
    )
    output_dir: str = field(default="outputs/trainer", metadata={"help": "Where this peer writes checkpoints."})
    save_steps: int = field(default=500, metadata={"help": "Save a local checkpoint every this many global steps."})
    keep_checkpoints: int = field(default=3, metadata={"help": "How many local checkpoints to keep."})
    log_every_seconds: float = field(default=10.0, metadata={"help": "Seconds between progress lines."})

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "save_steps", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max_steps must be at least 1, got {self.max_steps}")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")


@dataclass
class PeerArguments:
    """Every setting of a peer that holds the model (a trainer, the aux peer), one group per concern.

    Scripts parse the groups' flags together (`sahajbert.cli.parse_args` builds this from them); the aux peer is
    built from the same groups as the trainers, so it never re-types a hyperparameter.
    """

    swarm_args: SwarmArguments = field(default_factory=SwarmArguments)
    averaging_args: AveragingArguments = field(default_factory=AveragingArguments)
    optimizer_args: CollaborativeOptimizerArguments = field(default_factory=CollaborativeOptimizerArguments)
    model_args: ModelArguments = field(default_factory=ModelArguments)
    training_args: LocalTrainingArguments = field(default_factory=LocalTrainingArguments)
    corpus_args: CorpusArguments = field(default_factory=CorpusArguments)

    # the field types in field order: what the parser fills, one group after the other
    GROUPS: ClassVar[tuple[type, ...]] = (
        SwarmArguments,
        AveragingArguments,
        CollaborativeOptimizerArguments,
        ModelArguments,
        LocalTrainingArguments,
        CorpusArguments,
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
class FinetuneArguments:
    """finetune/train_ner.py and finetune/train_ncc.py: model and data of a downstream task."""

    TITLE: ClassVar[str] = "fine-tuning data"

    model_name_or_path: str = field(
        metadata={"help": "A pretraining checkpoint folder (e.g. outputs/demo/trainer0/checkpoint-10) or a Hub name."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (default: unimelb-nlp/wikiann for NER, ai4bharat/indic_glue)."}
    )
    dataset_config: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset config (default: bn for NER, sna.bn for classification)."}
    )
    train_file: Optional[str] = field(
        default=None, metadata={"help": "Local training file: CoNLL or JSONL for NER, CSV or JSONL for news."}
    )
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local validation file (same formats)."})
    test_file: Optional[str] = field(default=None, metadata={"help": "Local test file (same formats)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example after truncation."})
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Use only this many training examples (quick runs)."}
    )
    early_stopping_patience: int = field(
        default=3, metadata={"help": "Stop after this many evaluations (epochs) without improvement."}
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "Smallest improvement of the validation metric that counts."}
    )
    best_model_metric: str = field(
        default="task",
        metadata={
            "help": "What picks the best epoch and early-stops: task (F1 for NER, accuracy for news) or loss (the "
            "validation loss, as both references did).",
            "choices": ["task", "loss"],
        },
    )
    hidden_dropout_prob: Optional[float] = field(
        default=None, metadata={"help": "Dropout in the model while fine-tuning (default: the checkpoint's)."}
    )
    protocol: Optional[str] = field(
        default=None,
        metadata={
            "help": "Fine-tune as a reference evaluated: its learning rate, batch, epochs, early stopping, best epoch "
            "by validation loss, maximum length and dropout; flags you give win. See the protocol table in "
            "docs/models-and-evaluation.md.",
            "choices": ["sahajbert", "sahajbert-xl"],
        },
    )

    def __post_init__(self):
        local = [self.train_file, self.validation_file, self.test_file]
        if any(local) and not all(local):
            raise ValueError("give all three of --train_file, --validation_file and --test_file, or none")


@dataclass
class FinetuneTrainingArguments(transformers.TrainingArguments):
    """The usual transformers training flags, with defaults for evaluation every epoch and keeping the best model.

    Every flag of transformers' TrainingArguments is accepted; help lists ours and the common ones (SHOWN_INHERITED).
    """

    TITLE: ClassVar[str] = "fine-tuning"
    HIDE_INHERITED: ClassVar[bool] = True
    SHOWN_INHERITED: ClassVar[frozenset[str]] = frozenset(
        {
            "seed",
            "weight_decay",
            "warmup_steps",
            "lr_scheduler_type",
            "gradient_accumulation_steps",
            "max_grad_norm",
            "fp16",
            "bf16",
            "use_cpu",
            "dataloader_num_workers",
            "disable_tqdm",
        }
    )

    output_dir: str = field(default="outputs/finetune", metadata={"help": "Where the model and results.json go."})
    num_train_epochs: float = field(default=10.0, metadata={"help": "Most epochs (early stopping may end sooner)."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak AdamW learning rate."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Training batch size per device."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size per device."})
    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate (every epoch)."})
    save_strategy: str = field(default="epoch", metadata={"help": "When to save (every epoch, best kept)."})
    logging_strategy: str = field(default="epoch", metadata={"help": "When to log training loss."})
    load_best_model_at_end: bool = field(default=True, metadata={"help": "Test the best epoch, not the last."})
    save_total_limit: int = field(default=1, metadata={"help": "Checkpoints kept besides the best one."})
    report_to: str = field(default="none", metadata={"help": "Logging integrations (e.g. wandb)."})


@dataclass
class EvaluationArguments:
    """finetune/evaluate.py: both tasks, several seeds, one or more models, one table."""

    TITLE: ClassVar[str] = "evaluation"

    models: list[str] = field(metadata={"help": "Model folders or Hub names to compare, side by side."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Fine-tuning seeds per model."})
    tasks: list[str] = field(default_factory=lambda: ["ner", "ncc"], metadata={"help": "Tasks: ner, ncc."})
    output_dir: str = field(default="outputs/evaluation", metadata={"help": "Runs, results.md and results.json."})
    ner_args: str = field(default="", metadata={"help": "Extra flags for every NER run, e.g. '--train_file ...'."})
    ncc_args: str = field(default="", metadata={"help": "Extra flags for every classification run."})
    protocol: Optional[str] = field(
        default=None,
        metadata={
            "help": "Every run fine-tunes as this reference did (--protocol of train_ner.py / train_ncc.py).",
            "choices": ["sahajbert", "sahajbert-xl"],
        },
    )

    def __post_init__(self):
        for name in ("ner_args", "ncc_args"):
            text = getattr(self, name)
            try:
                shlex.split(text)
            except ValueError as e:  # shlex's own message: "No closing quotation", "No escaped character"
                raise ValueError(f"--{name} is not a valid command line ({str(e).lower()}): {text}") from e


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


def finetune_flags(task: str) -> Flags:
    """The flags of finetune/train_<task>.py, also what finetune/evaluate.py checks every run's flags with."""
    description = {
        "ner": "Fine-tune on Bengali NER (WikiANN bn, or local CoNLL/JSONL files) and score with seqeval.",
        "ncc": "Fine-tune on Bengali news classification (IndicGLUE sna.bn, or local CSV/JSONL files).",
    }[task]
    return Flags(
        (FinetuneArguments, FinetuneTrainingArguments),
        description=description,
        defaults={"output_dir": f"outputs/{task}"},
        expansions={"protocol": PROTOCOLS[task]},
    )


# the trainer and the aux peer take `--recipe`: one reference run's whole recipe, under the flags given
RECIPE_EXPANSION = {"recipe": RECIPES}
