"""Streaming safetensors I/O: one tensor in memory at a time, no mmap.

The `safetensors` package maps whole files, and mapped pages count in RSS, so a 7B model read
through it would blow a 4 GiB `cpu` budget. Here every read is a pread straight into the memory of
a tensor the caller owns (often a slice of a pooled host buffer) and every write a pwrite from it.
The on-disk format is exactly what `safetensors` and `transformers` read and write.
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
from pathlib import Path

import torch

from tierlm.units import parse_bytes

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PARTIAL = ".partial"  # suffix of files being written; loaders never look at these names
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces
_MAX_IO_BYTES = 1 << 30  # Linux moves at most ~2 GiB per read/write call; stay well below

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):  # present only in newer torch builds
        DTYPES[_code] = getattr(torch, _attr)
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(dtype: torch.dtype, shape) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable memoryview over a contiguous CPU tensor's bytes (bf16/fp8 have no numpy dtype)."""
    if t.device.type != "cpu":
        raise ValueError(f"safetensors I/O needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("safetensors I/O needs a contiguous tensor (a contiguous slice of a buffer is fine)")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _pread_into(fd: int, mv: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:done + _MAX_IO_BYTES]], offset + done)
        if n == 0:
            raise ValueError(f"{path}: file ends at byte {offset + done}, expected {offset + len(mv)}; "
                             "the file is truncated (an interrupted download or copy?) - fetch it again")
        done += n


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        done += os.pwritev(fd, [mv[done:done + _MAX_IO_BYTES]], offset + done)


def _parse_header(path: Path) -> tuple[dict, dict, int]:
    """-> ({name: (dtype_code, shape, start, end)} in file order, __metadata__, data start offset)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes is too short to be a safetensors file (truncated?)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > _MAX_HEADER_BYTES or 8 + hlen > size:
            raise ValueError(f"{path}: header claims {hlen} bytes but the file has {size}; "
                             "the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from None
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + hlen
    entries = {}
    # JSON object order is not guaranteed to be file order, so sort by offset (safetensors does too).
    for name, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        code, shape, (start, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        if code not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {code}, which this torch cannot hold "
                             f"(supported: {', '.join(DTYPES)})")
        if end - start != _nbytes(DTYPES[code], shape):
            raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for shape {list(shape)} {code}; "
                             "the file is corrupt")
        entries[name] = (code, shape, start, end)
    last = max((e[3] for e in entries.values()), default=0)
    if data_start + last > size:
        raise ValueError(f"{path}: tensors need {data_start + last} bytes but the file has {size}; "
                         "the file is truncated (an interrupted download or copy?) - fetch it again")
    return entries, meta, data_start


class SafetensorsDir:
    """Read-only view of a HF model directory's safetensors weights (single file or index + shards)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"model directory {self.dir} does not exist (or is not a directory); "
                                    "pass the folder that holds config.json and the *.safetensors files")
        index = self.dir / INDEX_NAME
        single = self.dir / SINGLE_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))  # shard order as first listed
        elif single.is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise FileNotFoundError(self._no_weights_message())
        # name -> (path, dtype_code, shape, absolute start, absolute end)
        self._where: dict[str, tuple[Path, str, tuple, int, int]] = {}
        self.metadata: dict = {}
        for fname in sorted(files):
            path = self.dir / fname
            if not path.is_file():
                raise FileNotFoundError(f"{index} lists shard {fname}, which is missing from {self.dir}; "
                                        "the download or copy is incomplete")
            entries, meta, base = _parse_header(path)
            self.metadata.update(meta)
            for name, (code, shape, start, end) in entries.items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # the index is authoritative about which shard holds a name
                self._where[name] = (path, code, shape, base + start, base + end)
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self._where]
            if missing:
                raise ValueError(f"{index} maps {len(missing)} tensors (e.g. {missing[0]!r}) to shards that do "
                                 "not contain them; the index and shards are from different saves")
        self._fds: dict[Path, int] = {}
        self._fd_lock = threading.Lock()  # reads may come from an I/O thread pool

    def _no_weights_message(self) -> str:
        bins = sorted(p.name for p in self.dir.glob("*.bin"))
        msg = f"no {SINGLE_NAME} or {INDEX_NAME} in {self.dir}"
        if bins:
            msg += (f" (found {', '.join(bins[:3])}: PyTorch .bin checkpoints are not supported because "
                    "loading them needs the whole model in memory)")
        return msg + (". Convert once on a machine with enough RAM: "
                      "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")

    def names(self) -> list[str]:
        """Tensor names, shard by shard, each shard in file order."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _get(self, name: str):
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.dir} ({len(self._where)} tensors, e.g. "
                           f"{', '.join(list(self._where)[:3])}); is this the right model?") from None

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        _, code, shape, _, _ = self._get(name)
        return DTYPES[code], shape

    def nbytes(self, name: str) -> int:
        _, _, _, start, end = self._get(name)
        return end - start

    def locate(self, name: str) -> tuple[Path, int, int]:
        """(file, absolute byte offset, byte count): for readers doing their own (direct) I/O."""
        path, _, _, start, end = self._get(name)
        return path, start, end - start

    def total_bytes(self) -> int:
        return sum(e[4] - e[3] for e in self._where.values())

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read one tensor into `out` (contiguous, same dtype and numel; any shape) or a new tensor."""
        _, _, shape, _, _ = self._get(name)
        return self._read(name, 0, shape[0] if shape else 0, out)

    def read_rows(self, name: str, first: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows first..stop-1 of a tensor (along its first dimension: one byte range), into `out`
        (contiguous, same dtype and numel) or a new tensor."""
        return self._read(name, first, stop, out)

    def _read(self, name: str, first: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        path, code, full, start, end = self._get(name)
        dtype = DTYPES[code]
        shape = (stop - first, *full[1:]) if full else full
        if full and not 0 <= first <= stop <= full[0]:
            raise ValueError(f"read({name!r}): rows {first}..{stop} of {full[0]}")
        if full and (first, stop) != (0, full[0]):
            row = (end - start) // full[0] if full[0] else 0
            start, end = start + first * row, start + stop * row
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or out.numel() != _numel(shape):
            raise ValueError(f"read({name!r}): out is {out.dtype} with {out.numel()} elements, the file has "
                             f"{dtype} {list(shape)} ({_numel(shape)} elements)")
        if end > start:
            fd = self._fds.get(path)
            if fd is None:
                with self._fd_lock:
                    fd = self._fds.get(path)
                    if fd is None:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
            _pread_into(fd, _byte_view(out), start, path)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class SafetensorsWriter:
    """Write a HF weights directory tensor by tensor, in any order, without holding more than one.

    All tensors are declared up front so shard layout and headers are fixed before any data; files
    are written under `*.partial` names and renamed (index last) on close, so an interrupted write
    never leaves something that `from_pretrained` would take for a complete model.
    """

    def __init__(self, directory: str | os.PathLike, tensors, max_shard_bytes: int | str = "5GB",
                 metadata: dict[str, str] | None = None):
        """`tensors`: iterable of (name, dtype, shape), in file order."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        limit = parse_bytes(max_shard_bytes, "max_shard_bytes")
        meta = {"format": "pt", **(metadata or {})}
        self._spec: dict[str, tuple[torch.dtype, tuple]] = {}
        shards: list[list[str]] = [[]]
        shard_bytes = 0
        for name, dtype, shape in tensors:
            if name in self._spec or name == "__metadata__":
                raise ValueError(f"tensor name {name!r} declared twice (or reserved)")
            if dtype not in DTYPE_CODES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            shape = tuple(int(s) for s in shape)
            n = _nbytes(dtype, shape)
            # Same rule as HF's splitter: start a new shard when this tensor would tip the current one over.
            if shards[-1] and shard_bytes + n > limit:
                shards.append([])
                shard_bytes = 0
            shards[-1].append(name)
            shard_bytes += n
            self._spec[name] = (dtype, shape)
        if not self._spec:
            raise ValueError("SafetensorsWriter needs at least one tensor")
        k = len(shards)
        fnames = [SINGLE_NAME] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
        self.total_size = 0
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (fd, absolute offset, nbytes)
        self._files: list[tuple[Path, int]] = []
        self.weight_map: dict[str, str] = {}
        try:
            for fname, names in zip(fnames, shards):
                self._open_shard(fname, names, meta)
        except BaseException:
            self.abort()
            raise
        self._pending = set(self._spec)
        self._rows: dict[str, list[tuple[int, int]]] = {}  # rows written of a tensor written in parts
        self._closed = False

    def _open_shard(self, fname: str, names: list[str], meta: dict) -> None:
        header, pos = {"__metadata__": meta}, 0
        for name in names:
            dtype, shape = self._spec[name]
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        # The data starts 64-byte aligned (safetensors asks for 8; the header may end in any number of
        # spaces), so every tensor whose offset is a multiple of 64 is cache-line aligned where a loader
        # maps the file: CPU products of some shapes (torch's grouped_mm for a mixture's experts) give
        # other bits on weights only 8- or 16-byte aligned, and a reloaded model must compute as it did.
        hbytes += b" " * (-(8 + len(hbytes)) % 64)
        path = self.dir / (fname + _PARTIAL)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._files.append((path, fd))
        base = 8 + len(hbytes)
        _pwrite_all(fd, memoryview(struct.pack("<Q", len(hbytes)) + hbytes), 0)
        os.ftruncate(fd, base + pos)
        for name in names:
            start, end = header[name]["data_offsets"]
            self._where[name] = (fd, base + start, end - start)
            self.weight_map[name] = fname
        self.total_size += pos

    def names(self) -> list[str]:
        return list(self._spec)

    def pending(self) -> set[str]:
        return set(self._pending)

    def write(self, name: str, tensor: torch.Tensor, first_row: int | None = None) -> None:
        """Write tensor `name` whole; with `first_row`, rows first_row.. of it (a parameter the
        family's save fuses with others: hf.split_tensors). It is written when all its rows are."""
        if self._closed:
            raise ValueError("write() after close()")
        if name not in self._spec:
            raise KeyError(f"tensor {name!r} was not declared to this writer")
        if name not in self._pending:
            raise ValueError(f"tensor {name!r} was already written")
        dtype, shape = self._spec[name]
        fd, offset, n = self._where[name]
        if first_row is None:
            rows, first_row = (shape[0] if shape else 1), 0
            ok = tuple(tensor.shape) == shape
        else:
            rows = tensor.shape[0] if tensor.dim() else 0
            ok = len(shape) > 0 and tuple(tensor.shape[1:]) == shape[1:] and 0 <= first_row <= shape[0] - rows
        if tensor.dtype != dtype or not ok:
            raise ValueError(f"tensor {name!r}: declared {dtype} {list(shape)}, got {tensor.dtype} "
                             f"{list(tensor.shape)}" + (f" at row {first_row}" if first_row else ""))
        done = self._rows.setdefault(name, [])
        if any(a < first_row + rows and first_row < b for a, b in done):
            raise ValueError(f"tensor {name!r}: rows {first_row}..{first_row + rows - 1} were already written")
        row_bytes = n // shape[0] if shape and shape[0] else n
        if n and rows:
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            _pwrite_all(fd, _byte_view(t.contiguous()), offset + first_row * row_bytes)
        done.append((first_row, first_row + rows))
        if sum(b - a for a, b in done) >= (shape[0] if shape else 1):
            self._pending.discard(name)
            del self._rows[name]

    def close(self) -> None:
        """Check completeness, make it durable, then publish the files under their real names."""
        if self._closed:
            return
        if self._pending:
            missing = sorted(self._pending)
            self.abort()
            raise ValueError(f"closing {self.dir} with {len(missing)} tensors never written "
                             f"(e.g. {missing[0]!r}); nothing was published")
        self._closed = True
        for path, fd in self._files:
            os.fsync(fd)
            os.close(fd)
        final = [p.with_name(p.name[: -len(_PARTIAL)]) for p, _ in self._files]
        # Remove weights of an earlier save that this one does not overwrite, or loaders could mix them.
        stale = [p for p in self.dir.iterdir() if (p.name == SINGLE_NAME or p.name == INDEX_NAME
                                                   or _SHARD_RE.match(p.name)) and p not in final]
        for p in stale:
            p.unlink()
        for (path, _), dst in zip(self._files, final):
            os.replace(path, dst)
        if len(final) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
            tmp = self.dir / (INDEX_NAME + _PARTIAL)
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / INDEX_NAME)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the renames themselves durable
        finally:
            os.close(dfd)

    def abort(self) -> None:
        """Drop everything written so far (the partial files); the directory is as before."""
        self._closed = True
        for path, fd in self._files:
            try:
                os.close(fd)
            except OSError:
                pass
            path.unlink(missing_ok=True)
        self._files = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()
