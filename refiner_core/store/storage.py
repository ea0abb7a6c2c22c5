"""All file I/O of the pipeline: atomic Parquet writes, content hashes, and the DuckDB catalog."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from refiner_core.schema import ALL_TABLES, Table, duckdb_ddl, duckdb_type, to_arrow
from refiner_core.store.faults import write_fault

if TYPE_CHECKING:  # imported where a catalog is opened: a learner alone (the GPU check's part d) needs no DuckDB
    import duckdb

_FOLDER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def folder_name_problem(name: str, what: str) -> str | None:
    """Why `name`, given by a user for one of a run's folders (a rescore version, a judge check), cannot be one: it
    must stay inside its parent folder. None when it can."""
    if _FOLDER_NAME_RE.fullmatch(name):
        return None
    return f"{what} {name!r}: use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"


def folder_name(text: str) -> str:
    """`text` made a name folder_name_problem accepts (a default derived from a file name)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:100] or "unnamed"


PARTIAL_SUFFIX = ".partial"  # a write in progress: hidden, and removed by the next run if its writer died
REPLACED_SUFFIX = ".replaced"  # a folder being replaced, moved aside: put back by the next run if its writer died


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shareable(path: Path, folder: bool = False) -> None:
    """Give a temporary file (mode 0600) or folder (0700) the mode a plain open() or mkdir() would: outputs are
    readable as the umask allows."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def atomic_path(path: Path) -> tuple[Path, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent)
    os.close(fd)
    shareable(Path(tmp))
    return Path(tmp), path


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """_fsync every file and folder below `folder` and itself (symbolic links are not followed)."""
    for root, _, files in os.walk(folder):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(Path(root, name))
        _fsync(Path(root))


def _replace_synced(tmp: Path, final: Path) -> None:
    """os.replace(tmp, final), durable: without the syncs a crash soon after can leave `final` naming an empty or
    partial file (the rename reached the disk before the data), or the old file (the rename never did)."""
    _fsync(tmp)
    write_fault(final)
    os.replace(tmp, final)
    _fsync(final.parent)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh folder beside `final`; on success it replaces `final` (a recomputed stage replaces its
    own output), on failure it is removed, so `final` is never half written. The folder it replaces is moved
    aside before the new one is renamed in and removed after: a writer killed in between leaves it beside
    `final`, and the next run puts it back (`remove_partial_writes`)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=PARTIAL_SUFFIX, dir=final.parent))
    shareable(build, folder=True)
    try:
        yield build
        _fsync_tree(build)  # what the new folder holds is on the disk before it takes the final name
        write_fault(final)
        aside = final.with_name(f".{final.name}.{build.name.rsplit('.', 2)[-2]}{REPLACED_SUFFIX}")
        if final.exists():
            final.rename(aside)
        try:
            write_fault(final.with_name(final.name + ".replacing"))
            build.rename(final)
        except BaseException:
            if aside.exists() and not final.exists():
                aside.rename(final)
            raise
        _fsync(final.parent)  # the renames themselves
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _restore_replaced(folder: Path) -> list[Path]:
    """Folders `atomic_dir` moved aside and did not live to remove: put back where their replacement never
    arrived, else removed."""
    left = sorted(Path(folder).rglob(f".*{REPLACED_SUFFIX}"))
    for aside in left:
        final = aside.with_name(aside.name[1:].rsplit(".", 2)[0])
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.rename(final)
    return left


def remove_partial_writes(folder: Path) -> list[Path]:
    """Remove what writers killed mid-write left in `folder` (their temporary files and folders, and a folder
    moved aside to be replaced, put back if its replacement never arrived); only safe while no writer is running
    there, i.e. under the run folder's lock."""
    replaced = _restore_replaced(folder)
    leftovers = sorted(
        p
        for p in Path(folder).rglob(f".*{PARTIAL_SUFFIX}*")
        if p.name.endswith((PARTIAL_SUFFIX, f"{PARTIAL_SUFFIX}.wal"))
    )
    leftovers = sorted([*leftovers, *replaced])
    for path in leftovers:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return leftovers


def write_table(table: Table, rows: list[dict], path: Path) -> str:
    """Write rows as Parquet atomically (temp file + rename) and return the file's content hash."""
    return write_arrow(to_arrow(table, rows), path)


def write_rows(table: Table, rows: list[dict], path: Path) -> dict:
    """Write rows as Parquet atomically and return their manifest entry: the file's hash (checked for damage) and,
    for a table with provenance columns, `rows_hash`: the rows' without them. The stages after key on the
    rows_hash, so a rerun that makes the same rows (sampled with another rollout.groups_per_part, judged from the
    judge cache, timed differently) leaves them cached."""
    data = to_arrow(table, rows)
    entry = {"path": str(path), "hash": write_arrow(data, path)}
    if table.provenance:
        entry["rows_hash"] = table_hash(data.drop_columns(list(table.provenance)))
    return entry


def write_arrow(data: pa.Table, path: Path) -> str:
    tmp, final = atomic_path(Path(path))
    try:
        pq.write_table(data, tmp)
        _replace_synced(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return file_hash(final)


def write_json(obj: Any, path: Path) -> str:
    tmp, final = atomic_path(Path(path))
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        _replace_synced(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return file_hash(final)


def read_rows(path: Path | str) -> list[dict]:
    return pq.read_table(path).to_pylist()


def file_hash(path: Path | str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


DESCRIPTION_FILES = ("README.md",)  # a folder's card describes its content and is rewritten (evaluated checkpoints)


def dir_hash(path: Path | str, ignore: tuple[str, ...] = ()) -> str:
    """Content hash of every file below a folder (names and bytes), independent of mtimes; top-level files or
    folders named in `ignore` do not count (a checkpoint's optimizer state is not part of the policy it holds),
    nor does a top-level README.md (DESCRIPTION_FILES: a model card is not the model)."""
    digest = hashlib.blake2b(digest_size=16)
    root = Path(path)
    skipped = set(ignore) | set(DESCRIPTION_FILES)
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] not in skipped):
        digest.update(file.relative_to(root).as_posix().encode())
        digest.update(file_hash(file).encode())
    return digest.hexdigest()


def json_hash(obj: Any) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def table_hash(data: pa.Table) -> str:
    """Content hash of an Arrow table's schema and values (its IPC stream, one chunk per column), whatever file
    they are written to."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data.combine_chunks())
    return hashlib.blake2b(sink.getvalue(), digest_size=16).hexdigest()


@contextmanager
def catalog_copy(db_path: Path, from_existing: bool) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection to a temporary copy of the catalog (of the existing one, or a new empty database) that
    replaces the catalog atomically when the block succeeds; on failure the catalog is left as it was."""
    tmp, final = atomic_path(Path(db_path))
    if from_existing:
        shutil.copyfile(final, tmp)
    else:
        tmp.unlink()  # DuckDB refuses to open an empty non-database file
    import duckdb

    try:
        con = duckdb.connect(str(tmp))
        try:
            yield con
        finally:
            con.close()
        _replace_synced(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".wal").unlink(missing_ok=True)


def _match_schema(con: duckdb.DuckDBPyConnection, table: Table) -> None:
    """Bring a published catalog's `table` to the schema's: created where the catalog was published before the
    table existed, given the columns added since (NULL in its older rows) where it lacks them."""
    columns_sql = "SELECT column_name FROM information_schema.columns WHERE table_name = ?"
    have = {r[0] for r in con.execute(columns_sql, [table.name]).fetchall()}
    if not have:
        con.execute(duckdb_ddl(table))
        return
    for column in table.columns:
        if column.name not in have:  # names and types come from the schema module, not from input
            con.execute(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {duckdb_type(column.type)}')


def insert_parquet(
    con: duckdb.DuckDBPyConnection, table: str, paths: Iterable[Path | str], run: str | None = None
) -> None:
    """Insert the rows of exactly these Parquet files into `table`, by column name: a column a file lacks (written
    before the column existed) is NULL in its rows. `run`: every row's run column is this name.

    The files reach DuckDB as an Arrow dataset of these very paths, not through read_parquet, which reads every path
    as a glob pattern (a run folder named exp[12] would publish exp1's files) and cannot match a path that holds a
    backslash and a glob character however it is escaped."""
    files = ds.dataset([str(p) for p in paths], format="parquet", filesystem=pafs.LocalFileSystem())
    schema = pa.unify_schemas([f.physical_schema for f in files.get_fragments()], promote_options="permissive")
    con.register("parquet_files", files.replace_schema(schema))
    try:
        select = "SELECT *" if run is None else "SELECT * REPLACE (?::VARCHAR AS run)"
        con.execute(f'INSERT INTO "{table}" BY NAME {select} FROM parquet_files', [] if run is None else [run])
    finally:
        con.unregister("parquet_files")


def replace_version_rows(db_path: Path, files: dict[str, list[str]], version: str) -> None:
    """Swap one reward version's rows of a published catalog for the given Parquet files, atomically."""
    with catalog_copy(db_path, from_existing=True) as con:
        for name, paths in files.items():
            _match_schema(con, ALL_TABLES[name])
            con.execute(f'DELETE FROM "{ALL_TABLES[name].name}" WHERE reward_version = ?', [version])
            insert_parquet(con, ALL_TABLES[name].name, paths)


def query(db_path: Path | str, sql: str, params: list | None = None) -> tuple[list[str], list[tuple]]:
    """Run SQL on a catalog read-only, with no access to files outside it (a `COPY ... TO`, `read_csv` or
    `ATTACH` is refused); returns (column names, rows)."""
    import duckdb

    con = duckdb.connect(str(db_path), read_only=True, config={"enable_external_access": False})
    try:
        cur = con.execute(sql, params or [])
        columns = [d[0] for d in cur.description] if cur.description else []
        return columns, cur.fetchall()
    finally:
        con.close()


def replace_rows(db_path: Path, files: dict[str, list[str]], column: str, value: object) -> None:
    """Swap the rows whose `column` is `value` in tables of a published catalog for the given Parquet files,
    atomically (a judge check run again replaces its earlier rows; a step's monitor events their earlier state)."""
    with catalog_copy(db_path, from_existing=True) as con:
        for name, paths in files.items():
            table = ALL_TABLES[name]
            if column not in table.column_names:
                raise ValueError(f"table {name} has no column {column!r}")
            _match_schema(con, table)
            con.execute(f'DELETE FROM "{name}" WHERE "{column}" = ?', [value])
            insert_parquet(con, name, paths)
