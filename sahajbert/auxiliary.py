"""The aux peer: monitor the swarm, checkpoint and upload its state, assist averaging, serve a rescue state.

`AuxPeer` has the trainer's shape: construction joins the swarm with the trainers' own model and optimizer
factories, `run()` is its loop read top to bottom, `close()` leaves the swarm.
"""

import logging
import time
from pathlib import Path

from sahajbert import adaptive, checkpoints, memory, records
from sahajbert.cli import UserError
from sahajbert.dashboard import Dashboard
from sahajbert.flags import AuxPeerArguments, PeerArguments
from sahajbert.hivemind_ext.optim import accessors
from sahajbert.model import build_model
from sahajbert.monitor import FinalModel, SwarmMonitor
from sahajbert.optim import build_collaborative_optimizer, restore_optimizer_state
from sahajbert.signals import StopRequest
from sahajbert.stopping import final_source
from sahajbert.swarm import SwarmPeer, validate_initial_peers
from sahajbert.tokenization import load_tokenizer

logger = logging.getLogger(__name__)
TICK = 0.5  # seconds between loop turns: an assisting peer must answer all-reduce rounds promptly
ANNOUNCE_EVERY = 20.0  # seconds between announcements of a served state, which expire after 60 s


class HubUploader:
    """Uploads a checkpoint folder with huggingface_hub; a failure is logged with its message and retried later."""

    def __init__(self, repo_id: str, interval: float):
        self.repo_id, self.interval = repo_id, interval
        self.next_attempt = 0.0
        self.uploaded_step = -1

    def maybe_upload(self, checkpoint: Path | None, loss: float | None, now: float) -> bool:
        if checkpoint is None or now < self.next_attempt:
            return False
        step = checkpoints.read_state(checkpoint)["global_step"]
        if step == self.uploaded_step:
            return False
        self.next_attempt = now + self.interval
        message = f"step {step}, loss {loss:.3f}" if loss is not None else f"step {step}"
        try:
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(self.repo_id, exist_ok=True)
            api.upload_folder(repo_id=self.repo_id, folder_path=str(checkpoint), commit_message=message)
        except Exception as e:  # network, auth, quota: the peer keeps running and tries again next interval
            logger.error(
                f"upload of {checkpoint.name} to {self.repo_id} failed: {type(e).__name__}: {e}; "
                f"retrying in {self.interval:.0f} s"
            )
            return False
        self.uploaded_step = step
        logger.info(f"uploaded {checkpoint.name} to {self.repo_id} ({message})")
        return True


def run_aux_peer(peer_args: PeerArguments, aux_args: AuxPeerArguments) -> None:
    """Run the aux peer until SIGINT/SIGTERM; it always leaves the swarm cleanly."""
    memory.set_up_peer_process()  # before the model and hivemind's forked processes allocate
    with StopRequest("stopping") as stop, AuxPeer(peer_args, aux_args) as peer:
        peer.run(stop)


class AuxPeer(SwarmPeer):
    """Watches the swarm and keeps its state; holds the trainers' model and optimizer but computes nothing."""

    def __init__(self, peer_args: PeerArguments, aux_args: AuxPeerArguments):
        self.args, self.aux_args = peer_args, aux_args
        swarm_args = peer_args.swarm_args
        validate_initial_peers(swarm_args.initial_peers)
        if aux_args.assist_in_averaging and swarm_args.client_mode:
            raise UserError("--assist_in_averaging needs incoming connections: it cannot run with --client_mode")
        if aux_args.assist_in_averaging and peer_args.optimizer_args.diloco_inner_steps:
            raise UserError(
                "--assist_in_averaging joins synchronous gradient rounds: with --diloco_inner_steps the trainers' "
                "outer rounds start from their own inner steps, and the aux peer follows them by downloading the state"
            )
        if aux_args.initial_state is not None:
            if not (Path(aux_args.initial_state) / checkpoints.STATE_FILE).is_file():
                raise UserError(
                    f"--initial_state '{aux_args.initial_state}' is not a checkpoint folder "
                    f"(no {checkpoints.STATE_FILE})"
                )
            checkpoints.read_state(aux_args.initial_state)
        self.tokenizer = load_tokenizer(peer_args.corpus_args.tokenizer_path)
        self.model = build_model(
            peer_args.model_args.model, self.tokenizer, peer_args.training_args.seed, aux_args.initial_state
        )
        self._join(swarm_args)
        self.dashboard = self.wandb_run = None
        try:
            # the trainers' own factory and arguments: the aux peer never re-types a hyperparameter
            # and the same timing rule: an assisting aux peer reduces a share of every all-reduce by its bandwidth
            timing, _, _ = adaptive.tune(peer_args, self.dht, sum(p.numel() for p in self.model.parameters()))
            self.timing = timing
            self.optimizer = build_collaborative_optimizer(
                self.model,
                self.dht,
                peer_args,
                auxiliary=aux_args.assist_in_averaging,
                timing=timing,
                gate=self.gate,
            )
            if aux_args.initial_state is not None:
                self._serve_initial_state(aux_args.initial_state)
            self.serving_step = self.optimizer.local_epoch if aux_args.initial_state is not None else None
            self.monitor = SwarmMonitor(swarm_args.run_id)
            if aux_args.dashboard_port is not None:
                self.dashboard = Dashboard(
                    aux_args.dashboard_host, aux_args.dashboard_port, lambda: self.monitor.state(time.time())
                )
            if aux_args.wandb_project:
                import wandb

                self.wandb_run = wandb.init(
                    project=aux_args.wandb_project,
                    name=swarm_args.run_id,
                    dir=peer_args.training_args.output_dir,
                    config={"run_id": swarm_args.run_id},
                )
        except BaseException:
            self.leave()
            raise
        self.uploader = HubUploader(aux_args.hub_model_id, aux_args.upload_interval) if aux_args.push_to_hub else None
        saved = checkpoints.list_checkpoints(peer_args.training_args.output_dir)
        self.saved_step = saved[-1][0] if saved else self.optimizer.local_epoch
        self._last_refresh = self._last_announce = 0.0
        self.final_step = 0  # the global step of the last final model saved (0: none)

    def close(self) -> None:
        """Finish the wandb run, stop the dashboard, then leave the swarm."""
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.dashboard is not None:
            self.dashboard.close()
        super().close()

    def run(self, stop: StopRequest) -> None:
        """Until a stop is requested: assist averaging, announce a served state, and every --refresh_period read
        the swarm's metrics, log and chart them, checkpoint the swarm's state and upload it."""
        while not stop:
            self.check_access()
            if self.aux_args.assist_in_averaging:
                self.optimizer.step()  # joins the all-reduce rounds of global steps as an auxiliary (no samples)
            now = time.time()
            if self.serving_step is not None and now - self._last_announce >= ANNOUNCE_EVERY:
                records.announce_state(self.dht, self.args.swarm_args.run_id, self.public_key, self.serving_step)
                self._last_announce = now
            if now - self._last_refresh >= self.aux_args.refresh_period:
                self._last_refresh = now
                self._refresh(now)
            stop.event.wait(TICK)

    def _refresh(self, now: float) -> None:
        run_id = self.args.swarm_args.run_id
        metrics = records.fetch(self.dht, run_id)
        new_points = self.monitor.update(metrics, now, accessors.progress_peers(self.optimizer))
        for point in new_points:
            loss = "n/a" if point["loss"] is None else f"{point['loss']:.4f}"
            logger.info(
                f"global step {point['step']} | loss {loss} | {point['peers']} peer(s) | "
                f"{point['samples_per_second']:.1f} samples/s | {point['samples']} samples"
            )
            if self.wandb_run is not None:
                self.wandb_run.log({**point, "alive_peers": self.monitor.alive_peers()})
        self._save_final_model(run_id)
        records.announce_archive(
            self.dht,
            run_id,
            self.public_key,
            records.ArchiveRecord(step=self.final_step, refresh_period=float(self.aux_args.refresh_period)),
        )
        swarm_step = max(self.monitor.global_step, accessors.position(self.optimizer).swarm_step)
        if self.final_step < swarm_step and swarm_step >= self.saved_step + self.aux_args.checkpoint_every:
            self.saved_step = self._checkpoint() or self.saved_step
        if self.uploader is not None:
            checkpoint = checkpoints.latest_checkpoint(self.args.training_args.output_dir)
            latest = self.monitor.history[-1] if self.monitor.history else {}
            self.uploader.maybe_upload(checkpoint, latest.get("loss"), now)

    def _save_final_model(self, run_id: str) -> None:
        """Once trainers end the run (their final round's records), download the final model from the peer whose
        parameters the round settled on and save it as the last checkpoint; the trainers wait for it
        (ending.Ending._wait_for_archive)."""
        finished = records.fetch_all_finished(self.dht, run_id)
        step = max((record.step for record in finished), default=0)
        if step <= self.final_step:
            return
        source = final_source([record for record in finished if record.step == step])
        if source is None:
            logger.warning(f"the run ended at step {step}, but no trainer serves its state: no final model saved")
            self.final_step = step
            return
        if not accessors.take_state_of(self.optimizer, source, step, self.timing.load_state_timeout):
            logger.info(f"could not download the final model of step {step} from peer {source}: will try again")
            return
        latest = self.monitor.history[-1] if self.monitor.history else {}
        saved = checkpoints.save_checkpoint(
            self.args.training_args.output_dir,
            step,
            self.model,
            self.tokenizer,
            optimizer_state=self.optimizer.state_dict(),
            state={"loss": latest.get("loss"), "final": True, "source": source},
            keep=self.args.training_args.keep_checkpoints,
        )
        self.final_step = self.saved_step = step
        self.monitor.final = FinalModel(step, source, saved.name)
        logger.info(f"saved the swarm's final model (step {step}, from peer {source}) as {saved}")

    def _serve_initial_state(self, checkpoint: str) -> None:
        """Load the checkpoint's optimizer state and global step, and advertise that step so joiners download it."""
        if not restore_optimizer_state(self.optimizer, checkpoint):
            accessors.set_step(self.optimizer, checkpoints.read_state(checkpoint)["global_step"])
        accessors.set_state_priority(self.optimizer, self.optimizer.local_epoch)  # served first
        accessors.report_step(self.optimizer, self.optimizer.local_epoch)
        logger.info(f"serving the state of {checkpoint} at global step {self.optimizer.local_epoch}")

    def _checkpoint(self) -> int | None:
        """Download the swarm's current state (model, optimizer, schedule, step) and save it; the step, or None."""
        before = self.optimizer.local_epoch
        self.optimizer.load_state_from_peers()
        if self.optimizer.local_epoch <= before and before != 0:
            logger.warning("no peer could share its state; will try again at the next refresh")
            return None
        # the swarm's step counts a step from its round's start (delayed updates), so a peer's state can still be one
        # behind it: such a state is not saved, to keep one checkpoint per --checkpoint_every steps
        due = self.saved_step + self.aux_args.checkpoint_every
        if self.optimizer.local_epoch < due:
            logger.info(
                f"the state downloaded is at global step {self.optimizer.local_epoch}, before step {due} that the "
                f"next checkpoint is for; will download it again at the next refresh"
            )
            return None
        latest = self.monitor.history[-1] if self.monitor.history else {}
        checkpoints.save_checkpoint(
            self.args.training_args.output_dir,
            self.optimizer.local_epoch,
            self.model,
            self.tokenizer,
            optimizer_state=self.optimizer.state_dict(),
            state={"loss": latest.get("loss")},
            keep=self.args.training_args.keep_checkpoints,
        )
        return self.optimizer.local_epoch
