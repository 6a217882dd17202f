"""Builds for other instruction sets compute the same bits as this machine's build: a C driver
prints the kernels' results on fixed data, compiled for each; the aarch64 NEON one runs under
qemu-user, the plain-AVX2 one (no VNNI) natively.

Needs a cross compiler and qemu (Debian: gcc-aarch64-linux-gnu, libgomp1-arm64-cross,
qemu-user-static); skipped where they are missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from syshax.workers.cpu import build

HERE = Path(__file__).parent
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"
FLAGS = ["-O2", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-lm"]


def _build(cc: str, extra: list[str], out: Path) -> Path:
    src = build._source_dir()
    files = [str(HERE / "kernel_check.c")] + [str(src / s) for s in build.SOURCES]
    subprocess.run([cc, *extra, f"-I{src}", "-o", str(out), *files, *FLAGS], check=True)
    return out


def _run(cmd: list[str]) -> list[str]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    return out.splitlines()


@pytest.mark.skipif(
    not (shutil.which(CROSS) and shutil.which(QEMU)),
    reason=f"needs {CROSS} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user-static)",
)
def test_neon_build_equals_this_machines_build(tmp_path):
    host = _run([str(_build("gcc", ["-march=native"], tmp_path / "host"))])
    arm_bin = _build(CROSS, ["-march=armv8.2-a+dotprod"], tmp_path / "arm")
    arm = _run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(arm_bin)])
    assert len(host) == len(arm) > 50
    for h, a in zip(host, arm, strict=True):
        assert h == a, f"first difference in {h.split()[0:3]}"
    # The NEON build did take its SIMD path (else this compared two scalar builds).
    nm = subprocess.run(
        ["aarch64-linux-gnu-objdump", "-d", str(arm_bin)], capture_output=True, text=True
    ).stdout
    assert "sdot" in nm


def test_plain_avx2_build_equals_this_machines_build(tmp_path):
    """maddubs + madd (AVX2 without AVX-512 VNNI) gives the bits vpdpbusd gives."""
    host = _run([str(_build("gcc", ["-march=native"], tmp_path / "host"))])
    avx2 = _run([str(_build("gcc", ["-march=haswell"], tmp_path / "avx2"))])
    assert host == avx2


def test_vnni_branch_equals_this_machines_build(tmp_path):
    """The AVX-512 VNNI code paths (SX_VNNI), built for plain AVX2 with vpdpbusd emulated
    exactly (vnni_emul.h), so they run and are checked on any AVX2 machine."""
    host = _run([str(_build("gcc", ["-march=native"], tmp_path / "host"))])
    emul = ["-march=haswell", "-DSX_VNNI", "-include", str(HERE / "vnni_emul.h")]
    vnni_bin = _build("gcc", emul, tmp_path / "vnni")
    dis = subprocess.run(["objdump", "-d", str(vnni_bin)], capture_output=True, text=True).stdout
    # Every tile took its VNNI branch: no maddubs left, the K-quants' sc x int32 sum is there.
    assert "vpmaddubsw" not in dis and "vpmulld" in dis
    assert _run([str(vnni_bin)]) == host
