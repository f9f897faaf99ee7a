"""Robust aggregation and bounded progress claims, on tensors and records shaped like hivemind's."""

import math

import pytest
import torch
from hivemind.utils import ValueWithExpiration

from sahajbert.robust import THROUGHPUT_FACTOR, Aggregation, aggregate, implausible, plausible_progress


def honest(count: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=generator)
    return [signal + 0.3 * torch.randn(size, generator=generator) for _ in range(count)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("rule", ["centered_clip", "norm_clip"])
@pytest.mark.parametrize("attack", ["nan", "inf", "scaled", "sign_flipped"])
def test_one_bad_contribution_of_four_barely_moves_the_average(rule, attack):
    good = honest(3)
    clean = torch.stack(good).mean(0)
    bad = {
        "nan": torch.full_like(clean, float("nan")),
        "inf": torch.full_like(clean, float("inf")),
        "scaled": 1e4 * good[0],
        "sign_flipped": -good[0],
    }[attack]
    combined = aggregate([*good, bad], [1.0] * 4, Aggregation(rule))
    robust_mean, plain_mean = combined.tensor, aggregate([*good, bad], [1.0] * 4, Aggregation("plain")).tensor
    assert torch.isfinite(robust_mean).all()
    assert combined.dropped == ([3] if attack in ("nan", "inf") else [])
    assert combined.outliers == ([3] if attack == "scaled" else [])
    if attack != "sign_flipped" or rule == "centered_clip":
        # the control: hivemind's mean is non-finite or far off; the robust one stays near the honest mean
        assert not torch.isfinite(plain_mean).all() or (plain_mean - clean).norm() > 0.4 * clean.norm()
        assert (robust_mean - clean).norm() < 0.3 * clean.norm(), (robust_mean - clean).norm() / clean.norm()
    else:  # a norm clip keeps a sign-flipped contribution's weight: the direction survives, the length shrinks
        assert cosine(robust_mean, clean) > 0.9


def test_claimed_weight_is_capped_at_the_median():
    good = honest(3)
    clean = torch.stack(good).mean(0)
    robust_mean = aggregate([*good, 1e3 * torch.ones_like(clean)], [8.0, 8.0, 8.0, 1e9], Aggregation()).tensor
    assert (robust_mean - clean).norm() < 0.3 * clean.norm()


def test_clean_contributions_average_close_to_the_mean():
    good = honest(5)
    clean = torch.stack(good).mean(0)
    for rule in ("centered_clip", "norm_clip"):
        combined = aggregate(good, [1.0] * 5, Aggregation(rule))
        assert combined.dropped == combined.outliers == []
        robust_mean = combined.tensor
        assert (robust_mean - clean).norm() < 0.1 * clean.norm(), rule


def test_two_contributions_are_averaged_and_none_finite_gives_nan():
    a, b = honest(2)
    mean = aggregate([a, b], [1.0, 3.0], Aggregation()).tensor
    assert torch.allclose(mean, (a + b) / 2)  # weights capped at the lower median (1.0): equal
    nothing = aggregate([torch.full((4,), float("nan"))] * 2, [1.0, 1.0], Aggregation())
    assert nothing.dropped == [0, 1] and torch.isnan(nothing.tensor).all()


def test_bad_settings_are_refused():
    for bad in (dict(rule="median"), dict(tau=0.0), dict(iterations=0)):
        with pytest.raises(ValueError):
            Aggregation(**bad)


def test_implausible_averages():
    own = torch.randn(100)
    scale = float(own.norm())
    assert implausible(torch.randn(100), scale) is None
    assert "non-finite" in implausible(torch.full((100,), float("nan")), scale)
    assert "over 100x" in implausible(1e4 * own, scale)
    assert implausible(1e4 * own, 0.0) is None  # this peer contributed nothing: only finiteness is checked


def record(peer: bytes, epoch: int, samples: int = 0, rate: float = 10.0, client: bool = False):
    value = dict(
        peer_id=peer, epoch=epoch, samples_accumulated=samples, samples_per_second=rate, time=0.0, client_mode=client
    )
    return ValueWithExpiration(value, math.inf)


def test_one_peer_cannot_move_the_swarm_step():
    claims = {b"a": record(b"a", 3), b"b": record(b"b", 3), b"x": record(b"x", 32)}
    kept, notes = plausible_progress(claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b"} and "step 32" in notes[0][0] and notes[0][1] == b"x"
    # one step ahead: some peers finished a round and others not yet, left out without a note
    claims[b"x"] = record(b"x", 4)
    kept, notes = plausible_progress(claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b"} and notes == []
    # a newcomer at step 0 follows a swarm whose serving peers are ahead
    claims = {b"new": record(b"new", 0), b"b": record(b"b", 50), b"c": record(b"c", 50)}
    kept, _ = plausible_progress(claims, own_peer=b"new", own_epoch=0, target=96, step_seconds=1.0)
    assert set(kept) == {b"new", b"b", b"c"}
    # and so does a peer whose one other peer is ahead (two peers cannot outvote each other)
    kept, _ = plausible_progress(
        {b"a": record(b"a", 0), b"b": record(b"b", 7)}, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0
    )
    assert set(kept) == {b"a", b"b"}


def test_inflated_samples_and_throughput_are_capped():
    claims = {
        b"a": record(b"a", 1, samples=20, rate=10.0),
        b"b": record(b"b", 1, samples=20, rate=12.0),
        b"x": record(b"x", 1, samples=10**6, rate=1e6),
        b"bad": record(b"bad", 1, samples=-5),
    }
    kept, notes = plausible_progress(claims, own_peer=b"a", own_epoch=1, target=96, step_seconds=2.0)
    assert b"bad" not in kept
    x = kept[b"x"].value
    assert x["samples_per_second"] == pytest.approx(THROUGHPUT_FACTOR * 12.0)  # the median of 10, 12, 1e6 is 12
    assert x["samples_accumulated"] <= 96
    assert kept[b"a"].value["samples_accumulated"] == 20  # honest claims are untouched
    assert ("capped", b"x") in [(note.split()[0], peer) for note, peer in notes]
    assert any("invalid" in note for note, _ in notes)
