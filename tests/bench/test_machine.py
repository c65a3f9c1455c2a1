"""The machine line names the CPU so a figure can be placed: a VM's bare 'AMD EPYC' gets its x86
family and model (Zen 4 and Zen 5 differ there only)."""
from tierlm.bench.machine import _cpuinfo, machine_line

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
"""

ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd bf16
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_an_x86_name_carries_its_family_and_model():
    name, flags = _cpuinfo(X86)
    assert name == "AMD EPYC (family 26 model 2)"
    assert {"avx512f", "avx512_bf16"} <= flags


def test_a_cpu_without_those_fields_keeps_what_it_has():
    assert _cpuinfo(ARM) == ("", {"fp", "asimd", "bf16"})
    assert _cpuinfo("model name\t: Some CPU\n") == ("Some CPU", set())


def test_the_line():
    kind = {"cpu": "AMD EPYC (family 26 model 2)", "isa": ["avx2", "avx512f"], "cores": 2, "ram_bytes": 24 << 30}
    assert machine_line(kind) == "AMD EPYC (family 26 model 2), 2 cores, 24.00 GiB RAM; ISA: avx2 avx512f"
