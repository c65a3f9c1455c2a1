"""Small tensors in RAM and in one pack file a commit (tierlm.storage.packed)."""
import os

import pytest
import torch

from tierlm.storage import CorruptionError, HostBufferPool, TensorStore
from tierlm.storage.packed import pack_name, prune_packs


def _store(root, **kw):
    return TensorStore(root, HostBufferPool(64 << 20), io_threads=2, pack_below=64 << 10, **kw)


def test_a_small_write_is_a_copy_and_a_pack_holds_them_all(tmp_path):
    s = _store(tmp_path / "nv")
    try:
        small = {f"master0/p{i}": torch.randn(7 + i) for i in range(5)}
        big = torch.randn(1 << 15)  # 128 KiB: a file of its own
        futs = [s.write(k, t) for k, t in small.items()] + [s.write("master0/big", big)]
        assert all(f.done() for f in futs[:-1])  # no I/O: done when write() returns
        for f in futs:
            f.result()
        assert not (tmp_path / "nv" / "master0" / "p0").exists()
        assert s.stats.snapshot()["writes"] == 1  # the large one only
        out = torch.empty(9)
        s.read_into("master0/p2", out).result()
        assert torch.equal(out, small["master0/p2"])
        assert s.stats.snapshot()["reads"] == 0  # from RAM

        recs = s.pack(pack_name(3), list(small) + ["master0/big"])
        assert s.stats.snapshot()["writes"] == 2  # one request for all five
        assert {r.pack for k, r in recs.items() if k != "master0/big"} == {pack_name(3)}
        assert recs["master0/big"].pack is None
        manifest = {k: r.to_json() for k, r in recs.items()}
    finally:
        s.close()

    # A new process: the records say where the bytes are; the pack serves them, checked.
    s2 = _store(tmp_path / "nv")
    try:
        s2.load_manifest(manifest)
        for k, t in small.items():
            assert torch.equal(s2.read(k).result().tensor, t)
        assert s2.stats.snapshot()["reads"] == len(small)
        s2.read("master0/p0").result()
        assert s2.stats.snapshot()["reads"] == len(small)  # kept in RAM once read
    finally:
        s2.close()


def test_a_damaged_pack_names_the_pack_and_the_tensor(tmp_path):
    s = _store(tmp_path / "nv")
    try:
        for i in range(3):
            s.write(f"m0/p{i}", torch.full((100,), float(i))).result()
        manifest = {k: r.to_json() for k, r in s.pack(pack_name(1), ["m0/p0", "m0/p1", "m0/p2"]).items()}
    finally:
        s.close()
    path = tmp_path / "nv" / pack_name(1)
    raw = bytearray(path.read_bytes())
    raw[400 + 17] ^= 0x10  # inside the second tensor
    path.write_bytes(bytes(raw))
    s2 = _store(tmp_path / "nv")
    try:
        s2.load_manifest(manifest)
        assert torch.equal(s2.read("m0/p0").result().tensor, torch.zeros(100))
        with pytest.raises(CorruptionError, match=rf"{path} \(holding m0/p1\): checksum mismatch"):
            s2.read("m0/p1").result()
        os.truncate(path, 500)
        with pytest.raises(CorruptionError, match=r"m0/p2\): truncated: 0 of 400"):
            s2.read("m0/p2").result()
    finally:
        s2.close()


def test_a_small_write_waits_for_a_read_of_its_file_in_flight(tmp_path):
    """A key read from its pack (after a resume) and written at once: the read gets the old
    bytes, later reads the new ones."""
    s = _store(tmp_path / "nv")
    try:
        s.write("w0/a", torch.ones(10)).result()
        manifest = {k: r.to_json() for k, r in s.pack(pack_name(0), ["w0/a"]).items()}
    finally:
        s.close()
    s2 = _store(tmp_path / "nv")
    try:
        s2.load_manifest(manifest)
        old = torch.empty(10)
        r = s2.read_into("w0/a", old)
        w = s2.write("w0/a", torch.full((10,), 2.0))
        r.result()
        w.result()
        assert torch.equal(old, torch.ones(10))
        new = torch.empty(10)
        s2.read_into("w0/a", new).result()
        assert torch.equal(new, torch.full((10,), 2.0))
    finally:
        s2.close()


def test_only_the_keys_asked_for_are_packed(tmp_path):
    s = _store(tmp_path / "nv", pack_keys=lambda k: not k.startswith("act/"))
    try:
        s.write("act/x", torch.randn(10)).result()
        s.write("w0/x", torch.randn(10)).result()
        assert (tmp_path / "nv" / "act" / "x").exists()
        assert not (tmp_path / "nv" / "w0" / "x").exists()
    finally:
        s.close()
    plain = TensorStore(tmp_path / "plain", HostBufferPool(1 << 20))  # the default packs nothing
    try:
        plain.write("w0/x", torch.randn(10)).result()
        assert (tmp_path / "plain" / "w0" / "x").exists()
    finally:
        plain.close()


def test_packs_no_manifest_names_are_pruned(tmp_path):
    d = tmp_path / "packs"
    d.mkdir()
    for step in (3, 4, 5):
        (tmp_path / pack_name(step)).write_bytes(b"x")
    (d / "00000006.bin.partial").write_bytes(b"x")  # an interrupted write
    prune_packs(tmp_path, {pack_name(4), pack_name(5)})
    assert sorted(p.name for p in d.iterdir()) == ["00000004.bin", "00000005.bin"]
