"""The step's global gradient norm (OutOfCoreAdamW's part): each gradient's, the early pieces of a
tied head's, and the clip decided from them at the end of the step."""
from __future__ import annotations

import torch

from ..dist.grads import gather_norms
from .grad_norm import chunked, piece_norms
from .optim_types import EARLY, ShardItem, StepResult


class NormsMixin:
    def finish_step(self) -> StepResult:
        """After the last micro-batch: global norm, and the clip redo when torch would clip."""
        per_param = self._norms
        if self.dist is not None:
            per_param = gather_norms(self.dist, self._norms, self.canonical)
        self.stepped = [n for n in self.canonical if n in per_param]  # on every rank alike
        norms = [per_param[n] for n in self.stepped]
        total = torch.linalg.vector_norm(torch.stack(norms), 2) if norms else torch.tensor(0.0)
        finite = bool(torch.isfinite(total))
        coef = 1.0
        redone = False
        clamped = None
        if self.cfg.max_grad_norm is not None and finite:
            clamped = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)
            coef = float(clamped)
            self.last_clipped = coef < 1.0
        if self.holding:
            if finite:  # the one update, with the factor where torch would scale the gradients
                self.start_apply(clamped if coef < 1.0 else None)
            return StepResult(float(total), coef, False, finite, "hold")
        if coef < 1.0:
            self._exec.submit(self._redo, clamped).result()
            redone = True
        return StepResult(float(total), coef, redone, finite)

    def _early_pieces(self, real: str, shards: list[int]) -> None:
        """An early arrival's final shards: the norms of the pieces within them, taken now (beside
        backward) rather than with the rest of the gradient at the end of the step."""
        g = self.queue.grads.get(real + EARLY)
        if g is not None and chunked(g):
            self._pieces[real] = piece_norms(g, [self.infos[real].shards[k] for k in shards])

    def _record_norm(self, it: ShardItem, g: torch.Tensor) -> None:
        info = self.infos[it.name]
        if len(info.shards) == 1:
            # The whole accumulated gradient: the very reduction clip_grad_norm_ runs.
            self._norms[it.name] = torch.linalg.vector_norm(g, 2)
            return
        # An accumulated gradient exists only shard by shard: combining shard norms equals the
        # tensor's norm to within rounding, not bitwise.
        sq = torch.linalg.vector_norm(g, 2).double() ** 2
        self._sq[it.name] = sq if it.shard == 0 else self._sq[it.name] + sq
        if it.shard == len(info.shards) - 1:
            self._norms[it.name] = self._sq.pop(it.name).sqrt().float()
