"""Robust aggregation and bounded progress claims, on tensors and records shaped like hivemind's."""

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils import ValueWithExpiration

from sahajbert.localswarm import wait_for
from sahajbert.robust import (
    PAIR_FACTOR,
    PARAMETER_PAIR_FACTOR,
    THROUGHPUT_FACTOR,
    Aggregation,
    Standing,
    aggregate,
    implausible,
    plausible_progress,
)

from .swarm_helpers import loopback_dhts, sgd_state_averager


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
    # a peer without samples (weight 0: an aux peer assisting) is not counted in, nor dropped as a bad one
    assisted = aggregate([a, b, torch.zeros_like(a)], [1.0, 3.0, 0.0], Aggregation())
    assert torch.allclose(assisted.tensor, mean) and assisted.dropped == [] and assisted.outliers == []


def test_two_honest_gradients_are_averaged_by_the_reducer_that_holds_one():
    generator = torch.Generator().manual_seed(1)
    signal = torch.randn(1000, generator=generator)
    # two batches' gradients: a shared signal and each batch's own noise, of about the signal's size
    a, b = (signal + torch.randn(1000, generator=generator) * s for s in (1.0, 1.5))
    for own in (0, 1):
        combined = aggregate([a, b], [8.0, 8.0], Aggregation(), own=own)
        assert torch.allclose(combined.tensor, (a + b) / 2) and combined.outliers == []


def whole_share(whole: torch.Tensor, part: torch.Tensor) -> float:
    """A whole contribution's norm shared out by a part's length, as a reducer passes it (`own_scale`)."""
    return float(whole.norm()) * (part.numel() / whole.numel()) ** 0.5


def test_honest_parts_near_zero_in_one_peer_are_averaged_as_they_are():
    # hivemind cuts each tensor into its own parts: honest peers' parts can be near zero in one of them. Embedding
    # rows only the other's batch touched (gradients: zero in this peer's), and a zero-initialized bias that the
    # other's last update moved (parameters: 1e-3 in this peer's, 2e-3 in the other's)
    generator = torch.Generator().manual_seed(2)
    gradient = torch.randn(20_000, generator=generator)
    mine, theirs = torch.zeros(1000), torch.randn(1000, generator=generator)
    biases = (torch.full((64,), 1e-3), torch.full((64,), 2e-3))
    parameters = 0.02 * torch.randn(100_000, generator=generator)
    for factor, (a, b), whole in (
        (PAIR_FACTOR, (mine, theirs), gradient),
        (PARAMETER_PAIR_FACTOR, biases, parameters),
    ):
        how = Aggregation(pair_factor=factor)
        combined = aggregate([a, b], [8.0, 8.0], how, own=0, own_scale=whole_share(whole, a))
        assert torch.allclose(combined.tensor, (a + b) / 2) and combined.outliers == [], factor
        # the bound of the own part's norm alone kept the own values (or moved them by a fifth of the difference)
        alone = aggregate([a, b], [8.0, 8.0], how, own=0).tensor
        assert float((alone - (a + b) / 2).norm()) > 0.25 * float((b - a).norm()), factor


@pytest.mark.parametrize("factor", [PAIR_FACTOR, PARAMETER_PAIR_FACTOR])
def test_a_hostile_peer_moves_a_part_near_zero_by_at_most_half_the_whole_contributions_share(factor):
    own, whole = torch.zeros(1000), honest(1)[0].repeat(20)
    share = whole_share(whole, own)
    for bad in (1e4 * torch.ones(1000), -1e4 * torch.ones(1000)):
        for rule in ("centered_clip", "norm_clip"):
            combined = aggregate([bad, own], [1e9, 8.0], Aggregation(rule, pair_factor=factor), own=1, own_scale=share)
            assert float(combined.tensor.norm()) <= factor / 2 * share * 1.0001 and combined.outliers == [0], rule


@pytest.mark.parametrize("attack", ["scaled", "sign_flipped", "nan"])
@pytest.mark.parametrize("factor", [PAIR_FACTOR, PARAMETER_PAIR_FACTOR])
def test_a_hostile_peer_moves_a_pair_by_at_most_half_the_bound(attack, factor):
    own = honest(1)[0]
    bad = {"scaled": 1e4 * own, "sign_flipped": -3 * own, "nan": torch.full_like(own, float("nan"))}[attack]
    how = Aggregation(pair_factor=factor)
    for rule in ("centered_clip", "norm_clip"):
        combined = aggregate([bad, own], [1e9, 8.0], Aggregation(rule, pair_factor=factor), own=1)
        moved = float((combined.tensor - own).norm())
        assert moved <= factor / 2 * float(own.norm()) * 1.0001, (rule, moved)
    combined = aggregate([bad, own], [1e9, 8.0], how, own=1)
    if attack == "nan":
        assert combined.dropped == [0]
    else:  # logged as outlying when shortened to under a tenth of its offset
        far = float((bad - own).norm()) > 10 * factor * float(own.norm())
        assert combined.outliers == ([0] if far else [])
    # without the reducer's own contribution (an aux peer reduces) the pair is averaged as before
    assert torch.allclose(aggregate([own, 2 * own], [1.0, 1.0], how).tensor, 1.5 * own)


def test_a_reducer_taking_part_with_weight_0_bounds_a_hostile_one_of_two_others_gradients_by_its_own():
    # a reducer one step behind tags along with weight 0: it combines the two others' gradients, one of them hostile,
    # and judges both by its own (their mean would take half of the x1e4 one)
    own, other = honest(2)
    for rule in ("centered_clip", "norm_clip"):
        contributions, weights = [1e4 * other, other, own], [8.0, 8.0, 0.0]
        combined = aggregate(contributions, weights, Aggregation(rule, pair_factor=PAIR_FACTOR), own=2)
        moved = float((combined.tensor - own).norm())
        assert moved <= PAIR_FACTOR * float(own.norm()) * 1.0001, (rule, moved)
        assert combined.outliers == [0] and combined.dropped == [], rule
    how = Aggregation(pair_factor=PAIR_FACTOR)
    # honest others' gradients: their mean, as before
    assert torch.allclose(aggregate([own, other, own], [8.0, 8.0, 0.0], how, own=2).tensor, (own + other) / 2)
    # a reducer that holds nothing of its own (an aux peer's zero gradients) has nothing to judge by: their mean
    zeros = torch.zeros_like(own)
    assert torch.allclose(aggregate([own, other, zeros], [8.0, 8.0, 0.0], how, own=2).tensor, (own + other) / 2)
    # parameters a step old are no reference: two honest peers' parameters a step apart from them are averaged
    stale, (a, b) = own, (own + 0.5 * (other - own), other)
    parameters = Aggregation(pair_factor=PARAMETER_PAIR_FACTOR)
    assert torch.allclose(aggregate([a, b, stale], [8.0, 8.0, 0.0], parameters, own=2).tensor, (a + b) / 2)


def test_bad_settings_are_refused():
    for bad in (dict(rule="median"), dict(tau=0.0), dict(iterations=0), dict(pair_factor=0.0)):
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
    # and so does a peer whose one other peer is ahead, once it vouches for it (it averaged with it, or took its
    # checked state): two peers cannot outvote each other
    claims = {b"a": record(b"a", 0), b"b": record(b"b", 7)}
    kept, _ = plausible_progress(
        claims, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0, standing=Standing(vouched={b"b"})
    )
    assert set(kept) == {b"a", b"b"}


def test_a_lone_claimant_moves_no_step_until_another_peer_backs_it_or_it_is_vouched_for():
    # a plain hivemind peer that trained alone before this one started: its step is not the swarm's
    claims = {b"a": record(b"a", 0), b"x": record(b"x", 7)}
    kept, notes = plausible_progress(claims, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0)
    assert set(kept) == {b"a"}
    assert notes == [
        ("ignored a claim of step 7 that no other peer backs: training on at step 0 unless its state checks out", b"x")
    ]
    # also from its first record, however far, and also beside an honest peer at this peer's step
    claims = {b"a": record(b"a", 2), b"b": record(b"b", 2), b"x": record(b"x", 1000)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=2, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b"}
    # two peers that report it corroborate a step (a newcomer follows a run of two trainers at once) ...
    claims = {b"a": record(b"a", 0), b"b": record(b"b", 7), b"c": record(b"c", 7)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b", b"c"}
    # ... up to the step both report
    claims[b"c"] = record(b"c", 20)
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b"}
    # one step more on one peer's word once this peer's own count of the step's batch backs it: the other peer may
    # have started the next step's round first
    claims = {b"a": record(b"a", 4), b"b": record(b"b", 5)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=4, target=96, step_seconds=1.0, batch_full=True)
    assert set(kept) == {b"a", b"b"}
    claims[b"b"] = record(b"b", 7)
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=4, target=96, step_seconds=1.0, batch_full=True)
    assert set(kept) == {b"a"}
    # one peer is one voice, whatever number of records it writes
    claims = {b"a": record(b"a", 0), b"x1": record(b"x", 7), b"x2": record(b"x", 7)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=0, target=96, step_seconds=1.0)
    assert set(kept) == {b"a"}
    # two claimants back each other only while this peer vouches for none of the peers that report progress: beside a
    # peer it averaged with (its swarm), two plain peers that never met its rounds move no step, however many they are
    claims = {b"a": record(b"a", 1), b"h": record(b"h", 1), b"x": record(b"x", 10), b"y": record(b"y", 1000)}
    for vouched, followed in (({b"h"}, {b"a", b"h"}), (set(), {b"a", b"h", b"x"})):
        kept, _ = plausible_progress(
            claims, own_peer=b"a", own_epoch=1, target=96, step_seconds=1.0, standing=Standing(vouched=vouched)
        )
        assert set(kept) == followed, vouched
    # and a peer it vouches for backs a step up to its own
    claims[b"h"] = record(b"h", 2)
    kept, _ = plausible_progress(
        claims, own_peer=b"a", own_epoch=1, target=96, step_seconds=1.0, standing=Standing(vouched={b"h"})
    )
    assert set(kept) == {b"a", b"h"}
    # a vouched peer's step counts alone, but still never above the others' lower median
    claims = {b"a": record(b"a", 3), b"b": record(b"b", 3), b"v": record(b"v", 9)}
    kept, _ = plausible_progress(
        claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=1.0, standing=Standing(vouched={b"v"})
    )
    assert set(kept) == {b"a", b"b"}
    kept, _ = plausible_progress(
        {b"a": record(b"a", 3), b"v": record(b"v", 9)},
        own_peer=b"a",
        own_epoch=3,
        target=96,
        step_seconds=1.0,
        standing=Standing(vouched={b"v"}),
    )
    assert set(kept) == {b"a", b"v"}


def test_a_left_out_peer_adds_nothing_to_the_swarm_progress():
    # x's samples would fill most of this peer's batch: once this peer's averagers left x out, they do not count
    claims = {b"a": record(b"a", 3, samples=10), b"b": record(b"b", 3, samples=10), b"x": record(b"x", 3, samples=60)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=10.0)
    assert set(kept) == {b"a", b"b", b"x"} and kept[b"x"].value["samples_accumulated"] == 60
    kept, notes = plausible_progress(
        claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=10.0, standing=Standing(left_out={b"x"})
    )
    assert set(kept) == {b"a", b"b"}
    assert notes == [("did not count the progress of a peer left out of this peer's averaging", b"x")]
    # nor does its step: with b, it would make a majority of the others (b, c, x) at step 9
    claims = {b"a": record(b"a", 3), b"b": record(b"b", 9), b"c": record(b"c", 3), b"x": record(b"x", 9)}
    kept, _ = plausible_progress(claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=1.0)
    assert set(kept) == {b"a", b"b", b"c", b"x"}
    kept, notes = plausible_progress(
        claims, own_peer=b"a", own_epoch=3, target=96, step_seconds=1.0, standing=Standing(left_out=[b"x"])
    )
    assert set(kept) == {b"a", b"c"} and ("ignored a claim of step 9 (most peers are at 3 or below)", b"b") in notes


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


def test_peers_that_sit_out_do_not_cap_the_one_that_makes_samples():
    # two of three trainers save a checkpoint (their records say 0 samples/s): the throughput cap is the median of the
    # peers that make samples, not 0, so the third's samples toward the step all count, and nothing is said of it
    claims = {
        b"a": record(b"a", 1, samples=0, rate=0.0),
        b"b": record(b"b", 1, samples=0, rate=0.0),
        b"c": record(b"c", 1, samples=60, rate=30.0),
    }
    kept, notes = plausible_progress(claims, own_peer=b"a", own_epoch=1, target=96, step_seconds=2.0)
    assert kept[b"c"].value["samples_accumulated"] == 60 and kept[b"c"].value["samples_per_second"] == 30.0
    assert notes == []


def bare_optimizer(averager):
    """What the parameter-round accessors read of a hivemind.Optimizer, around a real state averager: no step, no
    round in flight."""
    optimizer = SimpleNamespace(local_epoch=0, scheduled_state=None, scheduled_grads=None, state_averager=averager)
    optimizer.round_in_flight, optimizer.finish_round_in_flight = False, lambda timeout: None
    return optimizer


def test_a_hostile_peer_in_a_pair_cannot_take_over_the_parameters():
    # two real state averagers on loopback, one holding x1e4 parameters: the honest peer's reducer bounds that
    # contribution to its own part, and the x1e4 average the other reducer returns is refused by the honest receiver
    from sahajbert import hivemind_ext as compat
    from sahajbert.stopping import FINAL_GROUP_BITS

    start = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    peers = []
    with loopback_dhts(2) as dhts:
        try:
            for scale, dht in zip((1.0, 1e4), dhts):
                parameters = [torch.nn.Parameter(scale * start.clone())]
                averager = sgd_state_averager(dht, parameters, "pair")
                optimizer = bare_optimizer(averager)
                peers.append((parameters, optimizer))
            rounds = [compat.start_parameter_round(opt, FINAL_GROUP_BITS, 60, 120, group_size=2) for _, opt in peers]
            for control in rounds:  # the round ran, with both peers
                assert len(control.result(timeout=60)) == 2
            (parameters, optimizer), _ = peers
            assert compat.apply_pending_updates(optimizer, timeout=30)
            moved = float((parameters[0].detach() - start).norm())
            # (0 when the x1e4 peer reduced every part: its averages were all refused)
            assert moved <= PARAMETER_PAIR_FACTOR / 2 * float(start.norm()), moved
            # hivemind gives a vector this small to one reducer: the x1e4 peer's refused averages did not come back
            assert compat.partial_rounds(optimizer) == (1 if moved == 0 else 0), moved
        finally:
            for _, optimizer in peers:
                optimizer.state_averager.shutdown()


def test_a_reducer_whose_averages_do_not_come_back_is_named_with_the_reason(tmp_path):
    # two real state averagers on loopback: A reduces every part (B is a client), and B waits 1 us for A's averages
    # (no reply crosses two p2p daemons that fast): B keeps its own values, and its log names A and the timeout
    import logging

    from sahajbert import hivemind_ext as compat
    from sahajbert.stopping import FINAL_GROUP_BITS

    log = logging.getLogger("sahajbert.hivemind_ext.averaging.allreduce")
    handler, level = logging.FileHandler(tmp_path / "averagers.log"), log.level
    log.addHandler(handler)  # the averagers' processes, forked below, write their lines here
    log.setLevel(logging.INFO)
    start = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    peers = []
    try:
        with loopback_dhts(2) as dhts:
            try:
                b_options = {"client_mode": True, "sender_timeout": 1e-7, "reducer_timeout": 1e-6}
                for dht, options in zip(dhts, ({}, b_options)):
                    parameters = [torch.nn.Parameter(start.clone())]
                    averager = sgd_state_averager(dht, parameters, "slow_reply", **options)
                    optimizer = bare_optimizer(averager)
                    peers.append(optimizer)
                rounds = [compat.start_parameter_round(opt, FINAL_GROUP_BITS, 60, 120, group_size=2) for opt in peers]
                # B's round (A's waits for the parts B stopped sending, up to its timeout: not this test's concern)
                assert len(rounds[1].result(timeout=60)) == 2
                a, b = peers
                assert compat.apply_pending_updates(b, timeout=30)
                lines = (tmp_path / "averagers.log").read_text()
                assert compat.partial_rounds(b) == 1, lines
                assert f"no average came back from {a.state_averager.peer_id}" in lines, lines
                assert "TimeoutError" in lines and "this peer kept its own values there" in lines, lines
            finally:
                for optimizer in peers:
                    optimizer.state_averager.shutdown()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()


def test_a_peer_left_out_leads_no_group_of_this_peer():
    # two real state averagers on loopback; A leaves B out from the start. B's wait ends first, which makes it the
    # leader hivemind's matchmaking would have A follow: A does not ask it, and B cannot join A (A refuses it as its
    # leader), so no round forms and A keeps its parameters
    from sahajbert import hivemind_ext as compat
    from sahajbert.stopping import FINAL_GROUP_BITS

    peers = []
    with loopback_dhts(2) as dhts:
        try:
            for value, dht, distrusted in ((0.0, dhts[0], [dhts[1].peer_id]), (1.0, dhts[1], [])):
                parameters = [torch.nn.Parameter(torch.full((1000,), value))]
                averager = sgd_state_averager(dht, parameters, "leftout", distrusted=distrusted)
                optimizer = bare_optimizer(averager)
                peers.append((parameters, optimizer))
            (a_parameters, a), (_, b) = peers
            rounds = [
                compat.start_parameter_round(opt, FINAL_GROUP_BITS, wait, 10, 2) for opt, wait in ((a, 4), (b, 1))
            ]
            wait_for(lambda: all(control.done() for control in rounds), 60, "both rounds to end")
            assert [compat.round_steps(control) for control in rounds] == [None, None]
            compat.apply_pending_updates(a, timeout=10)
            assert float(a_parameters[0].detach().abs().max()) == 0.0
        finally:
            for _, optimizer in peers:
                optimizer.state_averager.shutdown()


def test_a_peer_left_out_by_one_averager_is_left_out_by_the_other():
    # peer A's two averagers (as its optimizer's gradient and state averagers), the second serving its state; B
    # downloads that state. Once A's first averager has left B out (here: from the start), and A's optimizer has told
    # the second (as GuardedOptimizer does whenever its tracker reads progress), the second serves B nothing
    averagers = []
    with loopback_dhts(2) as dhts:
        a, b = dhts
        try:
            served = torch.nn.Parameter(torch.ones(100))
            first = sgd_state_averager(a, [torch.nn.Parameter(torch.ones(100))], "first", distrusted=[b.peer_id])
            second = sgd_state_averager(a, [served], "second")
            downloaded = torch.nn.Parameter(torch.zeros(100))
            downloader = sgd_state_averager(b, [downloaded], "second")
            averagers += [first, second, downloader]

            def declared():
                found = b.get("second.all_averagers", latest=True)
                return found is not None and a.peer_id.to_bytes() in found.value

            wait_for(declared, 60, "A's state declared in the DHT", interval=0.2)
            downloader.load_state_from_peers(timeout=30)  # hivemind's state averager loads it in place
            assert torch.equal(downloaded.detach(), served.detach())  # served, as to any peer
            assert first.left_out_peers() == {b.peer_id.to_bytes()} and not second.left_out_peers()
            second.leave_out(first.left_out_peers())
            with torch.no_grad():
                served.fill_(2.0)
            downloader.load_state_from_peers(timeout=30)
            assert float(downloaded.detach().max()) == 1.0  # not served: B keeps what it had
        finally:
            for averager in averagers:
                averager.shutdown()


# ---- a downloaded training state ----


def lamb_peer(steps: int, seed: int = 0):
    """A small model under LAMB on sahajBERT's warmup schedule after `steps` optimizer steps, its statistics
    initialized as hivemind's state averager does; with its state as a peer serves it (metadata, tensors)."""
    from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_

    from sahajbert.optim import Lamb, lr_at_step

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = Lamb(model.parameters(), lr=0.01, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at_step(step, 1.0, 4, 100))
    initialize_optimizer_state_(optimizer)
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    opt_metadata, opt_tensors = dump_optimizer_state(optimizer)
    tensors = [p.detach().clone() for p in model.parameters()] + opt_tensors
    return optimizer, dict(epoch=steps, group_bits="", optimizer_metadata=opt_metadata), tensors


def template_of(optimizer, metadata, tensors, max_step):
    from sahajbert.robust import StateTemplate, flat_keys

    return StateTemplate(
        shapes=[tuple(t.shape) for t in tensors],
        optimizer_metadata=metadata["optimizer_metadata"],
        keys=list(flat_keys(optimizer.state_dict())),
        max_lr=max(g.get("initial_lr", g["lr"]) for g in optimizer.param_groups),
        min_step=metadata["epoch"],
        max_step=max_step,
    )


def corrupt(metadata, tensors, keys, how):
    import copy

    metadata, tensors = copy.deepcopy(metadata), [t.clone() for t in tensors]
    settings = {"a huge learning rate": ("lr", 1e3), "another weight decay": ("weight_decay", 10.0)}
    if how == "nan parameters":
        tensors[0].fill_(float("nan"))
    elif how == "inf statistics":
        tensors[-1].fill_(float("inf"))
    elif how == "a tensor missing":
        tensors.pop()
    elif how == "another shape":
        tensors[0] = torch.zeros(9, 8)
    elif how == "a step far ahead":
        metadata["epoch"] = 10**6
    else:
        name, value = settings[how]
        for entry, key in zip(metadata["optimizer_metadata"], keys):
            if key == name:
                entry["value"] = value
    return metadata, tensors


def test_an_honest_state_from_a_peer_further_on_is_accepted():
    from sahajbert.robust import state_problem, step_out_of_range

    newcomer, own_metadata, own_tensors = lamb_peer(0, seed=1)  # a newcomer: its statistics are zeros
    _, metadata, tensors = lamb_peer(6)  # a peer 6 steps on, past warmup: another learning rate, grown statistics
    template = template_of(newcomer, own_metadata, own_tensors, max_step=7)
    assert state_problem(metadata, tensors, template) is None and step_out_of_range(metadata, template) is None


@pytest.mark.parametrize(
    "how, reason",
    [
        ("nan parameters", "tensor 0 has non-finite values"),
        ("inf statistics", "non-finite values"),
        ("a tensor missing", "tensors where this peer's state has"),
        ("another shape", "tensor 0 has shape (9, 8)"),
        ("a step far ahead", "its step 1000000 is outside 0..7"),
        ("a huge learning rate", "learning rate 1000.0 outside 0..0.01"),
        ("another weight decay", "optimizer setting 'weight_decay' is 10.0, not 0.01"),
    ],
)
def test_a_corrupted_state_is_refused_with_its_reason(how, reason):
    from sahajbert.robust import flat_keys, state_problem, step_out_of_range

    newcomer, own_metadata, own_tensors = lamb_peer(0, seed=1)
    peer, metadata, tensors = lamb_peer(6)
    template = template_of(newcomer, own_metadata, own_tensors, max_step=7)
    state = corrupt(metadata, tensors, list(flat_keys(peer.state_dict())), how)
    problem = state_problem(*state, template) or step_out_of_range(state[0], template)
    assert problem is not None and reason in problem, (how, problem)
    # only a step out of range can be a stale view of the swarm: the peer is skipped, not left out
    assert (state_problem(*state, template) is None) == (how == "a step far ahead")


def test_a_state_cut_short_in_transit_is_skipped_not_refused_as_corrupted():
    # an honest peer's stream can end early (a newcomer in a CI run got 35 of 160 tensors): its first tensors, each of
    # the right shape, then nothing. That peer is skipped for this download, not left out; a tensor missing from the
    # middle (the rest shifted onto other shapes) is still a corrupted state
    from sahajbert.robust import state_cut_short, state_problem

    newcomer, own_metadata, own_tensors = lamb_peer(0, seed=1)
    _, metadata, tensors = lamb_peer(6)
    template = template_of(newcomer, own_metadata, own_tensors, max_step=7)
    assert state_cut_short(tensors, template) is None
    cut = tensors[: len(tensors) // 2]
    assert state_cut_short(cut, template) == f"it ended after {len(cut)} of this peer's {len(tensors)} tensors"
    shifted = tensors[1:]
    assert state_cut_short(shifted, template) is None and state_problem(metadata, shifted, template) is not None


def test_a_newcomer_refuses_a_corrupted_state_and_downloads_the_next_peers():
    # real state averagers on loopback: an honest peer and, first in line (a higher priority), one serving NaN
    # parameters; the newcomer takes the honest state, while hivemind's plain averager (the control) takes the NaN one

    from hivemind.optim.state_averager import TrainingStateAverager

    from sahajbert import hivemind_ext as compat

    honest_values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    averagers = []
    with loopback_dhts(4) as dhts:

        def peer(kind, dht, values, epoch, priority=None):
            parameters = [torch.nn.Parameter(values.clone())]
            averager = sgd_state_averager(
                dht, parameters, "state", kind=kind, momentum=0.9, allow_state_sharing=priority is not None
            )
            averager.local_epoch = epoch
            if priority is not None:
                averager.state_sharing_priority = priority
            averagers.append(averager)
            return averager

        try:
            peer(compat.GuardedStateAverager, dhts[0], honest_values, epoch=3, priority=1.0)
            peer(compat.GuardedStateAverager, dhts[1], torch.full((1000,), float("nan")), epoch=3, priority=10.0)
            newcomer = peer(compat.GuardedStateAverager, dhts[2], torch.zeros(1000), epoch=0)
            newcomer.state_step_ceiling = 4  # as GuardedOptimizer sets it from the swarm's step
            control = peer(TrainingStateAverager, dhts[3], torch.zeros(1000), epoch=0)

            def both_declared() -> bool:
                found = dhts[0].get("state.all_averagers", latest=True)
                return found is not None and len(found.value) == 2

            wait_for(both_declared, 120, "both sharing peers' declarations in the DHT", interval=0.2)
            control.load_state_from_peers(timeout=30)
            assert torch.isnan(control.main_parameters[0]).all(), "hivemind alone loads the first peer's NaN state"
            newcomer.load_state_from_peers(timeout=30)
            assert torch.equal(newcomer.main_parameters[0].detach(), honest_values)
            assert newcomer.local_epoch == 3
        finally:
            for averager in averagers:
                averager.shutdown()


def test_a_peer_takes_the_state_of_the_one_peer_it_names():
    # how a final round that came back partial settles on one model: real state averagers on loopback, two serving
    # their states; the one named is taken although the other declares the higher priority (a plain download takes
    # that one first), and a peer that serves no state gives none
    from sahajbert import hivemind_ext as compat

    averagers = []
    with loopback_dhts(3) as dhts:
        try:
            for dht, value, priority in ((dhts[0], 1.0, 10.0), (dhts[1], 2.0, 1.0), (dhts[2], 0.0, None)):
                parameters = [torch.nn.Parameter(torch.full((1000,), value))]
                averager = sgd_state_averager(dht, parameters, "named", allow_state_sharing=priority is not None)
                averager.local_epoch = 8  # all at the final round's step
                if priority is not None:
                    averager.state_sharing_priority = priority
                averagers.append(averager)

            def both_declared() -> bool:
                found = dhts[0].get("named.all_averagers", latest=True)
                return found is not None and len(found.value) == 2

            wait_for(both_declared, 120, "both sharing peers' declarations in the DHT", interval=0.2)
            taker = SimpleNamespace(state_averager=averagers[2])
            averagers[2].state_step_ceiling = 3  # as a download at step 2 left it: no bound on the final state
            assert compat.take_state_of(taker, dhts[1].peer_id.to_base58(), 8, timeout=30)
            assert torch.equal(averagers[2].main_parameters[0].detach(), torch.full((1000,), 2.0))
            server = SimpleNamespace(state_averager=averagers[0])
            assert not compat.take_state_of(server, dhts[2].peer_id.to_base58(), 8, timeout=30), "it serves none"
            assert torch.equal(averagers[0].main_parameters[0].detach(), torch.full((1000,), 1.0))
        finally:
            for averager in averagers:
                averager.shutdown()


def test_gradient_averagers_serve_no_state():
    # hivemind's Optimizer, after downloading the training state, downloads the gradient averager's too (its gradient
    # buffers, as large as the model) and discards it: ours do not serve one, so a state download is one model's size.
    # hivemind's plain GradientAverager (the control) serves its buffers
    from hivemind.optim.grad_averager import GradientAverager

    from sahajbert import hivemind_ext as compat

    averagers = []
    with loopback_dhts(3) as dhts:

        def averager(factory, dht, prefix, **kwargs):
            parameters = [torch.nn.Parameter(torch.ones(1000))]
            made = factory(parameters, dht=dht, prefix=prefix, min_matchmaking_time=1.0, start=True, **kwargs)
            averagers.append(made)
            return made

        try:
            averager(GradientAverager, dhts[0], "plain")
            averager(compat.gradient_averager_factory(), dhts[1], "ours")
            downloader = {
                prefix: averager(GradientAverager, dhts[2], prefix, allow_state_sharing=False)
                for prefix in ("plain", "ours")
            }
            plain_declared = partial(dhts[2].get, "plain.all_averagers", latest=True)
            wait_for(plain_declared, 120, "the plain averager's declaration in the DHT", interval=0.2)
            served = downloader["plain"].load_state_from_peers(timeout=30)
            assert served is not None and len(served[1]) == 1, "the control serves its gradient buffers"
            assert not averagers[1].allow_state_sharing
            assert dhts[2].get("ours.all_averagers", latest=True) is None, "ours declares nothing to download"
            assert downloader["ours"].load_state_from_peers(timeout=30) is None
        finally:
            for made in averagers:
                made.shutdown()


def test_a_client_mode_peer_joins_a_leader_whose_round_is_scheduled_after_its_own():
    # two real gradient averagers (ours) on loopback, the second in client mode (it cannot lead). The leader's round
    # begins at +60 s or once its group holds both; the client's is scheduled for +1 s and may wait 90 s. hivemind's
    # leader refuses a follower whose scheduled time is before its own and is not asked again until it declares a
    # new time (at +60 s); a client-mode peer offers its deadline instead, so the group forms at once
    from hivemind.utils import get_dht_time

    from sahajbert import hivemind_ext as compat

    averagers = []
    with loopback_dhts(2) as dhts:
        try:
            for dht, client_mode in zip(dhts, (False, True)):
                parameters = [torch.nn.Parameter(torch.zeros(1000))]
                parameters[0].grad = torch.ones(1000)
                averager = compat.gradient_averager_factory(target_group_size=2)(
                    parameters, dht=dht, prefix="client", min_matchmaking_time=1.0, client_mode=client_mode, start=True
                )
                averager.accumulate_grads_(batch_size=1)
                averagers.append(averager)
            leader, client = averagers
            rounds = [
                averager.schedule_step(scheduled_time=get_dht_time() + delay, timeout=90.0)
                for averager, delay in ((leader, 60.0), (client, 1.0))
            ]
            for averager, control in zip(averagers, rounds):
                averager.step(control=control, wait=False)
            # well before the leader's own time: the group formed when the client joined
            for control in rounds:
                assert len(control.result(timeout=30)) == 2
        finally:
            for averager in averagers:
                averager.shutdown()


@pytest.mark.parametrize("misshapen", [torch.tensor([1e30]), torch.ones(8)], ids=["one-value", "too-long"])
def test_a_part_of_another_shape_is_dropped(misshapen):
    # hivemind's reducer (the control) broadcasts a one-value part over the whole part, and given a longer one it
    # leaves every sender of that part waiting (in a round: until its timeout); ours drops it as a non-finite
    # contribution and averages the others
    import asyncio

    from hivemind.averaging.partition import TensorPartReducer

    from sahajbert.hivemind_ext.averaging.allreduce import RobustTensorPartReducer

    good = honest(2, size=4)

    async def reduce(make):  # a reducer's futures belong to the loop it is made in
        reducer = make()
        parts = [*good, misshapen]
        gathered = asyncio.gather(
            *(reducer.accumulate_part(i, 0, part.clone()) for i, part in enumerate(parts)), return_exceptions=True
        )
        try:  # hivemind's reducer, given a longer part, fails in the middle of it and leaves the others waiting
            return reducer, (await asyncio.wait_for(gathered, 3.0))[0]
        except TimeoutError as e:
            return reducer, e

    ours, result = asyncio.run(
        reduce(lambda: RobustTensorPartReducer([torch.Size([4])], 3, Aggregation("norm_clip"), own_sender=0))
    )
    assert torch.allclose(result, torch.stack(good).mean(0), atol=1e-6) and ours.dropped == {2}
    _, control = asyncio.run(reduce(lambda: TensorPartReducer([torch.Size([4])], 3)))
    assert isinstance(control, BaseException) or not torch.allclose(control, torch.stack(good).mean(0))


def test_state_downloads_back_off_after_failures_and_never_loop():
    from sahajbert.hivemind_ext.optim.optimizer import DOWNLOAD_BACKOFF_MAX, DownloadBackoff

    now = [0.0]
    downloads = DownloadBackoff(clock=lambda: now[0])
    assert downloads.due()
    waits = [downloads.done(False, period=2.0) for _ in range(6)]
    assert waits == [4.0, 8.0, 16.0, 2.0 * DOWNLOAD_BACKOFF_MAX, 2.0 * DOWNLOAD_BACKOFF_MAX, 16.0]
    assert not downloads.due()
    now[0] += 15.9
    assert not downloads.due()
    now[0] += 0.1
    assert downloads.due()
    # a download that brought a state: the next one may come after one refresh period
    assert downloads.done(True, period=2.0) == 2.0 and downloads.failures == 0
