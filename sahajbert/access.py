"""Invite-only runs: the organizer's authority, volunteers' access tokens, and the check on every RPC.

Trust is anchored in libp2p identities, which the transport already authenticates on every connection:
- the authority's signing key IS the first peer's identity key, so a volunteer checks that the key which signed its
  token hashes to the /p2p/ id it pasted in --initial_peers;
- a token names a volunteer and carries its identity's public key; the peer it admits is that key's peer id, so a
  token copied by another peer admits nobody new (hivemind's DHT also makes each request signed by that key).
The DHT checks every request and response (hivemind's TokenAuthorizerBase, given `InviteAuthorizer`). Averaging
RPCs carry no token, so each peer publishes its token under `<run_id>_members`, and the averagers' handlers
(sahajbert.hivemind_ext.averaging.averager.GuardedAverager) admit a caller only if a valid token there names its
peer id.
A volunteer removed from the allowlist gets no new token: every peer refuses it when its token expires.
"""

import asyncio
import atexit
import base64
import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import struct
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from sahajbert.cli import UserError
from sahajbert.flags import SwarmArguments
from sahajbert.hivemind_ext import identity
from sahajbert.hivemind_ext.dht.process import dht_authorizer
from sahajbert.hivemind_ext.p2p import add_stream_handler, kept_alive, p2p_of
from sahajbert.link_probe import peer_ids

logger = logging.getLogger(__name__)

INVITE_PROTOCOL = "/sahajbert/invite/1.0.0"
NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
MAX_MESSAGE = 64 * 1024  # bytes: an invite request or answer is well under 4 KiB
ASK_TIMEOUT = 30.0  # seconds for the authority to answer one request
RETRY = 5.0  # seconds between renewal attempts while the authority does not answer
# a stream that opened and then ended unanswered (dropped between the two daemons or by a busy authority: once in the
# project's CI, a third volunteer's join) is opened again, this many times in all, 1 s then 2 s apart; a refusal, a
# peer that runs no authority and one that cannot be reached are not asked again
ASK_TRIES = 3
ANY_PORT = "/ip4/0.0.0.0/tcp/0"  # the short-lived daemons that ask for a token only dial out
# a caller the members' records do not admit makes an averager read them again, at most this often (seconds)
MEMBERS_REREAD = 1.0


class Refused(Exception):
    """The authority answered, and said no (the reason is the message)."""


class Unanswered(Exception):
    """No initial peer answered an invite, and not every one of them said it runs no authority."""


# how p2pd answers a stream to a peer without a handler for the protocol (a peer that runs no authority)
NO_HANDLER = "protocols not supported"


def members_key(run_id: str) -> str:
    return f"{run_id}_members"  # its schema is sahajbert.records.MetricSchema.members


# ---- tokens ----


def peer_id_of(public_key: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key in hivemind's encoding (RSAPublicKey.to_bytes)."""
    return identity.peer_id_of_public_key(RSAPublicKey.from_bytes(public_key))


def _signed_part(token: AccessToken) -> bytes:
    return b"\n".join([token.username.encode(), token.public_key, token.expiration_time.encode()])


def token_expiry(token: AccessToken) -> float:
    try:
        return float(token.expiration_time)
    except ValueError:
        return 0.0


def token_valid(token: AccessToken, authority_key: bytes, now: float | None = None) -> bool:
    """Signed by the authority and not yet expired (DHT time, seconds); never raises on garbage."""
    if token_expiry(token) <= (get_dht_time() if now is None else now):
        return False
    try:
        return RSAPublicKey.from_bytes(authority_key).verify(_signed_part(token), token.signature)
    except Exception:  # a malformed key or signature is as invalid as a wrong one
        return False


# ---- the organizer's side ----


@dataclass(frozen=True)
class Invite:
    name: str
    secret: str


def parse_invite(text: str) -> Invite:
    name, _, secret = text.partition(":")
    if not NAME.match(name) or not secret:
        raise UserError(f"--invite must be NAME:SECRET as the organizer sent it, got '{text}'")
    return Invite(name, secret)


def read_allowlist(path: Path) -> dict[str, str]:
    """name -> secret, from one `name secret` per line (# starts a comment); a UserError names a bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"cannot read the allowlist '{path}': {e.strerror}") from e
    invites: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2 or not NAME.match(fields[0]):
            raise UserError(
                f"{path}:{number}: expected 'NAME SECRET' (NAME of letters, digits and _.@-), got '{line}'"
            )
        if fields[0] in invites:
            raise UserError(f"{path}:{number}: '{fields[0]}' is listed twice")
        invites[fields[0]] = fields[1]
    return invites


def add_invite(path: Path, name: str) -> Invite:
    """Append a new volunteer with a random secret (the file is created if missing)."""
    if not NAME.match(name):
        raise UserError(f"an invite name is letters, digits and _.@- (at most 64), got '{name}'")
    if path.exists() and name in read_allowlist(path):
        raise UserError(f"'{name}' is already in {path}")
    invite = Invite(name, secrets.token_urlsafe(18))
    # the secrets are for their owner only: created 0600, and a file made readable to others before is closed again
    with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_MODE), "a", encoding="utf-8") as f:
        os.fchmod(f.fileno(), PRIVATE_MODE)
        f.write(f"{invite.name} {invite.secret}\n")
    return invite


PRIVATE_MODE = 0o600  # invites and identity keys: read and written by their owner only


def new_identity(path: str) -> None:
    """A new peer identity (private key) at `path`, readable by its owner only."""
    P2P.generate_identity(path)
    os.chmod(path, PRIVATE_MODE)


class Allowlist:
    """The organizer's allowlist file, read again whenever it changes; a broken edit keeps the last good list."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mtime = self.path.stat().st_mtime_ns if self.path.exists() else None
        self._invites = read_allowlist(self.path)

    def secret_of(self, name: str) -> str | None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            mtime = None
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._invites = read_allowlist(self.path) if mtime is not None else {}
                logger.info(f"allowlist re-read: {len(self._invites)} volunteers")
            except UserError as e:
                logger.warning(f"allowlist not re-read, the last good one stays: {e}")
        return self._invites.get(name)


class Authority:
    """Signs access tokens for allowlisted volunteers; runs in the first peer's DHT process."""

    def __init__(self, key: RSAPrivateKey, allowlist: Allowlist, lifetime: float):
        self.key, self.allowlist, self.lifetime = key, allowlist, lifetime
        self.public_key = key.get_public_key().to_bytes()

    def issue(self, name: str, public_key: bytes) -> AccessToken:
        token = AccessToken(username=name, public_key=public_key, expiration_time=repr(get_dht_time() + self.lifetime))
        token.signature = self.key.sign(_signed_part(token))
        return token

    def admit(self, name: str, secret: str, public_key: bytes, caller: PeerID) -> AccessToken:
        known = self.allowlist.secret_of(name)
        if known is None or not hmac.compare_digest(known.encode(), secret.encode()):
            raise Refused(f"'{name}' with this secret is not on the organizer's allowlist")
        try:
            owner = peer_id_of(public_key)
        except Exception as e:
            raise Refused("the request's public key is not an RSA key") from e
        if owner != caller:
            raise Refused("the request's key is not the identity of the peer that sent it")
        return self.issue(name, public_key)

    async def serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per stream: {name, secret, public_key} -> {token, authority_key} or {refused}."""
        try:
            request = await asyncio.wait_for(_read_message(reader), ASK_TIMEOUT)  # a silent caller holds no task
            try:
                token = self.admit(
                    str(request["name"]), str(request["secret"]), _b64(request["public_key"]), stream_info.peer_id
                )
                answer = {"token": _text(token.SerializeToString()), "authority_key": _text(self.public_key)}
                logger.info(f"access token for '{token.username}' ({stream_info.peer_id})")
            except Refused as e:
                answer = {"refused": str(e)}
                logger.info(f"refused an invite from {stream_info.peer_id}: {e}")
            except (KeyError, TypeError, ValueError):
                answer = {"refused": "malformed request"}
            await _write_message(writer, answer)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            # a caller that only checks the protocol is served (runs_authority) closes without asking
            logger.debug(f"an invite stream from {stream_info.peer_id} ended unanswered: {type(e).__name__} {e}")
        finally:
            writer.close()


def _text(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _b64(text) -> bytes:
    return base64.b64decode(str(text), validate=True)


async def _read_message(reader: asyncio.StreamReader) -> dict:
    (size,) = struct.unpack("<I", await reader.readexactly(4))
    if size > MAX_MESSAGE:
        raise ValueError("message too long")
    message = json.loads(await reader.readexactly(size))
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return message


async def _write_message(writer: asyncio.StreamWriter, message: dict) -> None:
    data = json.dumps(message).encode()
    writer.write(struct.pack("<I", len(data)) + data)
    await writer.drain()


async def ask(p2p: P2P, authority: PeerID, invite: Invite, public_key: bytes) -> tuple[AccessToken, bytes]:
    """Ask `authority` for a token: (token, the authority's key). Refused if it says no; another exception if it
    does not answer or runs no authority (an open run)."""
    _, reader, writer = await p2p.call_binary_stream_handler(authority, INVITE_PROTOCOL)
    try:
        await _write_message(writer, {"name": invite.name, "secret": invite.secret, "public_key": _text(public_key)})
        answer = await asyncio.wait_for(_read_message(reader), ASK_TIMEOUT)
    finally:
        writer.close()
    if "refused" in answer:
        raise Refused(str(answer["refused"]))
    token, authority_key = AccessToken.FromString(_b64(answer["token"])), _b64(answer["authority_key"])
    # the key that signs tokens must be the identity of the peer that answered: the /p2p/ id the volunteer pasted
    if peer_id_of(authority_key) != authority or not token_valid(token, authority_key):
        raise Refused(f"{authority} answered with a token it cannot vouch for")
    return token, authority_key


# ---- hivemind's DHT authorization ----


class InviteAuthorizer(TokenAuthorizerBase):
    """Signs this peer's DHT requests with its token and admits only requests and answers with a valid one.

    On the first peer it holds the Authority and issues its own tokens; on a volunteer, `SwarmAccess` renews the
    token in the DHT process (`set_token`) before it expires."""

    def __init__(
        self,
        local_key: RSAPrivateKey,
        authority_key: bytes,
        run_id: str,
        token: AccessToken | None = None,
        authority: Authority | None = None,
    ):
        super().__init__(local_key)
        self.authority_key, self.token, self.authority = authority_key, token, authority
        self.gate = Gate(run_id, authority_key)

    async def get_token(self) -> AccessToken:
        if self.authority is not None:
            return self.authority.issue("organizer", self.local_public_key.to_bytes())
        if self.token is None or token_expiry(self.token) <= get_dht_time():
            raise RuntimeError("this peer's access token expired: the organizer did not renew it")
        return self.token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return token_valid(access_token, self.authority_key)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        if self.authority is not None:
            return token_expiry(access_token) - get_dht_time() < self.authority.lifetime / 2
        return access_token is not self.token or token_expiry(access_token) <= get_dht_time()

    def members_only(self, node, handler):
        """A p2p stream handler of the DHT process (the link probe) that serves members only."""

        async def serve(stream_info, reader, writer) -> None:
            if await self.gate.admits(stream_info.peer_id, lambda: node.get(self.gate.key, latest=True)):
                await handler(stream_info, reader, writer)
            else:
                writer.close()

        return serve


async def _serve_invites(_dht, node) -> None:
    authorizer = dht_authorizer(node)
    await add_stream_handler(node, INVITE_PROTOCOL, authorizer.authority.serve)


async def _renew(_dht, node, authority: PeerID, invite: Invite) -> tuple[str, bytes | str]:
    """("token", the new token), ("refused", why) or ("unanswered", why): hivemind logs a coroutine's exception as an
    error with its traceback, and neither a refusal nor an organizer that does not answer (yet) is an error here."""
    return await kept_alive(_renew_now(node, authority, invite))


async def _renew_now(node, authority: PeerID, invite: Invite) -> tuple[str, bytes | str]:
    authorizer = dht_authorizer(node)
    try:
        token, _ = await ask(p2p_of(node), authority, invite, authorizer.local_public_key.to_bytes())
    except Refused as e:
        return "refused", str(e)
    except Exception as e:  # the organizer's peer unreachable or gone: the renewal loop retries until expiry
        return "unanswered", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    authorizer.token = token
    return "token", token.SerializeToString()


# ---- averaging RPCs ----


class Gate:
    """Admits the peers whose valid token is in the run's member records; read in an averager's process."""

    def __init__(self, run_id: str, authority_key: bytes):
        self.key, self.authority_key = members_key(run_id), authority_key
        self._admitted: dict[PeerID, float] = {}  # peer id -> its token's expiry (DHT time)
        self._read_at = -float("inf")
        self._lock: asyncio.Lock | None = None

    def refresh(self, records) -> None:
        """Take the members' records as `dht.get(members_key, latest=True)` returns them."""
        now = get_dht_time()
        value = getattr(records, "value", None)
        admitted = {}
        for entry in value.values() if isinstance(value, dict) else ():
            try:
                token = AccessToken.FromString(entry.value)
                if token_valid(token, self.authority_key, now):
                    admitted[peer_id_of(token.public_key)] = token_expiry(token)
            except Exception:  # a malformed record admits nobody
                continue
        self._admitted = admitted

    async def admits(self, peer: PeerID, read: Callable[[], Awaitable]) -> bool:
        """Is `peer` a member now? `read()` fetches the members' records (`dht.get(key, latest=True)` awaited).

        A caller it does not know (a newcomer whose record just went in, a member whose token it saw lapse)
        makes it read them again, at most every MEMBERS_REREAD seconds: callers wait for that read rather than
        being refused, so that newcomers are admitted within a second and outsiders cannot flood the DHT."""
        if self._admitted.get(peer, 0.0) > get_dht_time():
            return True
        if self._lock is None:
            self._lock = asyncio.Lock()  # made in the process and event loop that use it
        async with self._lock:
            if self._admitted.get(peer, 0.0) <= get_dht_time():  # not found by a read another caller waited for
                await asyncio.sleep(max(0.0, self._read_at + MEMBERS_REREAD - time.monotonic()))
                self._read_at = time.monotonic()
                self.refresh(await read())
        return self._admitted.get(peer, 0.0) > get_dht_time()


# ---- joining ----


def ensure_identity(swarm_args: SwarmArguments) -> SwarmArguments:
    """An invite-only peer signs with its libp2p identity, so it needs the key before its daemon starts: without
    --identity_path, a fresh identity in a temporary file (removed at exit)."""
    if swarm_args.identity_path is not None:
        if not os.path.exists(swarm_args.identity_path):
            new_identity(swarm_args.identity_path)
        return swarm_args
    handle, path = tempfile.mkstemp(prefix="sahajbert-identity-")
    os.close(handle)
    os.unlink(path)
    new_identity(path)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return dataclasses.replace(swarm_args, identity_path=path)


def request_token(swarm_args: SwarmArguments, invite: Invite, public_key: bytes):
    """(token, authority key, authority peer id) from the first initial peer that runs the authority, or three
    Nones if none does; Refused if it says no, Unanswered if it could not be asked. `public_key` is that of
    --identity_path's key."""
    return asyncio.run(_first_token(swarm_args, invite, public_key))


async def _each_initial_peer(initial_peers: list[str], call, identity_path: str | None, startup_timeout: float):
    """`await call(p2p, peer)` for each initial peer in turn, over a short-lived p2p daemon (with this identity, if
    given), until one returns: (its result, None), or (None, every exception raised). Refused ends the search."""
    p2p = await P2P.create(
        initial_peers=initial_peers,
        identity_path=identity_path,
        host_maddrs=[ANY_PORT],
        startup_timeout=startup_timeout,
        check_if_identity_free=False,  # the DHT's own daemon checks it next
    )
    failures = []
    try:
        for peer in dict.fromkeys(peer_ids(initial_peers)):
            for attempt in range(ASK_TRIES):
                try:
                    return await asyncio.wait_for(call(p2p, peer), ASK_TIMEOUT), None
                except Refused:
                    raise
                except (asyncio.IncompleteReadError, ConnectionError) as e:  # ended unanswered: ask again
                    if attempt == ASK_TRIES - 1:
                        failures.append(e)
                    else:
                        logger.info(f"{peer} ended the invite stream unanswered ({type(e).__name__}): asking again")
                        await asyncio.sleep(2.0**attempt)
                except Exception as e:  # not the authority (an aux peer, an open run), or gone: try the next one
                    failures.append(e)
                    break
    finally:
        await p2p.shutdown()
    return None, failures


async def _first_token(swarm_args: SwarmArguments, invite: Invite, public_key: bytes):
    """Ask the initial peers, one by one, with this peer's identity (the DHT's own daemon cannot start before it
    has a token: its first requests must be signed)."""

    async def token_from(p2p, peer):
        return (*await ask(p2p, peer, invite, public_key), peer)

    found, failures = await _each_initial_peer(
        swarm_args.initial_peers, token_from, swarm_args.identity_path, swarm_args.join_timeout
    )
    if found is not None:
        return found
    other = [e for e in failures if NO_HANDLER not in str(e)]
    if other:
        raise Unanswered(f"{type(other[0]).__name__}: {other[0]}".strip())
    return None, None, None


class SwarmAccess:
    """This peer's place in an invite-only run: its token, the DHT authorizer, and renewal in the background.

    `failure` is set (one line) once the token cannot be renewed: the organizer refused or did not answer in time;
    the peer's loop calls `check()` and leaves."""

    def __init__(self, swarm_args: SwarmArguments, authorizer: InviteAuthorizer, authority_peer: PeerID | None):
        self.run_id, self.invite = swarm_args.run_id, parse_invite(swarm_args.invite) if swarm_args.invite else None
        self.authorizer, self.authority_peer = authorizer, authority_peer
        self.failure: str | None = None
        self._stop = threading.Event()
        self._publishing = threading.Lock()
        self.published: AccessToken | None = None  # the token last put in the members' records

    # the organizer's first peer
    @classmethod
    def authority(cls, swarm_args: SwarmArguments, allowlist: str, lifetime: float) -> "SwarmAccess":
        key = identity.identity_key(swarm_args.identity_path)
        authority = Authority(key, Allowlist(allowlist), lifetime)
        authorizer = InviteAuthorizer(key, authority.public_key, swarm_args.run_id, authority=authority)
        return cls(swarm_args, authorizer, None)

    # a volunteer with --invite
    @classmethod
    def join(cls, swarm_args: SwarmArguments) -> "SwarmAccess":
        invite = parse_invite(swarm_args.invite)
        key = identity.identity_key(swarm_args.identity_path)
        public_key = key.get_public_key().to_bytes()
        try:
            token, authority_key, peer = request_token(swarm_args, invite, public_key)
        except Refused as e:
            raise UserError(f"the organizer refused the invite '{invite.name}': {e}") from e
        except Exception as e:  # Unanswered, or the p2p daemon could not reach any initial peer
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"could not present the invite to the initial peers: {message}") from e
        if token is None:
            raise UserError(
                "no initial peer runs an invite authority: this run is open (drop --invite), or the first peer's "
                "address is missing from --initial_peers"
            )
        lifetime = token_expiry(token) - get_dht_time()
        logger.info(f"invite '{invite.name}' accepted; the access token is valid for {lifetime:.0f} s")
        return cls(swarm_args, InviteAuthorizer(key, authority_key, swarm_args.run_id, token=token), peer)

    def start(self, dht: hivemind.DHT, public_key: bytes) -> None:
        """Serve invites (first peer), or publish the token and renew it (volunteer), in the background."""
        if self.authorizer.authority is not None:
            dht.run_coroutine(_serve_invites)
            return
        # members admit this peer once its record is in: before it measures its link or asks for the state
        self._publish(dht, public_key, self.authorizer.token).result(timeout=ASK_TIMEOUT)
        threading.Thread(target=self._renew_loop, args=(dht, public_key), daemon=True).start()

    def _publish(self, dht: hivemind.DHT, public_key: bytes, token: AccessToken):
        """Put the token in the members' records (a future), unless stopped: after stop(), `published` stays the
        last one."""
        with self._publishing:
            if self._stop.is_set():
                return None
            self.published = token
            return dht.store(
                members_key(self.run_id),
                subkey=public_key,
                value=token.SerializeToString(),
                expiration_time=token_expiry(token),
                return_future=True,
            )

    def _renew_loop(self, dht: hivemind.DHT, public_key: bytes) -> None:
        token = self.authorizer.token
        issued = get_dht_time()
        while not self._stop.is_set():
            expiry = token_expiry(token)
            if not self._stop.wait(max(0.0, issued + (expiry - issued) / 2 - get_dht_time())):
                try:
                    renewal = partial(_renew, authority=self.authority_peer, invite=self.invite)
                    answer, data = dht.run_coroutine(renewal, return_future=True).result(timeout=ASK_TIMEOUT + RETRY)
                except Exception as e:
                    answer, data = "unanswered", repr(e)
                if answer == "unanswered":
                    if get_dht_time() + RETRY >= expiry:
                        self.failure = f"the access token expired: the organizer's peer did not answer ({data})"
                        return
                    logger.warning(f"could not renew the access token yet (retrying): {data}")
                    self._stop.wait(RETRY)
                    continue
                if answer == "refused":
                    self.failure = f"the organizer no longer admits '{self.invite.name}': {data}"
                    return
                token, issued = AccessToken.FromString(data), get_dht_time()
                self._publish(dht, public_key, token)
                logger.debug(f"access token renewed, valid for {token_expiry(token) - issued:.0f} s")

    def check(self) -> None:
        if self.failure is not None:
            raise UserError(self.failure)

    def stop(self) -> None:
        with self._publishing:
            self._stop.set()


async def _opens_invite_stream(p2p: P2P, peer: PeerID) -> bool:
    _, _, writer = await p2p.call_binary_stream_handler(peer, INVITE_PROTOCOL)
    writer.close()
    return True


def runs_authority(initial_peers: list[str]) -> bool:
    """Does an initial peer run an invite authority? (asked when joining without --invite failed)"""
    try:
        found, _ = asyncio.run(_each_initial_peer(initial_peers, _opens_invite_stream, None, 10.0))
        return bool(found)
    except Exception:
        return False


class InviteRequired(UserError):
    """A peer without --invite tried to join an invite-only run."""

    def __init__(self):
        super().__init__(
            "this run is invite-only: add --invite NAME:SECRET as the organizer sent it (ask them for one)"
        )
