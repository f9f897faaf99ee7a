"""A plain hivemind peer (tests/plain_hivemind_peer.py: not this project's code) that trains alone and claims progress,
in both orders: started before the honest trainers, it has made global steps alone when they come; started after
them, it claims a far higher step from its first record. Two honest trainers, each in its own process on 127.0.0.1,
reach --max_steps together, agree and stay finite, download a bounded number of states and print no traceback."""

import re

import pytest

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.localswarm import PeerProcess, checkpoints_agree, wait_for

from .swarm_helpers import final_step, first_peer, fixed_batch_loss, quiet, script, start_peer

pytestmark = pytest.mark.slow

# the run had 6 steps; 10 leave a late plain peer (10-20 s to start on a busy machine) time to join while the
# honest trainers still train
STEPS = 10
HONEST = ["--target_batch_size", "96", "--per_device_train_batch_size", "8", "--max_steps", str(STEPS)]
# a trainer downloads a state when it joins (at most one per peer it tries) and when it falls behind: a few in a run
# of 6 steps; the bug this guards against made one per pass (98 in a minute)
MAX_DOWNLOADS = 4


def plain_peer(tmp_path, name: str, run_id: str, initial_peers: list[str], *extra) -> PeerProcess:
    args = ["--run_id", run_id, "--initial_peers", *initial_peers, "--target_batch_size", "96", *extra]
    return PeerProcess(script("tests/plain_hivemind_peer.py"), args, tmp_path / f"{name}.log")


def peer_id(peer: PeerProcess) -> str:
    wait_for(lambda: "plain peer ready" in peer.output() or not peer.running(), 240, "the plain peer to start")
    assert peer.running(), peer.output()[-3000:]
    return re.search(r"plain peer id (\S+)", peer.output()).group(1)


@pytest.mark.timeout(900)
def test_honest_trainers_reach_their_last_step_together_beside_a_plain_peer_that_claims_progress(tmp_path):
    run_id = "outsider"
    first, initial_peers = first_peer(tmp_path / "first_peer", run_id)
    peers: list[PeerProcess] = []
    try:
        # first: a plain peer that steps alone (about one global step per 10 s) before any honest trainer exists
        early = plain_peer(tmp_path, "early", run_id, initial_peers)
        peers.append(early)
        early_id = peer_id(early)
        wait_for(lambda: "plain peer at epoch 2" in early.output(), 240, "the plain peer's second step alone")
        honest = [start_peer("run_trainer.py", tmp_path, f"h{i}", run_id, initial_peers, *HONEST) for i in range(2)]
        peers += honest
        # then, once the honest trainers made a step together: one that claims step 1000 from its first record (it
        # starts now, which takes up to a minute on a busy machine, and claims once told to)
        claim_now = tmp_path / "claim_now"
        claim = ["--claim_epoch", "1000", "--start_file", str(claim_now)]
        late = plain_peer(tmp_path, "late", run_id, initial_peers, *claim)
        peers.append(late)
        late_id = peer_id(late)
        wait_for(
            lambda: all("global step 1 |" in peer.output() for peer in honest) or not all(p.running() for p in honest),
            300,
            "the honest trainers' first global step",
        )
        claim_now.touch()
        wait_for(
            lambda: all(late_id in peer.output() or not peer.running() for peer in honest),
            120,
            "the honest trainers to see the late plain peer's claim",
        )
        for peer in honest:
            assert peer.wait(400) == 0, peer.output()[-3000:]
    finally:
        for peer in [*peers, first]:
            peer.stop()

    outputs = [peer.output() for peer in honest]
    # on a failure, both trainers' own lines (not hivemind's): when each saw which step, whom it left out or took
    story = "\n\n".join("\n".join(line for line in out.splitlines() if " sahajbert." in line) for out in outputs)
    for name, output in zip(("h0", "h1"), outputs):
        quiet(output)
        assert final_step(tmp_path / name) == STEPS, story
        # each plain peer's progress was seen and named (its claim, or its progress not counted once its averages had
        # it left out), and moved nothing
        for outsider in (early_id, late_id):
            named = [
                line for line in output.splitlines() if outsider in line and ("claim" in line or "progress" in line)
            ]
            assert len(named) >= 1, (outsider, output[-3000:])
        downloads = output.count("downloaded the training state from peer")
        assert downloads <= MAX_DOWNLOADS, output[-3000:]
        assert "stopped at global step 0" not in output
    checkpoints = [latest_checkpoint(tmp_path / name) for name in ("h0", "h1")]
    agree, difference = checkpoints_agree(checkpoints)
    assert agree, difference
    # finite, and learned (the plain peers' NaN gradients reached no parameter)
    assert fixed_batch_loss(checkpoints[0]) < fixed_batch_loss(None)
    assert "plain peer at epoch 3" in early.output(), "the early plain peer kept stepping alone"
