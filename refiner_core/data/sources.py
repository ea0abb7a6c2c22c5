"""Row sources: JSONL, Parquet, a `datasets.save_to_disk` folder or a hub dataset, with a field mapping.

Every source yields `RawRow`s: rows that could not be read (non-UTF-8 bytes, broken JSON, ...) carry an error
instead of data, so they reach the quarantine rather than crash the stage.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from refiner_core.config import SourceConfig
from refiner_core.data.rows import RawRow, check_row, read_jsonl

FORMATS = ("auto", "jsonl", "parquet", "disk", "hub")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


class SourceError(ValueError):
    pass


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        if fmt not in FORMATS:
            raise SourceError(f"unknown source format {fmt!r}; expected one of {list(FORMATS)}")
        return fmt
    p = Path(path)
    if not p.exists():
        # A missing local path is only a hub name when asked for explicitly: no surprise downloads. A path
        # with a file suffix is a missing file, not a hub name.
        hint = "" if p.suffix in FILE_SUFFIXES else " (set format: hub to load a hub dataset by name)"
        raise SourceError(f"{path!r} does not exist{hint}")
    if p.is_dir():
        return "disk"
    if p.suffix == ".jsonl":
        return "jsonl"
    if p.suffix in (".parquet", ".pq"):
        return "parquet"
    raise SourceError(f"cannot tell the format of {path!r}: set format to jsonl, parquet or disk")


def load_rows(
    path: str, fmt: str = "auto", fields: dict | None = None, split: str = "train", hub_config: str = ""
) -> list[RawRow]:
    """Read every row of a source and rename its columns through `fields` ({canonical: source column})."""
    kind = detect_format(path, fmt)
    if kind == "jsonl":
        rows = read_jsonl(Path(path))
    elif kind == "parquet":
        rows = _read_parquet(Path(path))
    elif kind == "disk":
        rows = _read_dataset(_load_from_disk(Path(path), split))
    else:
        rows = _read_dataset(_load_hub(path, split, hub_config))
    if not rows:  # nothing to validate: say so, rather than fail later on a missing column or an empty table
        raise SourceError(
            f"{path} is an empty file (no rows)"
            if kind in ("jsonl", "parquet")
            else f"{path} has no rows in split {split!r}"
        )
    return [apply_field_mapping(r, fields or {}) for r in rows]


def load_source(path: str, source: SourceConfig) -> list[RawRow]:
    """load_rows of `path` (the section's path, resolved) with the section's format, fields, split and hub_config."""
    return load_rows(path, source.format, source.fields, source.split, source.hub_config)


def source_identity(path: str, source: SourceConfig) -> dict:
    """What two sections must share for their rows to be the same rows under the same IDs: the path, the split
    and configuration read, and the column the IDs come from."""
    return {
        "file": path,
        "split": source.split,
        "hub_config": source.hub_config,
        "id_column": (source.fields or {}).get("id", "id"),
    }


def apply_field_mapping(row: RawRow, fields: dict) -> RawRow:
    """Canonical names read from mapped columns; columns already named canonically stay unless remapped."""
    if row.data is None or not fields:
        return row
    bad = [k for k, v in fields.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise SourceError(f"field mapping must map names to column names, got {fields!r}")
    data = {k: v for k, v in row.data.items() if k not in fields or fields.get(k) == k}
    for canonical, column in fields.items():
        if column in row.data:
            data[canonical] = row.data[column]
        else:
            data.pop(canonical, None)  # mapped but absent: the validator reports a missing field
    absent = {c: column for c, column in fields.items() if column not in row.data}
    problem = check_row(data) if absent else None
    for canonical, column in absent.items():
        if problem == ("missing_field", f"field {canonical!r} is missing"):
            # The quarantine names the user's column too, so that it explains the mapping.
            return RawRow(
                row.row_ref,
                row.raw,
                None,
                f"missing_field: field {canonical!r} (mapped from column {column!r}) is missing",
            )
    return RawRow(row.row_ref, row.raw, data, row.error)


def _read_parquet(path: Path) -> list[RawRow]:
    import pyarrow.parquet as pq

    return _rows_from_table(pq.read_table(path))


def _rows_from_table(table) -> list[RawRow]:
    """The rows of an Arrow table. A text column is not checked for UTF-8 by every writer: a row whose text (at
    any depth) holds other bytes is unreadable, as a binary column's is, and the other rows are kept."""
    unreadable: dict[int, str] = {}  # row -> its first column holding bytes that are not UTF-8
    columns = {name: _column_values(table.column(name), name, unreadable) for name in table.column_names}
    out = []
    for n in range(table.num_rows):
        record = {name: values[n] for name, values in columns.items()}
        bad = unreadable.get(n) or _undecodable_field(record)
        raw = json.dumps(record, default=_show_bytes, ensure_ascii=False)
        if bad is not None:
            out.append(RawRow(f"row {n}", raw, None, f"non_utf8: field {bad!r} holds bytes that are not UTF-8"))
            continue
        out.append(RawRow(f"row {n}", raw, _decode_bytes(record)))
    return out


def _column_values(column, name: str, unreadable: dict[int, str]) -> list:
    """A column's values as Python objects; a value whose text is not UTF-8 as its bytes (shown in the quarantine
    as read), its row noted in `unreadable`."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    as_bytes = column.cast(_binary_type(column.type)).to_pylist()
    values = []
    for n in range(len(column)):
        try:
            values.append(column[n].as_py())
        except UnicodeDecodeError:
            unreadable.setdefault(n, name)
            values.append(as_bytes[n])
    return values


def _binary_type(arrow_type):
    """`arrow_type` with its text (at any depth) read as bytes."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):  # a category column (pandas): its values, decoded
        return _binary_type(arrow_type.value_type)
    if pa.types.is_string(arrow_type):
        return pa.binary()
    if pa.types.is_large_string(arrow_type):
        return pa.large_binary()
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        item = arrow_type.value_field.with_type(_binary_type(arrow_type.value_type))
        return pa.list_(item) if pa.types.is_list(arrow_type) else pa.large_list(item)
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_binary_type(field.type)) for field in arrow_type])
    return arrow_type


def _undecodable_field(record: dict) -> str | None:
    """Binary columns are accepted when they decode as UTF-8 text; otherwise the row is unreadable."""
    for key, value in record.items():
        if isinstance(value, bytes):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return key
    return None


def _decode_bytes(record: dict) -> dict:
    return {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in record.items()}


def _show_bytes(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _load_from_disk(path: Path, split: str):
    from datasets import DatasetDict, load_from_disk

    state = (path / split if (path / "dataset_dict.json").is_file() else path) / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files", True):
        # datasets saves an empty dataset without data files and then fails to load it (IndexError)
        raise SourceError(f"{path} has no rows in split {split!r}")
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise SourceError(f"{path}: no split {split!r}; available: {sorted(loaded)}")
        return loaded[split]
    return loaded


def _load_hub(name: str, split: str, config: str):
    """A hub dataset by name. Without network (HF_HUB_OFFLINE=1, or the Hub unreachable) `datasets` reads only
    what an earlier load prepared in its cache (HF_DATASETS_CACHE, under HF_HOME)."""
    from datasets import load_dataset

    with _hub_errors(name, split, config):
        return load_dataset(name, config or None, split=split)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: hub datasets come from the local cache only."""
    from datasets import config as datasets_config

    return bool(datasets_config.HF_HUB_OFFLINE)


def cached_hub_columns(name: str, split: str, config: str) -> list[str]:
    """The columns of `split` of a hub dataset in the local cache, read from its info without loading rows
    (offline: the cache is all there is)."""
    from datasets import load_dataset_builder

    with _hub_errors(name, split, config):
        info = load_dataset_builder(name, config or None).info
    if split not in (info.splits or {}):
        raise SourceError(f"{_hub_name(name, config)}: no split {split!r}; available: {list(info.splits or {})}")
    return list(info.features or {})


def _hub_name(name: str, config: str) -> str:
    return f"hub dataset {name!r}" + (f" (config {config!r})" if config else "")


@contextmanager
def _hub_errors(name: str, split: str, config: str):
    from datasets import config as datasets_config

    try:
        yield
    except ConnectionError as e:
        raise SourceError(
            f"{_hub_name(name, config)} is not in the local cache {datasets_config.HF_DATASETS_CACHE}; "
            f"no network: {e}. Load it once with network access (or set HF_HOME to where it is "
            "cached)."
        ) from None
    except (ValueError, FileNotFoundError) as e:  # unknown split or config, a name the hub does not know
        raise SourceError(f"{_hub_name(name, config)}, split {split!r}: {' '.join(str(e).split())}") from None


def _read_dataset(dataset) -> list[RawRow]:
    return _rows_from_table(dataset.with_format("arrow")[:])
