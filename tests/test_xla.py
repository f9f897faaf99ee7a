"""The TPU path on CPU XLA devices: torch_xla 2.9 in its own virtualenv (.venv-tpu, built by `make test`).

PJRT_DEVICE=CPU with CPU_NUM_DEVICES=4 gives four XLA devices that SPMD shards a batch over, as over a TPU's cores.
`make test` sets SAHAJBERT_REQUIRE_XLA=1, so there a missing TPU virtualenv fails these tests instead of skipping.
"""

import json
import os
import subprocess

import pytest
import torch
from transformers import AlbertForPreTraining

from sahajbert.checkpoints import latest_checkpoint
from sahajbert.localswarm import peer_env, wait_for
from sahajbert.train_log import read_train_log

from .swarm_helpers import ROOT, final_step, first_peer, fixed_batch_loss, require, start_peer

TPU_PYTHON = ROOT / ".venv-tpu" / "bin" / "python"
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
LOCKSTEP = ["--delay_optimizer_step", "false", "--delay_grad_averaging", "false"]
pytestmark = pytest.mark.xla
# the XLA checks (tests/xla_checks.py) run once, for up to 600 s, in whichever of their tests comes first
SPMD_LIMIT = pytest.mark.timeout(660)


@pytest.fixture(scope="module")
def tpu_python():
    fix = "`make venv-tpu` builds it from requirements-tpu.txt"
    if not TPU_PYTHON.exists() and os.environ.get("SAHAJBERT_REQUIRE_XLA"):  # set by `make test`, as in CI
        pytest.fail(f"{TPU_PYTHON} is missing: {fix}")
    require(TPU_PYTHON.exists(), str(TPU_PYTHON), fix)
    return str(TPU_PYTHON)


@pytest.fixture
def xla_env(monkeypatch):
    for name, value in XLA_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def spmd_report(tpu_python):
    result = subprocess.run(
        [tpu_python, str(ROOT / "tests" / "xla_checks.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**peer_env(), **XLA_ENV},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@SPMD_LIMIT
def test_spmd_pass_over_four_devices_matches_the_cpu(spmd_report):
    report = spmd_report
    assert report["cores"] == 4 and report["device"] == "XLA CPU x4"
    assert report["implements_compute"], "SpmdReplica must implement the training loop's Compute protocol"
    assert report["input_sharding"] == "{devices=[4,1]0,1,2,3}", "the batch must be split over the 4 devices"
    assert report["xla_loss"] == pytest.approx(report["cpu_loss"], abs=1e-5)
    assert report["grad_rel_diff"] < 1e-5, report
    assert report["host_grad_dtypes"] == ["torch.float32"]
    assert report["recompilations"] == 0


@SPMD_LIMIT
def test_parameters_pushed_after_a_host_update_match_the_host_copy(spmd_report):
    report = spmd_report
    assert report["diff_before_push"] > 0.01, "the host update must have changed the parameters"
    assert report["diff_after_push"] == 0.0
    assert report["xla_loss_after_push"] == pytest.approx(report["cpu_loss_after_push"], abs=1e-5)
    assert report["grad_rel_diff_after_push"] < 1e-5, report


@SPMD_LIMIT
def test_spmd_pass_of_lean_albert_matches_the_cpu(spmd_report):
    report = spmd_report
    assert report["lean_model"] == "LeanAlbertForPreTraining"
    assert report["lean_xla_loss"] == pytest.approx(report["lean_cpu_loss"], abs=1e-5)
    assert report["lean_grad_rel_diff"] < 1e-5, report
    assert report["lean_recompilations"] == 0


@SPMD_LIMIT
def test_bf16_on_xla_sends_unscaled_fp32_gradients(spmd_report):
    report = spmd_report
    assert report["bf16_grad_dtypes"] == ["torch.float32"]
    # the same pass in bf16: close to the fp32 gradients (relative to the largest entry), not equal to them
    assert 0 < report["bf16_grad_rel_diff"] < 0.05, report
    assert report["bf16_loss"] == pytest.approx(report["cpu_loss_after_push"], abs=0.02)


def start_xla_peer(tmp_path, run_id: str, initial_peers: list[str], tpu_python: str, *flags):
    """A trainer on the 4 XLA devices (TPU virtualenv), 2 samples per core: 8 per pass, a CPU peer's batch."""
    return start_peer(
        "run_trainer.py",
        tmp_path,
        "xla",
        run_id,
        initial_peers,
        *["--per_device_train_batch_size", "2", "--device", "tpu", *flags],
        python=tpu_python,
    )


def assert_models_agree(tmp_path, names=("xla", "cpu")) -> None:
    """The final checkpoints of the named peers hold the same parameters (within 2e-3 + 1% of each value)."""
    a, b = (AlbertForPreTraining.from_pretrained(latest_checkpoint(tmp_path / n)).state_dict() for n in names)
    # on a mismatch, how each peer's last rounds ended says which of them kept parameters of its own
    endings = "\n".join(
        line
        for n in names
        for line in (tmp_path / f"{n}.log").read_text().splitlines()
        if any(word in line for word in ("final", "partial", "round", "download", "stopped", "WARN", "ERROR"))
    )
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], atol=2e-3, rtol=1e-2, msg=lambda m, name=name: f"{name} differs: {m}\n{endings}"
        )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cpu_peer_and_xla_peer_train_one_model(tmp_path, tpu_python, xla_env):
    """A plain CPU peer (main venv, fp32) and an XLA peer (TPU venv, 4 devices, bf16) make global steps together."""
    run_id = "hetero"
    first, initial_peers = first_peer(tmp_path / "first_peer", run_id)
    # 8 steps: the XLA peer (about 6 s a step under load) still trains when the CPU peer, started after the XLA
    # compilation, has joined; with 4 the XLA peer finished alone before it on a busy machine
    steps = ["--max_steps", "8", *LOCKSTEP]
    xla = start_xla_peer(tmp_path, run_id, initial_peers, tpu_python, "--precision", "bf16", *steps)
    cpu = None
    try:
        # the CPU peer joins once the XLA peer has compiled its step, so that neither trains the first steps alone
        wait_for(lambda: "XLA step compiled" in xla.output() or not xla.running(), 300, "the XLA peer's compilation")
        assert xla.running(), xla.output()[-3000:]
        cpu = start_peer("run_trainer.py", tmp_path, "cpu", run_id, initial_peers, "--device", "cpu", *steps)
        for peer in (xla, cpu):
            assert peer.wait(400) == 0, peer.output()[-3000:]
    finally:
        for peer in (xla, cpu, first):
            if peer is not None:
                peer.stop()

    xla_log, cpu_log = read_train_log(tmp_path / "xla"), read_train_log(tmp_path / "cpu")
    assert final_step(tmp_path / "xla") == final_step(tmp_path / "cpu") == 8
    assert max(r.peers for r in cpu_log) == 2 and max(r.peers for r in xla_log) == 2
    output = xla.output()
    assert "computing on XLA CPU x4 in bf16; 8 samples per pass (2 per core x 4 core(s)" in output
    assert "XLA recompiled" not in output, "fixed shapes: the step compiles once"
    assert "device copy vs host parameters: max difference 0" in output
    assert "computing on cpu in fp32" in cpu.output()

    assert_models_agree(tmp_path)
    assert fixed_batch_loss(latest_checkpoint(tmp_path / "cpu")) < fixed_batch_loss(None), (xla_log, cpu_log)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_diloco_on_a_tpu_host_with_a_client_mode_peer_then_resumed(tmp_path, tpu_python, xla_env):
    """DiLoCo with the peers it must work with: an XLA peer (TPU venv, 4 devices) and a CPU peer in client mode (it
    leads no group and serves nothing) make outer steps together and agree after the final round; the CPU peer
    then resumes from its last checkpoint (the outer and inner states) for two more outer steps."""
    run_id = "diloco-hetero"
    first, initial_peers = first_peer(tmp_path / "first_peer", run_id)
    inner = 5  # inner steps per outer step
    diloco = ["--diloco_inner_steps", str(inner), "--learning_rate", "0.01", "--total_steps", "100000"]
    diloco += ["--diloco_wait", "30"]
    xla = start_xla_peer(tmp_path, run_id, initial_peers, tpu_python, "--max_steps", "10", *diloco)
    cpu = resumed = None
    try:
        # the CPU peer waits for the XLA peer (announced at a start priority) to compile and report its first pass
        # before its first outer step (a client-mode peer announces nothing, so the XLA peer does not wait for it:
        # it is the slower to start). It starts once the XLA peer has measured its link, just before it announces
        # itself: started at once, on a busy machine, it made all its steps before the XLA peer had joined
        wait_for(lambda: "sahajbert.adaptive: link" in xla.output() or not xla.running(), 300, "the XLA peer's link")
        assert xla.running(), xla.output()[-3000:]
        cpu_flags = ["--device", "cpu", "--client_mode", *diloco]
        cpu = start_peer("run_trainer.py", tmp_path, "cpu", run_id, initial_peers, *cpu_flags, "--max_steps", "10")
        for peer in (xla, cpu):
            assert peer.wait(400) == 0, peer.output()[-3000:]
        cpu.stop()
        xla.stop()
        assert final_step(tmp_path / "xla") == final_step(tmp_path / "cpu") == 10
        # client mode: the CPU peer took part in the outer rounds (as a follower) and the final round
        assert max(r.peers for r in read_train_log(tmp_path / "cpu")) == 2
        assert "computing on XLA CPU x4 in fp32" in xla.output()
        assert_models_agree(tmp_path)
        assert fixed_batch_loss(latest_checkpoint(tmp_path / "cpu")) < fixed_batch_loss(None)

        resumed = start_peer("run_trainer.py", tmp_path, "cpu", run_id, initial_peers, *cpu_flags, "--max_steps", "12")
        assert resumed.wait(300) == 0, resumed.output()[-3000:]
        assert "resuming from" in resumed.output()
        steps = [r.step for r in read_train_log(tmp_path / "cpu")]
        assert steps[-2:] == [11, 12] and steps.count(11) == 1, steps
        assert latest_checkpoint(tmp_path / "cpu").name == "checkpoint-12"
    finally:
        for peer in (xla, cpu, resumed, first):
            if peer is not None:
                peer.stop()
