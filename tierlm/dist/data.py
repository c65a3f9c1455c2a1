"""Each rank's slice of the global batch, weighted so the ranks' losses add up to the global mean."""
from __future__ import annotations

import torch


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal LM's loss averages over: labels shift by one, -100 is ignored."""
    return int((labels[:, 1:] != -100).sum())


def split_batch(dist, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's rows and the weight w with sum over ranks of (w * its mean loss) equal to the
    mean loss over the whole batch. Every rank holds the global batch, so the token counts need no
    communication. A rank left without rows (a short last batch) or without a single label computes
    row 0 with weight 0: it still runs backward, so every rank takes part in every collective."""
    parts = list(zip(torch.tensor_split(ids, dist.world), torch.tensor_split(labels, dist.world)))
    total = sum(valid_tokens(lab) for _, lab in parts)
    mine_ids, mine_labels = parts[dist.rank]
    count = valid_tokens(mine_labels) if len(mine_ids) else 0
    if count == 0 or total == 0:
        return ids[:1], ids[:1].clone(), 0.0
    return mine_ids, mine_labels, count / total


def global_losses(dist, weighted: list[float]) -> list[float]:
    """The global mean loss of each micro-batch, from every rank's weighted share."""
    t = dist.all_reduce(torch.tensor(weighted, dtype=torch.float64))
    return t.tolist()
