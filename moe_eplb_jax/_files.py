"""Versioned document files (``.json`` or ``.npz``) shared by placement and load files.

A document is a flat mapping of field names to scalars or arrays carrying a
``format`` name and an integer ``version``. JSON stores arrays as nested lists;
``.npz`` stores every field as an array (scalars as 0-d arrays). Writes go
through a temporary file, so a failed write never leaves half a file behind.
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["write_document", "read_document", "pyplot"]


def _kind(path: str, what: str) -> str:
    for suffix in (".json", ".npz"):
        if path.endswith(suffix):
            return suffix
    raise ValueError(f"{what} file must end in .json or .npz, got {path!r}")


def write_document(path, fields: dict, *, what: str) -> None:
    """Writes ``fields`` (name -> scalar, string or array) as JSON or npz, chosen by the suffix."""
    path = os.fspath(path)
    suffix = _kind(path, what)
    tmp = path + ".tmp" + suffix  # np.savez appends .npz to names without it
    try:
        if suffix == ".npz":
            np.savez_compressed(tmp, **{k: np.asarray(v) for k, v in fields.items()})
        else:
            doc = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
            with open(tmp, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_document(path, *, what: str, file_format: str, version: int) -> dict:
    """Reads a document and checks its ``format`` and ``version``; ``ValueError`` for any malformed file."""
    path = os.fspath(path)
    suffix = _kind(path, what)
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                doc = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"{path}: not a readable .npz {what} file ({e})") from e
        doc = {k: (v.item() if v.ndim == 0 else v) for k, v in doc.items()}
    else:
        try:
            with open(path) as f:
                doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e})") from e
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: top level must be a JSON object")
    if "format" not in doc:
        raise ValueError(f"{path}: missing field 'format'")
    if doc["format"] != file_format:
        raise ValueError(f"{path}: field 'format' is {doc['format']!r}, expected {file_format!r}")
    if doc.get("version") != version:
        raise ValueError(f"{path}: unsupported field 'version' {doc.get('version')!r} (this library reads {version})")
    return doc


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; ``ValueError`` saying how to install it when missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'moe_eplb_jax[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
