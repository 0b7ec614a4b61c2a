"""The process's memory as the node reports it, and giving freed heap back to the OS.

RSS now (what /diagnostics' memory_bytes says; it goes down again when an engine is freed) and the
peak (ru_maxrss, memory_peak_bytes). glibc keeps the heap an unloaded engine freed (ONNX Runtime's
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
