"""DiLoCo on hivemind.Optimizer's gradient path (`DiLoCoOptimizer`)."""

import copy
import logging
import time
from collections.abc import Callable

import torch
from hivemind.averaging.control import StepControl
from hivemind.optim.progress_tracker import GlobalTrainingProgress
from hivemind.utils import get_dht_time

from sahajbert.hivemind_ext.averaging.control import cancel_round, round_pending, still_matching
from sahajbert.hivemind_ext.optim.optimizer import NEVER, NO_STATE_AVERAGING, GuardedOptimizer
from sahajbert.hivemind_ext.optim.progress import request_progress_read

logger = logging.getLogger(__name__)


SCHEDULE_MARGIN = 1.0  # seconds a round scheduled ahead starts before its timeout ends (hivemind asserts it does)


NOTE_PERIOD = 0.5  # seconds: a DiLoCo trainer notes its progress (samples) at most this often between its reports


class DiLoCoOptimizer(GuardedOptimizer):
    """DiLoCo (Douillard et al. 2023): H local steps of an inner optimizer on the model, then an all-reduce of the
    pseudo-gradients (the outer parameters minus the model's, weighted by the samples behind each) and one outer
    optimizer step (SGD with Nesterov momentum) on the outer parameters, which the model then takes.

    Built on hivemind.Optimizer's gradient path with `offload_optimizer`: the state averager's host copies of the
    parameters are the outer parameters and its optimizer is the outer one, the gradient averager's averaged tensors
    are their `.grad` (`_make_gradient_averager`), and `_update_global_epoch` averages what was accumulated, steps
    the outer optimizer (on this peer's own pseudo-gradient when the round fails or no other peer is there) and
    copies the result into the model (`_apply_optimizer_parameters_`). The inner optimizer's state travels with the
    outer state as `extra_tensors`, so a newcomer downloads both. A trainer that missed an outer round (the swarm's
    step is past its own) downloads the swarm's state at its next step, as hivemind's peers do.

    With `overlap`, the round runs in the background (in the gradient averager's process) while the next inner
    steps run from where this peer's inner steps ended; when it ends (at the first inner step after), the outer step
    is made as above, and the model moves by as much as it moved the outer parameters from where the round was sent
    (`GuardedStateAverager.progress_since`): it keeps its inner progress, and its next pseudo-gradient is that
    progress alone. This is Streaming DiLoCo's overlap with a delay of one round (Douillard et al. 2025; Kale et al.
    2025 call it the naive delayed update): each outer step arrives one round late. A round still in flight at the
    next H-th inner step (it waits for a slower peer to make its H steps) is not waited for: the inner steps go on
    until it ends, and the next round, sent then, carries them all (the rounds weigh each pseudo-gradient by its
    samples), so a faster peer computes where it would have idled. From `most_inner_steps` on (H + H/10, at least
    H + 1) the round is waited for: peers on alike hardware differ by a few percent in pace, and an outer step stays
    within 10% of H inner steps (where a round outlasts them, at small H on slow links, a looser bound would make
    every outer step one of more inner steps than H, and the one-round delay's loss worse).

    `inner_optimizer`: a factory over the parameter groups; `inner_lr(step)`: its learning rate at an inner step,
    counted over the run (global step x H + the inner steps since); `wait`: seconds a peer that made its H steps
    waits for every other trainer to make theirs (its round starts as soon as the group holds all of them), 0: the
    peers that are ready go on within the matchmaking time; `last_step`: the run's last global step (--max_steps;
    None: none), at which no outer round starts (with overlap, the inner steps made after the last round stay in the
    model for the final parameter round); `sparse`: None, or SparseLoCo's rounds (sahajbert.sparse.SparseRounds): it
    turns each pseudo-gradient, in place, into what this peer sends of it (`compress_`), puts the rest back into the
    model after the outer step (`keep_in_`), and names the `fragments` the rounds take turns at (Streaming DiLoCo: a
    round every H / F inner steps, of the tensors `fragment_at` the step it starts from); checkpoints keep its
    `state_dict` and the outer parameters under "diloco".
    """

    def __init__(
        self,
        *,
        inner_optimizer,
        inner_lr: Callable[[int], float],
        inner_steps: int,
        wait: float,
        overlap: bool = False,
        last_step: int | None = None,
        sparse=None,
        **kwargs,
    ):
        # copies: a torch optimizer writes its settings into the groups it is given, and the outer one gets them too
        self.inner = inner_optimizer([dict(group) for group in kwargs["params"]])
        fragments = sparse.fragments if sparse is not None else 1
        if not 1 <= fragments <= inner_steps:
            raise ValueError(f"DiLoCo's fragments must be from 1 to its inner steps ({inner_steps}), got {fragments}")
        # with fragments, a round every H / F inner steps, each of one fragment: each fragment's every H
        self.fragments = fragments
        inner_steps //= fragments
        self.inner_lr, self.inner_steps, self.wait, self.overlap = inner_lr, inner_steps, wait, overlap
        # with overlap: the most inner steps an outer step takes while its round in flight waits for a slower peer
        self.most_inner_steps = inner_steps + max(1, inner_steps // 10)
        self.last_step = last_step
        self.sparse = sparse
        self.inner_step = 0  # inner steps since the last outer step
        self.round_samples = 0  # samples behind them
        self.inner_step_seconds = 0.0  # in inner optimizer steps, until `take_inner_step_seconds`
        self.round_began = time.monotonic()  # when this outer step's first inner step began (for `_match_ahead`)
        self.next_round: StepControl | None = None  # with overlap: a group looked for while a round is in flight
        self.own_pseudo_gradient: list[torch.Tensor] | None = None  # during an outer step: this peer's, for a failure
        # the swarm's progress as it was when this round's read ahead was asked for (None: not asked yet)
        self.read_ahead_from: GlobalTrainingProgress | None = None
        self.sent_parameters: list[torch.Tensor] | None = None  # with overlap: the model's when its round was sent
        self.published_epoch: int | None = None  # the step of this peer's last published progress record
        self.noted_at = 0.0  # when this peer's progress was last reported or noted (time.monotonic)
        extras = tuple(self._initialize_inner_state())
        kwargs.update(
            extra_tensors=extras,
            offload_optimizer=True,
            delay_optimizer_step=False,
            delay_grad_averaging=False,
            use_local_updates=False,
            average_state_every=NO_STATE_AVERAGING,
            target_batch_size=NEVER,  # samples never start an outer round: the inner steps do
        )
        super().__init__(**kwargs)
        sizes = [p.numel() for p in self.state_averager.main_parameters]
        if fragments > len(sizes):
            raise ValueError(
                f"DiLoCo's {fragments} fragments need as many parameter tensors; the model has {len(sizes)}"
            )
        self.fragment_of = split_into_fragments(sizes, fragments)

    def fragment_at(self, step: int) -> set[int] | None:
        """The parameters (indices into the model's) whose round starts from global step `step`; None: all."""
        if self.fragments == 1:
            return None
        return {index for index, fragment in enumerate(self.fragment_of) if fragment == step % self.fragments}

    def _outer_step_fragment(self) -> set[int] | None:
        """The fragment of the outer step being made (None: all of them, or no outer step: an aux peer's round)."""
        return self.fragment_at(self.local_epoch) if self.own_pseudo_gradient is not None else None

    @torch.no_grad()
    def _initialize_inner_state(self):
        """Create the inner optimizer's state now (zeros, as its first step would), in the order it is shared; its
        step count is a tensor too, so that it travels and is averaged with the rest."""
        for group in self.inner.param_groups:
            for p in group["params"]:
                state = self.inner.state[p]
                state["step"] = torch.zeros(1)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                yield from (state["step"], state["exp_avg"], state["exp_avg_sq"])

    # ---- the questions of the trainer's loop, answered for DiLoCo's rounds ----

    steps_change_parameters = True  # every inner step does
    model_is_outer = False  # the model holds its inner steps (and with sparse, what it did not send) beyond them
    samples_start_steps = False  # each peer's H-th inner step starts the outer round, whatever the swarm's samples

    def step_would_be_global(self, batch_size: int) -> bool:
        """Its outer round starts with its H-th inner step; a peer the swarm's step has passed (no round of its own in
        flight, which brings it there) downloads the state at its next step."""
        behind = self.tracker.global_epoch > self.local_epoch and not self.round_in_flight
        return behind or self.outer_round_due(self.inner_step + 1)

    def read_progress_now(self, timeout: float) -> bool:
        # asked for halfway through the round (`_read_ahead`), and in: no wait before the outer round
        return self.read_ahead_came_in or super().read_progress_now(timeout)

    def step_progress(self) -> str:
        return f"inner step {self.inner_step}/{self.inner_steps} toward the next outer step"

    def take_inner_step_seconds(self) -> float:
        seconds, self.inner_step_seconds = self.inner_step_seconds, 0.0
        return seconds

    def local_state(self, copied: bool = True) -> dict:
        """The inner optimizer's state and the round's progress: a copy, or its live tensors (to write out now)."""
        return copy.deepcopy(self.inner_state_dict()) if copied else self.inner_state_dict()

    def restore_local_state(self, state: dict) -> None:
        self.load_inner_state_dict(copy.deepcopy(state))

    @property
    def run_inner_step(self) -> int:
        return self.local_epoch * self.inner_steps + self.inner_step

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None):
        """One inner step on this pass's gradients; the outer round after the H-th."""
        if self.auxiliary:
            return super().step()
        if grad_scaler is not None:
            raise ValueError("DiLoCo steps the inner optimizer itself: it takes no fp16 gradient scaler")
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        # while a round runs in the background, the swarm may be a step ahead: that round brings this peer there
        if not self.round_in_flight and self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "Peer is out of sync")
            self.load_state_from_peers()
            return None  # these gradients came from parameters the swarm has moved past
        for group in self.inner.param_groups:
            group["lr"] = self.inner_lr(self.run_inner_step)
        started = time.perf_counter()
        self.inner.step()
        self.inner_step_seconds += time.perf_counter() - started
        self.inner_step += 1
        self.round_samples += batch_size
        if self.round_in_flight and (self.scheduled_grads.done() or self.inner_step >= self.most_inner_steps):
            self.finish_round_in_flight()  # it ended, or this peer is a round ahead of the slowest: wait for it
        self._report_progress()
        self._read_ahead()
        self._match_ahead()
        if self.inner_step >= self.inner_steps and not self.round_in_flight:
            self._outer_step()
        return None

    def outer_round_due(self, inner_step: int) -> bool:
        """Whether an outer round would start after `inner_step` inner steps, as things are now (as `step` decides):
        from the H-th on, once no round is in flight (one in flight is finished at the first inner step after it
        ends, at the latest at the `most_inner_steps`-th)."""
        if inner_step < self.inner_steps:
            return False
        in_flight = self.round_in_flight and not self.scheduled_grads.done()
        return not in_flight or inner_step >= self.most_inner_steps

    def _report_progress(self) -> None:
        """The swarm needs this peer's step and presence from its progress record, not its samples (no count of
        samples starts a round): the record is published once per step, at the first inner step made at it, and
        refreshed by the tracker's periodic report; the other reports stay local. Each store of a signed record
        costs a DHT lookup that returns every peer's record: a store per inner step would be most of what a trainer
        sends, and the epoch change's own report (held in `_update_global_epoch`) one more per round. The other
        reports are noted at most every NOTE_PERIOD seconds: the periodic report sends the last one, seconds apart,
        and each note builds a record and updates the throughput's average."""
        now = time.monotonic()
        if self.local_epoch != self.published_epoch:
            self.tracker.report_local_progress(self.local_epoch, self.round_samples)
            self.published_epoch, self.noted_at = self.local_epoch, now
        elif now - self.noted_at >= NOTE_PERIOD:
            self.tracker.note_local_progress(self.local_epoch, self.round_samples)
            self.noted_at = now

    def _update_global_epoch(self, grad_scaler) -> None:
        # the new step is published with the next inner step's report (`_report_progress`), except the run's last,
        # after which there is no inner step
        last = self.last_step is not None and self.local_epoch + 1 >= self.last_step
        # an outer step of a fragment's round moves that fragment of the model only
        in_outer_step = self.own_pseudo_gradient is not None
        fragment = self._outer_step_fragment()
        self.state_averager.apply_only = fragment
        try:
            with self.tracker.reports_held(not (last or self.auxiliary)):
                super()._update_global_epoch(grad_scaler)
        finally:
            self.state_averager.apply_only = None
        if in_outer_step and self.sparse is not None:
            # the model, now at the swarm's new parameters, takes back what this peer did not send
            with torch.no_grad():
                self.sparse.keep_in_(self.state_averager.main_parameters, only=fragment)

    def _read_ahead(self) -> None:
        """Halfway through a round, ask for the fresh read of the swarm's progress (its peers, its step) that the
        outer round starts on, without waiting: it comes in during the next inner steps, and the H-th step does not
        wait for a DHT read (over a slow link, one takes as long as several tiny inner steps). Not in the run's first
        round, whose read follows the wait for the trainers starting with it; with overlap the second round, also
        sent at step 0 (while the first is in flight), reads ahead like the rest (otherwise its send would wait for a
        fresh read, then for its group). Also while the previous round is in flight: its outer step changes only
        this peer's own step, which the outer round does not read from the swarm, and a round in flight often ends
        after halfway: asking only then would leave the H-th step waiting for the read."""
        if (self.local_epoch == 0 and not self.round_in_flight) or self.read_ahead_from is not None:
            return
        if self.inner_step >= self.inner_steps // 2:
            self.read_ahead_from = self.tracker.global_progress
            request_progress_read(self.tracker)

    def _match_ahead(self) -> None:
        """Once the read asked halfway through the round has come in, look for the outer round's group, timed for
        the H-th inner step, where its all-reduce then starts at once: matchmaking takes several round trips (the
        DHT, then the leader) that would otherwise come after the H-th step, about half of a tiny trainer's round
        over slow links. hivemind's optimizer pre-schedules its gradient rounds the same way, in `scheduled_grads`,
        which the trainer's stopping rules read. With overlap, also while the previous round's all-reduce runs, into
        `next_round` until that round ends (over slow links matchmaking lasts tens of tiny inner steps: begun only
        once a round had ended, it could still be looking at the H-th); not while that round still looks for its
        group: the averager looks for one group at a time, and the group size it aims for is one setting."""
        if not self.read_ahead_came_in or round_pending(self.scheduled_grads) or round_pending(self.next_round):
            return
        if self.round_in_flight and still_matching(self.scheduled_grads):
            return
        coming_step = self.local_epoch + (1 if self.round_in_flight else 0)  # the step the next round starts from
        if self.last_step is not None and coming_step >= self.last_step:
            return  # no outer round follows
        peers = self.tracker.global_progress.num_peers
        if peers > 1:
            seconds_per_step = (time.monotonic() - self.round_began) / max(1, self.inner_step)
            control = self._schedule_round(peers, (self.inner_steps - self.inner_step) * seconds_per_step)
            if control is None:
                return  # the round is looked for at the H-th step instead
            if self.round_in_flight:
                self.next_round = control
            else:
                self.scheduled_grads = control

    def _schedule_round(self, peers: int, delay: float) -> StepControl | None:
        """A gradient round that looks for its group now and starts its all-reduce when triggered; a group waits
        `delay` seconds (the time to the H-th inner step) plus `wait` for the others, the matchmaking time at
        least, and is complete as soon as it holds every trainer when `wait` > 0. None, with a warning, when
        hivemind refuses it: the round is then looked for when it begins, as hivemind's optimizer does."""
        if self.wait > 0:
            self.grad_averager.set_target_group_size(peers)
        wait = max(self.wait, self.matchmaking_time)
        # hivemind refuses a start later than the round's timeout: a pace estimate can ask for that (a trainer whose
        # inner steps stalled), and the round then starts at the latest time that still fits
        if self.averaging_timeout is not None:
            delay = min(delay, self.averaging_timeout - wait - SCHEDULE_MARGIN)
        try:
            return self.grad_averager.schedule_step(
                scheduled_time=get_dht_time() + max(0.0, delay) + wait, timeout=self.averaging_timeout
            )
        except Exception as e:  # noqa: BLE001 - hivemind asserts its scheduling rules; a round it refuses is not made
            logger.warning(f"could not schedule the outer round ahead ({e!r}): it looks for its group when it begins")
            return None

    @property
    def read_ahead_came_in(self) -> bool:
        """The read asked for this round has come in (each read replaces the tracker's `global_progress`)."""
        return self.read_ahead_from is not None and self.tracker.global_progress is not self.read_ahead_from

    @property
    def round_in_flight(self) -> bool:
        """With overlap: an outer round runs in the background, its outer step not yet made."""
        return self.sent_parameters is not None

    @torch.no_grad()
    def _outer_step(self) -> None:
        if self.last_step is not None and self.local_epoch >= self.last_step:
            return  # the run has ended: the trainer stops at this step
        outer = self._outer_parameters()
        fragment = self.fragment_at(self.local_epoch)
        for index, (model_param, outer_param) in enumerate(zip(self.state_averager.main_parameters, outer)):
            if fragment is None or index in fragment:
                model_param.grad = outer_param.to(model_param.device) - model_param
            else:  # another fragment's: sent as zeros (a few bytes a part, sparse), its outer parameters unmoved
                model_param.grad = torch.zeros_like(model_param)
        if self.sparse is not None:  # what this peer sends of its pseudo-gradient; it keeps the rest
            self.sparse.compress_([p.grad for p in self.state_averager.main_parameters], only=fragment)
        self.grad_averager.reset_accumulated_grads_()
        self.grad_averager.accumulate_grads_(self.round_samples)  # once: the pseudo-gradient, weighted by samples
        peers = self.tracker.global_progress.num_peers
        # a group looked for ahead (`_match_ahead`) is taken as it is; alone, hivemind cancels it
        if peers > 1 and not round_pending(self.scheduled_grads):
            self.scheduled_grads = self._schedule_round(peers, 0.0)  # None: hivemind schedules its own below
        self.own_pseudo_gradient = [p.grad for p in self.state_averager.main_parameters]
        self.inner_step = self.round_samples = 0
        self.round_began = time.monotonic()
        self.read_ahead_from = None
        # alone, there is no round to overlap: the outer step is made now
        if self.overlap and peers > 1 and super()._begin_averaging_gradients(None):
            self.sent_parameters = [p.detach().clone() for p in self.state_averager.main_parameters]
            logger.log(self.status_loglevel, "Outer round sent: the next inner steps run while it averages")
        else:
            try:
                self._update_global_epoch(None)
            finally:
                self.own_pseudo_gradient = None
                # the pace of the next inner steps is measured from here: the wait for this round is no inner step's
                self.round_began = time.monotonic()
        self.zero_grad(set_to_none=True)

    def finish_round_in_flight(self, timeout: float | None = None) -> None:
        """With overlap: wait for the round in flight (at most `timeout` seconds, then it is cancelled; None: the
        averaging timeout), make its outer step (on this peer's own pseudo-gradient if the round failed) and move
        the model by as much, keeping the inner progress made since the round was sent."""
        if not self.round_in_flight:
            return
        if timeout is not None:
            try:
                self.scheduled_grads.result(timeout)
            except BaseException:  # failed or still running: hivemind's fallback below takes the own pseudo-gradient
                if not self.scheduled_grads.done():
                    cancel_round(self.scheduled_grads)
        logger.log(self.status_loglevel, f"Outer round awaited after {self.inner_step} inner step(s) behind it")
        self.state_averager.progress_since = self.sent_parameters
        try:
            self._update_global_epoch(None)
        finally:
            self.state_averager.progress_since = self.sent_parameters = self.own_pseudo_gradient = None
            if self.next_round is not None:  # the next round's group, looked for meanwhile, is the one to use
                self.scheduled_grads, self.next_round = self.next_round, None

    def _load_averaged_gradients_into_optimizer_(self):
        # a round's average holds the fragment this peer sent, and another fragment where a peer one step off (a
        # newcomer, a round awaited late) sent that: this peer's outer step moves its own fragment only
        fragment = self._outer_step_fragment()
        if fragment is not None:
            with torch.no_grad():
                for index, outer in enumerate(self._outer_parameters()):
                    if index not in fragment and outer.grad is not None:
                        outer.grad.zero_()
        super()._load_averaged_gradients_into_optimizer_()

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        # with overlap the round in flight was begun when it was sent (`_outer_step`); `finish_round_in_flight`'s
        # `_update_global_epoch` only awaits it
        return True if self.round_in_flight else super()._begin_averaging_gradients(grad_scaler)

    @torch.no_grad()
    def _load_local_gradients_into_optimizer(self):
        """Replaces hivemind 1.1.12's Optimizer._load_local_gradients_into_optimizer (hivemind/optim/optimizer.py),
        which it calls outside an outer step. No other peer, or a failed round: the outer step takes this peer's own
        pseudo-gradient. (hivemind's fallback reloads the gradient accumulators, which the start of a round has reset:
        after a failed round the outer step would get zeros and take the model back to where its inner steps began,
        H steps of work lost.)"""
        if self.own_pseudo_gradient is None:  # not in an outer step (an auxiliary peer's round): hivemind's way
            return super()._load_local_gradients_into_optimizer()
        logger.log(self.status_loglevel, "Proceeding with this peer's own pseudo-gradient")
        with self.grad_averager.get_tensors() as averaged:
            for target, own in zip(averaged, self.own_pseudo_gradient):
                target.copy_(own)
        self._load_averaged_gradients_into_optimizer_()

    @torch.no_grad()
    def take_model_into_outer(self) -> None:
        """Before the final parameter round, which averages the outer parameters: make them the model's, so that the
        swarm's final model holds each trainer's inner steps since its last round (with overlap) and what it had not
        sent (sparse), which its outer parameters lack; what it had not sent is then in them (its buffers zero)."""
        for outer, model_param in zip(self._outer_parameters(), self.state_averager.main_parameters, strict=True):
            outer.copy_(model_param.to(outer.device))
        if self.sparse is not None:
            self.sparse.clear()

    def load_state_from_peers(self, **kwargs):
        self.finish_round_in_flight()  # its result lands in the tensors the download replaces
        if still_matching(self.scheduled_grads):  # a group looked for ahead, not formed yet: this round is not made
            cancel_round(self.scheduled_grads)  # (hivemind's download joins a formed one with no weight, as it waits)
        taken = super().load_state_from_peers(**kwargs)
        if taken:
            self.inner_step = self.round_samples = 0  # the model is the swarm's outer parameters: a new round
            self.round_began = time.monotonic()
            self.read_ahead_from = None  # which reads ahead of its outer round again
        return taken

    def shutdown(self):
        # hivemind's shutdown leaves only `scheduled_grads`: a group looked for behind a round in flight is left too
        if still_matching(self.next_round):
            cancel_round(self.next_round)
        elif round_pending(self.next_round):
            self._tag_along_with_zero_weight(self.next_round)
        super().shutdown()

    def inner_state_dict(self) -> dict:
        """The inner optimizer's state and this round's progress (its tensors are the live ones: copy to keep)."""
        return {"inner": self.inner.state_dict(), "inner_step": self.inner_step, "round_samples": self.round_samples}

    @torch.no_grad()
    def load_inner_state_dict(self, state: dict) -> None:
        # into the tensors the state averager shares (extra_tensors): the inner optimizer's own load_state_dict
        # would replace them
        params = [p for group in self.inner.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            for name, value in state["inner"]["state"].get(index, {}).items():
                self.inner.state[p][name].copy_(torch.as_tensor(value))
        self.inner_step, self.round_samples = state["inner_step"], state.get("round_samples", 0)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["diloco"] = self.inner_state_dict()
        if self.sparse is not None:
            # the model holds what this peer has not sent: the outer parameters are not the model's, and are kept
            state["diloco"]["error_feedback"] = self.sparse.state_dict()
            state["diloco"]["outer_parameters"] = [p.detach().clone() for p in self._outer_parameters()]
        return state

    def load_state_dict(self, state_dict: dict):
        diloco = state_dict.pop("diloco", None)
        result = super().load_state_dict(state_dict)
        if diloco is not None:
            self.load_inner_state_dict(diloco)
            if self.sparse is not None and "error_feedback" in diloco:
                self.sparse.load_state_dict(diloco["error_feedback"])
                with torch.no_grad():
                    for outer, saved in zip(self._outer_parameters(), diloco["outer_parameters"], strict=True):
                        outer.copy_(torch.as_tensor(saved))
        return result

    def _outer_parameters(self) -> list[torch.Tensor]:
        """The outer parameters: the state averager's host copies, which its optimizer steps."""
        return [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]


def split_into_fragments(sizes: list[int], fragments: int) -> list[int]:
    """Each tensor's fragment (0 .. fragments - 1): consecutive tensors, about as many values in each fragment
    (Streaming DiLoCo's fragments are consecutive layers). Every fragment holds at least one tensor."""
    total, done, owner = sum(sizes), 0, []
    for index, size in enumerate(sizes):
        previous = owner[-1] if owner else -1
        # the fragment of the tensor's middle value; none skipped, and none left without a tensor
        fragment = int((done + size / 2) * fragments / max(1, total))
        fragment = min(fragment, previous + 1, fragments - 1)
        owner.append(max(fragment, previous, fragments - (len(sizes) - index)))
        done += size
    return owner
