"""What a user meets at the edges: every bad input is one `error:` line and exit code 2, nothing hangs, help reads.

Most cases call a script's own `main()` through `sahajbert.cli.run`, in this process, exactly as its `__main__`
does (exit code, stderr). The cases about processes and signals run the real scripts as processes.
"""

import json
import logging
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sahajbert import cli
from sahajbert.localswarm import PeerProcess, peer_env, wait_for
from sahajbert.samples import SAMPLE_FILES
from sahajbert.signals import FORCE_AFTER, StopNow, StopRequest
from sahajbert.stream import Prefetcher

from .swarm_helpers import LOCAL, ROOT, USER_SCRIPTS, assert_one_error, quiet, run_main, script

ENGLISH = "\n\n".join(" ".join(f"The cat number {i} sat on mat {j}." for j in range(8)) for i in range(50))


def help_of(name: str, capsys) -> str:
    main = runpy.run_path(str(script(name)))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


# ---- flags: spelled out, one line per mistake, settings files ----


@pytest.mark.parametrize(
    "args, message",
    [
        # argparse's prefix matching took this as --batch_size_lead 4
        (["--batch_size", "4"], "unknown flag --batch_size (did you mean --batch_size_lead"),
        (["--learning_rat", "1e-3"], "unknown flag --learning_rat (did you mean --learning_rate?)"),
        (["--max_steps", "abc"], "argument --max_steps: invalid int value: 'abc' (usage: --max_steps N)"),
        (["--masking", "words"], "invalid choice: 'words'"),
        (["4"], "unexpected value '4'"),
        (["--offload_optimizer", "maybe"], "expected true or false, got 'maybe'"),
    ],
)
def test_flags_must_be_spelled_out_and_bad_values_are_one_line(args, message, capsys):
    code, stderr = run_main("run_trainer.py", args, capsys)
    line = assert_one_error(code, stderr, message)
    assert "usage:" not in stderr.replace(line, ""), "one line, not argparse's usage wall"


def test_settings_file_combines_with_flags_and_refuses_unknown_keys(tmp_path, capsys):
    flags = runpy.run_path(str(script("run_trainer.py")))["FLAGS"]
    settings = tmp_path / "run.json"
    settings.write_text(json.dumps({"max_steps": 5, "learning_rate": 0.01, "initial_peers": ["/ip4/1.2.3.4/tcp/1"]}))
    peer_args, _ = cli.parse_args(flags, [str(settings), "--max_steps", "7"])
    assert peer_args.training_args.max_steps == 7, "a flag overrides the settings file"
    assert peer_args.training_args.learning_rate == 0.01
    assert peer_args.swarm_args.initial_peers == ["/ip4/1.2.3.4/tcp/1"]
    settings.write_text(json.dumps({"batch_size": 4}))
    code, stderr = run_main("run_trainer.py", [str(settings)], capsys)
    assert_one_error(code, stderr, "unknown setting 'batch_size' (did you mean --batch_size_lead")
    settings.write_text('{"max_steps": 5,\n "learning_rate": }')
    assert_one_error(*run_main("run_trainer.py", [str(settings)], capsys), "is not valid JSON (line 2)")
    assert_one_error(*run_main("run_trainer.py", [str(tmp_path / "no.json")], capsys), "settings file not found")
    (tmp_path / "dir.json").mkdir()
    assert_one_error(*run_main("run_trainer.py", [str(tmp_path / "dir.json")], capsys), "is a directory")


def test_a_required_flag_is_named(capsys):
    code, stderr = run_main("finetune/train_ner.py", [], capsys)
    assert_one_error(code, stderr, "the following arguments are required: --model_name_or_path")


def test_a_token_lifetime_beyond_what_peers_keep_is_refused(capsys):
    code, stderr = run_main("run_first_peer.py", ["--token_lifetime", "7200"], capsys)
    assert_one_error(code, stderr, "--token_lifetime must be at most 3600 seconds, got 7200")


def test_the_first_peer_refuses_client_mode(capsys):
    code, stderr = run_main("run_first_peer.py", ["--client_mode"], capsys)
    assert_one_error(code, stderr, "the first peer cannot run with --client_mode")


@pytest.mark.parametrize("content", [None, b"garbage\n"])
def test_identity_path_must_hold_an_identity(tmp_path, content, capsys):
    path = tmp_path / "identity"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, stderr = run_main("run_first_peer.py", ["--identity_path", str(path), *LOCAL], capsys)
    assert_one_error(code, stderr, "is a directory" if content is None else "does not hold a peer identity")


# ---- data and tokenizer ----


def test_text_without_sentence_breaks_fails_with_the_reason_and_the_script_share(tmp_path, capsys):
    english = tmp_path / "english.txt"
    english.write_text(ENGLISH)
    args = ["--tokenizer_path", "sample", "--data_files", str(english), "--num_examples", "2"]
    code, stderr = run_main("data/preview.py", args, capsys)
    line = assert_one_error(code, stderr, f"source '{english}' gave no training example in 1000 documents")
    assert "'.' does not end one" in line
    assert f"'{english}' is mostly not Bengali: 0% of the letters" in stderr


def test_malformed_json_lines_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "আমি ভাত খাই। তুমি কী খাও?"}\n{"text": broken\n', encoding="utf-8")
    code, stderr = run_main("data/preview.py", ["--tokenizer_path", "sample", "--data_files", str(bad)], capsys)
    assert_one_error(code, stderr, f"data file '{bad}' line 2 is not valid JSON")
    assert "ArrowInvalid" not in stderr


def test_a_directory_given_as_a_data_file(tmp_path, capsys):
    code, stderr = run_main("data/preview.py", ["--tokenizer_path", "sample", "--data_files", str(tmp_path)], capsys)
    assert_one_error(code, stderr, f"data file '{tmp_path}' is a directory: give the files in it")


def test_offline_without_data_files_fails_at_once_with_the_flag_to_use(capsys):
    code, stderr = run_main("data/preview.py", ["--tokenizer_path", "sample", "--num_examples", "3"], capsys)
    assert_one_error(code, stderr, "are on the Hub, and the Hub is switched off here (HF_HUB_OFFLINE)")
    assert "--data_files sample" in stderr
    code, stderr = run_main("data/preview.py", ["--num_examples", "3"], capsys)  # the default tokenizer is the Hub's
    assert_one_error(code, stderr, "--tokenizer_path 'neuropark/sahajBERT': no such folder here")


def test_the_bundled_sample_says_so(capsys):
    code, stderr = run_main("data/preview.py", ["--tokenizer_path", "sample", "--data_files", "sample"], capsys)
    assert code == 0
    assert "using the bundled 2,000-piece sample tokenizer" in stderr
    assert "--tokenizer_path neuropark/sahajBERT (the default)" in stderr
    assert "training on the bundled sample corpus" in stderr


@pytest.mark.parametrize("path", ["/nonexistent/tokenizer", "./my_tokenizer"])
def test_a_tokenizer_folder_that_does_not_exist(path, capsys):
    code, stderr = run_main("data/preview.py", ["--tokenizer_path", path, "--data_files", "sample"], capsys)
    assert_one_error(code, stderr, f"tokenizer folder not found: '{path}'")


def test_tokenizer_training_refuses_a_corpus_far_below_the_vocabulary(tmp_path, capsys):
    english = tmp_path / "english.txt"
    english.write_text(ENGLISH)
    out = tmp_path / "tokenizer"
    args = ["--data_files", str(english), "--vocab_size", "1000", "--output_dir", str(out)]
    code, stderr = run_main("tokenizer/train_tokenizer.py", args, capsys)
    assert_one_error(code, stderr, "far below --vocab_size 1000")
    assert "is mostly not Bengali" in stderr and not out.exists(), "nothing is saved"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--initial_peers", "1.2.3.4:1337"], "must be a libp2p multiaddr"),
        (["--model", "albert-huge"], "unknown model 'albert-huge'"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be at least 1"),
        (["--device", "tpu"], "pip install -r requirements-tpu.txt"),
        (["--device", "cpu", "--precision", "fp16"], "needs a CUDA GPU"),
        (["--final_averaging_window", "-5"], "--final_averaging_window must be >= 0 seconds"),
    ],
)
def test_a_trainers_bad_settings_are_one_line(tmp_path, args, message, capsys):
    # the bundled tokenizer: the default is the Hub's, which this offline machine cannot reach
    base = ["--output_dir", str(tmp_path / "o"), *LOCAL, "--tokenizer_path", "sample"]
    assert_one_error(*run_main("run_trainer.py", [*base, *args], capsys), message)


def test_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    from transformers import AlbertConfig, AlbertForPreTraining

    from sahajbert.tokenization import load_tokenizer, save_tokenizer

    checkpoint = tmp_path / "checkpoint"
    config = AlbertConfig(
        vocab_size=2000, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    AlbertForPreTraining(config).save_pretrained(checkpoint)
    save_tokenizer(load_tokenizer("sample"), checkpoint)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    news = ROOT / "finetune" / "sample"
    files = [f"--{split}_file={news / f'news_{split}.csv'}" for split in ("train", "validation", "test")]
    args = ["--model_name_or_path", str(checkpoint), *files, "--output_dir", str(tmp_path / "out")]
    code, stderr = run_main("finetune/train_ncc.py", args, capsys)
    assert_one_error(code, stderr, f"cannot load the model in '{checkpoint}'")


# ---- help ----


@pytest.mark.parametrize("name", USER_SCRIPTS)
def test_help_is_grouped_and_names_no_machine_path(name, capsys):
    text = help_of(name, capsys)
    lines = text.splitlines()
    assert lines[0].startswith("usage: ") and lines[2], "a usage line, then a one-line description"
    assert str(ROOT) not in text and "site-packages" not in text and "/root" not in text, "no machine path"
    groups = re.split(r"\n(?=\S[^\n]*:\n)", text)[1:]  # a group starts at an unindented "title:" line
    assert groups, text
    for group in groups:
        assert len(group.splitlines()) <= 50, f"group does not fit on a screen:\n{group}"
    for flag in re.findall(r"^\s+--no_(\w+)\s+(.*)$", text, flags=re.MULTILINE):
        positive = re.search(rf"^\s+--{flag[0]}\b.*?\s{{2,}}(\S.*)$", text, flags=re.MULTILINE)
        assert positive and positive.group(1) != flag[1], f"--no_{flag[0]} repeats the help of --{flag[0]}"


# what --help of a script may import: its flags' module, not the libraries of training (seconds of CPU before a page of
# text; fine-tuning's flags are transformers' own, so its scripts are not listed)
HEAVY_IMPORTS = ("torch", "transformers", "hivemind", "datasets")


@pytest.mark.parametrize("name", ["run_trainer.py", "run_first_peer.py", "run_aux_peer.py", "run_local_swarm.py"])
def test_help_of_a_peer_script_imports_no_training_library(name):
    check = (
        "import contextlib, io, runpy, sys\n"
        f"sys.argv = [{name!r}, '--help']\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    runpy.run_path({str(script(name))!r}, run_name='__main__')\n"
        f"print(out.getvalue().startswith('usage: '), sorted(m for m in {HEAVY_IMPORTS!r} if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=peer_env(), cwd=ROOT)
    assert run.returncode == 0 and run.stdout.split() == ["True", "[]"], (run.stdout, run.stderr[-2000:])


def test_each_script_shows_only_its_flags_with_its_own_defaults(capsys):
    aux = help_of("run_aux_peer.py", capsys)
    assert "--per_device_train_batch_size" not in aux and "--data_files" not in aux and "--max_steps" not in aux
    assert re.search(r"--output_dir TEXT.*\(default: outputs/aux\)", aux)
    # not listed, but accepted: the trainers' settings file or command line serves the aux peer too
    aux_flags = runpy.run_path(str(script("run_aux_peer.py")))["FLAGS"]
    peer_args, _ = cli.parse_args(aux_flags, ["--max_seq_length", "64", "--learning_rate", "0.02"])
    assert peer_args.training_args.learning_rate == 0.02 and peer_args.training_args.output_dir == "outputs/aux"
    tokenizer = help_of("tokenizer/train_tokenizer.py", capsys)
    assert "--masking" not in tokenizer and "--max_seq_length" not in tokenizer and "--vocab_size" in tokenizer
    assert "--client_mode" not in help_of("run_first_peer.py", capsys)
    for task in ("ner", "ncc"):
        text = help_of(f"finetune/train_{task}.py", capsys)
        assert f"(default: outputs/{task})" in text and "--model_name_or_path TEXT" in text
        assert re.search(r"(?s)--model_name_or_path TEXT((?!\n  --).)*\(required\)", text), text
        assert "--fsdp" not in text, "transformers' rarely used flags are accepted but not listed"
    trainer = help_of("run_trainer.py", capsys)
    assert "--tokenizer_path TEXT" in trainer and "(default: neuropark/sahajBERT)" in trainer


# ---- real processes: nothing hangs, signals, ports, peers ----


def test_a_trainer_on_text_without_sentence_breaks_fails_instead_of_hanging(tmp_path, capsys):
    english = tmp_path / "english.txt"
    english.write_text(ENGLISH)
    args = ["--model", "tiny", "--tokenizer_path", "sample", "--data_files", str(english), *LOCAL]
    code, stderr = run_main("run_trainer.py", [*args, "--output_dir", str(tmp_path / "o")], capsys)
    assert_one_error(code, stderr, "gave no training example in 1000 documents")


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_while_the_stream_is_busy_stops_the_trainer_within_seconds(tmp_path, signals):
    """The stream spends a minute on one enormous document; the trainer waits for its first batch meanwhile."""
    text = Path(SAMPLE_FILES[0]).read_text(encoding="utf-8").replace("\n\n", " ")
    huge = tmp_path / "one_document.txt"
    huge.write_text((text + " ") * (12_000_000 // len(text)), encoding="utf-8")
    args = ["--model", "tiny", "--tokenizer_path", "sample", "--data_files", str(huge), "--max_seq_length", "64"]
    args += [*LOCAL, "--output_dir", str(tmp_path / "o")]
    peer = PeerProcess(script("run_trainer.py"), args, tmp_path / "t.log")
    try:
        wait_for(lambda: "computing on" in peer.output() or not peer.running(), 120, "the trainer to start")
        time.sleep(5)  # into construction or the wait for the first batch: either must stop at once
        sent = time.monotonic()
        peer.process.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_for(lambda: "received SIGTERM" in peer.output(), 10, "the first signal to be taken")
            peer.process.send_signal(signal.SIGTERM)
        code = peer.wait(60)
        took = time.monotonic() - sent
    finally:
        peer.stop()
    output = peer.output()
    assert "received SIGTERM" in output, output[-3000:]
    # well inside the minute the document takes, and within the 15 s every stop request is bounded by
    assert took < 30, f"stopped {took:.0f} s after the signal:\n{output[-3000:]}"
    assert code in ((0,) if signals == 1 else (0, 130)), output[-3000:]
    if signals == 1:
        assert "stopped at global step 0 (stop requested)" in output
    quiet(output)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_busy_port_and_a_wrong_peer_id_are_one_line(tmp_path, capsys):
    port = free_port()
    first = PeerProcess(
        script("run_first_peer.py"), ["--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}"], tmp_path / "first.log"
    )
    try:
        line = wait_for(lambda: re.search(r"--initial_peers (\S+)", first.output()), 60, "the first peer").group(1)
        code, stderr = run_main("run_first_peer.py", ["--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}"], capsys)
        assert_one_error(code, stderr, f"port {port} is already in use on 127.0.0.1")
        other_id = line.rsplit("/p2p/", 1)[0] + "/p2p/QmXa1yGyEqqZrNqBGNd3YjUVWyKwYQ8Uw3tWNBhJuLbX9f"
        flags = ["--model", "tiny", "--tokenizer_path", "sample", "--data_files", "sample"]
        flags += ["--initial_peers", other_id, "--join_timeout", "15", *LOCAL, "--output_dir", str(tmp_path / "o")]
        code, stderr = run_main("run_trainer.py", flags, capsys)
        error = assert_one_error(code, stderr, "none of the initial peers answered")
        assert "the /p2p/ peer id" in error
    finally:
        first.stop()


# a script whose averager's loop has closed when its error ends it: hivemind's future is collected at exit
CLOSED_LOOP_AT_EXIT = """
import asyncio, atexit
from hivemind.utils.mpfuture import MPFuture
from sahajbert import cli

futures = []
atexit.register(futures.clear)

async def await_a_future():
    futures.append(MPFuture())
    asyncio.ensure_future(futures[0])
    await asyncio.sleep(0.1)

def main():
    cli.setup_logging()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(await_a_future())
    loop.close()
    raise cli.UserError("the organizer no longer admits you")

cli.run(main)
"""


def test_the_error_line_is_the_last_line_even_when_a_closed_loop_future_is_collected_at_exit():
    result = subprocess.run(
        [sys.executable, "-c", CLOSED_LOOP_AT_EXIT], capture_output=True, text=True, timeout=60, env=peer_env()
    )
    assert_one_error(result.returncode, result.stderr, "no longer admits you")
    assert result.stderr.strip().splitlines()[-1] == "error: the organizer no longer admits you", result.stderr


# a stream server whose handler fails, as hivemind's p2p daemon client's does now and then (plain hivemind peers too)
FAILING_STREAM_HANDLER = """
import asyncio
from sahajbert import cli

async def handler(reader, writer):
    raise RuntimeError("cannot reuse already awaited coroutine")

async def serve_one_stream():
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    await asyncio.sleep(0.5)
    writer.close()
    server.close()

def main():
    cli.setup_logging()
    asyncio.run(serve_one_stream())
    return 0

cli.run(main)
"""


def test_a_stream_the_p2p_client_drops_is_one_info_line_not_an_error_with_a_traceback():
    result = subprocess.run(
        [sys.executable, "-c", FAILING_STREAM_HANDLER], capture_output=True, text=True, timeout=60, env=peer_env()
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert " INFO asyncio: hivemind's p2p client dropped an incoming stream (RuntimeError" in lines[0], lines


# a script whose main() ends while a child process that ignores SIGTERM is still running (Python's exit handler
# terminates such a child and then joins it without a time limit)
STUCK_CHILD_AT_EXIT = """
import multiprocessing, signal, time
from sahajbert import cli

def stuck():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("child", flush=True)
    time.sleep(600)

def main():
    child = multiprocessing.Process(target=stuck, daemon=True)
    child.start()
    time.sleep(1)
    return 3

cli.EXIT_GRACE = 2.0
cli.run(main)
"""


def test_a_script_exits_soon_after_its_end_even_with_a_stuck_child():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STUCK_CHILD_AT_EXIT], capture_output=True, text=True, timeout=120, env=peer_env()
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert "still exiting 2 s after the end: stopping 1 process(es) left" in result.stderr, result.stderr
    assert time.monotonic() - started < 100  # without the grace, it never ends: subprocess.run's timeout says so
    assert result.stdout.strip() == "child"


# a process that leaves at once after a DHT call in the background (the progress tracker's last store is one)
LEAVES_AT_ONCE = """
import os, sys
import hivemind
from hivemind.utils import get_dht_time
from sahajbert.hivemind_ext.dht.process import drain_dht_calls
from sahajbert.swarm import install_hivemind_ext

install_hivemind_ext()
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(*dht.get_visible_maddrs(), flush=True)
sys.stdin.readline()  # (the test's reader has joined)
dht.store("leaving", "goodbye", get_dht_time() + 30, return_future=True)
print("drained", drain_dht_calls(dht), flush=True)
sys.stderr.flush()
os._exit(0)  # no shutdown, no atexit: the DHT process is on its own from here
"""


@pytest.mark.slow
def test_the_dht_process_reads_every_call_before_its_peer_leaves(tmp_path):
    """Without the drain, the DHT process reads the store after this process is gone and fails with a traceback (the
    store's reply pipe is fetched from this process): 2 of 2 runs here."""
    import hivemind

    errors = tmp_path / "stderr"
    with open(errors, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", LEAVES_AT_ONCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=peer_env(),
            start_new_session=True,  # the DHT process and its p2pd outlive the script: one group to end them with
        )
        reader = None
        try:
            # a peer that will read the record, joined before the store: the DHT process may not outlive a failed read
            reader = hivemind.DHT(start=True, client_mode=True, initial_peers=process.stdout.readline().split())
            process.stdin.write("go\n")
            process.stdin.flush()
            assert process.stdout.readline().strip() == "drained True"
            assert process.wait(60) == 0

            def stored_or_failed():
                found = reader.get("leaving", latest=True)
                return (found.value if found else None) or "Traceback" in errors.read_text()

            # the DHT process, left alone, has read the store once the other peer finds the record in it; a read
            # that failed shows as a traceback instead
            assert wait_for(stored_or_failed, 60, "the store to be read") == "goodbye", errors.read_text()
        finally:
            if reader is not None:
                reader.shutdown()
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Traceback" not in errors.read_text(), errors.read_text()


# ---- stopping: the rules behind "within seconds" ----


def test_a_stop_request_ends_even_a_wait_that_never_checks_it(caplog):
    """FORCE_AFTER seconds after the first signal the role stops at once (KeyboardInterrupt), whatever it does."""
    stop = StopRequest(force_after=1.0)
    with stop, pytest.raises(KeyboardInterrupt), caplog.at_level("INFO", logger="sahajbert.signals"):
        signalled = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        # a wait that never looks at the request (a round, a download), for half the default FORCE_AFTER: a stop
        # forced at the default, not at this request's force_after, lets it end (then nothing is raised)
        while time.monotonic() - signalled < FORCE_AFTER / 2:
            time.sleep(0.05)
    forced = time.monotonic() - signalled
    assert stop and forced >= stop.force_after, forced
    # stopped by the force, not by a second signal (nothing sent one)
    lines = [r.getMessage() for r in caplog.records if r.name == "sahajbert.signals"]
    assert any("still running 1 s after the stop request: stopping at once" in line for line in lines), lines
    assert signal.getsignal(signal.SIGTERM) is not stop._handle, "the previous handler is back"


def test_a_second_signal_stops_at_once():
    with StopRequest(force_after=60.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stop, "the first signal asks for a stop after the current step"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def test_the_wait_for_a_batch_ends_on_a_stop_request():
    release = threading.Event()

    def stuck_source():
        release.wait(60)  # a Hub stream that stalls, or one enormous document
        yield {"input_ids": [1]}

    batches = Prefetcher(stuck_source())
    stop = StopRequest()
    threading.Timer(0.3, stop.event.set).start()
    started = time.monotonic()
    with pytest.raises(StopNow):
        batches.get(stop)
    assert time.monotonic() - started < 5
    release.set()
    batches.close()


def test_hivemind_errors_a_user_cannot_act_on_are_one_line_shown_only_with_verbose():
    from sahajbert.swarm import _ROUTINE_ERRORS, _RoutineErrors, quiet_hivemind

    shown: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = shown.append
    averager = logging.getLogger("hivemind.averaging.averager")
    averager.addHandler(handler)

    def _step():  # the name of hivemind's averager routine that logs a failed round with its traceback
        try:
            raise RuntimeError("Averaging step failed: could not find a group")
        except RuntimeError as e:
            averager.exception(e)

    try:
        for verbose in (False, True):
            quiet_hivemind(verbose)
            _step()
            averager.error("Averager shutdown has no effect: the process is already not alive", exc_info=True)
        averager.error("a real problem")
    finally:
        averager.removeHandler(handler)
        quiet_hivemind(False)
        for name in _RoutineErrors.LOGGERS:
            logging.getLogger(name).removeFilter(_ROUTINE_ERRORS)
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in shown] == [
        ("INFO", "Averaging step failed: could not find a group", None),
        ("INFO", "Averager shutdown has no effect: the process is already not alive", None),
        ("ERROR", "a real problem", None),
    ]


def test_a_dht_request_whose_sender_exited_is_an_error_hivemind_reads_past():
    import multiprocessing as mp

    from sahajbert.hivemind_ext.dht.process import RequestPipe

    reader, writer = mp.Pipe(duplex=False)
    writer.close()  # the sender is gone: reading fails with EOFError, which would end hivemind's DHT process
    with pytest.raises(ConnectionResetError):
        RequestPipe(reader).recv()
    assert RequestPipe(reader).fileno() == reader.fileno()
