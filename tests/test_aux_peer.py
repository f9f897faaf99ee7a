"""The aux peer with real trainers: checkpoints, wandb, dashboard in a real browser, forgery, upload, rescue."""

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request

import pytest
import torch
from transformers import AlbertForPreTraining, AutoModel

from sahajbert.checkpoints import list_checkpoints, read_state
from sahajbert.localswarm import PeerProcess, wait_for
from sahajbert.monitor import FinalModel, SwarmMonitor
from sahajbert.records import RECENT_STEPS, LocalMetrics, StepEntry
from sahajbert.train_log import read_train_log

from .swarm_helpers import first_peer, kill_orphans, require, signed_dhts, start_peer
from .wandb_reader import history

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EXPIRING = ("--metadata_expiration", "20")


def test_the_monitor_has_one_point_per_global_step_and_each_peers_own_count_and_status():
    """Read every third step, the monitor still has every step (each record repeats the peer's last steps); the
    peers are named and counted as their logs name and count them; a peer that ends says so, one that vanishes from
    the swarm's progress has departed, and the run ends when no peer trains."""
    monitor = SwarmMonitor("run")
    entries = {name: [] for name in ("QmA", "QmB")}

    def records(step, statuses=("training", "training")):
        out = {}
        for (name, status), share in zip(zip(entries, statuses), (1, 3)):
            entries[name].append(
                StepEntry(step=step, loss=2.0 * share, mini_steps=share, samples=8 * share, samples_per_second=1.0)
            )
            recent = entries[name][-RECENT_STEPS:]
            out[name.encode()] = LocalMetrics(
                step=step,
                samples_per_second=1.0,
                samples_accumulated=8 * share,
                loss=2.0 * share,
                mini_steps=share,
                peer_id=name,
                samples_contributed=sum(e.samples for e in entries[name]),
                recent=recent,
                status=status,
            )
        return out

    for step in range(1, 10):
        latest = records(step)
        if step % 3 == 0:
            assert [p["step"] for p in monitor.update(latest, now=step, live_peers={"QmA", "QmB"})] == [
                step - 2,
                step - 1,
                step,
            ]
    state = monitor.state(now=10.0)
    assert [p["step"] for p in state["history"]] == list(range(1, 10)) and state["global_step"] == 9
    assert all(p["samples"] == 32 and p["peers"] == 2 and p["loss"] == 2.0 for p in state["history"])
    assert {p["peer"]: p["samples_contributed"] for p in state["peers"]} == {"QmA": 72, "QmB": 216}
    assert state["alive_peers"] == 2 and state["run_status"] == "training: global step 9"
    # QmA ends the run; QmB's progress report vanishes (killed): departed
    monitor.update(records(10, ("finished", "training")), now=11.0, live_peers={"QmA"})
    state = monitor.state(now=12.0)
    assert {p["peer"]: p["status"] for p in state["peers"]} == {"QmA": "finished", "QmB": "departed"}
    assert state["alive_peers"] == 0 and state["run_status"] == "run finished at step 10"
    monitor.final = FinalModel(10, "QmA", "checkpoint-10")
    assert monitor.state(now=12.0)["run_status"] == "run finished at step 10; final model: checkpoint-10"


def test_a_record_with_its_last_steps_fits_the_dhts_record_bound_and_reads_back():
    from sahajbert.records import fetch, publish

    run_id = "bound"
    entries = [
        StepEntry(step=10**6 + i, loss=123.456789, mini_steps=1000, samples=10**6, samples_per_second=1234.5678)
        for i in range(RECENT_STEPS)
    ]
    with signed_dhts(run_id, 2) as ((writer, key), (reader, _)):
        record = LocalMetrics(
            step=10**6 + RECENT_STEPS - 1,
            samples_per_second=1234.5678,
            samples_accumulated=10**6,
            loss=123.456789,
            mini_steps=1000,
            peer_id=writer.peer_id.to_base58(),
            samples_contributed=10**12,
            recent=entries,
            status="finished",
        )
        assert publish(writer, run_id, key, record).result(timeout=30), "stored within the record bound"
        assert wait_for(lambda: fetch(reader, run_id).get(key), 30, "the record on the other peer") == record


def test_a_start_record_naming_a_trainer_that_another_signer_names_too_is_not_trusted():
    # a trainer skips downloading the first trainer's parameters when that trainer's start record has its own digest:
    # a record forged under the first trainer's peer id must not make it skip (it would start from other parameters)
    from sahajbert.records import declare_start, fetch_starts

    run_id = "starts"
    with signed_dhts(run_id, 2) as ((honest, honest_key), (forger, forger_key)):
        first, other = honest.peer_id.to_base58(), forger.peer_id.to_base58()
        assert declare_start(honest, run_id, honest_key, first, "a" * 32)
        assert declare_start(forger, run_id, forger_key, other, "b" * 32)
        assert fetch_starts(forger, run_id) == {first: "a" * 32, other: "b" * 32}
        assert declare_start(forger, run_id, forger_key, first, "c" * 32)  # its own record, now naming the first
        assert fetch_starts(honest, run_id) == {}, "both records that name the first trainer are left out"


def aux(tmp_path, name, run_id, initial_peers, *extra) -> PeerProcess:
    return start_peer("run_aux_peer.py", tmp_path, name, run_id, initial_peers, "--refresh_period", "1", *extra)


def trainer(tmp_path, name, run_id, initial_peers, *extra) -> PeerProcess:
    return start_peer("run_trainer.py", tmp_path, name, run_id, initial_peers, *extra)


def forge_metrics(initial_peers, run_id) -> tuple[bool, bool]:
    """From this test process (its own RSA key): overwrite a trainer's record, and store a malformed one."""
    import hivemind
    from hivemind.utils.timed_storage import get_dht_time

    from sahajbert.records import fetch, make_validators, metrics_key

    validators, own_key = make_validators(run_id)
    dht = hivemind.DHT(
        initial_peers=initial_peers, start=True, record_validators=validators, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    try:
        victim_key = next(key for key in fetch(dht, run_id) if key != own_key)  # a real trainer's subkey
        expiration = get_dht_time() + 600
        forged = dict(step=10**6, samples_per_second=1e9, samples_accumulated=10**9, loss=0.0, mini_steps=1)
        other = dht.store(metrics_key(run_id), forged, expiration, subkey=victim_key)
        malformed = dht.store(metrics_key(run_id), {**forged, "loss": "low"}, expiration, subkey=own_key)
        return other, malformed
    finally:
        dht.shutdown()


def dashboard_dom(url: str) -> str:
    """Render the dashboard in headless Chromium and return the DOM after its scripts ran."""
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={os.environ.get('TMPDIR', '/tmp')}/chromium-{os.getpid()}",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


class AuxSwarm:
    """A first peer, the aux peer (monitor, checkpoints every 2 steps, wandb, dashboard, Hub upload, assisting in
    averaging) and two trainers, until the aux peer has saved three checkpoints."""

    RUN_ID = "aux_run"

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.organizer, self.initial_peers = first_peer(tmp_path / "fp1", self.RUN_ID)
        self.monitor = aux(
            tmp_path,
            "aux",
            self.RUN_ID,
            self.initial_peers,
            *("--checkpoint_every", "2", "--keep_checkpoints", "10", "--wandb_project", "sahajbert-test"),
            *("--dashboard_port", "0", "--push_to_hub", "--hub_model_id", "test-org/sahajbert-test"),
            *("--upload_interval", "2", "--assist_in_averaging", "--verbose"),
        )
        # progress reports that expire 20 s after a peer vanished: the monitor marks the killed trainers departed soon
        self.trainers = [
            trainer(tmp_path, f"t{i}", self.RUN_ID, self.initial_peers, "--max_steps", "100", *EXPIRING)
            for i in range(2)
        ]
        self.orphans = []

    def url(self) -> str:
        found = wait_for(lambda: re.search(r"dashboard at (http://\S+/)", self.monitor.output()), 10, "the URL")
        return found.group(1)

    def api_state(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url() + "api/state", timeout=10).read())

    def alive(self) -> bool:
        return all(p.running() for p in [self.organizer, self.monitor, *self.trainers])

    def kill_trainers(self) -> None:
        """Every trainer dies at once (SIGKILL), as when the volunteers' machines go away."""
        for peer in self.trainers:
            self.orphans += peer.descendants()
            peer.process.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        kill_orphans(self.orphans)
        for peer in [*self.trainers, self.monitor, self.organizer]:
            peer.stop()


@pytest.fixture(scope="module")
def aux_swarm(tmp_path_factory):
    swarm = AuxSwarm(tmp_path_factory.mktemp("aux_swarm"))
    try:
        wait_for(lambda: len(list_checkpoints(swarm.tmp_path / "aux")) >= 3 or not swarm.alive(), 300, "3 checkpoints")
        assert swarm.alive(), [p.output()[-3000:] for p in [swarm.monitor, *swarm.trainers]]
        yield swarm
    finally:
        swarm.stop()


# the tests below share one swarm, in this order: those that need it running, then the one that kills its trainers


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_dashboard_shows_the_swarms_numbers_in_a_browser(aux_swarm):
    require(CHROMIUM is not None, "chromium", "apt-get install chromium (.ci/run does)")
    assert aux_swarm.alive()
    state = aux_swarm.api_state()
    assert state["run_id"] == AuxSwarm.RUN_ID and state["global_step"] >= 2 and len(state["peers"]) == 2
    dom = dashboard_dom(aux_swarm.url())
    shown_step = int(re.search(r'id="global_step">(\d+)<', dom).group(1))
    assert shown_step >= state["global_step"]
    table = re.search(r'<tbody id="peers">(.*?)</tbody>', dom, re.S).group(1)
    assert table.count("<tr>") == 2, "one table row per trainer"
    assert '<path d="M' in dom, "the charts were drawn"
    for peer in state["peers"]:
        assert f"<td>{peer['peer']}</td><td>training</td>" in table
    # the peers are named as their own logs name them
    logged = {re.search(r"joined the swarm as peer (\S+)", t.output()).group(1) for t in aux_swarm.trainers}
    assert {peer["peer"] for peer in state["peers"]} == logged


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_forged_records_are_refused_by_every_peer_and_never_shown(aux_swarm):
    assert aux_swarm.alive()
    assert forge_metrics(aux_swarm.initial_peers, AuxSwarm.RUN_ID) == (False, False)
    after = aux_swarm.api_state()
    assert len(after["peers"]) == 2 and all(p["step"] < 10**6 for p in after["peers"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_aux_peer_assists_in_averaging(aux_swarm):
    # --assist_in_averaging: it joins the trainers' gradient all-reduce rounds without samples of its own, so their
    # groups hold three peers (its hivemind log, at --verbose)
    assert aux_swarm.alive()
    wait_for(lambda: "Averaged gradients with 3 peers" in aux_swarm.monitor.output(), 120, "a round of three")
    # with nothing to tell of it: its contribution, of no samples, is neither averaged in nor dropped as a bad one by
    # the trainers it averages with. (What the trainers tell of each other's contributions is not its part: under
    # load, one trainer's gradients from fewer samples can be bounded by the other's rule.)
    aux_id = re.search(r"joined the swarm as peer (\S+)", aux_swarm.monitor.output()).group(1)
    for peer in aux_swarm.trainers:
        assert f"contribution of {aux_id}" not in peer.output(), peer.output()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_the_aux_peer_checkpoints_logs_uploads_and_rescues_the_run(aux_swarm, tmp_path):
    aux_swarm.kill_trainers()  # all trainers die
    organizer, monitor, trainers = aux_swarm.organizer, aux_swarm.monitor, aux_swarm.trainers
    wait_for(lambda: not any(p.running() for p in trainers), 30, "the trainers to die")
    # the monitor marks them departed once their progress reports expire, and counts none training
    departed = lambda: [p["status"] for p in aux_swarm.api_state()["peers"]] == ["departed", "departed"]  # noqa: E731
    wait_for(departed, 90, "both killed trainers shown departed")
    assert aux_swarm.api_state()["alive_peers"] == 0
    aux_swarm.stop()
    # the busiest DHT traffic of the suite (a monitor refreshing every second, two trainers, a dashboard) stays within
    # every peer's DHT request bounds (hivemind_ext's BoundedDHTProtocol): no honest request was refused
    for peer in [organizer, monitor, *trainers]:
        assert "refused a DHT request" not in peer.output(), peer.output()[-3000:]
    saved = list_checkpoints(aux_swarm.tmp_path / "aux")
    steps = [step for step, _ in saved]
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:])), f"cadence of 2 global steps: {steps}"
    last_step_saved, last_checkpoint = saved[-1]
    # a transformers checkpoint: the pretraining model and its encoder alone load from it, with the same weights
    pretraining = AlbertForPreTraining.from_pretrained(last_checkpoint)
    assert pretraining.config.vocab_size == 2000
    encoder = AutoModel.from_pretrained(last_checkpoint)
    for name, tensor in encoder.state_dict().items():
        torch.testing.assert_close(tensor, pretraining.albert.state_dict()[name], rtol=0, atol=0, msg=name)
    assert (last_checkpoint / "tokenizer.json").exists() and (last_checkpoint / "optimizer.pt").exists()
    # the upload failed (no Hub here): logged with its message, retried, and the checkpoints are intact
    log = monitor.output()
    failures = re.findall(r"upload of checkpoint-\d+ to test-org/sahajbert-test failed: \w+", log)
    assert len(failures) >= 2, log[-3000:]
    # no traceback from the upload or from our code; hivemind may log one for a state download from a trainer that
    # was just stopped (connection refused), which it retries
    tracebacks = log.split("Traceback (most recent call last):")[1:]
    ours = [t[:3000] for t in tracebacks if "sahajbert/" in t[:3000] or "huggingface_hub" in t[:3000]]
    assert ours == [], ours[0]
    # wandb (offline) holds what the monitor logged
    (run_dir,) = (aux_swarm.tmp_path / "aux" / "wandb").glob("offline-run-*")
    rows = [row for row in history(run_dir) if "loss" in row]
    assert len(rows) >= 2 and rows[-1]["step"] >= last_step_saved - 2
    # each point with the peers alive when the monitor logged it: both while they trained (one before the other's first
    # record reached it, on a busy machine), none for a last step it read after they were killed
    assert all(row["loss"] > 0 for row in rows), rows
    assert all(row["alive_peers"] in (0, 1, 2) for row in rows) and max(row["alive_peers"] for row in rows) == 2

    # rescue: every peer is gone; an aux peer serves the last checkpoint to a new swarm
    run_id = AuxSwarm.RUN_ID
    organizer, initial_peers = first_peer(tmp_path / "fp2", run_id)
    # the rescue aux peer also shows the new run on its dashboard, reading the records every 5 s (not every step)
    rescue = aux(
        tmp_path,
        "rescue",
        run_id,
        initial_peers,
        "--initial_state",
        str(last_checkpoint),
        "--dashboard_port",
        "0",
        "--refresh_period",
        "5",
    )
    newcomer, final_step = None, last_step_saved + 2
    try:
        wait_for(lambda: "serving the state of" in rescue.output(), 120, "the rescue aux peer")
        newcomer = trainer(tmp_path, "newcomer", run_id, initial_peers, "--max_steps", str(final_step))
        assert newcomer.wait(300) == 0, newcomer.output()[-3000:]
        # the trainer that ended the run stayed up until the aux peer had saved its final model
        assert "waiting for the aux peer to save the final model" in newcomer.output()
        assert f"saved the swarm's final model (step {final_step}, from peer" in rescue.output(), rescue.output()
        url = re.search(r"dashboard at (http://\S+/)", rescue.output()).group(1)
        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
        dom = dashboard_dom(url)
    finally:
        for process in [p for p in (newcomer, rescue, organizer) if p]:
            process.stop()
    assert f"joined at global step {last_step_saved}" in newcomer.output()
    records = read_train_log(tmp_path / "newcomer")
    steps = [record.step for record in records]
    assert steps == [last_step_saved + 1, final_step], f"resumed at the served step {last_step_saved}"

    # the aux peer's last checkpoint is the run's final model: the trainer's own final parameters (sent in fp16)
    aux_last = list_checkpoints(tmp_path / "rescue")[-1]
    own_last = list_checkpoints(tmp_path / "newcomer")[-1]
    assert aux_last[0] == own_last[0] == final_step
    assert read_state(aux_last[1])["final"] is True
    final, own = AutoModel.from_pretrained(aux_last[1]), AutoModel.from_pretrained(own_last[1])
    for (name, tensor), theirs in zip(final.state_dict().items(), own.state_dict().values()):
        torch.testing.assert_close(tensor, theirs, rtol=1e-3, atol=1e-3, msg=name)

    # the dashboard, in a real browser, agrees with the trainer's log: its steps, its id, its samples, its end
    require(CHROMIUM is not None, "chromium", "apt-get install chromium (.ci/run does)")
    peer_id = re.search(r"joined the swarm as peer (\S+)", newcomer.output()).group(1)
    contributed = int(re.findall(r"this peer contributed (\d+) samples so far", newcomer.output())[-1])
    assert contributed == sum(record.samples for record in records)
    assert [point["step"] for point in state["history"]] == steps, "one point per global step"
    assert [point["samples"] for point in state["history"]] == [record.samples for record in records]
    assert int(re.search(r'id="global_step">(\d+)<', dom).group(1)) == final_step
    status = re.search(r'id="run_status">([^<]*)<', dom).group(1)
    assert status == f"run finished at step {final_step}; final model: checkpoint-{final_step}", status
    table = re.search(r'<tbody id="peers">(.*?)</tbody>', dom, re.S).group(1)
    assert f"<tr><td>{peer_id}</td><td>finished</td><td>{final_step}</td><td>{contributed}</td>" in table, table
    loss_chart = re.search(r'<svg id="chart_loss"[^>]*>(.*?)</svg>', dom, re.S).group(1)
    assert loss_chart.count('class="pt"') == len(steps), loss_chart
