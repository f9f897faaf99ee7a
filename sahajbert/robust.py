"""Robust aggregation: what one all-reduce part becomes when some of the peers that sent it may be wrong or hostile.

hivemind's reducer returns the weighted mean of whatever arrives, so one peer sending NaN makes every groupmate's
part NaN, and one peer sending x1e4-scaled values decides the average alone. The reducer of a part here
(`hivemind_ext.averaging.allreduce.RobustAccumulator`, used by every averager: gradients, parameters, DiLoCo's
pseudo-gradients) instead combines the contributions with `aggregate`; the fence is given this module as its rules
(`hivemind_ext.install(rules=...)`, by `swarm.install_hivemind_ext`):

- non-finite contributions are always dropped;
- each contribution's weight (the samples a peer claims for its gradients) is capped at the median weight, so that a
  claimed weight cannot outvote the others;
- "centered_clip" (the default) is CenteredClip from "Secure Distributed Training at Scale" (Gorbunov et al., 2022,
  BTARD): starting at the coordinate-wise median, `iterations` times v <- v + mean_i(clip(x_i - v, tau)), where
  clip shortens a vector to norm tau. tau here is a multiple (--clip_tau) of the median distance of the
  contributions from the median, so that one setting suits gradients and parameters of any size and scale;
- "norm_clip" clips each contribution's norm to --clip_tau times the median norm, then takes the weighted mean:
  cheaper, and enough against scaled contributions, but a sign-flipped one keeps its full weight;
- "plain" is hivemind's weighted mean (no checks), for comparison and for runs that trust every peer.

Two contributions have no majority: their median is their mean, and a hostile one decides it. A reducer that holds
one of the two (`own`) takes its own as the reference and shortens the other's offset from it to `pair_factor` x
its own size (by either rule): honest gradients of two batches lie about 1.4x their norm apart (PAIR_FACTOR 3
leaves them as they are), honest parameters of two peers a few updates apart (PARAMETER_PAIR_FACTOR 0.1). A hostile
peer then moves a pair's average by at most half that bound per round: not stopped (no rule can tell which of two
is honest), but bounded. The own size is the larger of the own part's norm and `own_scale`, the reducer's whole
contribution's norm shared out by the part's length: hivemind cuts each tensor into its own parts, and a part can be
near zero in one honest peer's values and not in the other's (a zero-initialized bias that the other's last update
moved, embedding rows that only the other's batch touched), where a bound of the part's own norm would throw away the
other's values. A reducer that takes part with weight 0 (one step behind, tagging along) and combines two others'
gradients judges both by its own in the same way: their plain mean would again let a hostile one decide.

A receiver also checks what a reducer sends back (`implausible`): a reducer may return anything for its part.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

RULES = ("centered_clip", "norm_clip", "plain")
# a reducer's average may differ from the receiver's own part by at most this many times the norm of that part (or
# of the part's typical size when that is near zero): an honest average of honest parts is never that far
IMPLAUSIBLE_FACTOR = 100.0
TINY = 1e-12
OUTLIER_FACTOR = 10.0  # a contribution this many times farther out than the median one is logged as an outlier,
OUTLIER_SHARE = 10.0  # if also farther from the result than this many times the result's norm
PAIR_FACTOR = 3.0  # gradients: the other of two contributions stays within this many times the own one's norm of it
PARAMETER_PAIR_FACTOR = 0.1  # parameters (and optimizer statistics): within a tenth of the own one's norm


@dataclass(frozen=True)
class Aggregation:
    """How a reducer combines the contributions to its part (see the module's docstring)."""

    rule: str = "centered_clip"
    tau: float = 1.0
    iterations: int = 3
    pair_factor: float = PAIR_FACTOR

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"--aggregation must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not self.tau > 0:
            raise ValueError(f"--clip_tau must be positive, got {self.tau}")
        if not self.pair_factor > 0:
            raise ValueError(f"the pair factor must be positive, got {self.pair_factor}")
        if self.iterations < 1:
            raise ValueError(f"--clip_iterations must be at least 1, got {self.iterations}")


def finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


@dataclass
class Combined:
    """A reduced part, with the contributions (by index) dropped as non-finite and those far out of the others'
    range (over OUTLIER_FACTOR x the median distance from the result, or x the median norm for norm_clip), which the
    rule bounded: a reducer logs both with the peer's ID."""

    tensor: torch.Tensor
    dropped: list[int]
    outliers: list[int]


def aggregate(
    contributions: list[torch.Tensor],
    weights: list[float],
    how: Aggregation,
    own: int | None = None,
    own_scale: float = 0.0,
) -> Combined:
    """Combine one part's contributions; `own`: the index of the reducer's own contribution, if it sent one, and
    `own_scale` its whole contribution's norm shared out by this part's length (see the module's docstring). With no
    finite contribution the result is NaN: receivers (`implausible`) then keep their own part."""
    shape = contributions[0].shape
    if how.rule == "plain":
        mean = sum(c.float() * w for c, w in zip(contributions, weights)) / sum(weights)
        return Combined(mean, [], [])
    keep = [i for i, (c, w) in enumerate(zip(contributions, weights)) if w > 0 and math.isfinite(w) and finite(c)]
    # a weight of 0 is a peer that takes part without samples (an aux peer assisting, one tagging along): not dropped,
    # nothing to tell of
    dropped = [i for i in range(len(contributions)) if i not in keep and weights[i] != 0]
    if not keep:
        return Combined(torch.full(shape, float("nan")), dropped, [])
    stacked = torch.stack([contributions[i].float().reshape(-1) for i in keep])  # [peers, values]
    claimed = torch.tensor([float(weights[i]) for i in keep])
    w = torch.clamp(claimed, max=float(claimed.median()))
    w = w / w.sum()
    reference = _own_reference(contributions, weights, keep, own, own_scale, how)
    if reference is not None:
        bound = how.pair_factor * max(float(reference.norm()), own_scale)
        paired = _around(stacked, w, keep, reference, bound, dropped)
        return Combined(paired.tensor.reshape(shape), paired.dropped, paired.outliers)
    if how.rule == "norm_clip":
        sizes = stacked.norm(dim=1)
        bound = how.tau * float(sizes.median())
        scale = torch.clamp(bound / sizes.clamp_min(TINY), max=1.0)
        combined = (w[:, None] * scale[:, None] * stacked).sum(0)
    else:
        # with two contributions the median is their mean and both are equally far from it: nothing to clip
        combined = stacked.median(dim=0).values if len(keep) > 2 else (w[:, None] * stacked).sum(0)
        tau = how.tau * float((stacked - combined).norm(dim=1).median())
        for _ in range(how.iterations if tau > 0 else 0):
            offsets = stacked - combined
            scale = torch.clamp(tau / offsets.norm(dim=1).clamp_min(TINY), max=1.0)
            combined = combined + (w[:, None] * scale[:, None] * offsets).sum(0)
        sizes = (stacked - combined).norm(dim=1)
    # far out both next to the others and next to the result itself: peers with equal parameters (the same averaged
    # update applied) make the median distance about 0, and every other peer would look far out of it
    bound = max(OUTLIER_FACTOR * float(sizes.median()), OUTLIER_SHARE * float(combined.norm()))
    outliers = [keep[j] for j in range(len(keep)) if len(keep) > 2 and float(sizes[j]) > bound]
    return Combined(combined.reshape(shape), dropped, outliers)


def _own_reference(contributions, weights, keep: list[int], own: int | None, own_scale: float, how: Aggregation):
    """The reducer's own part, flattened, when the two contributions it combines are to be judged by it (else None):
    two contributions have no majority, so the reducer's own part is the reference. Also when the reducer takes part
    with weight 0 (one step behind, tagging along) in a gradient round (a pair factor of 1 or more): its gradients
    still say how large an honest one is, where the two others' mean would let a hostile one decide. Not in a
    parameter round: its parameters are a step old, and a bound of a tenth of their size would shorten honest ones.
    Not a part of zeros with no scale either (an aux peer's gradients)."""
    if len(keep) != 2 or own is None:
        return None
    if own in keep:
        return contributions[own].float().reshape(-1)
    if weights[own] != 0 or how.pair_factor < 1 or not finite(contributions[own]):
        return None
    reference = contributions[own].float().reshape(-1)
    return reference if own_scale > 0 or float(reference.norm()) > 0 else None


def _around(stacked, w, keep: list[int], reference: torch.Tensor, bound: float, dropped: list[int]) -> Combined:
    """Contributions judged by a reference part (the reducer's own): each one's offset from it is shortened to
    `bound`, then they are averaged by weight; one is an outlier if it was shortened to less than a tenth
    (1 / OUTLIER_FACTOR) of its offset."""
    offsets = stacked - reference
    distances = offsets.norm(dim=1)
    scale = torch.clamp(bound / distances.clamp_min(TINY), max=1.0)
    combined = reference + (w[:, None] * scale[:, None] * offsets).sum(0)
    outliers = [keep[j] for j in range(len(keep)) if float(distances[j]) > OUTLIER_FACTOR * bound]
    return Combined(combined, dropped, outliers)


def implausible(delta: torch.Tensor, scale: float) -> str | None:
    """Why an average a reducer sent back (as `delta`, the change to this peer's own part) cannot be honest, or None.

    `scale` is this peer's own idea of the part's size: the larger of its own part's norm and its whole contribution's
    norm shared out by the part's length (a part of zeros in this peer's gradient may be non-zero in others'). With
    scale 0 (this peer contributed nothing) only finiteness is checked."""
    if not finite(delta):
        return "non-finite values"
    distance = float(delta.float().norm())
    if scale > 0 and distance > IMPLAUSIBLE_FACTOR * scale:
        return f"it moves this peer's part by {distance:.3g}, over {IMPLAUSIBLE_FACTOR:g}x its size {scale:.3g}"
    return None


# ---- progress claims: what a peer may say about its share of the swarm's batch ----

# other serving peers that must report a step above this peer's own before it counts, unless one of them is vouched
# for (see plausible_progress): one peer's claim alone never moves the swarm's step
CORROBORATING_PEERS = 2
UNBACKED = "that no other peer backs"  # in the note on such a claim
THROUGHPUT_FACTOR = 10.0  # a claimed samples/s above this many times the peers' median counts as this much
SAMPLES_SLACK = 2.0  # a claimed count above twice what the (capped) throughput accumulates since the step began


@dataclass(frozen=True)
class Standing:
    """What a peer knows of the others (peer ids as bytes): those its averagers left out, and those it vouches for."""

    left_out: Collection[bytes] = ()
    vouched: Collection[bytes] = ()


def _corroborated_step(
    own_epoch: int, others: list[tuple[int, bytes]], vouched: Collection[bytes], batch_full: bool
) -> int:
    """The highest step this peer may follow, given the other serving peers' (step, peer id), highest first: at most
    their lower median, and reported by one that is vouched for, or, while no peer that reports progress is vouched
    for, by CORROBORATING_PEERS of them; else its own, or one more when `batch_full` (this peer's own count of the
    step's samples backs the next step)."""
    if not others:
        return own_epoch
    median = others[len(others) // 2][0]
    if batch_full and median > own_epoch:
        own_epoch += 1
    # peers this one vouches for are the swarm it trains in: where they report progress, a step none of them backs
    # is another swarm's (plain peers that share the run's name never meet this one's rounds, and two of them back
    # each other's claims), checked as a lone claim is, by taking the claimant's state
    any_vouched = any(peer in vouched for _, peer in others)
    for epoch in sorted({epoch for epoch, _ in others if own_epoch < epoch <= median}, reverse=True):
        backers = [peer for step, peer in others if step >= epoch]
        if any(peer in vouched for peer in backers) or (len(backers) >= CORROBORATING_PEERS and not any_vouched):
            return epoch
    return own_epoch


def plausible_progress(
    claims: dict,
    own_peer: bytes,
    own_epoch: int,
    target: int,
    step_seconds: float,
    standing: Standing = None,
    batch_full: bool = False,
) -> tuple[dict, list[tuple[str, bytes]]]:
    """The progress records hivemind's tracker reads (subkey -> record with a dict `value`: peer_id, epoch,
    samples_accumulated, samples_per_second, client_mode), bounded; and (what was done, peer) for each claim changed
    or ignored.

    - a record with a non-finite or negative number is ignored;
    - so is the record of a peer in `left_out` (this peer's averagers left it out): its samples would make this peer
      step on samples that no round of its averages holds, ahead of the other honest peers;
    - the swarm's step (hivemind takes the highest any peer reports) is at most the lower median of the other
      serving peers' steps: more than half of them must be there, so one peer cannot end or skip others' runs
      (a peer that joins a run in progress still follows them: all others are ahead). A claim one step ahead is
      the normal moment when some peers have finished a round and others not yet: it is left out without a note;
    - and a step above this peer's own counts only when it is corroborated: one of the peers that report it is
      `vouched` for (this peer averaged with it in a round that came back whole, or took a checked state from it),
      or, while this peer vouches for none of the peers that report progress (a newcomer), CORROBORATING_PEERS of
      them report it (or more). A lone claimant, such as a plain hivemind peer that trains alone before the honest
      trainers start, moves neither the step they stop at nor the one they download, and neither do two such
      peers once the honest trainers have averaged together. One step
      more is followed on one peer's word when `batch_full`: this peer's last read counted the step's batch (at
      least half of it), so another peer may well have started the next step's round;
    - with three peers or more a throughput over THROUGHPUT_FACTOR x the median (of the peers that report one: a
      peer that sits out reports 0) is capped there, and a peer's
      samples toward the current step at SAMPLES_SLACK x what that throughput gives over `step_seconds` (since this
      peer saw the step begin), plus a share of the batch; never more than the batch.
    """
    standing = standing or Standing()
    left_out, vouched = standing.left_out, standing.vouched
    notes = []
    records = {}
    for subkey, record in claims.items():
        value = getattr(record, "value", None)
        if not isinstance(value, dict):
            continue
        numbers = [value.get(k) for k in ("epoch", "samples_accumulated", "samples_per_second", "time")]
        if not all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in numbers):
            notes.append(("ignored a progress record with invalid numbers", value.get("peer_id", b"")))
            continue
        if value.get("peer_id") in left_out:
            notes.append(("did not count the progress of a peer left out of this peer's averaging", value["peer_id"]))
            continue
        records[subkey] = record
    steps = {}  # each other serving peer's highest step: one peer is one voice, however many records it wrote
    for r in records.values():
        if r.value["peer_id"] != own_peer and not r.value["client_mode"]:
            steps[r.value["peer_id"]] = max(r.value["epoch"], steps.get(r.value["peer_id"], 0))
    others = sorted(((epoch, peer) for peer, epoch in steps.items()), reverse=True)
    ceiling = _corroborated_step(own_epoch, others, vouched, batch_full)
    median = others[len(others) // 2][0] if others else own_epoch
    kept = {}
    for subkey, record in records.items():
        epoch = record.value["epoch"]
        if epoch <= ceiling:
            kept[subkey] = record
        elif epoch > ceiling + 1 and epoch > median:
            notes.append(
                (f"ignored a claim of step {epoch} (most peers are at {ceiling} or below)", record.value["peer_id"])
            )
        elif epoch > ceiling + 1:
            notes.append(
                (
                    f"ignored a claim of step {epoch} {UNBACKED}: training on at step {ceiling} unless its state "
                    "checks out",
                    record.value["peer_id"],
                )
            )
    if len(kept) >= 3:
        # the median of the peers that make samples now: one that sits out (saving a checkpoint) reports 0 samples/s
        rates = sorted(rate for r in kept.values() if (rate := r.value["samples_per_second"]) > 0)
        rate_cap = THROUGHPUT_FACTOR * rates[len(rates) // 2] if rates else math.inf
        share = target / len(kept)
        bounded = {}
        for subkey, record in kept.items():
            value = dict(record.value)
            rate = min(value["samples_per_second"], rate_cap)
            samples = min(value["samples_accumulated"], SAMPLES_SLACK * rate * step_seconds + share, target)
            if rate < value["samples_per_second"] or samples < value["samples_accumulated"]:
                notes.append(
                    (
                        f"capped a claim of {value['samples_accumulated']} samples at "
                        f"{value['samples_per_second']:.1f} samples/s to {samples:.0f} at {rate:.1f}",
                        value["peer_id"],
                    )
                )
                value["samples_per_second"], value["samples_accumulated"] = rate, int(samples)
            bounded[subkey] = type(record)(value, record.expiration_time)
        kept = bounded
    return kept, notes


# ---- a downloaded state: what a peer accepts from the peer it downloads the training state from ----

# optimizer values that differ between honest peers: the learning rate follows the step (at most its peak), step
# counters grow; every other value (hyperparameters, parameter ids) must equal this peer's own
LR_KEY, STEP_KEY = "lr", "step"


@dataclass
class StateTemplate:
    """This peer's own training state, as hivemind serves it (`TrainingStateAverager.get_current_state`): a
    downloaded state must have the same tensors and optimizer structure, and a plausible step."""

    shapes: list[tuple[int, ...]]  # parameters, extra tensors, then optimizer statistics
    optimizer_metadata: list[dict]  # hivemind's flat optimizer metadata (`dump_optimizer_state`)
    keys: list  # the state_dict key each metadata entry sits under (`flat_keys`)
    max_lr: float  # the highest learning rate the schedule reaches (each group's initial_lr, or lr)
    min_step: int  # this peer's own step: hivemind never loads an older state
    max_step: int | None  # the swarm's step + 1 (None: this peer has no view of the swarm yet)


def flat_keys(tree, key=None):
    """The dict key above each leaf of `tree`, in the order of hivemind's `nested_flatten` (dict items sorted)."""
    if isinstance(tree, list | tuple):
        for item in tree:
            yield from flat_keys(item, key)
    elif isinstance(tree, dict):
        for name, value in sorted(tree.items()):
            yield from flat_keys(value, name)
    else:
        yield key


def _plain(value):
    """Tuples and lists alike (the state travels as msgpack, which has one array type)."""
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def step_out_of_range(metadata, template: StateTemplate) -> str | None:
    """Why a downloaded state's step is not one to load now, or None. Not proof of a corrupted state: this peer's
    view of the swarm's step may be stale (a peer that left is counted until its record expires)."""
    step = metadata.get("epoch") if isinstance(metadata, dict) else None
    ceiling = step if template.max_step is None else template.max_step
    if not isinstance(step, int) or template.min_step <= step <= ceiling:
        return None
    return f"its step {step} is outside {template.min_step}..{template.max_step}"


def state_cut_short(tensors, template: StateTemplate) -> str | None:
    """Why a downloaded state looks cut off in transit (its first tensors, each of the right shape, then nothing),
    or None. Not proof of a corrupted state: an honest peer's stream can end early (a stream cut in transit); the
    peer is skipped, not left out."""
    if len(tensors) >= len(template.shapes):
        return None
    if any(tuple(tensor.shape) != tuple(shape) for tensor, shape in zip(tensors, template.shapes)):
        return None
    return f"it ended after {len(tensors)} of this peer's {len(template.shapes)} tensors"


def state_problem(metadata, tensors, template: StateTemplate) -> str | None:
    """Why a downloaded state (hivemind's metadata dict and flat tensors) is corrupted, or None (its step's range is
    `step_out_of_range`)."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
        return "no step in its metadata"
    if len(tensors) != len(template.shapes):
        return f"{len(tensors)} tensors where this peer's state has {len(template.shapes)}"
    for index, (tensor, shape) in enumerate(zip(tensors, template.shapes)):
        if tuple(tensor.shape) != tuple(shape):
            return f"tensor {index} has shape {tuple(tensor.shape)}, not {tuple(shape)}"
        if tensor.is_floating_point() and not finite(tensor):
            return f"tensor {index} has non-finite values"
    entries = metadata.get("optimizer_metadata")
    if not isinstance(entries, list) or len(entries) != len(template.optimizer_metadata):
        return "its optimizer metadata does not match this peer's optimizer"
    for entry, own, key in zip(entries, template.optimizer_metadata, template.keys):
        if not isinstance(entry, dict) or entry.get("type") != own["type"]:
            return f"its optimizer metadata differs at '{key}'"
        if own["type"] == "tensor":
            if entry.get("index") != own["index"]:
                return f"its optimizer metadata differs at '{key}'"
        elif key == LR_KEY:
            if not (_number(entry.get("value")) and 0 <= entry["value"] <= template.max_lr * (1 + 1e-6)):
                return f"learning rate {entry.get('value')!r} outside 0..{template.max_lr:g}"
        elif key == STEP_KEY:
            if not (_number(entry.get("value")) and entry["value"] >= 0):
                return f"optimizer step {entry.get('value')!r} is not a count"
        elif _plain(entry.get("value")) != _plain(own.get("value")):
            return f"optimizer setting '{key}' is {entry.get('value')!r}, not {own.get('value')!r}"
    return None
