"""A trainer's last good state, and the rollback to it when its parameters or its passes go non-finite."""

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from sahajbert.cli import UserError
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.hivemind_ext.optim.optimizer import GuardedOptimizer
from sahajbert.optim import is_finite

# the trainer's lines keep the trainer's logger name, whichever of its parts says them: users filter on it
logger = logging.getLogger("sahajbert.trainer")
# dropped passes in a row, with finite parameters, that show the parameters themselves are unusable; an honest
# fp32 model's pass is rarely non-finite at all
DROPPED_PASSES_BEFORE_ROLLBACK = 3
# where a trainer keeps its last good state on disk, in its --output_dir (not a checkpoint: removed as it stops)
GOOD_STATE_FILE = ".last_good_state.pt"
KEEP_IN = ("disk", "memory")

# (parameters, optimizer state, the optimizer's local state: DiLoCo's inner state, or None)
State = tuple[list[torch.Tensor], dict, dict | None]
LocalState = Callable[..., dict | None]  # the optimizer's `local_state(copied=...)`


class KeptInMemory:
    """The last good state as host tensors, one copy overwritten in place: with LAMB 3 copies of the parameters (the
    parameters and two moments) held for the whole run (sahajbert-xl: 870 MiB)."""

    def __init__(self):
        self.state: State | None = None

    @property
    def empty(self) -> bool:
        return self.state is None

    def write(self, parameters: list[torch.Tensor], optimizer_state: dict, local_state: LocalState) -> None:
        """Copy the state in; `local_state(copied)` gives the optimizer's local state (a copy, or its live tensors)."""
        if self.state is None:
            kept = [p.detach().to("cpu", copy=True) for p in parameters]
            self.state = (kept, copy.deepcopy(optimizer_state), local_state(copied=True))
            return
        kept, kept_optimizer_state, _ = self.state
        for saved, p in zip(kept, parameters):
            saved.copy_(p.detach())
        state = _copied_into(kept_optimizer_state, optimizer_state)
        self.state = (kept, state, None)  # the old local state is freed before its new copy is made
        self.state = (kept, state, local_state(copied=True))

    def read(self) -> State:
        """The kept state; its optimizer state is a copy the caller may hand to the optimizer."""
        parameters, optimizer_state, local_state = self.state
        return parameters, copy.deepcopy(optimizer_state), local_state

    def close(self) -> None:
        self.state = None


class KeptOnDisk:
    """The last good state in one file (`path`). It costs no memory between rollbacks: the written pages are the
    page cache's, which the kernel drops under pressure, and a rollback maps the file rather than reading it into
    memory. A file that cannot be written (a full disk) sends the state to memory, with one line (`fallback`).

    The file is rewritten in place, once per global step: the kernel reuses its cached pages, where a new file and
    a rename allocate and free them all (sahajbert-xl's 870 MiB: 0.35 s instead of 1-2.8 s, which was 6% of a
    4-sample global step's time in bench_overhead). Only this process reads the file, never while writing it, and a
    restart never reads it (its checkpoint resumes it), so a write cut short costs nothing. After a rollback mapped
    it, the next write goes to a new file, renamed over it: the tensors mapped from the old one keep their values."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.written = False
        self.mapped = False  # a rollback mapped the file since it was last written
        self.fallback: KeptInMemory | None = None

    @property
    def empty(self) -> bool:
        return self.fallback.empty if self.fallback is not None else not self.written

    def write(self, parameters: list[torch.Tensor], optimizer_state: dict, local_state: LocalState) -> None:
        if self.fallback is not None:
            return self.fallback.write(parameters, optimizer_state, local_state)
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        # the live tensors, written as they are: no copy in memory on the way
        live = {"parameters": [p.detach() for p in parameters], "optimizer": optimizer_state}
        state = {**live, "local": local_state(copied=False)}
        try:
            if self.written and not self.mapped:
                with open(self.path, "r+b") as file:
                    torch.save(state, file)
                    file.truncate()
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, tmp)
                os.replace(tmp, self.path)
        except OSError as error:
            _remove(tmp)
            logger.warning(
                f"cannot write the last good state to {self.path} ({error.strerror or error}): it is kept in memory "
                "instead"
            )
            _remove(self.path)
            self.written, self.fallback = False, KeptInMemory()
            return self.fallback.write(parameters, optimizer_state, local_state)
        self.written, self.mapped = True, False

    def read(self) -> State:
        """The kept state, mapped from the file: the parameters are copied from the file's pages, and the optimizer's
        tensors become private copies only where the optimizer writes them."""
        if self.fallback is not None:
            return self.fallback.read()
        # written by this process from its own tensors and dicts (weights_only refuses DiLoCo's inner state)
        state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=False)
        self.mapped = True
        return state["parameters"], state["optimizer"], state["local"]

    def close(self) -> None:
        _remove(self.path)
        self.written = False


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # its folder is gone or not a folder: nothing is left to clean
        pass


def keep_good_state(where: str, output_dir: str | Path) -> KeptInMemory | KeptOnDisk:
    """Where a trainer keeps its last good state (--keep_good_state): on disk in `output_dir`, or in memory."""
    if where not in KEEP_IN:
        raise UserError(f"--keep_good_state must be one of {', '.join(KEEP_IN)}, got {where!r}")
    return KeptOnDisk(Path(output_dir) / GOOD_STATE_FILE) if where == "disk" else KeptInMemory()


class LastGoodState:
    """Host copies of parameters and optimizer state to roll back to: those after the last global step whose
    parameters were finite and then gave a finite pass. Finite parameters can still be unusable: a plain mean with a
    x1e4 peer's contribution leaves values whose every pass overflows; such a state is never the one rolled back to.

    One copy is kept (`kept`: on disk or in memory), overwritten: a global step's state is copied only once a pass
    from it was finite (`after_finite_pass`), not when the step ends, so that the copy of the last good state never
    has to sit beside a copy of a state not yet trusted (with LAMB, 3 copies of the parameters each: the parameters
    and two moments).
    With delayed updates the optimizer steps its state in the background and the parameters take that step only at
    a later `step()`: the copy waits for a finite pass with no update pending, so that it never pairs checked
    parameters with optimizer state half-way through (or one step past) them, and it skips optimizer state that is
    not finite. A run in which every pass has an update pending (a global step every pass) keeps an older good state.
    """

    def __init__(
        self,
        optimizer: GuardedOptimizer,
        pending_update_timeout: float,
        kept: KeptInMemory | KeptOnDisk | None = None,
    ):
        self.optimizer = optimizer
        self.pending_update_timeout = pending_update_timeout
        self.kept = kept if kept is not None else KeptInMemory()
        self.untrusted = False  # a global step's finite state waits for a finite pass to become the good one
        self.dropped_in_a_row = 0
        self.restored = False  # the state was restored and no pass from it was finite yet

    def keep_or_roll_back(self) -> bool:
        """After a global step: keep finite parameters as the next good state (True), or restore the last one."""
        if self.parameters_finite():
            self.save()
            return True
        self.roll_back(f"parameters became non-finite at step {self.optimizer.local_epoch}")
        return False

    def after_finite_pass(self) -> None:
        """A pass from the current parameters gave a finite loss and gradients: they are good."""
        self.dropped_in_a_row, self.restored = 0, False
        if self.untrusted and not accessors.has_pending_updates(self.optimizer, round_in_flight=False):
            self.untrusted = not self._copy()

    def after_dropped_pass(self) -> bool:
        """A pass was dropped as non-finite: roll back (True) if the parameters are non-finite, or if this was the
        DROPPED_PASSES_BEFORE_ROLLBACK-th dropped pass in a row (finite parameters that overflow every pass)."""
        self.dropped_in_a_row += 1
        if not self.parameters_finite():
            self.roll_back("parameters became non-finite between global steps")
        elif self.dropped_in_a_row >= DROPPED_PASSES_BEFORE_ROLLBACK:
            if self.restored:  # rolling back again would restore the same state and spin
                raise UserError(
                    f"every pass from the last good state is non-finite too ({self.dropped_in_a_row} in a row): the "
                    "model cannot train from it (is --learning_rate too high?)"
                )
            self.roll_back(f"the last {self.dropped_in_a_row} passes were all non-finite")
        else:
            return False
        return True

    def roll_back(self, reason: str) -> None:
        logger.warning(f"{reason}: rolling back to the last good state")
        # every round still running lands first: one that landed after the restore would bring the bad values back
        accessors.apply_pending_updates(self.optimizer, self.pending_update_timeout)
        self.restore()
        self.untrusted, self.dropped_in_a_row, self.restored = False, 0, True

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        offloaded = [p for group in self.optimizer.opt.param_groups for p in group["params"]]
        return accessors.master_parameters(self.optimizer), offloaded

    def parameters_finite(self) -> bool:
        main, offloaded = self._tensors()
        return is_finite(main) and is_finite(offloaded)

    def save(self) -> None:
        """Keep the current state; it becomes the good one with the first finite pass from it (at once if there is
        no good one yet: the state a peer starts from was checked when loaded)."""
        if self.kept.empty:
            self.untrusted = not self._copy()
        else:
            self.untrusted = True

    @torch.no_grad()
    def _copy(self) -> bool:
        """Keep the current state as the good one; False (nothing kept) if the optimizer's state is not finite and
        there is a good state already (the first one, the state a peer starts from, was checked when loaded)."""
        main, _ = self._tensors()
        live = self.optimizer.opt.state_dict()
        moments = (t for state in live["state"].values() for t in state.values() if torch.is_tensor(t))
        if not self.kept.empty and not is_finite(moments):
            return False
        self.kept.write(main, live, self.optimizer.local_state)
        return True

    @torch.no_grad()
    def restore(self) -> None:
        parameters, optimizer_state, local_state = self.kept.read()
        main, offloaded = self._tensors()
        # with offload_optimizer the optimizer steps host copies of the model's parameters: both are restored, except
        # DiLoCo's outer parameters, which differ from the model (its inner steps, its unsent rest) and change only
        # in an outer step: restored only where not finite
        outer_apart = not getattr(self.optimizer, "model_is_outer", True)
        for saved, target, copy_ in zip(parameters, main, offloaded):
            target.copy_(saved)
            if not outer_apart or not is_finite([copy_]):
                copy_.copy_(saved)
        self.optimizer.opt.load_state_dict(optimizer_state)
        self.optimizer.restore_local_state(local_state)

    def close(self) -> None:
        """The trainer stops: the kept state is let go (a file on disk removed; its checkpoint is what resumes)."""
        self.kept.close()


def _copied_into(kept, current):
    """`current` (an optimizer's state dict) copied into `kept`'s tensors where the two have the same structure and
    shapes (no new memory), else a deep copy of it."""
    if isinstance(current, torch.Tensor):
        if isinstance(kept, torch.Tensor) and kept.shape == current.shape and kept.dtype == current.dtype:
            return kept.copy_(current)
        return current.detach().clone()
    if isinstance(current, dict):
        kept = kept if isinstance(kept, dict) else {}
        return {key: _copied_into(kept.get(key), value) for key, value in current.items()}
    if isinstance(current, list | tuple):
        kept = kept if isinstance(kept, list | tuple) and len(kept) == len(current) else [None] * len(current)
        return type(current)(_copied_into(k, v) for k, v in zip(kept, current))
    return copy.deepcopy(current)
