"""macOS memory from `vm_stat`: free + reclaimable bytes from real captured output (Apple Silicon with 16 KiB
pages, Intel with 4 KiB), and malformed output falling back safely to psutil's figure.

The samples in tests/data/vm_stat/ are real `vm_stat` output from three Macs (README.md there says where each
was published). The program itself is run through a small executable that prints a sample, so the path from
running `vm_stat` to `system_memory` is exercised on any OS."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

import engine.planning.memory as memory
from engine.planning.memory import macos_available_from_vm_stat, parse_vm_stat, system_memory

SAMPLES = Path(__file__).parent / "data" / "vm_stat"
GIB = 1024**3


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


# (file, the machine's RAM, page size, pages held: app memory (anonymous - purgeable) + wired + compressor)
CAPTURED = [
    ("apple_m4_16gib.txt", 16 * GIB, 16384, (363641 - 4133) + 106741 + 110063),
    ("apple_m5pro_48gib.txt", 48 * GIB, 16384, (768041 - 23665) + 160600 + 120819),
    ("intel_32gib.txt", 32 * GIB, 4096, (464333 - 11820) + 715958 + 0),
]


@pytest.mark.parametrize(("name", "total", "page_size", "held_pages"), CAPTURED)
def test_captured_output_gives_free_plus_reclaimable_memory(name, total, page_size, held_pages):
    text = sample(name)
    parsed_page_size, counters = parse_vm_stat(text)
    assert parsed_page_size == page_size
    available = macos_available_from_vm_stat(text, total)
    assert available == total - held_pages * page_size
    # Free pages are always available, and so is the file cache (file-backed pages can be dropped).
    assert counters["Pages free"] * page_size < available < total
    assert available >= (counters["Pages free"] + counters["File-backed pages"]) * page_size * 0.9


def test_the_page_size_comes_from_the_header_not_a_guess():
    """The same counters read as 4 KiB pages would hold a quarter of the memory: the header decides."""
    text = sample("apple_m4_16gib.txt")
    as_intel = text.replace("page size of 16384 bytes", "page size of 4096 bytes")
    assert macos_available_from_vm_stat(as_intel, 16 * GIB) > macos_available_from_vm_stat(text, 16 * GIB)


def test_lines_vm_stat_added_later_and_windows_line_ends_change_nothing():
    text = sample("apple_m5pro_48gib.txt")
    without_tag_lines = "\n".join(line for line in text.splitlines() if "tag" not in line)
    figure = macos_available_from_vm_stat(text, 48 * GIB)
    assert macos_available_from_vm_stat(without_tag_lines, 48 * GIB) == figure
    assert macos_available_from_vm_stat(text.replace("\n", "\r\n"), 48 * GIB) == figure


def _without(text: str, prefix: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(prefix))


M4 = sample("apple_m4_16gib.txt")
MALFORMED = {
    "empty": "",
    "an error instead of counters": "vm_stat: host_statistics64 failed: (os/kern) failure\n",
    "no page-size header": _without(M4, "Mach Virtual Memory Statistics"),
    "a page size of zero": M4.replace("page size of 16384 bytes", "page size of 0 bytes"),
    "a page size that is no power of two": M4.replace("page size of 16384 bytes", "page size of 16000 bytes"),
    "no anonymous-page count (older macOS)": _without(M4, "Anonymous pages"),
    "no wired count": _without(M4, "Pages wired down"),
    "cut off after six lines": "\n".join(M4.splitlines()[:6]),
    "counters with their numbers cut off": "\n".join(line.split(":")[0] + ":" for line in M4.splitlines()),
}


@pytest.mark.parametrize("output", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_output_gives_no_figure(output):
    assert macos_available_from_vm_stat(output, 16 * GIB) is None


def test_counters_of_a_bigger_machine_give_no_figure():
    """48 GiB of held pages on a 16 GiB machine: the output does not describe it, so it is not used (a zero
    would refuse every reply)."""
    assert macos_available_from_vm_stat(sample("apple_m5pro_48gib.txt"), 16 * GIB) is None


@pytest.fixture()
def fake_vm_stat(tmp_path, monkeypatch):
    """Point the engine at an executable that behaves like vm_stat: prints `output` and exits with `code`."""

    def install(output: bytes, code: int = 0) -> None:
        (tmp_path / "output").write_bytes(output)
        program = tmp_path / "vm_stat"
        program.write_text(f"#!/bin/sh\ncat '{tmp_path / 'output'}'\nexit {code}\n")
        program.chmod(program.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setattr(memory, "VM_STAT_COMMAND", (str(program),))

    return install


@pytest.mark.parametrize(("name", "total", "page_size", "held_pages"), CAPTURED)
def test_running_vm_stat_reads_its_output(fake_vm_stat, name, total, page_size, held_pages):
    fake_vm_stat(sample(name).encode())
    assert memory._macos_available_from_vm_stat(total) == total - held_pages * page_size


@pytest.mark.parametrize(("output", "code"), [(M4.encode(), 1), (b"\xff\xfe\x00garbage", 0), (b"", 0)],
                         ids=["failed", "not text", "silent"])
def test_a_failing_vm_stat_gives_no_figure(fake_vm_stat, output, code):
    fake_vm_stat(output, code)
    assert memory._macos_available_from_vm_stat(16 * GIB) is None


def test_a_missing_vm_stat_gives_no_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "VM_STAT_COMMAND", (str(tmp_path / "no-such-program"),))
    assert memory._macos_available_from_vm_stat(16 * GIB) is None


def test_system_memory_on_macos_uses_vm_stat_only_when_it_is_lower(fake_vm_stat, tmp_path):
    """On a Mac, available memory is the lower of psutil's figure and vm_stat's; the figures of a machine
    this host is not are either used exactly or (when impossible for this host) ignored."""
    no_cgroups = {"cgroup_root": tmp_path / "absent", "proc_cgroup": tmp_path / "absent-proc"}
    fake_vm_stat(M4.encode())
    system = system_memory(platform="darwin", **no_cgroups)
    counted = macos_available_from_vm_stat(M4, system["total"])
    if system["limited_by"] == "macOS free + reclaimable pages":
        assert system["available"] == counted
    else:
        assert system["limited_by"] == "physical memory"
        assert counted is None or counted >= system["available"]

    fake_vm_stat(b"vm_stat: failure\n", 1)
    fallback = system_memory(platform="darwin", **no_cgroups)
    assert fallback["limited_by"] == "physical memory" and 0 < fallback["available"] <= fallback["total"]
