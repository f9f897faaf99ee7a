"""Settings shared by the integration tests; the process handling itself is the library's (sahajbert.localswarm)."""

import contextlib
import functools
import itertools
import os
import re
import runpy
import sys
from pathlib import Path

import psutil
import pytest
import torch

from sahajbert.checkpoints import list_checkpoints
from sahajbert.collators import PretrainingCollator
from sahajbert.flags import CorpusArguments
from sahajbert.localswarm import LOOPBACK, PeerProcess, start_first_peer, tiny_trainer_flags
from sahajbert.model import build_model, load_model
from sahajbert.samples import SAMPLE_FILES
from sahajbert.stream import batched, iterate_examples
from sahajbert.tokenization import load_tokenizer
from sahajbert.train_log import StepRecord, read_train_log

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the scripts under test live here
# the scripts a user runs, each built on sahajbert.cli's flags
USER_SCRIPTS = [
    "run_trainer.py",
    "run_first_peer.py",
    "run_aux_peer.py",
    "run_local_swarm.py",
    "tokenizer/train_tokenizer.py",
    "data/preview.py",
    "finetune/train_ner.py",
    "finetune/train_ncc.py",
    "finetune/evaluate.py",
]
LOCAL = LOOPBACK
# every test's trainers: the library's tiny settings, a checkpoint at every global step, frequent progress lines
TINY_TRAINING = tiny_trainer_flags(save_steps=1, log_every_seconds=2)


def script(name: str) -> Path:
    """A script of this repository by its path from the root, e.g. "run_trainer.py" or "benchmarks/netswarm.py"."""
    return ROOT / name


def first_peer(log_dir: Path, run_id: str, extra: list[str] = ()) -> tuple[PeerProcess, list[str]]:
    """run_first_peer.py on loopback (with `extra` flags), and the multiaddrs others join through."""
    return start_first_peer(script("run_first_peer.py"), log_dir, run_id, extra)


def last_step(output_dir: Path) -> int:
    records = read_train_log(output_dir)
    return records[-1].step if records else 0


def final_step(output_dir: Path) -> int:
    """The step label of a peer's final checkpoint, written after the final parameter round.

    Its train log can end one or two steps lower: a peer whose labels lag the swarm's takes part in the same rounds
    and adopts the group's highest label only in that final round.
    """
    saved = list_checkpoints(output_dir)
    return saved[-1][0] if saved else 0


def kill_orphans(processes: list[psutil.Process]) -> None:
    """SIGKILL what a SIGKILLed peer left behind (its DHT child, p2pd); some exit on their own first."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def swarm_loss(logs: list[list[StepRecord]], steps) -> float:
    """The swarm's mean loss per mini-step over some global steps, from every peer's records.

    Per swarm, not per peer: a peer that downloads the state (joins late, or catches up) skips steps in its own log.
    """
    records = [r for log in logs for r in log if r.step in set(steps)]
    return sum(r.loss * r.mini_steps for r in records) / sum(r.mini_steps for r in records)


@functools.cache
def _fixed_batches() -> list[dict]:
    tokenizer = load_tokenizer("sample")
    corpus = CorpusArguments(sources=[], data_files=list(SAMPLE_FILES), shuffle_buffer=200, max_seq_length=64)
    collator = PretrainingCollator.from_tokenizer(tokenizer, seed=999)
    return list(itertools.islice(batched(iterate_examples(corpus, tokenizer, seed=999), 32, collator), 8))


def fixed_batch_loss(checkpoint: Path | None) -> float:
    """The pretraining loss of a checkpoint (None: the tiny model as every test run initializes it, seed 0) on one
    fixed set of 256 sample examples with fixed masks.

    Tells whether a short run learned: the same examples for both models leave only the training's own noise. A
    train-log step record is no such measure: its loss is over that peer's mini-steps of the step, which can be one
    batch of 8 (a tiny run learns about 0.005 per step of 96 samples; its records scatter by more).
    """
    model = load_model(checkpoint) if checkpoint is not None else build_model("tiny", load_tokenizer("sample"), 0)
    model.eval()
    with torch.no_grad():
        return sum(model(**batch).loss.item() for batch in _fixed_batches()) / len(_fixed_batches())


def start_peer(
    name_of_script: str,
    tmp_path: Path,
    name: str,
    run_id: str,
    initial_peers: list[str],
    *extra,
    python: str = sys.executable,
) -> PeerProcess:
    """run_trainer.py or run_aux_peer.py with the tests' tiny settings; its output_dir and log are named `name`.

    `extra` flags come last and win; `python` is the interpreter (the TPU virtualenv's for an XLA peer).
    """
    args = [
        "--run_id",
        run_id,
        "--initial_peers",
        *initial_peers,
        *TINY_TRAINING,
        "--output_dir",
        str(tmp_path / name),
    ]
    return PeerProcess(script(name_of_script), [*args, *extra], tmp_path / f"{name}.log", python=python)


@contextlib.contextmanager
def loopback_dhts(count: int, record_validators: list[list] | None = None):
    """`count` real hivemind DHT peers in this process on 127.0.0.1, joined through the first, each with its
    `record_validators` (None: none); shut down after."""
    import hivemind

    host_maddrs = LOOPBACK[1:]
    validators = record_validators or [[] for _ in range(count)]
    dhts = [hivemind.DHT(start=True, host_maddrs=host_maddrs, record_validators=validators[0])]
    try:
        for own in validators[1:]:
            joined = dict(host_maddrs=host_maddrs, initial_peers=dhts[0].get_visible_maddrs())
            dhts.append(hivemind.DHT(start=True, record_validators=own, **joined))
        yield dhts
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@contextlib.contextmanager
def signed_dhts(run_id: str, count: int):
    """`count` loopback DHT peers with the run's record validators (sahajbert.records), each signing with its own RSA
    key, as trainers in separate processes do: yields [(dht, its public key)]."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from sahajbert.records import MetricSchema

    signers = [RSASignatureValidator(RSAPrivateKey()) for _ in range(count)]
    validators = [[SchemaValidator(MetricSchema, prefix=run_id), signer] for signer in signers]
    with loopback_dhts(count, validators) as dhts:
        yield [(dht, signer.local_public_key) for dht, signer in zip(dhts, signers)]


def sgd_state_averager(dht, parameters: list, prefix: str, kind=None, momentum: float = 0.0, **kwargs):
    """A started state averager over `parameters` under SGD (lr 0.1), on `dht`: ours (GuardedStateAverager) unless
    `kind` names another, such as hivemind's TrainingStateAverager."""
    from functools import partial

    import torch

    from sahajbert.hivemind_ext.averaging.averager import GuardedStateAverager

    return (kind or GuardedStateAverager)(
        dht=dht,
        optimizer=partial(torch.optim.SGD, lr=0.1, momentum=momentum),
        params=parameters,
        prefix=prefix,
        min_matchmaking_time=1.0,
        start=True,
        **kwargs,
    )


def require(present: bool, what: str, fix: str) -> None:
    """Skip a test whose prerequisite `what` is missing, saying the `fix`; in CI (CI=true) fail instead: CI provides
    every prerequisite, so a missing one must not silently drop the tests that need it."""
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide {what}: {fix}")
    pytest.skip(f"{what} is missing: {fix}")


def run_script(name: str, args: list[str], capsys) -> tuple[int, str, str]:
    """The script's main(args) through cli.run, in this process, as `python <name> args` runs it: (exit code, stdout,
    stderr). A bad-input case runs this way, in a fraction of a new process's start."""
    from sahajbert import cli

    main = runpy.run_path(str(script(name)))["main"]
    with pytest.raises(SystemExit) as exit_:
        cli.run(lambda: main(args))
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def run_main(name: str, args: list[str], capsys) -> tuple[int, str]:
    """`run_script`'s exit code and stderr."""
    code, _, err = run_script(name, args, capsys)
    return code, err


def assert_one_error(code: int, stderr: str, message: str) -> str:
    """Exit code 2, exactly one `error:` line, containing `message`, and no traceback; returns that line."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


# what a healthy run's terminal never shows: an error line (ours or hivemind's) or a Python warning of a library
ALARMS = re.compile(r"^\S+ ERROR |\[ERROR\]|\b\w*Warning: ", re.M)


def quiet(output: str, healthy: bool = False) -> None:
    """A peer's terminal shows one line per event: none of hivemind's per-refresh or start-up lines, no asyncio noise,
    no traceback, no repeated save; and with `healthy` (a run where nothing went wrong), no alarm (`no_alarms`)."""
    for noise in ("ETA ", "Task was destroyed", "It is recommended to use request_timeout", "Traceback"):
        assert noise not in output, f"{noise!r} in:\n{output[-3000:]}"
    if healthy:
        no_alarms(output)


def no_alarms(output: str) -> None:
    """No error line (ours or hivemind's), traceback or library warning: what a healthy run's terminal never shows,
    at --verbose too."""
    alarms = ALARMS.findall(output) + (["Traceback"] if "Traceback" in output else [])
    assert not alarms, f"{alarms} in:\n{output[-3000:]}"
    saved = re.findall(r"saved checkpoint (\S+)", output)
    assert len(saved) == len(set(saved)), saved
