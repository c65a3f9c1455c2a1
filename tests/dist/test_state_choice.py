"""Which committed state a data-parallel resume takes: the newest step every rank of a world has."""
import json

from tierlm.dist.group import owners_by_bytes
from tierlm.dist.state import complete, scan


def manifest(folder, step, world=None, rank=None, pending=False):
    folder.mkdir(parents=True, exist_ok=True)
    content = {"step": step, "records": {}}
    if world is not None:
        content["dist"] = {"world": world, "rank": rank, "owners": {}}
    name = f"reshard-{step:08d}.json" if pending else f"manifest-{step:08d}.json"
    (folder / name).write_text(json.dumps(content))


def test_newest_step_committed_on_every_rank(tmp_path):
    manifest(tmp_path / "rank0", 3, 2, 0)
    manifest(tmp_path / "rank0", 4, 2, 0)   # rank 1 died before writing step 4
    manifest(tmp_path / "rank1", 2, 2, 1)
    manifest(tmp_path / "rank1", 3, 2, 1)
    assert complete(scan(tmp_path)) == [(2, 3)]


def test_other_layouts_and_pending_reshards(tmp_path):
    manifest(tmp_path, 5)                                  # a one-process run's state in --nvme itself
    manifest(tmp_path / "rank0", 7, 1, 0)                  # then 1 rank (a world of 1) went on to step 7
    manifest(tmp_path / "rank0", 6, 2, 0)                  # stale: a 2-rank state rank 1 never finished
    manifest(tmp_path / "rank1", 7, 3, 1, pending=True)    # a 3-rank reshard that rank 0 and 2 lack
    manifest(tmp_path / "rank2", 9, 2, 0)                  # a folder whose manifest names another rank
    assert complete(scan(tmp_path)) == [(1, 7), (0, 5)]


def test_ownership_is_balanced_and_deterministic():
    sizes = {f"p{i}": s for i, s in enumerate([8192, 8192, 4096, 2048, 2048, 6144, 6144, 6144, 64, 64])}
    owners = owners_by_bytes(sizes, 2)
    assert owners == owners_by_bytes(dict(sizes), 2)
    load = [sum(s for n, s in sizes.items() if owners[n] == r) for r in range(2)]
    assert abs(load[0] - load[1]) <= max(sizes.values())
    assert set(owners_by_bytes(sizes, 1).values()) == {0}


def test_split_batch_weights_add_up_to_the_global_mean():
    import torch
    import torch.nn.functional as F

    from tierlm.dist.group import Dist
    from tierlm.dist.data import split_batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100                  # a masked prompt: fewer label tokens in row 0
    logits = torch.randn(3, 9, 50, generator=g)

    def mean_loss(lg, lab):
        return F.cross_entropy(lg[:, :-1].reshape(-1, 50), lab[:, 1:].reshape(-1), ignore_index=-100)

    for world in (2, 4):                  # 4 ranks for 3 rows: one rank gets none
        total = 0.0
        for r in range(world):
            mine, lab, w = split_batch(Dist(r, world, group=False), ids, labels)
            rows = [i for i in range(3) if any(torch.equal(mine[j], ids[i]) for j in range(len(mine)))]
            if w == 0:
                continue
            total += w * float(mean_loss(logits[rows], lab))
        assert abs(total - float(mean_loss(logits, labels))) < 1e-5
