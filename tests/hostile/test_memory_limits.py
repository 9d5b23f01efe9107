"""Issue 10, item 2: memory figures follow cgroup limits, and the CLI refuses a turn that cannot fit.

Each test builds a fake cgroup file system (the files the kernel shows under /sys/fs/cgroup) in a
temporary folder and points the engine at it."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.planning.memory as memory
from engine.planning.memory import cgroup_memory_limits, macos_available_bytes, parse_vm_stat, system_memory

GB = 1_000_000_000
MB = 1_000_000


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_v2(root: Path, own: str, limits: dict[str, tuple[str, int, int]]) -> Path:
    """A cgroup v2 tree: {relative folder: (memory.max, memory.current, inactive_file)}; returns the
    /proc/self/cgroup file naming `own` as this process's cgroup."""
    for folder, (limit, current, inactive) in limits.items():
        base = root / folder if folder else root
        write(base / "memory.max", f"{limit}\n")
        write(base / "memory.current", f"{current}\n")
        write(base / "memory.stat", f"anon {current}\nfile 0\ninactive_file {inactive}\nactive_file 0\n")
    proc = root.parent / "proc_self_cgroup"
    write(proc, f"0::{own}\n")
    return proc


def test_cgroup_v2_limit_caps_available_memory(tmp_path):
    root = tmp_path / "cgroup"
    proc = fake_v2(root, "/", {"": (str(1 * GB), 600 * MB, 100 * MB)})
    system = system_memory(cgroup_root=root, proc_cgroup=proc)
    assert system["total"] == 1 * GB
    assert system["available"] == 1 * GB - 600 * MB + 100 * MB  # the inactive page cache can be dropped
    assert system["limited_by"] == f"cgroup v2 {root / 'memory.max'}"
    assert system["pressure"] == "normal"


def test_the_tightest_nested_cgroup_wins(tmp_path):
    root = tmp_path / "cgroup"
    proc = fake_v2(root, "/user.slice/velox.scope", {
        "user.slice": (str(1 * GB), 920 * MB, 0),  # the parent is nearly full
        "user.slice/velox.scope": ("max", 300 * MB, 0),  # no limit of its own
    })
    limits = cgroup_memory_limits(root, proc)
    assert [limit.limit for limit in limits] == [1 * GB]
    system = system_memory(cgroup_root=root, proc_cgroup=proc)
    assert system["available"] == 80 * MB
    assert system["pressure"] == "critical"


def test_cgroup_v1_limit_and_unlimited_marker(tmp_path):
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_self_cgroup"
    write(proc, "4:memory:/docker/abc\n0::/\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{2 * GB}\n")
    write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{1500 * MB}\n")
    write(root / "memory" / "docker" / "abc" / "memory.stat", f"cache 0\ntotal_inactive_file {200 * MB}\n")
    system = system_memory(cgroup_root=root, proc_cgroup=proc)
    assert system["total"] == 2 * GB
    assert system["available"] == 2 * GB - 1500 * MB + 200 * MB
    assert "cgroup v1" in system["limited_by"]


def test_no_cgroup_file_system_means_physical_memory(tmp_path):
    system = system_memory(cgroup_root=tmp_path / "absent", proc_cgroup=tmp_path / "absent-proc")
    assert system["limited_by"] == "physical memory"
    assert 0 < system["available"] <= system["total"]


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               10000.
Pages active:                            200000.
Pages inactive:                          190000.
Pages speculative:                         3000.
Pages throttled:                              0.
Pages wired down:                        100000.
Pages purgeable:                           5000.
"Translation faults":                 123456789.
File-backed pages:                       150000.
Anonymous pages:                         243000.
Pages stored in compressor:              400000.
Pages occupied by compressor:             50000.
"""


def test_macos_available_counts_free_and_reclaimable_pages_only():
    page_size, counters = parse_vm_stat(VM_STAT)
    assert page_size == 16384
    assert counters["Pages occupied by compressor"] == 50000
    total = 16 * 1024**3  # 1,048,576 pages of 16 KB
    held = (243000 - 5000) + 100000 + 50000  # app memory + wired + compressor
    assert macos_available_bytes(total, page_size, counters) == total - held * page_size


def test_cli_refuses_a_turn_that_does_not_fit_the_cgroup_before_reading(default_model_path, tmp_path,
                                                                         monkeypatch, capsys):
    # The probe: inside a 1 GB cgroup the CLI read 5,120 of 8,153 tokens and was killed (exit 137).
    root = tmp_path / "cgroup"
    proc = fake_v2(root, "/", {"": (str(1 * GB), 1 * GB - 50 * MB, 0)})
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", proc)
    document = tmp_path / "long.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 600)

    from app.cli import main

    code = main(["chat", "--model", str(default_model_path), "--doc", str(document), "--prompt", "Summarise.",
                 "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 1
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "can be used safely" in errors[0], captured.err
    assert "Traceback" not in captured.err
    assert "[reading" not in captured.err and captured.out == ""  # refused before any token was read


@pytest.mark.parametrize("argument", [["--max-tokens", "0"], ["--temperature", "-1"], ["--top-p", "0"],
                                      ["--temp", "nan"], ["--seed", "-1"], ["--kv-bits", "0"]])
def test_cli_rejects_out_of_range_arguments_in_one_line(argument, capsys):
    from app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--prompt", "hi", *argument])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert [line for line in error.splitlines() if "error:" in line][0].count("out of range") == 1
