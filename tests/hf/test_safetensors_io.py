import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierlm.hf.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsDir, SafetensorsWriter


def _sample_tensors():
    g = torch.Generator().manual_seed(0)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {
        "f32": f(3, 5),
        "f64": f(4).double(),
        "f16": f(2, 3, 4).half(),
        "bf16": f(7, 3).bfloat16(),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.randint(-2**31, 2**31 - 1, (6,), dtype=torch.int32, generator=g),
        "i16": torch.randint(-2**15, 2**15 - 1, (6,), dtype=torch.int16, generator=g),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "odd_bf16": f(1, 3).bfloat16(),  # 6 bytes: the next tensor starts unaligned
    }
    t["bf16"][0, 0] = float("nan")
    t["bf16"][0, 1] = float("-inf")
    return t


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal treats NaN != NaN; compare raw bytes so bit patterns count.
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _write(directory, tensors, order=None, **kw):
    with SafetensorsWriter(directory, [(n, t.dtype, t.shape) for n, t in tensors.items()], **kw) as w:
        for n in order or list(tensors):
            w.write(n, tensors[n])
    return w


def test_round_trip_all_dtypes_any_write_order(tmp_path):
    tensors = _sample_tensors()
    order = list(tensors)
    random.Random(1).shuffle(order)
    _write(tmp_path, tensors, order)
    assert sorted(os.listdir(tmp_path)) == [SINGLE_NAME]
    loaded = load_file(tmp_path / SINGLE_NAME)
    assert set(loaded) == set(tensors)
    for n, t in tensors.items():
        assert _bits_equal(loaded[n], t), n
    with open(tmp_path / SINGLE_NAME, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(hlen))
    assert (8 + hlen) % 64 == 0 and header["__metadata__"] == {"format": "pt"}  # data cache-line aligned

    with SafetensorsDir(tmp_path) as d:
        assert d.names() == list(tensors)  # declaration order is file order
        for n, t in tensors.items():
            assert d.info(n) == (t.dtype, tuple(t.shape))
            assert d.nbytes(n) == t.numel() * t.element_size()
            assert _bits_equal(d.read(n), t), n


def test_read_into_view_of_larger_buffer(tmp_path):
    tensors = _sample_tensors()
    _write(tmp_path, tensors)
    d = SafetensorsDir(tmp_path)
    buf = torch.full((100,), -1, dtype=torch.bfloat16)
    out = buf[10:31]  # 21 elements = numel of "bf16" (7, 3), any shape
    assert d.read("bf16", out) is out
    assert _bits_equal(out.view(7, 3), tensors["bf16"])
    assert (buf[:10] == -1).all() and (buf[31:] == -1).all()
    with pytest.raises(ValueError, match="contiguous"):
        d.read("bf16", torch.empty(3, 7, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="elements"):
        d.read("bf16", torch.empty(20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        d.read("bf16", torch.empty(21, dtype=torch.float16))


def test_sharding_matches_huggingface_split(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.w": torch.randn(17 + i, 8, generator=g) for i in range(12)}
    limit = 2000
    _write(tmp_path, tensors, list(reversed(tensors)), max_shard_bytes=limit)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"]["total_size"] == split.metadata["total_size"]
    assert sorted(os.listdir(tmp_path)) == sorted([*split.filename_to_tensors, INDEX_NAME])
    merged = {}
    for fname in split.filename_to_tensors:
        merged.update(load_file(tmp_path / fname))
    assert all(_bits_equal(merged[n], t) for n, t in tensors.items())
    d = SafetensorsDir(tmp_path)
    assert d.names() == list(tensors)
    assert all(_bits_equal(d.read(n), t) for n, t in tensors.items())


def test_tensor_larger_than_a_shard_gets_its_own_in_order(tmp_path):
    # HF's splitter moves such a tensor ahead of the shard being filled; we keep declaration order.
    tensors = {"a": torch.randn(10), "big": torch.randn(100), "b": torch.randn(10), "c": torch.randn(10)}
    _write(tmp_path, tensors, max_shard_bytes=100)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert list(index["weight_map"].values()) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3, 3)]
    d = SafetensorsDir(tmp_path)
    assert d.names() == list(tensors)
    assert all(_bits_equal(d.read(n), t) for n, t in tensors.items())


def test_reads_files_written_by_safetensors_and_transformers(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, tmp_path / SINGLE_NAME, metadata={"format": "pt"})
    d = SafetensorsDir(tmp_path)
    assert set(d.names()) == set(tensors)
    assert all(_bits_equal(d.read(n), t) for n, t in tensors.items())

    from transformers import AutoModelForCausalLM
    from tierlm.hf.presets import make_config

    model = AutoModelForCausalLM.from_config(make_config("qwen2"), dtype=torch.bfloat16)
    out = tmp_path / "hf"
    model.save_pretrained(out, max_shard_size="60KB")
    assert (out / INDEX_NAME).exists()
    d = SafetensorsDir(out)
    sd = model.state_dict()
    assert "lm_head.weight" not in d  # tied
    assert len(d) == len(sd) - 1
    assert all(_bits_equal(d.read(n), sd[n]) for n in d.names())


def test_transformers_loads_what_the_writer_writes(tmp_path):
    from transformers import AutoModelForCausalLM
    from tierlm.hf.presets import make_config

    config = make_config("llama", overrides={"dtype": "bf16"})
    src = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    sd = src.state_dict()
    _write(tmp_path, sd, list(reversed(sd)), max_shard_bytes="40KB")
    config.save_pretrained(tmp_path)
    assert (tmp_path / INDEX_NAME).exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    lsd = loaded.state_dict()
    assert set(lsd) == set(sd)
    assert all(_bits_equal(lsd[n], sd[n]) for n in sd)


def test_reader_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SafetensorsDir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        SafetensorsDir(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"\.bin.*save_pretrained\(.*safe_serialization=True"):
        SafetensorsDir(tmp_path)

    tensors = {"a": torch.randn(64), "b": torch.randn(64)}
    ok = tmp_path / "ok"
    _write(ok, tensors)
    with pytest.raises(KeyError, match=r"'c' is not in .*ok"):
        SafetensorsDir(ok).read("c")

    path = ok / SINGLE_NAME
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        SafetensorsDir(ok)
    path.write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="too short"):
        SafetensorsDir(ok)

    sharded = tmp_path / "sharded"
    _write(sharded, tensors, max_shard_bytes=256)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors.*missing"):
        SafetensorsDir(sharded)


def test_writer_checks_and_publishes_atomically(tmp_path):
    spec = [("a", torch.float32, (4,)), ("b", torch.bfloat16, (2, 2))]
    w = SafetensorsWriter(tmp_path, spec)
    with pytest.raises(KeyError):
        w.write("c", torch.zeros(4))
    with pytest.raises(ValueError, match="declared"):
        w.write("a", torch.zeros(5))
    with pytest.raises(ValueError, match="declared"):
        w.write("b", torch.zeros(2, 2))
    w.write("a", torch.zeros(4))
    with pytest.raises(ValueError, match="already written"):
        w.write("a", torch.zeros(4))
    assert not (tmp_path / SINGLE_NAME).exists()  # nothing visible before close
    with pytest.raises(ValueError, match="never written"):
        w.close()
    assert os.listdir(tmp_path) == []  # partial files removed

    with pytest.raises(RuntimeError):
        with SafetensorsWriter(tmp_path, spec) as w:
            w.write("a", torch.zeros(4))
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []

    # A later save replaces an earlier one completely: no stale shards or index remain.
    big = {f"t{i}": torch.randn(100) for i in range(5)}
    _write(tmp_path, big, max_shard_bytes=800)
    assert (tmp_path / INDEX_NAME).exists()
    _write(tmp_path, {"x": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == [SINGLE_NAME]
    assert SafetensorsDir(tmp_path).names() == ["x"]


def test_non_contiguous_and_grad_tensors_are_written(tmp_path):
    a = torch.randn(4, 6).t()  # non-contiguous
    p = torch.nn.Parameter(torch.randn(3))
    _write(tmp_path, {"a": a, "p": p})
    d = SafetensorsDir(tmp_path)
    assert torch.equal(d.read("a"), a) and torch.equal(d.read("p"), p.detach())


def test_a_tensor_written_in_row_parts_and_read_by_rows(tmp_path):
    """A fused file tensor the family's save makes of several parameters (hf.split_tensors): each
    parameter writes its rows, in any order; it is complete when every row is, and a reader takes
    any rows back as one byte range."""
    whole = torch.randn(10, 3, dtype=torch.bfloat16)
    other = torch.arange(4, dtype=torch.float32)
    w = SafetensorsWriter(tmp_path, [("fused", torch.bfloat16, (10, 3)), ("other", torch.float32, (4,))])
    w.write("fused", whole[6:], 6)
    w.write("other", other)
    assert w.pending() == {"fused"}
    with pytest.raises(ValueError, match="rows 5..6 were already written"):
        w.write("fused", whole[5:7], 5)
    with pytest.raises(ValueError, match="declared"):
        w.write("fused", whole[:2, :2], 0)                # other columns than declared
    with pytest.raises(ValueError, match="declared"):
        w.write("fused", whole[:6], 5)                    # past the last row
    w.write("fused", whole[:2], 0)
    w.write("fused", whole[2:6], 2)
    assert w.pending() == set()
    w.close()
    st = SafetensorsDir(tmp_path)
    assert torch.equal(load_file(tmp_path / SINGLE_NAME)["fused"], whole)
    assert torch.equal(st.read_rows("fused", 2, 7), whole[2:7])
    out = torch.empty(3, 3, dtype=torch.bfloat16)
    assert st.read_rows("fused", 7, 10, out) is out and torch.equal(out, whole[7:])
    assert torch.equal(st.read("other"), other)
    with pytest.raises(ValueError, match="rows 8..11 of 10"):
        st.read_rows("fused", 8, 11)


def test_a_tensor_written_in_part_is_not_published(tmp_path):
    w = SafetensorsWriter(tmp_path, [("fused", torch.float32, (4, 2))])
    w.write("fused", torch.ones(3, 2), 0)
    with pytest.raises(ValueError):
        w.close()
    assert not (tmp_path / SINGLE_NAME).exists()
