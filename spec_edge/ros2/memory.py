"""The process's memory as the node reports it, and giving freed heap back to the OS.

RSS now (what /diagnostics' memory_bytes says; it goes down again when an engine is freed) and the
peak (ru_maxrss, memory_peak_bytes). RSS mixes two kinds of pages (breakdown(), docs/ros.md "Memory"):
anonymous memory (heap, ONNX Runtime's arenas and pre-packed weights, the KV caches, Python objects: private to
the process, held until freed; the one to watch for a leak) and file-backed pages (the mapped weights file and
shared libraries: clean copies of files, shared with every process that maps them and dropped by the kernel
under memory pressure; reading more of the weights file grows them up to its size). Pss divides each shared
page among the processes that map it. glibc keeps the heap an unloaded engine freed (ONNX Runtime's
sessions, arenas and initializers: hundreds of MB in many blocks) for later allocations instead of
returning it; the next configure's allocations then land elsewhere and RSS grows with every
cleanup / configure cycle. release_freed_heap() hands it back (malloc_trim)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource


def rss_bytes() -> int:
    """Resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def breakdown(pid: int | str = "self") -> dict[str, int]:
    """The memory of a process (this one by default) in bytes: rss (VmRSS), pss (Pss: shared pages divided
    among the processes that map them), anon (RssAnon: private anonymous memory) and file (RssFile: resident
    pages of mapped files). Linux /proc; a key the kernel does not report is left out."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "Pss": "pss"}
    out: dict[str, int] = {}
    for name in ("status", "smaps_rollup"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                lines = f.read().splitlines()
        except OSError:  # smaps_rollup: Linux >= 4.14, and readable only by the process's owner
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key in keys and value.strip().endswith("kB"):
                out[keys[key]] = int(value.split()[0]) * 1024
    return out


def peak_rss_bytes() -> int:
    """The largest resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed_heap() -> None:
    """Collect unreachable Python objects, then return the C heap's free pages to the OS (glibc's
    malloc_trim; a libc without it, e.g. musl, returns freed memory by itself)."""
    gc.collect()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return
    trim(0)
