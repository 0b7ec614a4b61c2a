"""Is this a Jetson (unified memory), and what /proc/meminfo says: what memory.read_device_memory reads."""
from __future__ import annotations

from pathlib import Path


def is_jetson() -> bool:
    """A Jetson (Thor, Orin): unified memory, /proc/meminfo is the device's memory."""
    if Path("/etc/nv_tegra_release").exists():
        return True
    try:
        model = Path("/proc/device-tree/model").read_text(errors="ignore")
    except OSError:
        return False
    return "jetson" in model.lower() or "thor" in model.lower()


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo text."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in values or "MemAvailable" not in values:
        raise ValueError("no MemTotal/MemAvailable in meminfo")
    return values["MemTotal"], values["MemAvailable"]
