"""Shared fixtures (the bundled sample corpus, a tokenizer trained in-process on it) and the suite's tiers.

Tiers, by marker: `slow` starts peer processes (a swarm, a script, a benchmark) and is left out of `make test-fast`;
`xla` needs the TPU virtualenv; `scale` is a real-size scenario that only `make test-scale` runs. A test in the fast
tier may not start a peer script: the fast tier stays fast because it starts no swarm.
"""

import logging
import os
import subprocess
from pathlib import Path

import pytest

from sahajbert.samples import SAMPLE_FILES

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing in the tests may need the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# the scripts that start a peer (a swarm's members); the fast tier calls their main() in-process instead
PEER_SCRIPTS = ("run_trainer.py", "run_first_peer.py", "run_aux_peer.py", "run_local_swarm.py", "netswarm.py")
TIER_MARKERS = ("slow", "xla", "scale")


# the modules that take longest under `make test` (seconds of their tests, measured with two workers on 2 cores), so
# that they start first and the workers end at about the same time; a module not listed counts its tests' timeouts
MODULE_SECONDS = {
    "test_xla": 320,
    "test_swarm": 270,
    "test_aux_peer": 255,
    "test_robustness": 235,
    "test_netswarm": 175,
    "test_access": 150,
    "test_bounds": 110,
    "test_diloco": 230,
    "test_training_parts": 90,
    "test_finetune": 75,
    "test_outsider": 140,
    "test_scale": 300,
}


def pytest_collection_modifyitems(config, items):
    """Longest modules first: `make test`'s workers (pytest-xdist, a module per worker at a time) take them in this
    order, so no long module starts last."""

    def seconds(module) -> float:
        name = module.__name__.rsplit(".", 1)[-1]
        if name in MODULE_SECONDS:
            return MODULE_SECONDS[name]
        limits = [item.get_closest_marker("timeout") for item in items if item.module is module]
        return min(60.0, sum(limit.args[0] for limit in limits if limit is not None and limit.args) / 10)

    order = {module: seconds(module) for module in {item.module for item in items}}
    items.sort(key=lambda item: -order[item.module])


@pytest.fixture(autouse=True)
def _fast_tests_start_no_peer(request, monkeypatch):
    """A test outside the slow, xla and scale tiers that starts a peer script fails at once, naming the script."""
    if any(request.node.get_closest_marker(name) for name in TIER_MARKERS):
        yield
        return
    popen_init = subprocess.Popen.__init__

    def refuse_peers(self, args, *rest, **kwargs):
        words = [str(word) for word in ([args] if isinstance(args, str | os.PathLike) else args)]
        peers = [word for word in words if word.endswith(PEER_SCRIPTS)]
        if peers:
            raise AssertionError(f"a fast-tier test started {peers[0]}: mark it slow, or call its main() in-process")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_peers)
    yield


@pytest.fixture(autouse=True, scope="session")
def _hivemind_ext_installed():
    """The fence installed (`sahajbert.swarm.install_hivemind_ext`), as a peer does when it joins: every hivemind
    object a test builds in this process (a DHT, an averager, an optimizer) runs with its bounds and patches."""
    from sahajbert.swarm import install_hivemind_ext

    install_hivemind_ext()


@pytest.fixture(autouse=True)
def _scripts_logging():
    """A script's main() run in-process points the root logger at that test's captured stderr: drop that after."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(handler)


@pytest.fixture(scope="session")
def sample_files() -> list[str]:
    return list(SAMPLE_FILES)


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    texts = []
    for path in SAMPLE_FILES:
        texts += [t for t in Path(path).read_text(encoding="utf-8").split("\n\n") if t.strip()]
    return texts


@pytest.fixture(scope="session")
def trained_tokenizer_dir(tmp_path_factory, sample_texts) -> Path:
    """A tokenizer trained here, in-process, on the sample (not the shipped one: training itself is under test)."""
    from sahajbert.tokenization import save_tokenizer, train_tokenizer

    output = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(sample_texts, vocab_size=1500, show_progress=False), output)
    return output


@pytest.fixture(scope="session")
def tokenizer(trained_tokenizer_dir):
    from sahajbert.tokenization import load_tokenizer

    return load_tokenizer(trained_tokenizer_dir)
