"""safetensors files as Hugging Face checkpoints use them: headers, tensors by name, FP8 included.

The reader and writer is ``safetensors``' numpy API (the optional ``hf``
extra). Its numpy reader cannot build ``float8_e4m3fn`` arrays, so FP8
tensors are read from the file's bytes at the offsets its header gives (the
format: a little-endian u64 header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the data).
"""

from __future__ import annotations

import json
import os
import stat
import struct

import ml_dtypes  # registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np

__all__ = ["DTYPES", "FP8", "checkpoint_files", "dtype_code", "index", "read", "save"]

FP8 = "F8_E4M3"
DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F64": np.dtype(np.float64),
    FP8: np.dtype(ml_dtypes.float8_e4m3fn),
}


def dtype_code(dtype) -> str:
    """The safetensors code of a numpy dtype (``"BF16"`` for bfloat16)."""
    for code, value in DTYPES.items():
        if value == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no safetensors code among {sorted(DTYPES)}")


def _library():
    try:
        from safetensors import safe_open  # pyright: ignore[reportMissingImports] -- the optional "hf" extra
        from safetensors.numpy import save_file  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise ImportError("checkpoints need safetensors: pip install 'moe_eplb_jax[hf]'") from e
    return safe_open, save_file


def checkpoint_files(path) -> list[str]:
    """``[path]`` for a file, the sorted ``*.safetensors`` of a directory; each a regular file.

    A FIFO, device or socket among them is refused before anything opens it
    (the reader would wait on a FIFO forever).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{path}: directory holds no .safetensors file")
    elif not os.path.lexists(path):
        raise ValueError(f"{path}: no such checkpoint file or directory")
    else:
        files = [path]
    for file in files:
        try:
            mode = os.stat(file).st_mode
        except OSError as e:
            raise ValueError(f"{file}: cannot read the checkpoint file ({e.strerror})") from None
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
            raise ValueError(f"{file}: cannot read the checkpoint file, it is {kind}")
    return files


def index(files: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (file, dtype code, shape), from the headers only."""
    safe_open, _ = _library()
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                    if name in found:
                        raise ValueError(f"{file}: tensor {name!r} also in {found[name][0]}")
                    piece = f.get_slice(name)
                    found[name] = (file, str(piece.get_dtype()), tuple(int(n) for n in piece.get_shape()))
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error type for a damaged header
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    return found


def read(found, names) -> dict[str, np.ndarray]:
    """The tensors ``names`` of an ``index``, as numpy arrays in their file dtype."""
    safe_open, _ = _library()
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(found[name][0], []).append(name)
    out = {}
    for file, wanted in by_file.items():
        try:
            raw = [n for n in wanted if found[n][1] == FP8]
            with safe_open(file, framework="np") as f:
                for name in wanted:
                    if found[name][1] != FP8:
                        out[name] = np.asarray(f.get_tensor(name))
            out.update(_read_raw(file, raw))
        except Exception as e:
            raise ValueError(f"{file}: could not read its tensors ({e})") from e
    return out


def _read_raw(file: str, names: list[str]) -> dict[str, np.ndarray]:
    if not names:
        return {}
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        out = {}
        for name in names:
            entry = header[name]
            begin, end = entry["data_offsets"]
            dtype = DTYPES[entry["dtype"]]
            if end - begin != dtype.itemsize * int(np.prod(entry["shape"], dtype=np.int64)):
                raise ValueError(f"tensor {name!r}: {end - begin} bytes do not hold {entry['shape']} {entry['dtype']}")
            f.seek(8 + size + begin)
            out[name] = np.frombuffer(f.read(end - begin), dtype).reshape(entry["shape"])
    return out


def save(tensors: dict[str, np.ndarray], path: str, *, metadata: dict[str, str]) -> None:
    """Writes ``tensors`` to ``path`` (overwriting it)."""
    _, save_file = _library()
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, path, metadata=metadata)
