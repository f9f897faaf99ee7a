"""SparseLoCo's pseudo-gradients (--pseudo_gradient_compression sparse): the error feedback, the wire codec of sparse
parts, and a round of real averagers exchanging them."""

import numpy as np
import pytest
import torch

from sahajbert.flags import CollaborativeOptimizerArguments, PeerArguments, SparseDiLoCoArguments
from sahajbert.hivemind_ext.compression import (
    SPARSE_WIRE_TYPE,
    SparseParts,
    deserialize_tensor_part,
    serialize_tensor_part,
)
from sahajbert.hivemind_ext.optim.diloco import split_into_fragments
from sahajbert.sparse import SparseRounds

from .swarm_helpers import loopback_dhts


def pseudo_gradient(seed: int, shape=(300, 100)) -> torch.Tensor:
    return 0.01 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_error_feedback_sends_each_chunks_top_share_in_two_magnitudes_and_keeps_the_rest_in_the_model():
    feedback = SparseRounds(density=1 / 64, chunk_size=4096, decay=0.9)
    first, second = pseudo_gradient(0), pseudo_gradient(1)
    sent = [first.clone()]
    feedback.compress_(sent)
    (buffer,) = feedback.buffers
    # nothing is lost but the decay: what was sent and what is kept make up the pseudo-gradient
    assert torch.allclose(sent[0] + buffer / 0.9, first, atol=1e-7)
    flat = sent[0].reshape(-1)
    # 30,000 values: 7 whole chunks of 4,096 (64 sent from each) and a last one of 1,328 (21 sent)
    for start, kept in [(i * 4096, 64) for i in range(7)] + [(7 * 4096, 21)]:
        chunk = flat[start : start + 4096]
        assert int((chunk != 0).sum()) == kept
        # the largest magnitudes of the chunk are the ones sent, each as one of two magnitudes (2 bits with the sign)
        original = first.reshape(-1)[start : start + 4096]
        assert set(chunk.nonzero().flatten().tolist()) == set(original.abs().topk(kept).indices.tolist())
        assert chunk[chunk != 0].abs().unique().numel() == 2
        assert torch.equal(torch.sign(chunk[chunk != 0]), torch.sign(original[chunk != 0]))
    # after the outer step the model (at the swarm's parameters) moves back by what was not sent: the next
    # pseudo-gradient (outer parameters minus model) holds it again
    outer = torch.randn(300, 100)
    model = [outer.clone()]
    feedback.keep_in_(model)
    assert torch.allclose(outer - model[0], buffer, atol=1e-6)
    # a round sends from its own pseudo-gradient alone (the rest of earlier rounds is in it already)
    again = [second.clone()]
    feedback.compress_(again)
    assert torch.allclose(again[0] + feedback.buffers[0] / 0.9, second, atol=1e-7)
    # a non-finite pseudo-gradient goes out as it is (the reducers drop it) and nothing of it stays in the model
    broken = pseudo_gradient(2)
    broken[0, 0] = float("nan")
    out = [broken.clone()]
    feedback.compress_(out)
    assert torch.isnan(out[0][0, 0]) and not feedback.buffers[0].any()
    # a checkpoint keeps the buffer
    feedback.compress_([second.clone()])
    restored = SparseRounds(density=1 / 64)
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.buffers[0], feedback.buffers[0]) and feedback.buffers[0].any()


def test_sparse_parts_travel_exactly_and_small():
    feedback = SparseRounds(density=1 / 64)
    one, other = [pseudo_gradient(3, (200_000,))], [pseudo_gradient(4, (200_000,))]
    feedback.compress_(one)
    SparseRounds(density=1 / 64).compress_(other)
    codec = SparseParts(1 / 64)
    wire = codec.compress(one[0])
    assert wire.compression == SPARSE_WIRE_TYPE
    assert torch.equal(deserialize_tensor_part(wire), one[0])  # its values were rounded to fp16 before sending
    nonzeros = int((one[0] != 0).sum())
    # a byte per position, 2 bits per value, a 2-value codebook per chunk: 1.5 bytes per value sent, not 4 (fp32)
    # or 64 x 1 (int8 of the dense part)
    assert len(wire.buffer) < 1.5 * nonzeros, len(wire.buffer) / nonzeros
    # the average a reducer sends back (in the sender's wire type): up to both parts' non-zeros, near-exact
    delta = (3 * one[0] + 5 * other[0]) / 8 - one[0]
    back = serialize_tensor_part(delta, SPARSE_WIRE_TYPE)
    assert torch.allclose(deserialize_tensor_part(back), delta, rtol=1e-3, atol=1e-7)
    assert len(back.buffer) < 2.2 * int((delta != 0).sum())
    # a dense part (an attacker's, or a non-finite one) still travels, as fp16, its NaN kept for the reducer to drop
    # (fp16 keeps 11 significant bits, and values below 2^-14 on a grid of 2^-24: atol is half that grid's step)
    dense = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    dense[7] = float("nan")
    decoded = deserialize_tensor_part(codec.compress(dense))
    assert torch.isnan(decoded[7]) and torch.allclose(decoded[8:], dense[8:], rtol=1e-3, atol=2**-25)
    # a buffer whose positions run past its part is refused, not read out of bounds
    wire = codec.compress(one[0])
    wire.size[:] = [1000]
    with pytest.raises(ValueError, match="do not fit|does not fit"):
        deserialize_tensor_part(wire)


def test_fragments_without_sparse_pseudo_gradients_are_one_line_from_the_command_line():
    from sahajbert.cli import UserError, parse_args

    with pytest.raises(UserError, match="needs --pseudo_gradient_compression sparse"):
        parse_args([PeerArguments], ["--diloco_inner_steps", "10", "--diloco_fragments", "2"])


def test_sparse_flags():
    sparse = CollaborativeOptimizerArguments(diloco_inner_steps=10, pseudo_gradient_compression="sparse")
    assert sparse.outer_lr == 2.0 and SparseDiLoCoArguments().sparse_density == 1 / 64
    assert CollaborativeOptimizerArguments(diloco_inner_steps=10).outer_lr == 0.7
    with pytest.raises(ValueError, match="is DiLoCo's"):
        CollaborativeOptimizerArguments(pseudo_gradient_compression="sparse")
    with pytest.raises(ValueError, match="--sparse_density"):
        SparseDiLoCoArguments(sparse_density=0.0)
    with pytest.raises(ValueError, match="needs --pseudo_gradient_compression sparse"):
        PeerArguments(
            optimizer_args=CollaborativeOptimizerArguments(diloco_inner_steps=10),
            sparse_args=SparseDiLoCoArguments(diloco_fragments=2),
        )


def test_three_real_averagers_exchange_sparse_parts_and_drop_a_nan_contribution():
    # three gradient averagers on loopback, each sending its sparse pseudo-gradient as SparseParts; the third's parts
    # hold NaN: every reducer drops them, and the two honest peers end with the mean of their two parts
    from sahajbert.hivemind_ext.averaging.averager import GuardedGradientAverager

    sizes = (50_000, 3_000)
    contributions = []
    for seed in range(3):
        parts = [pseudo_gradient(10 * seed + i, (size,)) for i, size in enumerate(sizes)]
        SparseRounds(density=1 / 64).compress_(parts)
        contributions.append(parts)
    for part in contributions[2]:  # a NaN in every part it sends (hivemind cuts the tensors into parts by size)
        part[::997] = float("nan")
    averagers = []
    with loopback_dhts(3) as dhts:
        try:
            for dht, parts in zip(dhts, contributions):
                parameters = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
                for parameter, part in zip(parameters, parts):
                    parameter.grad = part.clone()
                averager = GuardedGradientAverager(
                    parameters,
                    dht=dht,
                    prefix="sparse",
                    compression=SparseParts(1 / 64),
                    target_group_size=3,
                    min_matchmaking_time=2.0,
                    start=True,
                )
                averager.accumulate_grads_(batch_size=1)
                averagers.append(averager)
            rounds = [averager.step(wait=False, timeout=60) for averager in averagers]
            for control in rounds[:2]:
                assert len(control.result(timeout=90)) == 3
            expected = [(a + b) / 2 for a, b in zip(contributions[0], contributions[1])]
            # averages come back as their change to the own part, in fp16: within half its last place (~8e-6 at 0.03)
            for averager in averagers[:2]:
                with averager.get_tensors() as averaged:
                    for got, want in zip(averaged, expected):
                        assert torch.isfinite(got).all()
                        assert torch.allclose(got, want, rtol=0, atol=2e-5), (got - want).abs().max()
        finally:
            for averager in averagers:
                averager.shutdown()


def test_split_into_fragments_keeps_tensors_in_order_and_sizes_near_equal():
    assert split_into_fragments([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_into_fragments([100, 1, 1, 1], 4) == [0, 1, 2, 3]  # none left without a tensor
    assert split_into_fragments([5] * 8, 3) == [0, 0, 0, 1, 1, 2, 2, 2]


def test_a_fragment_round_moves_its_fragment_and_keeps_the_others_inner_progress(tokenizer):
    # a sparse DiLoCo trainer alone (its rounds step on its own pseudo-gradient), H = 4 in 2 fragments: a round every
    # 2 inner steps, fragment 0 from even global steps, fragment 1 from odd ones
    from .test_training_parts import lonely_diloco, train_one_batch

    flags = dict(compression="sparse", sparse=SparseDiLoCoArguments(diloco_fragments=2))
    model, optimizer, dht = lonely_diloco(tokenizer, "fragments", inner_steps=4, **flags)
    try:
        assert optimizer.inner_steps == 2 and optimizer.fragments == 2
        fragment = [optimizer.fragment_at(0), optimizer.fragment_at(1)]
        assert fragment[0] and fragment[1] and not fragment[0] & fragment[1]
        assert len(fragment[0] | fragment[1]) == len(optimizer.state_averager.main_parameters)
        outer = [p for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]]
        start = [p.detach().clone() for p in outer]
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 1
        model_now = [p.detach().clone() for p in optimizer.state_averager.main_parameters]
        buffers = optimizer.sparse.buffers
        for index, (was, now, inner) in enumerate(zip(start, outer, model_now)):
            if index in fragment[0]:  # the outer step took this fragment's sent pseudo-gradient; the model is there,
                assert torch.allclose(inner, now - buffers[index], atol=1e-7)  # less what it did not send
            else:  # unmoved outside; the model keeps its two inner steps there, toward the fragment's own round
                assert torch.equal(now, was)
        assert any(not torch.equal(model_now[i], start[i]) for i in fragment[1])
        assert all(not buffers[i].any() for i in fragment[1]) and any(buffers[i].any() for i in fragment[0])
        for _ in range(2):
            train_one_batch(model, optimizer)
        assert optimizer.local_epoch == 2
        # fragment 1's round sent its four inner steps' progress: its outer parameters moved
        assert any(not torch.equal(outer[i], start[i]) for i in fragment[1])
        assert any(buffers[i].any() for i in fragment[1])
        # a checkpoint keeps the buffers, and the outer parameters, which the model is not: a trainer resumed from it
        # (its model, then its optimizer's state) has them back
        state = optimizer.state_dict()
        saved = state["diloco"]["error_feedback"]["buffers"]
        assert all(torch.equal(a, b) for a, b in zip(saved, buffers))
        resumed_model, resumed, resumed_dht = lonely_diloco(tokenizer, "fragments-resumed", inner_steps=4, **flags)
        try:
            resumed_model.load_state_dict(model.state_dict())
            resumed.load_state_dict(state)
            outer_again = [p for group in resumed.state_averager.optimizer.param_groups for p in group["params"]]
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outer_again, outer))
        finally:
            resumed.shutdown()
            resumed_dht.shutdown()
    finally:
        optimizer.shutdown()
        dht.shutdown()


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_rollback_restores_a_sparse_trainers_model_and_keeps_its_outer_parameters(tokenizer, where, tmp_path):
    # DiLoCo's outer parameters are not the model (its inner steps, what it has not sent): a rollback of a model gone
    # non-finite restores the model's last good state and leaves the finite outer parameters as they are
    from sahajbert.rollback import LastGoodState, keep_good_state

    from .test_training_parts import lonely_diloco, train_one_batch

    model, optimizer, dht = lonely_diloco(tokenizer, "sparse-rollback", inner_steps=2, compression="sparse")
    try:
        for _ in range(3):  # a round (alone: on its own pseudo-gradient), then an inner step
            train_one_batch(model, optimizer)
        outer = [p.detach().clone() for p in optimizer._outer_parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(outer, optimizer.state_averager.main_parameters))
        good = LastGoodState(optimizer, pending_update_timeout=10.0, kept=keep_good_state(where, tmp_path))
        assert good.keep_or_roll_back()
        saved = [p.detach().clone() for p in model.parameters()]
        inner = optimizer.local_state()
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
        assert not good.keep_or_roll_back()
        assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(outer, optimizer._outer_parameters()))
        restored = optimizer.local_state()
        assert restored["inner_step"] == inner["inner_step"] and restored["round_samples"] == inner["round_samples"]
        for index, state in inner["inner"]["state"].items():  # the inner optimizer's moments, as they were kept
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(restored["inner"]["state"][index][name]))
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_a_crafted_sparse_part_is_refused_before_its_size_is_allocated():
    codec = SparseParts()
    honest = codec.compress(torch.zeros(1000))
    # a header claiming 30 million non-zeros in a 48-byte buffer, a chunk size of 0, a part of 2^30 values
    for header in ([1, 4096, 30_000_000, 8, 0, 0], [1, 0, 0, 1, 0, 0]):
        crafted = codec.compress(torch.zeros(1000))
        crafted.buffer = np.array(header, dtype=np.int64).tobytes()
        with pytest.raises(ValueError, match="does not fit|not one"):
            deserialize_tensor_part(crafted)
    huge = codec.compress(torch.zeros(1000))
    huge.size[:] = [2**30]  # 4 GiB of fp32, with no value in its buffer
    with pytest.raises(ValueError, match="is not one this peer sends"):
        deserialize_tensor_part(huge)
    assert torch.equal(deserialize_tensor_part(honest), torch.zeros(1000))
