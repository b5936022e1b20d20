"""Read `torch.save` files (`pytorch_model.bin`, `.pth`, `.pt`) into NumPy, refusing what
`torch.load(weights_only=True)` refuses.

With torch installed this is `torch.load(path, map_location="cpu", weights_only=True)`. Without
it, the zip archive is read directly: `data.pkl` is unpickled with an allow-list of globals (the
ones a tensor checkpoint needs: OrderedDict, torch's tensor/parameter rebuild functions and storage
types), and each storage is read from `data/<key>` in the archive. Any other global - the way a
hostile pickle runs code - stops loading with an error that names it. Either way tensors come back
as NumPy arrays (bfloat16 through ml_dtypes) and everything else as plain Python values.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class RefusedPickle(ValueError):
    """The file needs a global that a weights-only load does not allow."""


class _StorageType:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage, offset, size, stride, *_):
    itemsize = storage.dtype.itemsize
    if not size:
        return storage[offset].copy() if storage.size else np.zeros((), storage.dtype)
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(data, *_):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise RefusedPickle(f"the pickle needs the global {module}.{name}, which a weights-only load refuses "
                            "(only tensors, dicts, lists and numbers are read)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise RefusedPickle(f"unsupported persistent id {pid!r:.80}")
        storage_type, key = pid[1], pid[2]
        return np.frombuffer(self.archive.read(f"{self.prefix}/data/{key}"), storage_type.dtype)


def _to_numpy(value):
    """torch tensors (from torch.load) -> NumPy, recursively through dicts and lists."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        import torch

        if value.dtype == torch.bfloat16:
            return value.detach().float().numpy().astype(ml_dtypes.bfloat16)
        return value.detach().numpy()
    if isinstance(value, dict):
        return type(value)((k, _to_numpy(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_numpy(v) for v in value)
    return value


def load(path: str | Path):
    """The object a weights-only `torch.load` would return, with NumPy arrays for tensors."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        import torch
    except ImportError:
        return _load_without_torch(path)
    try:
        return _to_numpy(torch.load(path, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError as e:
        raise RefusedPickle(f"{path}: torch.load(weights_only=True) refuses it: {str(e).splitlines()[0]}") from e
    except (RuntimeError, EOFError) as e:
        raise ValueError(f"cannot read {path} (truncated or not a torch checkpoint?): {e}") from e


def _load_without_torch(path: Path):
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ValueError(f"cannot read {path}: not a zip archive (truncated, or the legacy pre-1.6 torch format, "
                         "which needs torch to read)") from e
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise ValueError(f"{path}: no data.pkl in the archive: not a torch.save file")
        prefix = pkl[0][: -len("/data.pkl")] if "/" in pkl[0] else ""
        order = f"{prefix}/byteorder"
        if order in archive.namelist() and archive.read(order).decode().strip() != "little":
            raise ValueError(f"{path}: big-endian tensors are not supported")
        try:
            with archive.open(pkl[0]) as f:
                return _Unpickler(f, archive, prefix).load()
        except RefusedPickle as e:
            raise RefusedPickle(f"{path}: {e}") from None
        except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError) as e:
            raise ValueError(f"cannot read {path} (truncated or damaged?): {e}") from e
