"""Peer identities as hivemind writes them (libp2p PrivateKey protobufs of RSA keys), and peer ids of keys."""

from hivemind.p2p import PeerID


def is_identity_file(path: str) -> bool:
    """Is `path` a peer identity as hivemind writes it (P2P.generate_identity): a libp2p PrivateKey protobuf holding an
    RSA key in DER? The p2p daemon itself only says "proto: cannot parse invalid wire-format data" of a bad one."""
    from cryptography.hazmat.primitives import serialization
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    try:
        with open(path, "rb") as f:
            key = crypto_pb2.PrivateKey.FromString(f.read())
        serialization.load_der_private_key(key.data, password=None)
    except (OSError, DecodeError, ValueError, TypeError):
        return False
    return key.key_type == crypto_pb2.KeyType.RSA


def identity_key(identity_path: str):
    """A peer identity file's RSA key as hivemind's RSAPrivateKey (built through its pickling state, the one way
    hivemind loads an existing key: `__setstate__` with the DER bytes `to_bytes` writes)."""
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    with open(identity_path, "rb") as f:
        der = crypto_pb2.PrivateKey.FromString(f.read()).data
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def peer_id_of_public_key(public_key) -> PeerID:
    """libp2p's peer id of an RSA key (hivemind.RSAPublicKey): sha2-256 multihash of its PublicKey protobuf, the
    rule hivemind's PeerID.from_identity applies to a private key."""
    import hashlib

    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2

    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))
