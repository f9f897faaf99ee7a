"""LAMB, the global-step learning-rate schedule, and the hivemind.Optimizer that wraps them.

This module is the only place where optimizer hyperparameters become objects: the trainer and the aux peer both
call `build_collaborative_optimizer`, so the aux peer can never drift from the trainers' settings.
"""

import math
from functools import partial

import hivemind
import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
)
from transformers import get_linear_schedule_with_warmup

from sahajbert import checkpoints, robust
from sahajbert.adaptive import (
    DILOCO_READS_PER_STEP,
    Timing,
    explicit_timing,
    payload_bytes,
    plan_timing,
    round_wait_of,
)
from sahajbert.flags import PeerArguments
from sahajbert.hivemind_ext.compression import SparseParts, Uniform8Bit
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.hivemind_ext.optim.diloco import DiLoCoOptimizer
from sahajbert.hivemind_ext.optim.optimizer import GuardedOptimizer, gradient_averager_factory
from sahajbert.signals import StopNow
from sahajbert.sparse import SparseRounds


def clip_applied_gradients(optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    """Clip the gradients `optimizer` is about to apply (in a swarm: the averaged ones) to this total norm; None or
    0: no clipping."""
    if max_grad_norm:
        gradients = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(gradients, max_grad_norm)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) as sahajBERT and sahajBERT-XL ran it: `torch_optimizer.Lamb` with debias on.

    The Adam direction is not bias-corrected; its layer-wise trust ratio (clamped weight norm over direction norm) is,
    and then the step size is multiplied by sqrt(1 - beta2^t) / (1 - beta1^t). Correcting the direction instead would
    be cancelled by the trust ratio's normalization, and early steps would be several times larger.
    """

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10.0, max_grad_norm=None
    ):
        if lr <= 0 or eps <= 0 or clamp_value <= 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid LAMB settings: lr={lr}, betas={betas}, eps={eps}, clamp_value={clamp_value}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, clamp_value=clamp_value))
        # clip the gradients this optimizer applies (in a swarm: the averaged ones) to this total norm first
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_applied_gradients(self, self.max_grad_norm)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        """One step of a group's parameters, each tensor list in one foreach call: in DiLoCo this runs at every pass,
        and per-tensor Python was an eighth of a tiny model's time there."""
        beta1, beta2 = group["betas"]
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        step_sizes = []
        for state in states:
            state["step"] += 1  # an int, or a tensor shared with the swarm (DiLoCo's inner state): in place
            step = float(state["step"])
            step_sizes.append(group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step))
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # beta1 * m + (1 - beta1) * g
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        directions = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(directions, group["eps"])
        directions = torch._foreach_div(exp_avgs, directions)
        if group["weight_decay"]:
            torch._foreach_add_(directions, params, alpha=group["weight_decay"])
        weight_norms = torch.stack(torch._foreach_norm(params)).clamp(0, group["clamp_value"])
        direction_norms = torch.stack(torch._foreach_norm(directions))
        # layer-wise trust ratio; 1 where either norm is 0 (fresh zeros, or no update)
        trust = torch.where(
            (weight_norms > 0) & (direction_norms > 0), weight_norms / direction_norms, torch.ones_like(weight_norms)
        )
        scales = trust * -torch.tensor(step_sizes, dtype=trust.dtype, device=trust.device)
        torch._foreach_mul_(directions, list(scales.unbind()))
        torch._foreach_add_(params, directions)


class AdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, bias-corrected moments), clipping the gradients it applies to
    `max_grad_norm` first, as `Lamb` does: DiLoCo's inner optimizer in the DiLoCo and OpenDiLoCo papers."""

    def __init__(self, params, max_grad_norm: float | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        clip_applied_gradients(self, self.max_grad_norm)
        return super().step(closure)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: none on biases and LayerNorm (found by module type, whatever its name)."""
    no_decay = set()
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            no_decay.add(id(p))
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]


# "8bit" sends a smaller tensor part in fp16: 8-bit takes n + 1,032 bytes (its values, 256 float32 bucket means and
# an 8-byte header), fewer than fp16's 2n only from here
EIGHT_BIT_MIN_VALUES = 1033


def make_compression(name: str) -> CompressionBase:
    """--compression -> hivemind codec; "8bit": 8-bit where it takes fewer bytes than fp16 (parts of over 1,032
    values), "adaptive": fp16 for small tensors, 8-bit for large ones (> 64 Ki)."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "8bit":
        # per tensor part, whichever takes fewer bytes: fp16 is also exact-er (a tiny model's biases and norms, 20 of
        # its 32 tensors, went as 1 KiB of bucket means each)
        return SizeAdaptiveCompression(
            threshold=EIGHT_BIT_MIN_VALUES, less=Float16Compression(), greater_equal=Uniform8Bit()
        )
    if name == "adaptive":  # sahajBERT-XL's: fp16 below 2^16 + 1 elements (tanmoyio/sahajBERT run_trainer.py:168)
        return SizeAdaptiveCompression(threshold=2**16 + 1, less=Float16Compression(), greater_equal=Uniform8Bit())
    raise ValueError(f"unknown compression '{name}'")


def outer_sgd(param_groups: list[dict], lr: float, momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on the pseudo-gradients (DiLoCo and OpenDiLoCo: lr 0.7,
    momentum 0.9), or plain SGD with momentum 0 (SparseLoCo's); no weight decay, which the inner LAMB applies
    already."""
    # the parameters alone: the groups' other keys are the inner optimizer's settings
    groups = [{"params": group["params"]} for group in param_groups]
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)


def lr_at_step(step: int, peak: float, warmup_steps: int, total_steps: int) -> float:
    """The schedule's learning rate at a global step (linear warmup, then linear decay to 0 at total_steps)."""
    if step < warmup_steps:
        return peak * step / max(1, warmup_steps)
    return peak * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def restore_optimizer_state(optimizer: hivemind.Optimizer, checkpoint) -> bool:
    """Load a checkpoint's optimizer state (its global step with it), the learning rate following that step; False
    when the checkpoint holds none."""
    state = checkpoints.load_optimizer_state(checkpoint)
    if state is None:
        return False
    optimizer.load_state_dict(state)
    accessors.follow_schedule(optimizer)  # load_state_dict restores the step, not the scheduler
    return True


def build_collaborative_optimizer(
    model: torch.nn.Module,
    dht: hivemind.DHT,
    peer_args: PeerArguments,
    auxiliary: bool = False,
    batch_size_per_step: int | None = None,
    timing: Timing | None = None,
    gate=None,
) -> GuardedOptimizer:
    """hivemind.Optimizer over LAMB, scheduled by the GLOBAL step (hivemind steps the scheduler per epoch).

    `batch_size_per_step`: samples one optimizer.step() reports (default: batch x accumulation on one device).
    `timing`: from sahajbert.adaptive.tune (default: planned without a measured link).
    `gate`: in an invite-only run, the sahajbert.access.Gate whose members alone may call this peer's averagers.
    """
    swarm_args, averaging_args = peer_args.swarm_args, peer_args.averaging_args
    optimizer_args, training_args = peer_args.optimizer_args, peer_args.training_args
    # what LAMB and DiLoCo's inner AdamW share
    adam_settings = dict(
        lr=training_args.learning_rate,
        betas=(training_args.adam_beta1, training_args.adam_beta2),
        eps=training_args.adam_epsilon,
        max_grad_norm=training_args.max_grad_norm if training_args.clip_gradients == "averaged" else None,
    )
    lamb = partial(Lamb, clamp_value=training_args.clamp_value, **adam_settings)
    scheduler = partial(
        get_linear_schedule_with_warmup,
        num_warmup_steps=training_args.warmup_steps,
        num_training_steps=training_args.total_steps,
    )
    compression = make_compression(averaging_args.compression)
    # parameters are averaged for consistency, not learning: fp16 keeps them close without 8-bit's error
    state_compression = NoCompression() if averaging_args.compression == "none" else Float16Compression()
    if timing is None:
        parameters = sum(p.numel() for p in model.parameters())
        payload = payload_bytes(parameters, averaging_args.compression)
        timing = plan_timing(*payload, None, explicit_timing(peer_args), round_wait_of(peer_args))
    averager_opts = {"request_timeout": timing.request_timeout}
    if timing.bandwidth is not None:
        averager_opts["bandwidth"] = timing.bandwidth
    if averaging_args.target_group_size is not None:
        averager_opts["target_group_size"] = averaging_args.target_group_size
    if not auxiliary and batch_size_per_step is None:
        batch_size_per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    aggregation = robust.Aggregation(
        averaging_args.aggregation, averaging_args.clip_tau, averaging_args.clip_iterations
    )
    # what both modes are built with; each adds its own settings below
    shared = dict(
        gate=gate,
        aggregation=aggregation,
        passes_through=(StopNow,),  # a stop request during a state download stops the trainer
        dht=dht,
        run_id=swarm_args.run_id,
        batch_size_per_step=batch_size_per_step,
        params=parameter_groups(model, training_args.weight_decay),
        matchmaking_time=timing.matchmaking_time,
        next_chunk_timeout=timing.next_chunk_timeout,
        load_state_timeout=timing.load_state_timeout,
        # hivemind 1.1.x replaces an explicit client_mode by dht.client_mode only when it is not None (inverted
        # condition), so pass the DHT's own value: the DHT is where client mode is really set
        client_mode=dht.client_mode,
        auxiliary=auxiliary,
        state_averaging_compression=state_compression,
        load_state_compression=state_compression,
        averager_opts=averager_opts,
        tracker_opts={
            "metadata_expiration": optimizer_args.metadata_expiration,
            "max_refresh_period": timing.max_refresh_period,
        },
        # hivemind reports each round's result at INFO only when verbose: sahajbert.round_log.RoundMonitor counts
        # them and keeps them (and the progress lines) off the terminal without --verbose
        verbose=True,
    )
    if optimizer_args.diloco_inner_steps:
        # SparseLoCo: top-k pseudo-gradients with error feedback, which takes the outer momentum's place
        sparse = optimizer_args.pseudo_gradient_compression == "sparse"
        outer_momentum = 0.0 if sparse else optimizer_args.outer_momentum
        sparse_args = peer_args.sparse_args
        rounds, pseudo_gradient_codec = None, None
        if sparse:
            pseudo_gradient_codec = SparseParts(sparse_args.sparse_density)
            rounds = SparseRounds(
                sparse_args.sparse_density,
                sparse_args.sparse_chunk_size,
                sparse_args.error_feedback_decay,
                sparse_args.diloco_fragments,
            )
        inner_optimizer = partial(AdamW, **adam_settings) if optimizer_args.diloco_inner_optimizer == "adamw" else lamb
        return DiLoCoOptimizer(
            inner_optimizer=inner_optimizer,
            inner_lr=partial(
                lr_at_step,
                peak=training_args.learning_rate,
                warmup_steps=training_args.warmup_steps,
                total_steps=training_args.total_steps,
            ),
            inner_steps=optimizer_args.diloco_inner_steps,
            wait=optimizer_args.diloco_wait,
            overlap=optimizer_args.diloco_overlap,
            reads_per_step=DILOCO_READS_PER_STEP,
            last_step=None if auxiliary else training_args.max_steps,
            optimizer=partial(outer_sgd, lr=optimizer_args.outer_lr, momentum=outer_momentum),
            scheduler=None,
            # the round's result is awaited from the end of this peer's inner steps: the wait for the others first
            averaging_timeout=timing.averaging_timeout + optimizer_args.diloco_wait,
            grad_compression=pseudo_gradient_codec or make_compression(optimizer_args.pseudo_gradient_compression),
            sparse=rounds,
            grad_averager_factory=gradient_averager_factory(gate, aggregation, **averager_opts),
            **shared,
        )
    return GuardedOptimizer(
        target_batch_size=optimizer_args.target_batch_size - optimizer_args.batch_size_lead,
        optimizer=lamb,
        scheduler=scheduler,
        averaging_timeout=timing.averaging_timeout,
        offload_optimizer=optimizer_args.offload_optimizer,
        delay_optimizer_step=optimizer_args.delay_optimizer_step,
        delay_grad_averaging=optimizer_args.delay_grad_averaging and not optimizer_args.use_local_updates,
        average_state_every=optimizer_args.average_state_every,
        use_local_updates=optimizer_args.use_local_updates,
        grad_compression=compression,
        grad_averager_factory=None
        if optimizer_args.use_local_updates
        else gradient_averager_factory(gate, aggregation, **averager_opts),
        **shared,
    )


# devices with torch's fused non-finite check (`torch._amp_foreach_non_finite_check_and_unscale_`, GradScaler's)
FUSED_CHECK_DEVICES = ("cpu", "cuda")


@torch.no_grad()
def gradients_finite(gradients) -> bool:
    """`is_finite` for a pass's gradients, by GradScaler's fused check (one call per device and dtype) where torch has
    it, scaling by 1 (it multiplies in place: the values stay as they are, so it is only for tensors that no other
    process writes, unlike parameters that an averager shares): ~20 us for the tiny model's 32 gradients on one CPU
    core, against ~80 us for `is_finite`'s sums, which cost ~1% of a tiny DiLoCo trainer's time on busy cores."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    others = []
    for t in gradients:
        if t is None or not t.is_floating_point():
            continue  # (no gradient; integers are finite)
        if t.device.type in FUSED_CHECK_DEVICES:
            groups.setdefault((t.device, t.dtype), []).append(t)
        else:
            others.append(t)
    for (device, _), group in groups.items():
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.ones((), device=device))
        if found.item():
            return False
    return is_finite(others)


def is_finite(tensors) -> bool:
    """True if every tensor is free of NaN and inf, by its float32 sum: a NaN or an infinity makes the sum non-finite,
    and so would a finite sum past 3.4e38, which no trainable tensor reaches. A trainer checks every pass: on the CPU a
    sum is ~15x faster than `isfinite().all()`, which took 6% of a tiny DiLoCo trainer's time; one sync per device."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None:
            sums.setdefault(t.device, []).append(t.sum(dtype=torch.float32))
    return all(bool(torch.stack(found).isfinite().all()) for found in sums.values())
