"""The volunteer's path: hardware auto-configuration, the preflight checklist, and the notebook run for real."""

import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from sahajbert.devices import DeviceInfo, HardwareConfig, auto_configure
from sahajbert.localswarm import peer_env
from sahajbert.model import read_config, supports_gradient_checkpointing

from .swarm_helpers import LOCAL, ROOT, TINY_TRAINING, first_peer, script


@pytest.mark.parametrize(
    "device, expected",
    [
        (DeviceInfo("cuda", "Tesla T4", (7, 5), 14.7), HardwareConfig("cuda", "fp16", 8, True)),
        (DeviceInfo("cuda", "Tesla P100-PCIE-16GB", (6, 0), 15.9), HardwareConfig("cuda", "fp32", 4, True)),
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 39.4), HardwareConfig("cuda", "fp16", 16, False)),
        (DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 79.1), HardwareConfig("cuda", "fp16", 32, False)),
        (DeviceInfo("tpu", "TPU v3-8", None, 128.0), HardwareConfig("tpu", "fp32", 8, False)),
        (DeviceInfo("cpu", "cpu"), HardwareConfig("cpu", "fp32", 2, False)),
    ],
)
def test_auto_configuration(device, expected):
    assert auto_configure(device) == expected


def test_auto_config_leaves_reachability_to_the_trainer():
    # behind NAT a trainer books a relay slot, or joins in client mode by itself: no --client_mode from hardware
    assert "--client_mode" not in auto_configure(DeviceInfo("cuda", "T4", (7, 5), 15.0)).as_flags()
    assert "--gradient_checkpointing" in auto_configure(DeviceInfo("cuda", "T4", (7, 5), 15.0)).as_flags()


def test_auto_config_never_picks_what_the_trainer_refuses():
    # transformers' ALBERT (the sahajbert preset) cannot recompute activations: the trainer refuses the flag for it
    t4 = DeviceInfo("cuda", "Tesla T4", (7, 5), 14.7)
    assert "--gradient_checkpointing" not in auto_configure(t4, can_recompute=False).as_flags()
    assert not supports_gradient_checkpointing(read_config("sahajbert"))
    assert supports_gradient_checkpointing(read_config("sahajbert-xl"))
    # DiLoCo takes no fp16 (no loss scaler for its inner optimizer)
    assert auto_configure(t4, diloco=True).precision == "fp32"
    a100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 39.4)
    assert auto_configure(a100, diloco=True).precision == "fp32"


def run_trainer(*args, timeout=180):
    return subprocess.run(
        [sys.executable, str(script("run_trainer.py")), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=peer_env(),
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    organizer, initial_peers = first_peer(tmp_path_factory.mktemp("fp"), "volunteers")
    yield initial_peers
    organizer.stop()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_check_passes_against_a_running_first_peer(swarm, tmp_path):
    result = run_trainer(
        "--check",
        "--run_id",
        "volunteers",
        "--initial_peers",
        *swarm,
        *LOCAL,
        "--model",
        "tiny",
        "--output_dir",
        str(tmp_path),
        "--auto_config",
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    out = result.stdout
    # the flags it chose, then its estimate of the trainer's peak memory
    assert (
        "auto config for cpu: --device cpu --precision fp32 --per_device_train_batch_size 2; estimated peak host "
        in out
    )
    for item in (
        "versions",
        "open-files limit",
        "disk space",
        "memory",
        "p2pd starts",
        "initial peers answer",
    ):
        assert f"[ ok ] {item}" in out, out
    # a swarm on 127.0.0.1: nothing to be reached from, and no public relay to test against (a warning, not a fail)
    assert "[warn] reachable from outside: only private or loopback addresses, and no public relay" in out, out
    assert "6/7 checks passed; 1 with a warning: reachable from outside\n" in out, out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_check_names_the_failing_item_and_its_fix(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGWn1HNMv3LKnLgpbWQTqVjibrBXd37rwaD1WNqbMmSAQ"
    result = run_trainer(
        "--check",
        "--initial_peers",
        dead,
        *LOCAL,
        "--join_timeout",
        "10",
        "--model",
        "tiny",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 1
    assert "[FAIL] initial peers answer" in result.stdout and "fix: Check that the first peer runs" in result.stdout
    assert "[ ok ] p2pd starts" in result.stdout and "Traceback" not in result.stderr
    on_loopback = run_trainer("--check", "--initial_peers", "1.2.3.4:1337", "--model", "tiny")
    assert on_loopback.returncode == 1 and "[FAIL] initial peers: --initial_peers must be a libp2p multiaddr" in (
        on_loopback.stdout
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_joins_a_local_swarm_and_trains(swarm, tmp_path):
    notebook = nbformat.read(ROOT / "notebooks" / "contributor.ipynb", as_version=4)
    (parameters,) = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    extra = [*TINY_TRAINING, "--target_batch_size", "64"]
    parameters.source += (
        f"\nRUN_ID = 'volunteers'\nINITIAL_PEERS = {swarm!r}\nINSTALL = False\nSTORE = {str(tmp_path)!r}\n"
        f"EXTRA_ARGS = {extra!r}\nMAX_STEPS = 2\n"
    )
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "\n".join(
        output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []) if "text" in output
    )
    assert "cpu: --device cpu --precision fp32" in outputs
    assert "global step 2 |" in outputs and "this peer contributed" in outputs, outputs[-3000:]
    assert (tmp_path / "identity.key").exists(), "the identity must persist where the notebook keeps files"
    assert (tmp_path / "checkpoints" / "checkpoint-2").is_dir()
