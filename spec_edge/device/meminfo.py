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


def cuda_memory() -> tuple[int, int] | None:
    """(total, free) bytes of CUDA device 0 through the CUDA driver API (libcuda, ctypes: no torch), or None when
    there is no driver or no device."""
    import ctypes
    import ctypes.util

    try:
        cuda = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    except OSError:
        return None
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    try:
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
            return None
        if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0:
            return None
        try:
            if cuda.cuCtxPushCurrent_v2(ctx) != 0:
                return None
            ok = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(device)
    except AttributeError:
        return None
    return (int(total.value), int(free.value)) if ok else None
