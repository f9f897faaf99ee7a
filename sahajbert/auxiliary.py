"""The aux peer: monitor the swarm, checkpoint and upload its state, assist averaging, serve a rescue state."""

import logging
import time
from pathlib import Path

from sahajbert import checkpoints, metrics
from sahajbert.cli import UserError
from sahajbert.dashboard import Dashboard
from sahajbert.model import build_model
from sahajbert.monitor import SwarmMonitor
from sahajbert.optim import build_collaborative_optimizer
from sahajbert.swarm import build_dht, validate_initial_peers
from sahajbert.tokenization import load_tokenizer
from sahajbert.training import StopRequest

logger = logging.getLogger(__name__)
TICK = 0.5  # seconds between loop turns: an assisting peer must answer all-reduce rounds promptly


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


def run_aux_peer(swarm_args, averaging_args, optimizer_args, model_args, training_args, corpus_args, aux_args) -> None:
    """Run until SIGINT/SIGTERM."""
    validate_initial_peers(swarm_args.initial_peers)
    if aux_args.assist_in_averaging and swarm_args.client_mode:
        raise UserError("--assist_in_averaging needs incoming connections: it cannot run with --client_mode")
    if aux_args.initial_state is not None:
        if not (Path(aux_args.initial_state) / checkpoints.STATE_FILE).is_file():
            raise UserError(
                f"--initial_state '{aux_args.initial_state}' is not a checkpoint folder (no {checkpoints.STATE_FILE})"
            )
        checkpoints.read_state(aux_args.initial_state)
    tokenizer = load_tokenizer(corpus_args.tokenizer_path)
    model = build_model(model_args.model, tokenizer, training_args.seed, aux_args.initial_state)
    validators, public_key = metrics.make_validators(swarm_args.run_id)
    dht = build_dht(swarm_args, validators)
    optimizer = dashboard = wandb_run = None
    try:
        # the trainers' own factory and arguments: the aux peer never re-types a hyperparameter
        optimizer = build_collaborative_optimizer(
            model,
            dht,
            swarm_args,
            averaging_args,
            optimizer_args,
            training_args,
            auxiliary=aux_args.assist_in_averaging,
        )
        if aux_args.initial_state is not None:
            _serve_initial_state(optimizer, aux_args.initial_state)
        serving = (public_key, optimizer.local_epoch) if aux_args.initial_state is not None else None
        monitor = SwarmMonitor(swarm_args.run_id)
        if aux_args.dashboard_port is not None:
            dashboard = Dashboard(aux_args.dashboard_host, aux_args.dashboard_port, lambda: monitor.state(time.time()))
        if aux_args.wandb_project:
            import wandb

            wandb_run = wandb.init(
                project=aux_args.wandb_project,
                name=swarm_args.run_id,
                dir=training_args.output_dir,
                config={"run_id": swarm_args.run_id},
            )
        uploader = HubUploader(aux_args.hub_model_id, aux_args.upload_interval) if aux_args.push_to_hub else None
        with StopRequest() as stop:
            _loop(
                optimizer,
                dht,
                monitor,
                tokenizer,
                model,
                wandb_run,
                uploader,
                stop,
                swarm_args,
                training_args,
                aux_args,
                serving,
            )
    finally:
        if wandb_run is not None:
            wandb_run.finish()
        if dashboard is not None:
            dashboard.close()
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


def _serve_initial_state(optimizer, checkpoint: str) -> None:
    """Load the checkpoint's optimizer state and global step, and advertise that step so joiners download it."""
    state = checkpoints.load_optimizer_state(checkpoint)
    if state is not None:
        optimizer.load_state_dict(state)
    else:
        optimizer.state_averager.local_epoch = checkpoints.read_state(checkpoint)["global_step"]
    optimizer.state_averager._update_scheduler()  # the LR follows the restored global step
    optimizer.state_averager.state_sharing_priority = optimizer.local_epoch  # the preferred donor for its step
    optimizer.tracker.report_local_progress(optimizer.local_epoch, samples_accumulated=0)
    logger.info(f"serving the state of {checkpoint} at global step {optimizer.local_epoch}")


def _loop(
    optimizer, dht, monitor, tokenizer, model, wandb_run, uploader, stop, swarm_args, training_args, aux_args, serving
):
    last_refresh, last_announce = 0.0, 0.0
    last_saved = checkpoints.list_checkpoints(training_args.output_dir)
    saved_step = last_saved[-1][0] if last_saved else optimizer.local_epoch
    while not stop:
        if aux_args.assist_in_averaging:
            optimizer.step()  # joins the all-reduce rounds of global steps as an auxiliary (no samples)
        now = time.time()
        if serving is not None and now - last_announce >= 20.0:  # the announcement expires after 60 s
            metrics.announce_state(dht, swarm_args.run_id, *serving)
            last_announce = now
        if now - last_refresh >= aux_args.refresh_period:
            last_refresh = now
            summary = monitor.update(metrics.fetch(dht, swarm_args.run_id), now)
            if summary is not None:
                loss = "n/a" if summary.loss != summary.loss else f"{summary.loss:.4f}"
                logger.info(
                    f"global step {summary.step} | loss {loss} | {summary.alive_peers} peer(s) | "
                    f"{summary.samples_per_second:.1f} samples/s | {summary.samples_accumulated} samples"
                )
                if wandb_run is not None:
                    wandb_run.log(
                        {
                            "loss": summary.loss,
                            "alive_peers": summary.alive_peers,
                            "samples_per_second": summary.samples_per_second,
                            "samples": summary.samples_accumulated,
                            "step": summary.step,
                        }
                    )
            swarm_step = max(monitor.latest.step if monitor.latest else 0, optimizer.tracker.global_epoch)
            if swarm_step >= saved_step + aux_args.checkpoint_every:
                saved_step = _checkpoint(optimizer, model, tokenizer, training_args, monitor) or saved_step
            if uploader is not None:
                latest = checkpoints.latest_checkpoint(training_args.output_dir)
                uploader.maybe_upload(latest, monitor.latest.loss if monitor.latest else None, now)
        stop.event.wait(TICK)


def _checkpoint(optimizer, model, tokenizer, training_args, monitor) -> int | None:
    """Download the swarm's current state (model, optimizer, schedule, step) and save it; the step, or None."""
    before = optimizer.local_epoch
    optimizer.load_state_from_peers()
    if optimizer.local_epoch <= before and before != 0:
        logger.warning("no peer could share its state; will try again at the next refresh")
        return None
    loss = monitor.latest.loss if monitor.latest else None
    checkpoints.save_checkpoint(
        training_args.output_dir,
        optimizer.local_epoch,
        model,
        tokenizer,
        optimizer_state=optimizer.state_dict(),
        state={"loss": loss},
        keep=training_args.keep_checkpoints,
    )
    return optimizer.local_epoch
