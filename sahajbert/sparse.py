"""SparseLoCo's pseudo-gradients (Sarfi et al. 2025, arXiv 2508.15706): what a DiLoCo trainer sends of its
pseudo-gradient is the top-k of each chunk of values in 2 bits, and what it did not send stays with it.

Each round, a trainer sends the `density` share of its pseudo-gradient's values with the largest magnitude in each
chunk of `chunk_size`, each as its sign times one of two magnitudes of the chunk (the mean of the larger half of the
kept magnitudes, and of the smaller half: 2 bits a value). What it did not send (the rounding included), times
`decay`, stays in its model: after the outer step puts the model at the swarm's new parameters, the model moves
back by that much (`keep_in_`), so its inner steps go on from its own progress, and its next pseudo-gradient (the
outer parameters minus the model) holds it again. This is SparseLoCo's error feedback kept in the parameters instead
of a separate buffer: with the buffer, the model restarted every round from the swarm's parameters, where 98% of
the values had not moved, and the inner steps relearned them (a tiny pair stalled at a loss of ~6.9 where int8
DiLoCo reached 6.5; with the rest kept in the model, 6.58). The error feedback plays the part of DiLoCo's outer
momentum, so the outer step is plain SGD on the averaged sparse updates.

The trainers' models then differ by what each has not sent (the outer parameters agree); the final parameter
round averages the models (DiLoCoOptimizer.take_model_into_outer). The buffer (`buffers`, decay x the rest) is this
trainer's own: it is not averaged, a newcomer does not download it (it starts from the swarm's parameters with
none), and a checkpoint keeps it, with the outer parameters (which the model no longer equals).
"""

import torch

CHUNK_SIZE = 4096  # values per top-k chunk (SparseLoCo's)
DECAY = 1.0  # the share of what was not sent that stays in the model (SparseLoCo's buffer decays by 0.95)


class SparseRounds:
    """A trainer's sparse pseudo-gradients: their top-k, 2-bit compression and error feedback (see the module's
    docstring), and the fragments its rounds take turns at (`fragments`, 1: every round is of the whole model)."""

    def __init__(self, density: float, chunk_size: int = CHUNK_SIZE, decay: float = DECAY, fragments: int = 1):
        if not 0 < density <= 1:
            raise ValueError(f"--sparse_density must be in (0, 1], got {density}")
        if chunk_size < 1:
            raise ValueError(f"--sparse_chunk_size must be positive, got {chunk_size}")
        if not 0 <= decay <= 1:
            raise ValueError(f"--error_feedback_decay must be in [0, 1], got {decay}")
        if fragments < 1:
            raise ValueError(f"--diloco_fragments must be at least 1, got {fragments}")
        self.density, self.chunk_size, self.decay, self.fragments = density, chunk_size, decay, fragments
        self.buffers: list[torch.Tensor] | None = None  # one per parameter, made at the first round

    @torch.no_grad()
    def compress_(self, pseudo_gradients: list[torch.Tensor], only: set[int] | None = None) -> None:
        """Replace each pseudo-gradient, in place, by what this trainer sends of it, and keep `decay` x the rest in
        the buffer; `only`: the indices of the tensors of this round (a fragment's; None: all), the others and their
        buffers are left as they are. A non-finite one is left as it is (the reducers drop it), its buffer zero."""
        if self.buffers is None:
            self.buffers = [torch.zeros_like(g) for g in pseudo_gradients]
        for index, (gradient, buffer) in enumerate(zip(pseudo_gradients, self.buffers, strict=True)):
            if only is not None and index not in only:
                continue
            if buffer.device != gradient.device:  # a checkpoint's buffers load on the host
                buffer = self.buffers[index] = buffer.to(gradient.device)
            if not bool(torch.isfinite(gradient).all()):
                buffer.zero_()
                continue
            sent = self.top_k_two_bit(gradient)
            torch.sub(gradient, sent, out=buffer).mul_(self.decay)
            gradient.copy_(sent)

    @torch.no_grad()
    def keep_in_(self, parameters: list[torch.Tensor], only: set[int] | None = None) -> None:
        """After the outer step: move each parameter (at the swarm's new value) back by what this trainer did not
        send of it (the buffer), so that the model keeps its own progress; `only` as in `compress_`."""
        if self.buffers is None:
            return
        for index, (parameter, buffer) in enumerate(zip(parameters, self.buffers, strict=True)):
            if only is None or index in only:
                parameter.sub_(buffer.to(parameter.device))

    def top_k_two_bit(self, tensor: torch.Tensor) -> torch.Tensor:
        """The `density` share of each chunk's values with the largest magnitude, each as its sign times the mean
        magnitude of the larger or the smaller half of them (rounded to fp16, which the wire carries exactly); zero
        elsewhere. A tensor's last, shorter chunk keeps its own share."""
        flat = tensor.reshape(-1)
        sent = torch.zeros_like(flat)
        whole = flat.numel() // self.chunk_size * self.chunk_size
        pieces = [(0, flat[:whole].view(-1, self.chunk_size)), (whole, flat[whole:].view(1, -1))]
        for start, piece in pieces:
            if piece.numel() == 0:
                continue
            kept = max(1, round(self.density * piece.shape[1]))
            magnitudes, positions = piece.abs().topk(kept, dim=1)  # largest first
            larger = max(1, kept // 2)
            levels = torch.empty_like(magnitudes)
            levels[:, :larger] = magnitudes[:, :larger].mean(dim=1, keepdim=True)
            if kept > larger:
                levels[:, larger:] = magnitudes[:, larger:].mean(dim=1, keepdim=True)
            # fp16 on the wire: rounded to it here, and kept finite (a rest past its range stays in the model)
            levels = levels.clamp(max=torch.finfo(torch.float16).max).to(torch.float16).to(flat.dtype)
            values = torch.sign(piece.gather(1, positions)) * levels
            end = start + piece.numel()
            sent[start:end].view_as(piece).scatter_(1, positions, values)
        return sent.view_as(tensor)

    def clear(self) -> None:
        """Nothing kept any more (the model's rest went into the outer parameters: the final parameter round)."""
        if self.buffers is not None:
            for buffer in self.buffers:
                buffer.zero_()

    def state_dict(self) -> dict:
        return {"buffers": None if self.buffers is None else [b.clone() for b in self.buffers]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        buffers = state.get("buffers")
        self.buffers = None if buffers is None else [torch.as_tensor(b).clone() for b in buffers]
