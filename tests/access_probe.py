"""What outsiders and members of an invite-only run can do, tried with real hivemind peers; prints one JSON object.

`python tests/access_probe.py member ...` joins as an invited peer (the project's own joining code) and, from its
libp2p identity, calls the averaging and DHT RPCs of the run's peers directly, as any member could; it then calls
the same RPCs as raw hivemind peers without a token, with a forged token and with its own token taken by another
key, and replays one of its signed requests. It saves its token for `expired`, which later calls the same RPCs
with that token once the organizer stopped renewing it. Run by tests/test_access.py.
"""

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sahajbert import access, records, swarm  # noqa: E402
from sahajbert.flags import SwarmArguments  # noqa: E402
from sahajbert.hivemind_ext.identity import identity_key  # noqa: E402
from sahajbert.link_probe import PROBE_PROTOCOL  # noqa: E402

RPC_TIMEOUT = 20.0  # seconds for one direct RPC; a refused one answers at once
PART_WAIT = 5.0  # seconds to wait for the answer to a part sent for no group


def signed(request, token: AccessToken, key: RSAPrivateKey):
    """Sign a DHT request as hivemind's TokenAuthorizerBase.sign_request does, with any token (even an expired or a
    stolen one: a misbehaving peer is not bound by our authorizer's checks)."""
    request.auth.client_access_token.CopyFrom(token)
    request.auth.time = get_dht_time()
    request.auth.nonce = secrets.token_bytes(8)
    request.auth.signature = key.sign(request.SerializeToString())
    return request


async def ping(p2p: P2P, peer: PeerID, request) -> bool:
    """Does `peer`'s DHT answer this ping? (a refused request gets no answer: the call fails)"""
    try:
        # the handler hivemind's DHTProtocol registers (ServicerBase names it "<class>.<method>")
        call = p2p.call_protobuf_handler(peer, "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse)
        answer = await asyncio.wait_for(call, RPC_TIMEOUT)
        return answer is not None and answer.ByteSize() > 0
    except Exception:
        return False


def ping_request(p2p: P2P):
    return dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=DHTID.generate().to_bytes()), validate=False)


async def download_state(p2p: P2P, peer: PeerID, run_id: str) -> int:
    """Messages of `peer`'s state that a download from it yields (0: refused)."""
    stub = TrainingStateAverager.get_stub(p2p, peer, namespace=f"{run_id}_state_averager")
    count = 0
    try:
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        async for _ in stream:
            count += 1
    except Exception:
        pass
    return count


async def join_group(p2p: P2P, peer: PeerID, run_id: str) -> str:
    """The first answer of `peer`'s gradient averager to a request to join its group, by code name."""
    stub = GradientAverager.get_stub(p2p, peer, namespace=f"{run_id}_grad_averager")
    # well formed (hivemind itself answers PROTOCOL_VIOLATION to an empty schema hash): a member hears why this
    # averager will not take it now (not looking for a group, another schema); an outsider, that it may not ask
    request = averaging_pb2.JoinRequest(schema_hash=b"probe", expiration=get_dht_time() + 5, gather=b"", group_key="")
    try:
        stream = await stub.rpc_join_group(request)
        answer = await asyncio.wait_for(anext(stream), RPC_TIMEOUT)
        return averaging_pb2.MessageCode.Name(answer.code)
    except Exception as e:
        return f"failed: {type(e).__name__}"


async def send_part(p2p: P2P, peer: PeerID, run_id: str) -> str:
    """`peer`'s answer to a part of a tensor sent for a group it never formed, by code name."""
    stub = GradientAverager.get_stub(p2p, peer, namespace=f"{run_id}_grad_averager")

    async def parts():
        yield averaging_pb2.AveragingData(group_id=b"no such group")

    try:
        stream = await stub.rpc_aggregate_part(parts())
        # hivemind answers an unknown group only after its next group registers (it may be one that is forming)
        answer = await asyncio.wait_for(anext(stream), PART_WAIT)
        return averaging_pb2.MessageCode.Name(answer.code)
    except asyncio.TimeoutError:
        return "waiting"
    except Exception as e:
        return f"failed: {type(e).__name__}"


async def link_probe(p2p: P2P, peer: PeerID) -> bool:
    """Does `peer` answer the link probe's echo (sahajbert.link_probe)?"""
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, PROBE_PROTOCOL)
        writer.write(b"P")
        await writer.drain()
        answered = await asyncio.wait_for(reader.readexactly(1), RPC_TIMEOUT) == b"P"
        writer.close()
        return answered
    except Exception:
        return False


async def answered_within(call, seconds: float) -> bool:
    """Whether a call of `call()` was answered within `seconds` (tried again each second): a member is admitted once
    its token's record has reached the peer it calls, which takes longer on a busy machine; an outsider is refused
    every time. With 0 seconds, one call."""
    deadline = time.monotonic() + seconds
    while not await call():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(1.0)
    return True


async def rpcs(p2p: P2P, first: PeerID, trainer: PeerID, run_id: str, request, wait: float = 0.0) -> dict:
    return {
        "dht_ping": await ping(p2p, first, request),
        "link_probe": await answered_within(lambda: link_probe(p2p, trainer), wait),
        "download_state": await download_state(p2p, trainer, run_id),
        "join_group": await join_group(p2p, trainer, run_id),
        "send_part": await send_part(p2p, trainer, run_id),
    }


async def as_outsiders(first_maddrs, first: PeerID, trainer: PeerID, run_id: str, token: AccessToken) -> dict:
    """Raw hivemind peers: no token, a token from an authority of its own, and the member's token under a new key."""
    found = {}
    p2p = await P2P.create(initial_peers=first_maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        found["no_token"] = await rpcs(p2p, first, trainer, run_id, ping_request(p2p))
        impostor = RSAPrivateKey()
        forger = access.Authority(impostor, allowlist=None, lifetime=600)
        forged = forger.issue("mallory", impostor.get_public_key().to_bytes())
        found["forged_token"] = {"dht_ping": await ping(p2p, first, signed(ping_request(p2p), forged, impostor))}
        found["stolen_token"] = {"dht_ping": await ping(p2p, first, signed(ping_request(p2p), token, impostor))}
    finally:
        await p2p.shutdown()
    return found


def raw_dht(first_maddrs, run_id: str) -> dict:
    """A plain hivemind.DHT that knows the run id and the first peer's address."""
    try:
        hivemind.DHT(initial_peers=first_maddrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]).shutdown()
        joined = True
    except Exception:
        joined = False
    dht = hivemind.DHT(
        initial_peers=first_maddrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], ensure_bootstrap_success=False
    )
    try:
        found = {
            "joins": joined,
            "reads_metrics": dht.get(records.metrics_key(run_id), latest=True) is not None,
            "reads_members": dht.get(access.members_key(run_id), latest=True) is not None,
        }
        dht.store(f"{run_id}_intruder", b"x", get_dht_time() + 300)  # the member checks below that it is not there
        return found
    finally:
        dht.shutdown()


def member(args) -> dict:
    swarm_args = SwarmArguments(
        run_id=args.run_id,
        initial_peers=args.first,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=args.identity,
        invite=args.invite,
    )
    validators, public_key = records.make_validators(args.run_id)
    swarm_args, membership = swarm.admission(swarm_args)
    dht = swarm.build_dht(swarm_args, validators, authorizer=membership.authorizer)
    membership.start(dht, public_key)
    first, trainer = PeerID.from_base58(args.first[0].rsplit("/p2p/", 1)[1]), PeerID.from_base58(args.trainer)
    token = membership.authorizer.token
    key = identity_key(swarm_args.identity_path)
    try:
        found = {"outsider_dht": raw_dht(args.first, args.run_id)}

        async def direct():
            p2p = await dht.replicate_p2p()

            # a signed request is answered once (a replay is refused): each try is signed anew, with the token as
            # renewed now (it lives test_access.LIFETIME seconds: the one read at the start may have expired by the
            # time the outsiders' checks above were done)
            def fresh():
                return signed(ping_request(p2p), membership.authorizer.token, key)

            admitted = await answered_within(lambda: ping(p2p, first, fresh()), 90)
            request = fresh()
            results = await rpcs(p2p, first, trainer, args.run_id, request, wait=90)
            results["admitted_within_90_s"] = admitted
            results["replayed_ping"] = await ping(p2p, first, request)  # the very same signed request again
            return results

        time.sleep(args.settle)  # the members' records reach the trainer's averagers
        found["member"] = asyncio.run(direct())
        found.update(asyncio.run(as_outsiders(args.first, first, trainer, args.run_id, token)))
        # the trainers publish metrics after each global step, and a record may lapse between them on a busy machine
        deadline = time.monotonic() + 60
        while (metrics_found := dht.get(records.metrics_key(args.run_id), latest=True)) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
        found["member_reads_metrics"] = metrics_found is not None
        found["intruder_key_in_swarm"] = dht.get(f"{args.run_id}_intruder", latest=True) is not None
        found["token_expires_in"] = access.token_expiry(token) - get_dht_time()
        found["membership_failure"] = membership.failure  # why this member lost its token, if it did
    finally:
        membership.stop()
        dht.shutdown()
    # the token the swarm knows last (it may have been renewed meanwhile): `expired` waits for its end
    Path(args.token_file).write_bytes(membership.published.SerializeToString())
    return found


def expired(args) -> dict:
    """With the saved token after it expired (the organizer removed its name): the same identity, the same RPCs."""
    token = AccessToken.FromString(Path(args.token_file).read_bytes())
    wait = access.token_expiry(token) - get_dht_time() + 1.0
    time.sleep(max(0.0, wait))
    key = identity_key(args.identity)
    first, trainer = PeerID.from_base58(args.first[0].rsplit("/p2p/", 1)[1]), PeerID.from_base58(args.trainer)

    async def direct():
        p2p = await P2P.create(
            initial_peers=args.first, identity_path=args.identity, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        try:
            return await rpcs(p2p, first, trainer, args.run_id, signed(ping_request(p2p), token, key))
        finally:
            await p2p.shutdown()

    try:
        again = SwarmArguments(initial_peers=args.first, identity_path=args.identity)
        renewal = access.request_token(again, access.parse_invite(args.invite), key.get_public_key().to_bytes())
        renewed = f"granted: {renewal[0].username}"
    except access.Refused as e:
        renewed = f"refused: {e}"
    return {"waited_for_expiry": wait, "renewal": renewed, "after_expiry": asyncio.run(direct())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("phase", choices=["member", "expired"])
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--first", nargs="+", required=True, help="the first peer's multiaddrs")
    parser.add_argument("--trainer", required=True, help="peer id of a trainer of the run")
    parser.add_argument("--invite", required=True, help="this member's NAME:SECRET")
    parser.add_argument("--identity", required=True, help="this member's identity file (created if missing)")
    parser.add_argument("--token_file", required=True)
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()
    swarm.install_hivemind_ext()  # before any DHT starts here, the raw one included: each runs with the fence's bounds
    found = member(args) if args.phase == "member" else expired(args)
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
