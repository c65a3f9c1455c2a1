"""The hardware catalog: named parts with their datasheet rates, and combinations of them.

Every value carries its source. Rates are the vendor's peak numbers; what a real run reaches is a
fraction of them, and that fraction lives in one place (`cost.Efficiency`), applied the same way to
every part of a class, never tuned per part. Prices are reference street/list prices in USD, meant
to rank options, not to quote them.

A hardware spec combines parts with '+': `rtx4090+256GiB+p5510*12` is one RTX 4090, 256 GiB of RAM
and twelve P5510 drives in RAID-0, on the default host CPU. `*N` repeats a drive (RAID-0). Users
add or override parts in a TOML file (`[gpu.NAME]`, `[cpu.NAME]`, `[drive.NAME]`, `[system.NAME]`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ..units import parse_bytes
from ..validate import Num, Size

GB = 1000**3
GiB = 1024**3
TB = 1000**4


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_tflops: float       # dense tensor-core peak (fp32 accumulate); 0 where bf16 is not supported
    fp16_tflops: float       # dense tensor-core peak, fp16 inputs, fp32 accumulate
    mem_gbps: float          # device memory bandwidth, GB/s
    link_gbps: float         # host link, GB/s per direction (PCIe is full duplex)
    price_usd: float
    power_w: float
    source: str

    @property
    def tflops(self) -> float:
        """The training dtype's peak: bf16, or fp16 (with loss scaling) where bf16 is missing."""
        return self.bf16_tflops or self.fp16_tflops


@dataclass(frozen=True)
class CPU:
    name: str
    sockets: int
    cores: int               # all sockets
    bf16_tflops: float       # matmul peak of all sockets (AMX, AVX-512 BF16, or fp32 FMA where neither)
    mem_channels: int        # all sockets
    mem_gbps: float          # theoretical DRAM bandwidth of all channels, GB/s
    max_memory_bytes: int
    price_usd: float         # all sockets
    power_w: float           # all sockets (TDP)
    source: str


@dataclass(frozen=True)
class Drive:
    name: str
    read_gbps: float         # sequential, 128 KiB blocks, high queue depth (vendor method)
    write_gbps: float
    capacity_bytes: int
    price_usd: float
    power_w: float           # active
    source: str


_PCIE3, _PCIE4, _PCIE5 = 15.75, 31.5, 63.0  # x16 per direction, GB/s: PCI-SIG base specifications 3.0/4.0/5.0

# The GPUs' memory bandwidth (mem_gbps) and host link (link_gbps) are published datasheet values,
# not measured: what a card reaches is a fraction of them (cost.Efficiency; benchmarks/plan_vs_gpu.py
# measures both on the machine at hand beside these). Dense tensor-core rates are the datasheets'
# "with sparsity" figures halved where only those are printed.
GPUS = {g.name: g for g in [
    GPU("v100-32g", 32 * GiB, 0.0, 125.0, 900.0, _PCIE3, 10_000, 300,
        "NVIDIA Tesla V100 datasheet (SXM2 32GB: 125 TFLOPS fp16 tensor, 900 GB/s HBM2); no bf16 support"),
    GPU("a100-40g", 40 * GiB, 312.0, 312.0, 1555.0, _PCIE4, 10_000, 400,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 312 TFLOPS bf16 dense, 1,555 GB/s)"),
    GPU("a100-80g", 80 * GiB, 312.0, 312.0, 2039.0, _PCIE4, 15_000, 400,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 TFLOPS bf16 dense, 2,039 GB/s)"),
    GPU("a800-80g", 80 * GiB, 312.0, 312.0, 2039.0, _PCIE4, 15_000, 400,
        "NVIDIA A800 Tensor Core GPU product brief (SXM4 80GB: A100 compute and memory, NVLink 400 GB/s)"),
    GPU("h100-80g", 80 * GiB, 989.0, 989.0, 3350.0, _PCIE5, 30_000, 700,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS bf16 dense, 3.35 TB/s HBM3)"),
    GPU("h100-pcie", 80 * GiB, 756.0, 756.0, 2000.0, _PCIE5, 25_000, 350,
        "NVIDIA H100 Tensor Core GPU datasheet (PCIe 80GB: 1,513 TFLOPS bf16 with sparsity, 756 dense; "
        "2 TB/s HBM2e; PCIe Gen5 128 GB/s); price a reference street price (assumption)"),
    GPU("h200", 141 * GiB, 989.0, 989.0, 4800.0, _PCIE5, 35_000, 700,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM 141GB: 1,979 TFLOPS bf16 with sparsity, 989 dense; "
        "4.8 TB/s HBM3e; PCIe Gen5 128 GB/s); price a reference street price (assumption)"),
    GPU("l4", 24 * GiB, 121.0, 121.0, 300.0, _PCIE4, 2_500, 72,
        "NVIDIA L4 Tensor Core GPU datasheet (24GB GDDR6: 242 TFLOPS bf16 with sparsity, 121 dense; "
        "300 GB/s; PCIe Gen4 x16 64 GB/s; 72 W); price a reference street price (assumption)"),
    GPU("h800-80g", 80 * GiB, 989.0, 989.0, 3350.0, _PCIE5, 30_000, 700,
        "NVIDIA H800 product brief (SXM5: H100 compute and memory, NVLink 400 GB/s)"),
    GPU("rtx4090", 24 * GiB, 165.2, 165.2, 1008.0, _PCIE4, 1_599, 450,
        "NVIDIA Ada Lovelace architecture whitepaper, appendix A (RTX 4090: 165.2 TFLOPS bf16/fp16 "
        "tensor dense with fp32 accumulate, 1,008 GB/s GDDR6X); US launch MSRP $1,599"),
]}

CPUS = {c.name: c for c in [
    # Ice Lake has AVX-512 but no bf16 instructions: the fp32 FMA peak (2 x 512-bit FMA/cycle = 64 FLOP
    # per cycle per core) at the 2.2 GHz base clock stands in for it.
    CPU("xeon-gold-5320x2", 2, 52, 52 * 64 * 2.2e9 / 1e12, 16, 16 * 25.6, 12 * TB, 2 * 1_555, 2 * 185,
        "Intel ARK, Xeon Gold 5320 (26 cores, 2.2 GHz, 8 channels DDR4-3200, 6 TB per socket, "
        "RCP $1,555, 185 W); 2 sockets"),
    # Sapphire Rapids AMX: 2,048 bf16 FLOP/cycle/core (Intel 64 and IA-32 Optimization Reference Manual,
    # AMX chapter: 1,024 bf16 multiply-adds per cycle), at the 2.0 GHz base clock.
    CPU("xeon-8480x2", 2, 112, 112 * 2048 * 2.0e9 / 1e12, 16, 16 * 38.4, 8 * TB, 2 * 10_710, 2 * 350,
        "Intel ARK, Xeon Platinum 8480+ (56 cores, 2.0 GHz, AMX, 8 channels DDR5-4800, 4 TB per socket, "
        "RCP $10,710, 350 W); 2 sockets"),
    CPU("xeon-8490hx4", 4, 240, 240 * 2048 * 1.9e9 / 1e12, 32, 32 * 38.4, 16 * TB, 4 * 17_000, 4 * 350,
        "Intel ARK, Xeon Platinum 8490H (60 cores, 1.9 GHz, AMX, 8 channels DDR5-4800, 4 TB per socket, "
        "8-socket capable, RCP $17,000, 350 W); 4 sockets"),
    # Zen 4 runs AVX-512 BF16 (VDPBF16PS) on two 256-bit pipes: 64 bf16 FLOP/cycle/core.
    CPU("epyc-9654x2", 2, 192, 192 * 64 * 2.4e9 / 1e12, 24, 24 * 38.4, 12 * TB, 2 * 11_805, 2 * 360,
        "AMD EPYC 9654 product page (96 cores, 2.4 GHz base, AVX-512 BF16, 12 channels DDR5-4800, "
        "6 TB per socket, 1kU price $11,805, 360 W); 2 sockets"),
    CPU("epyc-9124", 1, 16, 16 * 64 * 3.0e9 / 1e12, 12, 12 * 38.4, 6 * TB, 1_083, 200,
        "AMD EPYC 9124 product page (16 cores, 3.0 GHz base, AVX-512 BF16, 12 channels DDR5-4800, "
        "6 TB, 1kU price $1,083, 200 W)"),
]}

DRIVES = {d.name: d for d in [
    Drive("p5510", 6.5, 3.4, int(3.84 * TB), 400, 18,
          "Intel SSD D7-P5510 product brief (3.84 TB, PCIe 4.0: 6,500 MB/s read, 3,400 MB/s write, 18 W)"),
    Drive("pm9a3", 6.9, 4.1, int(3.84 * TB), 400, 13,
          "Samsung PM9A3 U.2 datasheet (3.84 TB: 6,900 MB/s read, 4,100 MB/s write, 13 W)"),
    Drive("micron-7450", 6.8, 5.3, int(3.84 * TB), 450, 20,
          "Micron 7450 PRO U.3 product brief (3.84 TB: 6,800 MB/s read, 5,300 MB/s write)"),
    Drive("cm7-r", 14.0, 6.75, int(3.84 * TB), 800, 24,
          "KIOXIA CM7-R product brief (3.84 TB, PCIe 5.0: 14,000 MB/s read, 6,750 MB/s write)"),
    Drive("990pro", 7.45, 6.9, 2 * TB, 170, 8.5,
          "Samsung 990 PRO datasheet (2 TB: 7,450 MB/s read, 6,900 MB/s write); consumer drive"),
]}

# Combinations worth naming. `lohan` is the machine of Liao et al. 2024 (Fuyou/LoHan), as that paper
# describes it: one RTX 4090, 768 GB DDR4, 12 NVMe drives in RAID-0.
SYSTEMS = {
    "lohan": "rtx4090+xeon-gold-5320x2+768GB+p5510*12",
    "4090-workstation": "rtx4090+epyc-9124+256GiB+990pro*2",
    "a100-server": "a100-80g+epyc-9124+512GiB+pm9a3*4",
    "h100-server": "h100-80g+epyc-9124+1TiB+cm7-r*4",
    "cpu-4s-ddr5": "xeon-8490hx4+1TiB+pm9a3*4",
    "cpu-2s-genoa": "epyc-9654x2+768GiB+pm9a3*4",
}

DEFAULT_CPU = "epyc-9124"      # host of a spec that names a GPU and no CPU
DEFAULT_RAM = 256 * GiB        # RAM of a spec that names no size

# Prices and power of the parts the table does not itemise. Assumptions, stated, used for every spec.
DRAM_USD_PER_GIB = 3.0         # DDR4/DDR5 registered DIMMs, 2024 street price per GiB (assumption)
DRAM_W_PER_GIB = 0.375         # ~3 W per 8 GiB of registered DIMM under load (assumption)
PLATFORM_USD = 2_500           # board, chassis, PSU (assumption)
PLATFORM_W = 100               # fans, board, NIC (assumption)


@dataclass
class Hardware:
    """One machine: at most one GPU, a CPU (all sockets), RAM, and a RAID-0 of identical drives."""
    spec: str
    cpu: CPU
    ram_bytes: int
    gpu: GPU | None = None
    drive: Drive | None = None
    drives: int = 0
    measured: dict | None = None          # `bench` results when spec == "this"
    price_usd: float | None = None        # overrides the sum of parts (e.g. `this` from a TOML file)
    notes: list = field(default_factory=list)

    @property
    def nvme_read_gbps(self) -> float:
        return self.drive.read_gbps * self.drives if self.drive else 0.0

    @property
    def nvme_write_gbps(self) -> float:
        return self.drive.write_gbps * self.drives if self.drive else 0.0

    @property
    def nvme_bytes(self) -> int:
        return self.drive.capacity_bytes * self.drives if self.drive else 0

    def parts_price(self) -> float | None:
        if self.price_usd is not None:
            return self.price_usd
        if self.measured is not None:
            return None
        total = PLATFORM_USD + self.cpu.price_usd + DRAM_USD_PER_GIB * self.ram_bytes / GiB
        total += self.gpu.price_usd if self.gpu else 0
        total += self.drive.price_usd * self.drives if self.drive else 0
        return total

    def power_w(self) -> float:
        w = PLATFORM_W + self.cpu.power_w + DRAM_W_PER_GIB * self.ram_bytes / GiB
        w += self.gpu.power_w if self.gpu else 0
        return w + (self.drive.power_w * self.drives if self.drive else 0)

    def describe(self) -> str:
        parts = [self.gpu.name if self.gpu else None, self.cpu.name, f"{self.ram_bytes / GiB:,.0f} GiB RAM",
                 f"{self.drives}x {self.drive.name} (RAID-0)" if self.drive else "no NVMe"]
        return ", ".join(p for p in parts if p)


_GRAMMAR = ("write 'this', a system name, or parts joined by '+': a GPU, a CPU, a RAM size like 256GiB "
            "and a drive, NAME*N for N >= 1 drives in RAID-0, e.g. rtx4090+256GiB+p5510*12")


def _bad(given: str, part: str, why: str, fix: str = _GRAMMAR) -> ValueError:
    """The error of a --hardware spec: the spec as given, the part at fault, why, and the fix."""
    return ValueError(f"--hardware {given!r}: {f'part {part!r}: ' if part else ''}{why}; {fix}")


@dataclass
class _Parts:
    """What a spec has named so far: at most one GPU, CPU, kind of drive (with its count) and RAM size."""
    gpu: GPU | None = None
    cpu: CPU | None = None
    drive: Drive | None = None
    drives: int = 0
    ram: int | None = None


class Catalog:
    def __init__(self):
        self.gpus, self.cpus, self.drives = dict(GPUS), dict(CPUS), dict(DRIVES)
        self.systems = dict(SYSTEMS)

    def add_toml(self, text: str, where: str) -> "Catalog":
        """Add or replace parts from a TOML text (a `--catalog` file's, read by the recipe):
        [gpu.NAME], [cpu.NAME], [drive.NAME] tables with every field of that class (sizes may be
        strings like "48GiB"), [system] NAME = "spec". where: the file, for the errors."""
        import tomllib

        path = where
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--catalog {path}: cannot read it as TOML: {e}") from None
        kinds = {"gpu": (GPU, self.gpus), "cpu": (CPU, self.cpus), "drive": (Drive, self.drives)}
        for kind, table in data.items():
            if kind == "system":
                self.systems.update({str(k): str(v) for k, v in table.items()})
                continue
            if kind not in kinds:
                raise ValueError(f"--catalog {path}: unknown table [{kind}]; use [gpu.NAME], [cpu.NAME], "
                                 f"[drive.NAME] or [system]")
            cls, target = kinds[kind]
            for name, fields_ in table.items():
                target[name] = _part_from_toml(cls, name, fields_, f"{path} [{kind}.{name}]")
        return self

    def names(self) -> dict[str, list[str]]:
        return {"gpu": sorted(self.gpus), "cpu": sorted(self.cpus), "drive": sorted(self.drives),
                "system": sorted(self.systems)}

    def parse(self, spec: str) -> Hardware:
        """A spec like 'rtx4090+256GiB+p5510*12', or a system name.

        The grammar, strictly (a typo must not plan a default machine in silence): parts joined by
        '+', none empty; a part is a GPU, a CPU, a drive with an optional *N (N >= 1 drives in RAID-0)
        or a RAM size with its unit (> 0); at most one of each. Each error names the bad part."""
        given = spec
        spec = spec.strip().lower()
        if spec in self.systems:
            hw = self.parse(self.systems[spec])
            hw.spec = spec
            return hw
        if not spec:
            raise _bad(given, "", "empty")
        parts = _Parts()
        for raw in (p.strip() for p in given.strip().split("+")):  # as the user wrote them, for the errors
            self._add_part(parts, given, raw)
        return self._machine(spec, parts)

    def _add_part(self, parts: _Parts, given: str, raw: str) -> None:
        """Add the part `raw` of the spec `given` to `parts`, or raise what is wrong with it."""
        if not raw:
            raise _bad(given, "", "an empty part (a '+' at either end, or two together)")
        name, n = self._name_and_count(given, raw)
        if name in self.systems:
            raise _bad(given, raw, "a whole system", f"use {name!r} alone, or its parts: {self.systems[name]}")
        elif name in self.gpus:
            if parts.gpu is not None:
                raise _bad(given, raw, "one GPU per machine is planned so far", f"drop the extra {name!r}")
            parts.gpu = self.gpus[name]
        elif name in self.cpus:
            if parts.cpu is not None:
                raise _bad(given, raw, f"a second CPU (after {parts.cpu.name})",
                           "give one CPU entry; a multi-socket CPU is its own entry, e.g. xeon-8480x2")
            parts.cpu = self.cpus[name]
        elif name in self.drives or name in ("nvme", "nvme-default"):
            if parts.drive is not None:
                raise _bad(given, raw, f"a second kind of drive (after {parts.drive.name})",
                           "the drives form one RAID-0 of identical drives: give one NAME*N")
            parts.drive, parts.drives = self.drives.get(name, self.drives["pm9a3"]), n
        elif re.fullmatch(r"[0-9.]+[kmgt]i?b?", name):
            if parts.ram is not None:
                raise _bad(given, raw, "a second RAM size", "give the machine's RAM once")
            parts.ram = parse_bytes(name, f"--hardware {given!r} part {raw!r}")  # its own error for '1.2.3gib'
            if parts.ram <= 0:
                raise _bad(given, raw, "the RAM size must be > 0", "write it like 256GiB or 768GB")
        elif re.fullmatch(r"[0-9.]+b?", name):
            raise _bad(given, raw, "a RAM size needs its unit", f"write it like {name.rstrip('b')}GiB")
        else:
            raise _bad(given, "", f"unknown part {raw!r}", "known: " + "; ".join(
                f"{k}: {', '.join(v)}" for k, v in self.names().items()) + f" (or a RAM size); {_GRAMMAR}")

    def _name_and_count(self, given: str, raw: str) -> tuple[str, int]:
        """A part's name and its count (NAME*N; 1 without '*'), only a drive taking one."""
        m = re.fullmatch(r"([a-z0-9_.\-]+)(?:\*(.*))?", raw.lower())
        if not m:
            raise _bad(given, raw, "cannot read it")
        name, count = m.group(1), m.group(2)
        if count is not None and (not count.isdigit() or int(count) < 1):
            raise _bad(given, raw, f"the count after '*' must be an integer >= 1; got {count!r}",
                       f"write {name}*N with N >= 1, or {name} for one")
        if count is not None and name not in self.drives and not name.startswith("nvme"):
            raise _bad(given, raw, "only a drive takes *N (drives in RAID-0)",
                       "one GPU per machine is planned so far, and a CPU entry holds all its sockets "
                       f"(e.g. xeon-8480x2); drop the '*{count}'" if name in self.gpus or name in self.cpus
                       else f"drives: {', '.join(sorted(self.drives))}")
        return name, int(count) if count is not None else 1

    def _machine(self, spec: str, parts: _Parts) -> Hardware:
        """The machine of `parts`, the default CPU and RAM where none is named (said in its notes)."""
        cpu = parts.cpu or self.cpus[DEFAULT_CPU]
        hw = Hardware(spec, cpu, parts.ram if parts.ram is not None else DEFAULT_RAM, parts.gpu, parts.drive,
                      parts.drives)
        if parts.ram is None:
            hw.notes.append(f"no RAM size given: assumed {DEFAULT_RAM // GiB} GiB")
        if cpu.name == DEFAULT_CPU and DEFAULT_CPU not in spec:
            hw.notes.append(f"no CPU given: assumed {DEFAULT_CPU}")
        if hw.ram_bytes > cpu.max_memory_bytes:
            raise ValueError(f"--hardware {spec!r}: {hw.ram_bytes / GiB:,.0f} GiB of RAM is more than "
                             f"{cpu.name} holds ({cpu.max_memory_bytes / GiB:,.0f} GiB); pick a larger CPU")
        return hw

    def everything(self) -> list[str]:
        """`--compare all`: every named system, and every GPU and CPU on a default host."""
        specs = list(self.systems)
        specs += [f"{g}+256GiB+pm9a3*4" for g in sorted(self.gpus)]
        specs += [f"{c}+{min(1024, self.cpus[c].max_memory_bytes // GiB)}GiB+pm9a3*4" for c in sorted(self.cpus)]
        return specs


# no bf16 (fp16 stands in), free (a machine already owned), or no power figure
_MAY_BE_ZERO = {"bf16_tflops", "fp16_tflops", "price_usd", "power_w"}


def _part_from_toml(cls, name: str, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)} - {"name"}
    unknown = set(values) - known
    missing = known - set(values)
    if unknown or missing:
        raise ValueError(f"{where}: " + "; ".join(filter(None, [
            f"unknown field(s) {', '.join(sorted(unknown))}" if unknown else "",
            f"missing field(s) {', '.join(sorted(missing))}" if missing else ""])) + f" (fields: {', '.join(sorted(known))})")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name == "name":
            continue
        v = values[f.name]
        what = f"{where} {f.name}"
        if f.name.endswith("_bytes"):
            v = parse_bytes(v, what)
            Size().check(v, what)
        elif f.type in ("int", int, "float", float):
            kind = int if f.type in ("int", int) else float
            try:
                v = kind(v) if not isinstance(v, bool) else None
            except (TypeError, ValueError):
                v = None
            if v is None:
                raise ValueError(f"{what} must be {'an integer' if kind is int else 'a number'}; got {values[f.name]!r}")
            # a rate of 0 divides by zero in the planner; 0 is a real value only where it means "none"
            (Num(kind, ge=0) if f.name in _MAY_BE_ZERO else Num(kind, gt=0)).check(v, what)
        else:
            v = str(v)
        kw[f.name] = v
    if not kw["source"].strip():
        raise ValueError(f"{where}: source must say where the numbers come from")
    return cls(name=name, **kw)
