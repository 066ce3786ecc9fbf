"""A GGUF file (llama.cpp's format) opened and checked: its metadata read with their types checked, every tensor's
type one this reader knows and its bytes inside the file, and tensor bytes read with plain file reads (the `gguf`
package memory-maps the file; only its header pages are ever touched, so the weights count once in memory: as we hold
them). Each failure is one line naming the file and the key or the tensor."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.errors import NpumoeError

INSTALL_HINT = "reading GGUF files needs the gguf package (llama.cpp's gguf-py): pip install 'npumoe[gguf]'"
_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
          "strs": "an array of strings", "ints": "an array of integers"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise NpumoeError(INSTALL_HINT) from None
    return gguf


def _reader_class():
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        """gguf's reader, checking each tensor's type and extent before it maps it: the package's own failures
        (a ValueError from numpy's reshape) name neither the tensor nor the cause."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                tensor = bytes(name).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise NpumoeError(f"tensor {tensor} has quantization type {int(raw_type[0])}, which llama.cpp's "
                                      "gguf package does not know") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims.astype(np.int64)))
                end = int(start_offs + offset[0]) + n * type_size // block
                if n % block or end > size:
                    raise NpumoeError(f"tensor {tensor} ({qtype.name}) runs past the end of the file ({end} of "
                                      f"{size} bytes): truncated")
            super()._build_tensors(start_offs, fields)

    return Reader


class GGUFFile:
    """The file's metadata and tensor table (name -> type name, shape as [outer, ..., inner], offset, bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        gguf = _gguf()
        try:
            reader = _reader_class()(self.path)
        except NpumoeError as e:
            raise NpumoeError(f"{self.path}: {e}") from None
        except (ValueError, IndexError, OSError, UnicodeDecodeError, TypeError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise NpumoeError(f"{self.path}: not a GGUF file, or truncated ({first})") from None
        self.fields = reader.fields
        self._types = gguf.GGUFValueType
        self.tensors = {t.name: (t.tensor_type.name, [int(d) for d in reversed(t.shape.tolist())],
                                 int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
        del reader  # its memory map: the weights are read with plain file reads (`read_bytes`)

    def has(self, key: str) -> bool:
        return key in self.fields

    def value(self, key: str, kind: str, default: object = ...) -> object:
        """Metadata `key` as `kind` (int, float, str, bool, strs, ints), or `default` where absent; a key of another
        type is refused in one line."""
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise NpumoeError(f"{self.path}: metadata key {key} is missing")
            return default
        t, vt = field.types[0], self._types
        ints = {vt.UINT8, vt.INT8, vt.UINT16, vt.INT16, vt.UINT32, vt.INT32, vt.UINT64, vt.INT64}
        sub = field.types[-1] if t == vt.ARRAY and len(field.types) > 1 else None
        ok = {"int": t in ints, "float": t in ints | {vt.FLOAT32, vt.FLOAT64}, "str": t == vt.STRING,
              "bool": t == vt.BOOL, "strs": sub == vt.STRING, "ints": sub in ints}[kind]
        if not ok:
            got = f"an array of {sub.name}" if sub is not None else t.name
            raise NpumoeError(f"{self.path}: metadata key {key} is {got}, expected {_KINDS[kind]}")
        return field.contents()

    def rows(self, name: str) -> int:
        """Rows of tensor `name` (of one expert, for a 3D tensor): its shape but the first and the last dims."""
        shape = self.tensors[name][1]
        return int(np.prod(shape[1:-1] if len(shape) == 3 else shape[:-1]))

    def read_bytes(self, name: str, index: int | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name`'s bytes as [rows, row bytes], with a plain file read: of sub-tensor `index` along its first
        dimension where given (one expert of a 3D tensor), of rows [a, b) of that where given."""
        _, shape, offset, n_bytes = self.tensors[name]
        count = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = n_bytes // count
        if index is not None:
            offset += index * self.rows(name) * row_bytes
        a, b = rows if rows is not None else (0, self.rows(name) if index is not None else count)
        out = np.empty((b - a, row_bytes), dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(offset + a * row_bytes)
            if f.readinto(out) != out.nbytes:
                raise NpumoeError(f"{self.path}: tensor {name} is cut short: truncated file")
        return out

    def read_values(self, name: str, index: int | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name` (or its sub-tensor `index`, its rows [a, b)) at full width, float32 [rows, n]: F32/F16/BF16
        as stored, other types dequantized by the gguf package."""
        type_name, shape, _, _ = self.tensors[name]
        data = self.read_bytes(name, index, rows)
        n = shape[-1]
        if type_name == "F32":
            return data.view(np.float32).reshape(-1, n)
        if type_name == "F16":
            return data.view(np.float16).astype(np.float32).reshape(-1, n)
        if type_name == "BF16":
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, n)
        gguf = _gguf()
        return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).astype(np.float32).reshape(-1, n)
