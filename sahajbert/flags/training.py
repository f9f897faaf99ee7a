"""A trainer's own flags: the model and the local training (batch, optimizer and schedule, precision, device,
checkpoints)."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional


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
    data_seed: Optional[int] = field(
        default=None,
        metadata={
            "help": "This peer's data order, the same on every start (default: --seed mixed with this process's key, "
            "so that no two peers read one stream); give it to repeat a stream, never the same on two peers."
        },
    )
    output_dir: str = field(default="outputs/trainer", metadata={"help": "Where this peer writes checkpoints."})
    save_steps: int = field(default=500, metadata={"help": "Save a local checkpoint every this many global steps."})
    keep_checkpoints: int = field(default=3, metadata={"help": "How many local checkpoints to keep."})
    log_every_seconds: float = field(default=10.0, metadata={"help": "Seconds between progress lines."})
    keep_good_state: str = field(
        default="disk",
        metadata={
            "help": "Where the last good state that a rollback restores is kept: disk (a file in --output_dir, "
            "rewritten once per global step) or memory (3 more copies of the parameters for the whole run).",
            "choices": ["disk", "memory"],
        },
    )

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "save_steps", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max_steps must be at least 1, got {self.max_steps}")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
