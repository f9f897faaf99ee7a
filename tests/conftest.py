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


def pytest_collection_modifyitems(config, items):
    """Modules whose tests may run longest go first (by the sum of their own pytest.mark.timeout limits), so that
    `make test`'s workers (pytest-xdist, a module per worker at a time) end at about the same time."""

    def budget(item) -> float:
        limit = item.get_closest_marker("timeout")
        return limit.args[0] if limit is not None and limit.args else 0.0

    modules: dict[str, float] = {}
    for item in items:
        modules[item.module.__name__] = modules.get(item.module.__name__, 0.0) + budget(item)
    items.sort(key=lambda item: -modules[item.module.__name__])


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
