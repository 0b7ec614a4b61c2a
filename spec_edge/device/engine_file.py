"""An engine file on disk, read into TensorRT as a stream, and its cheap stamp.

Loading: `load_engine(trt, runtime, path)` hands TensorRT an IStreamReaderV2 over the open file
(TensorRT 10.7+; `Runtime.deserialize_cuda_engine(stream_reader_v2)`), so the file is never held
whole in host memory next to TensorRT's own copy. The bindings call `read(num_bytes, stream)` until
they have every byte TensorRT asked for; each call returns at most READ_CHUNK bytes, so the host
side of a load peaks at one chunk (LOAD_PEAK_BYTES) instead of the engine's size (~15 GiB for an 8B
target in bf16: on Thor's unified memory that was the device's memory too). memory.py counts that
peak through load_peak_bytes().

Stamp: `engine_stamp(path)` is the engine's size and the sha256 of its first and last MiB: what
the runtime checks at every start (milliseconds), where the full sha256 (a minute for an 8B engine
on Thor) runs in `spec-edge build --check` only (manifest.check_engines verify='full').

Needs tensorrt only inside load_engine (the caller passes the module in); nothing is imported here.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

READ_CHUNK = 64 << 20        # bytes handed to TensorRT per read() call
LOAD_PEAK_BYTES = READ_CHUNK  # host bytes an engine load holds beyond TensorRT's own copy
STAMP_BYTES = 1 << 20        # head and tail hashed by engine_stamp
# TensorRT members used on objects (test/test_tensorrt_api.py checks them, the trt.X chains and the
# methods FileReader overrides against the 10.13 bindings)
TENSORRT_API = {"Runtime": ("deserialize_cuda_engine",)}
TENSORRT_RECEIVERS = {"runtime": "Runtime"}  # expressions that always hold that TensorRT class here


def load_peak_bytes() -> int:
    """Host memory an engine load needs on top of the engine itself (one read chunk)."""
    return LOAD_PEAK_BYTES


def engine_stamp(path: Path) -> str:
    """'<size>:<sha256 of the first and last MiB>', cheap enough for every start."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(STAMP_BYTES))
        if size > STAMP_BYTES:
            fh.seek(max(STAMP_BYTES, size - STAMP_BYTES))
            digest.update(fh.read())
    return f"{size}:{digest.hexdigest()[:32]}"


def stream_reader(trt, fh, chunk: int = READ_CHUNK):
    """An IStreamReaderV2 over the open binary file `fh` (read(num_bytes, stream) -> bytes of at
    most `chunk`; seek(offset, SeekPosition) -> bool)."""
    whence = {trt.SeekPosition.SET: 0, trt.SeekPosition.CUR: 1, trt.SeekPosition.END: 2}

    class FileReader(trt.IStreamReaderV2):
        def __init__(self):
            trt.IStreamReaderV2.__init__(self)

        def read(self, num_bytes, stream):  # the bindings copy it (host or device) and ask again
            return fh.read(min(int(num_bytes), chunk))

        def seek(self, offset, where):
            fh.seek(int(offset), whence[where])
            return True

    return FileReader()


def load_engine(trt, runtime, path: Path):
    """Deserialize the engine at `path` by streaming it; None when TensorRT refuses it (another
    TensorRT or GPU built it, or the file is damaged: the caller says what to rebuild)."""
    with Path(path).open("rb") as fh:
        reader = stream_reader(trt, fh)
        return runtime.deserialize_cuda_engine(reader)
