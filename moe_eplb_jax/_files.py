"""The package's one way to write and read files: atomic writes and checked ``.json`` / ``.npz`` readers.

* :func:`atomic_write` / :func:`atomic_path` -- every file the package writes
  goes through a unique temporary file in the target directory
  (``tempfile.mkstemp``, given the mode a new file gets), flushed, fsynced and
  renamed over the target: a crash never leaves half a file, and two
  processes writing one path never collide (the last rename wins whole).
* :func:`check_output_path` -- whether a file can be written at a path, tried
  before the work whose result goes there.
* :func:`read_json` / :func:`read_npz` -- regular files only (a FIFO, a device
  or a link to one is refused before it is read); JSON with duplicate keys,
  ``NaN`` / ``Infinity`` or deep nesting is refused; ``.npz`` members are read
  by their ``.npy`` headers, whose declared sizes are checked against the
  archive before anything is allocated.
* :func:`write_document` / :func:`read_fields` + :func:`check_document` --
  versioned documents: a flat mapping of field names to scalars or arrays
  carrying a ``format`` name and an integer ``version``; JSON stores arrays as
  nested lists, ``.npz`` every field as an array (scalars as 0-d arrays).
  :func:`int_field` / :func:`array_field` read a field strictly (a bool is not
  an int, a string is not a number).

Every malformed file raises ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import stat
import tempfile
import zipfile
import zlib
from typing import Any

import numpy as np

__all__ = [
    "array_field",
    "atomic_path",
    "atomic_write",
    "check_document",
    "FIGURE_SUFFIXES",
    "check_output_path",
    "int_field",
    "pyplot",
    "read_fields",
    "read_json",
    "read_npz",
    "save_figure",
    "write_document",
    "write_json",
]

# Deflate expands at most 1032-fold; a member declaring more than this per stored byte is damaged, so no
# header can make the reader allocate more than about a thousand times the archive's size.
_MAX_DEFLATE_RATIO = 1032
_MAX_NPY_HEADER = 10_000
_NPZ_KINDS = "biufU"  # bool, integers, floats, text; no objects (pickles) and no raw bytes


def _kind(path: str, what: str, suffixes=(".json", ".npz")) -> str:
    for suffix in suffixes:
        if path.endswith(suffix):
            return suffix
    raise ValueError(f"{what} file must end in {' or '.join(suffixes)}, got {path!r}")


# ------------------------------------------------------------------ writing
def check_output_path(path, *, what: str, suffixes: tuple[str, ...] | None = None) -> str:
    """``path`` as a string if a file can be written there; ``ValueError`` saying why not otherwise.

    The path must be a non-empty string or path object; its directory must
    exist and take a new file (tried: a temporary file is made and removed,
    so ``/proc``, ``/sys``, read-only mounts and unwritable directories are
    refused here, not after the work); the path must not name a directory,
    a device, a FIFO or a socket; with ``suffixes`` the name must end in one
    of them. Call it before long work whose result goes to ``path``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} file: need a path, got {path!r}")
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} file: need a non-empty path, got {path!r}")
    if suffixes is not None:
        _kind(path, what, suffixes)
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise ValueError(f"{path}: cannot write the {what} file, directory {directory!r} does not exist")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise ValueError(f"{path}: cannot write the {what} file ({e.strerror})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{path}: cannot write the {what} file, the path names a directory")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{path}: cannot write the {what} file, the path names a device, FIFO or socket")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".probe")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{path}: cannot write the {what} file in {directory!r} ({e.strerror or e})") from None
    return path


def _new_file_mode(path: str) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)  # replacing a file keeps its permissions
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path, *, what: str):
    """Context manager yielding a temporary file name whose file replaces ``path`` on a clean exit.

    For writers that take a file name (``atomic_write`` hands a file object):
    the temporary file sits next to ``path`` with the mode a new file there
    gets (``0666`` less the umask, or the replaced file's), is fsynced and
    renamed over ``path``; on an exception it is removed and ``path`` is
    untouched. An ``OSError`` becomes a ``ValueError`` naming ``path``.
    """
    path = check_output_path(path, what=what)
    directory = os.path.dirname(path) or "."
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        yield tmp
        os.chmod(tmp, _new_file_mode(path))  # after the writer: some (safetensors) replace the file they are given
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise ValueError(f"{path}: cannot write the {what} file ({e.strerror or e})") from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    _sync_directory(directory)


@contextlib.contextmanager
def atomic_write(path, *, what: str):
    """Context manager yielding a binary file object whose contents replace ``path`` on a clean exit.

    The data goes to a unique temporary file next to ``path`` (see
    :func:`atomic_path`); on exit it is flushed, fsynced and renamed over
    ``path`` (then the directory is fsynced). On an exception the temporary
    file is removed and ``path`` is untouched.
    """
    with atomic_path(path, what=what) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()


def _sync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):  # the rename is durable once the directory is; not every FS allows it
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def save_figure(fig, path, *, what: str = "figure") -> None:
    """Saves a matplotlib figure atomically; the image format follows the suffix, one of :data:`FIGURE_SUFFIXES`."""
    path = check_output_path(path, what=what, suffixes=FIGURE_SUFFIXES)
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    with atomic_write(path, what=what) as f:
        fig.savefig(f, format=suffix, dpi=100)


def write_document(path, fields: dict, *, what: str) -> None:
    """Writes ``fields`` (name -> scalar, string or array) as JSON or npz, chosen by the suffix, atomically."""
    path = check_output_path(path, what=what, suffixes=(".json", ".npz"))
    suffix = _kind(path, what)
    if suffix == ".npz":
        with atomic_write(path, what=what) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name, value in fields.items():  # the layout np.savez_compressed writes, without pickles
                with archive.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)
    else:
        doc = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
        write_json(path, doc, what=what)


def write_json(path, doc: Any, *, what: str) -> None:
    """Writes ``doc`` as compact standard JSON (no NaN / Infinity), atomically."""
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    with atomic_write(path, what=what) as f:
        f.write(text.encode())


# ------------------------------------------------------------------ reading
def _read_regular_file(path: str, what: str) -> bytes:
    """The bytes of a regular file; FIFOs, devices and links to them are refused before any read."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer before fstat can refuse it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        raise ValueError(f"{path}: cannot read the {what} file, it is {kind}")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise ValueError(f"{path}: cannot read the {what} file ({e.strerror})") from None


def _unique_keys(pairs):
    doc = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"duplicate key {key!r}")
        doc[key] = value
    return doc


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _find_bool_in_lists(value) -> bool:
    if isinstance(value, list):
        return any(type(x) is bool or _find_bool_in_lists(x) for x in value)
    return False


def read_json(path, *, what: str) -> dict:
    """Parses a JSON object from a regular file; ``ValueError`` naming the file for anything malformed."""
    path = os.fspath(path)
    raw = _read_regular_file(path, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"{path}: not a {what} file, its JSON is nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level must be a JSON object, got {type(doc).__name__}")
    # numpy reads [true, 2] as [1, 2]: a bool inside a table must be found by type (only if the text has one).
    if "true" in text or "false" in text:
        for key, value in doc.items():
            try:
                found = _find_bool_in_lists(value)
            except RecursionError:
                raise ValueError(f"{path}: field {key!r} is nested too deeply") from None
            if found:
                raise ValueError(f"{path}: field {key!r} holds true/false inside a table of numbers")
    return doc


def _npy_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, archive_size: int) -> np.ndarray:
    field = info.filename.removesuffix(".npy")
    where = f"{path}: field {field!r}"
    if info.compress_size > archive_size or info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 4096:
        raise ValueError(f"{where}: damaged archive entry (sizes {info.compress_size} -> {info.file_size} bytes)")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=_MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=_MAX_NPY_HEADER)
        else:
            raise ValueError(f"{where}: unsupported .npy format version {version}")
        if dtype.hasobject or dtype.kind not in _NPZ_KINDS or dtype.fields is not None:
            raise ValueError(f"{where}: unsupported dtype {dtype} (numbers or text only)")
        count = math.prod(shape)
        declared = count * dtype.itemsize
        if f.tell() + declared != info.file_size:
            raise ValueError(
                f"{where}: header declares shape {shape} ({declared} bytes) but the archive holds "
                f"{info.file_size - f.tell()} bytes"
            )
        array = np.empty(count, dtype)
        view = array.view(np.uint8)
        filled = 0
        while filled < declared:
            chunk = f.read(min(declared - filled, 1 << 24))
            if not chunk:
                raise ValueError(f"{where}: truncated data ({filled} of {declared} bytes)")
            view[filled : filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
            filled += len(chunk)
        if f.read(1):  # also reaches the end of the member, where zipfile checks its CRC
            raise ValueError(f"{where}: data past the declared shape {shape}")
    return array.reshape(shape, order="F" if fortran else "C")


def read_npz(path, *, what: str) -> dict:
    """Reads every array of an ``.npz`` file (no pickles), checking each header before allocating."""
    path = os.fspath(path)
    raw = _read_regular_file(path, what)
    fields = {}
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy") or info.is_dir():
                    raise ValueError(f"{path}: not a {what} .npz file (member {info.filename!r} is not an array)")
                name = info.filename.removesuffix(".npy")
                if name in fields:
                    raise ValueError(f"{path}: field {name!r} appears twice")
                fields[name] = _npy_member(archive, info, path, len(raw))
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable .npz {what} file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path}: not a readable .npz {what} file ({e})") from None
    return {k: (v.item() if v.ndim == 0 else v) for k, v in fields.items()}


def read_fields(path, *, what: str) -> dict:
    """The fields of a ``.json`` (:func:`read_json`) or ``.npz`` (:func:`read_npz`) file, chosen by the suffix."""
    path = os.fspath(path)
    return read_npz(path, what=what) if _kind(path, what) == ".npz" else read_json(path, what=what)


def check_document(doc: dict, path: str, *, file_format: str, version: int, fields: tuple[str, ...] = ()) -> None:
    """Checks a versioned document's ``format`` and ``version`` and, given ``fields``, that no other field appears."""
    if "format" not in doc:
        raise ValueError(f"{path}: missing field 'format'")
    if doc["format"] != file_format:
        raise ValueError(f"{path}: field 'format' is {doc['format']!r}, expected {file_format!r}")
    found = doc.get("version")
    if type(found) is not int or found != version:
        raise ValueError(f"{path}: unsupported field 'version' {found!r} (this library reads {version})")
    if fields:
        unknown = sorted(set(doc) - set(fields) - {"format", "version"})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; a {file_format} file holds {list(fields)}")


# ------------------------------------------------------------ typed fields
def int_field(doc: dict, name: str, path: str, *, minimum: int | None = None) -> int:
    """The integer field ``name`` of ``doc`` (a bool is not an int; 3.0 is not an int)."""
    if name not in doc:
        raise ValueError(f"{path}: missing field {name!r}")
    value = doc[name]
    if minimum is None:
        kind = "an integer"
    else:
        kind = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{path}: field {name!r} must be {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}: field {name!r} must be {kind}, got {value!r}")
    return int(value)


def _json_table(value, name: str, path: str) -> np.ndarray:
    """A JSON value (nested lists of numbers) as an exact numpy array; strings and ragged rows refused."""
    try:
        table = np.asarray(value)
    except (ValueError, OverflowError) as e:
        raise ValueError(f"{path}: field {name!r} is not a rectangular table of numbers ({e})") from None
    if table.dtype == object:
        if all(type(x) is int for x in np.asarray(value, dtype=object).ravel()):
            raise ValueError(f"{path}: field {name!r} holds integers no int64 / uint64 table holds exactly")
        raise ValueError(f"{path}: field {name!r} is not a rectangular table of numbers")
    return table


def array_field(doc: dict, name: str, path: str, *, kind: str) -> np.ndarray:
    """The field ``name`` as a numpy array of ``kind`` ``"integer"`` (int / uint dtypes) or ``"number"``.

    Values are kept exact (no cast): JSON integers become int64 (uint64 above
    ``2**63``); the caller checks ranges before any narrowing cast.
    """
    if name not in doc:
        raise ValueError(f"{path}: missing field {name!r}")
    value = doc[name]
    table = value if isinstance(value, np.ndarray) else _json_table(value, name, path)
    allowed = "iu" if kind == "integer" else "iuf"
    if table.dtype.kind not in allowed:
        want = "integers" if kind == "integer" else "numbers"
        raise ValueError(f"{path}: field {name!r} must hold {want}, got dtype {table.dtype}")
    return table


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; ``ValueError`` saying how to install it when missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'moe_eplb_jax[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
