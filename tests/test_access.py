"""Invite-only runs for real: an allowlisting first peer, invited trainers, outsiders, a forged, a stolen and a
replayed token, and a revoked member, each a real hivemind peer in its own process."""

import json
import subprocess
import sys
import threading
import time

import pytest

from sahajbert import access
from sahajbert.access import Allowlist, Authority, add_invite, parse_invite, read_allowlist, token_valid
from sahajbert.cli import UserError
from sahajbert.localswarm import PeerProcess, peer_env, wait_for

from .swarm_helpers import ROOT, TINY_TRAINING, assert_one_error, first_peer, quiet, run_main, run_script, script

# seconds: the first peer's --token_lifetime here (600 by default). Short, so that a revoked member is refused soon;
# long enough that a member asks for its next token at half its life (20 s) and has it before the old one ends even
# when the organizer's peer answers slowly on a busy machine (with 15 s, a member could be left without a valid token)
LIFETIME = 40.0


# ---- the allowlist and tokens, in this process ----


def test_allowlist_lines_and_errors(tmp_path):
    path = tmp_path / "allow.txt"
    alice = add_invite(path, "alice")
    path.write_text(path.read_text() + "# the second cohort\nbob  s3cret   # from the forum\n\n")
    assert read_allowlist(path) == {"alice": alice.secret, "bob": "s3cret"}
    with pytest.raises(UserError, match="already in"):
        add_invite(path, "bob")
    path.write_text("carol\n")
    with pytest.raises(UserError, match=r"allow.txt:1: expected 'NAME SECRET'"):
        read_allowlist(path)
    path.write_text("dan a\ndan b\n")
    with pytest.raises(UserError, match="listed twice"):
        read_allowlist(path)
    with pytest.raises(UserError, match="NAME:SECRET"):
        parse_invite("no-secret")


def test_a_broken_edit_keeps_the_last_good_allowlist(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text("alice one\n")
    allowlist = Allowlist(path)
    time.sleep(0.05)  # a new modification time (the file system's clock ticks in milliseconds)
    path.write_text("alice one\nbob\n")  # a half-typed line
    assert allowlist.secret_of("alice") == "one"
    time.sleep(0.05)
    path.write_text("bob two\n")
    assert allowlist.secret_of("alice") is None and allowlist.secret_of("bob") == "two"


def test_tokens_are_checked_against_the_authority(tmp_path):
    from hivemind.utils.crypto import RSAPrivateKey

    path = tmp_path / "allow.txt"
    path.write_text("alice one\n")
    authority, other = Authority(RSAPrivateKey(), Allowlist(path), 60), RSAPrivateKey()
    token = authority.issue("alice", other.get_public_key().to_bytes())
    assert token_valid(token, authority.public_key)
    assert not token_valid(token, other.get_public_key().to_bytes())  # another authority's key
    token.username = "mallory"  # the signature covers the name
    assert not token_valid(token, authority.public_key)
    assert not token_valid(authority.issue("alice", b"key"), authority.public_key, now=time.time() + 61)


def test_an_invite_stream_that_ends_unanswered_is_asked_again(tmp_path):
    """A real authority behind a p2p daemon that drops the first stream unanswered (as a busy peer did in CI): the
    volunteer's join asks again and gets its token; a refusal ends the join at the first answer."""
    import asyncio

    from hivemind.p2p import P2P

    from sahajbert.flags import SwarmArguments
    from sahajbert.hivemind_ext.identity import identity_key

    allowlist = tmp_path / "allow.txt"
    invite = add_invite(allowlist, "alice")
    for name in ("authority", "alice"):
        access.new_identity(str(tmp_path / f"{name}.id"))
    authority = Authority(identity_key(str(tmp_path / "authority.id")), Allowlist(allowlist), 60)
    public_key = identity_key(str(tmp_path / "alice.id")).get_public_key().to_bytes()
    streams = []

    async def drops_the_first(stream_info, reader, writer):
        streams.append(stream_info.peer_id)
        if len(streams) == 1:
            writer.close()
        else:
            await authority.serve(stream_info, reader, writer)

    async def joins():
        server = await P2P.create(identity_path=str(tmp_path / "authority.id"), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await server.add_binary_stream_handler(access.INVITE_PROTOCOL, drops_the_first)
            maddrs = [str(m) for m in await server.get_visible_maddrs()]
            alice = str(tmp_path / "alice.id")
            swarm_args = SwarmArguments(run_id="invited", initial_peers=maddrs, identity_path=alice)
            token, authority_key, peer = await access._first_token(swarm_args, invite, public_key)
            assert peer == server.peer_id and authority_key == authority.public_key and len(streams) == 2
            assert token.username == "alice" and token_valid(token, authority.public_key)

            streams.clear()
            with pytest.raises(access.Refused, match="not on the organizer's allowlist"):
                await access._first_token(swarm_args, access.Invite("alice", "guessed"), public_key)
            assert len(streams) == 2  # the dropped stream, then the refusal: not asked a third time
        finally:
            await server.shutdown()

    asyncio.run(joins())


# ---- a run ----


def trainer(tmp_path, name, initial_peers, *flags):
    return PeerProcess(
        script("run_trainer.py"),
        [*TINY_TRAINING, "--run_id", "invited", "--initial_peers", *initial_peers, "--max_steps", "1000", *flags]
        + ["--output_dir", str(tmp_path / name)],
        tmp_path / f"{name}.log",
    )


def step_with_two_peers(peer: PeerProcess) -> bool:
    return any("global step" in line and "| 2 peer(s)" in line for line in peer.output().splitlines())


def probe(*args, timeout=300) -> dict:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "access_probe.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=peer_env(),
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_invite_only_run(tmp_path, capsys):
    allowlist = tmp_path / "allow.txt"
    invites = {name: add_invite(allowlist, name) for name in ("alice", "bob", "mallory")}
    invite = {name: f"{i.name}:{i.secret}" for name, i in invites.items()}
    organizer, initial_peers = first_peer(
        tmp_path / "fp",
        "invited",
        ["--allowlist", str(allowlist), "--token_lifetime", str(LIFETIME), "--identity_path", str(tmp_path / "fp.id")],
    )
    assert "--invite NAME:SECRET" in organizer.output()
    peers = [organizer]
    try:
        alice = trainer(tmp_path, "alice", initial_peers, "--invite", invite["alice"])
        bob = trainer(tmp_path, "bob", initial_peers, "--invite", invite["bob"])
        peers += [alice, bob]

        # meanwhile, uninvited and with a wrong secret (in this process: bad input): one line each, exit code 2
        common = [*TINY_TRAINING, "--run_id", "invited", "--initial_peers", *initial_peers, "--max_steps", "1"]
        for name, extra, message in (
            ("nobody", [], "this run is invite-only: add --invite NAME:SECRET"),
            ("guesser", ["--invite", "alice:guessed"], "refused the invite 'alice'"),
        ):
            args = [*common, *extra, "--output_dir", str(tmp_path / name)]
            assert_one_error(*run_main("run_trainer.py", args, capsys), message)
        # the volunteer's checklist says what is missing, and how to fix it
        code, out, err = run_script("run_trainer.py", ["--check", *common[:-2], "--output_dir", str(tmp_path)], capsys)
        assert code == 1, out + err
        assert "[FAIL] invite: this run is invite-only" in out
        assert "pass --invite NAME:SECRET exactly as the organizer sent it" in out

        # invited trainers average with each other: steps of the swarm's batch made by two peers
        wait_for(lambda: step_with_two_peers(alice) and step_with_two_peers(bob), 240, "two invited trainers' steps")
        for peer in (alice, bob):  # each measured its link against the first peer, which serves members only
            assert "no initial peer answered the link probe" not in peer.output()

        alice_id = wait_for(
            lambda: next(
                (line.split()[-1] for line in alice.output().splitlines() if "joined the swarm" in line), None
            ),
            10,
            "alice's peer id",
        )
        identity, token_file = str(tmp_path / "mallory.id"), str(tmp_path / "mallory.token")
        probe_args = ["--run_id", "invited", "--first", *initial_peers, "--trainer", alice_id]
        probe_args += ["--invite", invite["mallory"], "--identity", identity, "--token_file", token_file]
        found = probe("member", *probe_args)

        # a member reaches everything: the DHT, the state, the averagers' matchmaking and all-reduce
        member = found["member"]
        assert member["dht_ping"] and found["member_reads_metrics"] and member["link_probe"], found
        assert member["download_state"] > 0
        assert member["join_group"] in ("NOT_LOOKING_FOR_GROUP", "BAD_SCHEMA_HASH"), member
        # a part for a group that does not exist: hivemind looks it up (at once, or after its next group forms)
        assert member["send_part"] in ("BAD_GROUP_ID", "waiting"), member
        # the same signed request sent twice: the second is refused
        assert not member["replayed_ping"]
        # a raw hivemind DHT with the run id and the first peer's address: no join, no reads, its write went nowhere
        assert found["outsider_dht"] == {"joins": False, "reads_metrics": False, "reads_members": False}
        assert not found["intruder_key_in_swarm"]
        # raw hivemind RPCs without a token: no state, no group, no all-reduce, no DHT
        outsider = found["no_token"]
        assert outsider == {
            "dht_ping": False,
            "link_probe": False,
            "download_state": 0,
            "join_group": "PROTOCOL_VIOLATION",
            "send_part": "PROTOCOL_VIOLATION",
        }
        # a token signed by another authority, and the member's own token presented by another key
        assert not found["forged_token"]["dht_ping"] and not found["stolen_token"]["dht_ping"]

        # the organizer removes bob and mallory: neither gets a new token, everyone refuses them once theirs ends
        allowlist.write_text(f"alice {invites['alice'].secret}\n")
        revoked_at = time.monotonic()
        bob_left = []  # the moment bob's process ended, taken while the probe below runs

        def watch_bob():
            bob.process.wait()
            bob_left.append(time.monotonic())

        watcher = threading.Thread(target=watch_bob, daemon=True)
        watcher.start()
        expired = probe("expired", *probe_args)
        assert expired["renewal"].startswith("refused: 'mallory' with this secret is not on"), expired
        assert expired["after_expiry"] == outsider, expired  # with the old token, mallory is an outsider
        # bob asks to renew at half his token's lifetime, is refused, and stops with a checkpoint: within the
        # lifetime and a stop's time of the revocation (without the revocation he would renew and train on)
        watcher.join(LIFETIME + 60)
        assert bob_left, "bob still trains after his invite was revoked"
        assert bob_left[0] - revoked_at <= LIFETIME + 60, bob_left[0] - revoked_at
        assert bob.wait(1) == 2
        assert "error: the organizer no longer admits 'bob'" in bob.output().strip().splitlines()[-1]
        assert list((tmp_path / "bob").glob("checkpoint-*")), "bob leaves with a checkpoint"
        # alice trains on alone
        steps = alice.output().count("global step")
        wait_for(lambda: alice.output().count("global step") > steps, 60, "alice's next step after bob left")
        assert alice.running()
        quiet(alice.output(), healthy=True)  # an invite-only run, a member revoked beside her: nothing alarming
    finally:
        for peer in reversed(peers):
            peer.stop()


def test_invites_and_identity_keys_are_readable_by_their_owner_only(tmp_path):
    from sahajbert.access import new_identity

    invites = tmp_path / "invites.txt"
    invites.write_text("")
    invites.chmod(0o644)  # made readable to others before: closed again at the next invite
    add_invite(invites, "alice")
    key = tmp_path / "peer.key"
    new_identity(str(key))
    assert [oct(path.stat().st_mode & 0o777) for path in (invites, key)] == ["0o600", "0o600"]
    fresh = tmp_path / "fresh.txt"
    add_invite(fresh, "bob")
    assert oct(fresh.stat().st_mode & 0o777) == "0o600" and "bob " in fresh.read_text()
