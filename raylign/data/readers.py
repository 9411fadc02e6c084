"""Read dataset files as ``(row_number, row)`` pairs, whatever the format.

Row numbers are 1-based: the line number for ``.jsonl`` (blank lines count, as in an editor),
the position in the list for ``.json``, and the data row (header not counted) for ``.csv``,
``.parquet``, Arrow files and ``datasets`` folders. A file that cannot be read raises
:class:`DataError` naming the file and, where the format allows, the row; a row that is not
a JSON object (or a ``.jsonl`` line that is not JSON, or a JSON row holding bytes that are not
UTF-8) raises :class:`RowError`, or is handed to ``on_bad_row`` and skipped when one is given.

JSON files are decoded with ``surrogateescape``, which turns each byte that is not UTF-8 into a
lone surrogate U+DC80..U+DCFF (valid UTF-8 never decodes to one), so the row that holds it can
be found, named and skipped while the rows around it still load.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from raylign.data.errors import DataError, RowError, RowRef

Row = dict[str, Any]
BadRowHandler = Callable[[RowError], None]

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".feather")
SUPPORTED_TEXT = ", ".join(SUPPORTED_SUFFIXES) + ", or a folder saved with datasets.save_to_disk"

ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8
JSON_SPACE = re.compile(r"[ \t\n\r]*")


def read_rows(
    path: str | Path, split: str | None = None, on_bad_row: BadRowHandler | None = None
) -> Iterator[tuple[int, Row]]:
    """Yield ``(row_number, row)`` for every row of a dataset file or ``datasets`` folder.

    ``split`` picks a split of a ``datasets`` folder that holds several. ``on_bad_row``, when
    given, receives rows that are not JSON objects instead of an exception being raised.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path}")
    if path.is_dir():
        yield from _read_datasets_folder(path, split)
        return
    if split is not None:
        raise DataError(f"{path}: split={split!r} applies only to datasets folders, not to files")
    readers = {
        ".jsonl": _read_jsonl,
        ".json": _read_json,
        ".parquet": _read_parquet,
        ".csv": _read_csv,
        ".arrow": _read_arrow,
        ".feather": _read_arrow,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        kind = path.suffix or "(no extension)"
        raise DataError(f"{path}: unsupported file type {kind!r}; supported: {SUPPORTED_TEXT}")
    try:  # before any reader starts: a file that cannot be opened is the file's error, not a traceback
        path.open("rb").close()
    except OSError as err:
        raise DataError(f"{path}: cannot be read: {err.strerror or err}") from None
    yield from reader(path, on_bad_row)


def _not_an_object(where: RowRef, value: Any) -> RowError:
    return where.error(None, f"expected a JSON object, got {type(value).__name__}", "not_an_object")


def _reject(err: RowError, on_bad_row: BadRowHandler | None) -> None:
    if on_bad_row is None:
        raise err
    on_bad_row(err)


class _RepeatedKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_with_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s object hook: an object that names a key twice is refused, where ``json`` would keep
    the last value and drop the other without a word."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return row


def _parse_json(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_object_with_unique_keys)


def _repeated_key(where: RowRef, err: _RepeatedKey) -> RowError:
    return where.error(None, f"the key {err.key!r} is given twice in one object; keep one", "repeated_key")


def _not_json(where: RowRef, err: ValueError | RecursionError) -> RowError:
    if isinstance(err, json.JSONDecodeError):
        problem = f"line {where.row} is not valid JSON: {err.msg} at column {err.colno}"
    elif isinstance(err, RecursionError):
        problem = f"line {where.row} is not usable JSON: nested too deeply"
    else:  # e.g. an integer with more digits than Python converts
        problem = f"line {where.row} is not usable JSON: {err}"
    return where.error(None, problem, "bad_json")


def _bad_byte(text: str, index: int, line_number: int, line_start: int) -> str:
    """Where the byte that ``text[index]`` stands for lies: 'byte 0xe9 at byte offset 10 of line 4'."""
    offset = len(text[line_start:index].encode("utf-8", "surrogateescape"))
    return f"byte 0x{ord(text[index]) - 0xDC00:02x} at byte offset {offset} of line {line_number}"


def _not_utf8(where: RowRef, place: str) -> RowError:
    return where.error(None, f"not UTF-8 text: {place}", "not_utf8")


def _read_jsonl(path: Path, on_bad_row: BadRowHandler | None) -> Iterator[tuple[int, Row]]:
    # The standard json parser per line (not pyarrow.json): rows keep their own types and nesting,
    # and a bad line is reported by its number without losing the rest of the file.
    # -sig: tolerate a byte-order mark.
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = RowRef(str(path), line_number)
            undecodable = ESCAPED_BYTE.search(line)
            if undecodable is not None:
                _reject(_not_utf8(where, _bad_byte(line, undecodable.start(), line_number, 0)), on_bad_row)
                continue
            try:
                row = _parse_json(line)
            except _RepeatedKey as err:
                _reject(_repeated_key(where, err), on_bad_row)
                continue
            except (ValueError, RecursionError) as err:
                _reject(_not_json(where, err), on_bad_row)
                continue
            if not isinstance(row, dict):
                _reject(_not_an_object(where, row), on_bad_row)
                continue
            yield line_number, row


class _Lines:
    """Line number and start of any position of a text, for messages about a whole-file format."""

    def __init__(self, text: str):
        self.text = text
        self.newlines = [match.start() for match in re.finditer("\n", text)]

    def bad_byte(self, index: int) -> str:
        number = bisect.bisect_left(self.newlines, index) + 1
        start = self.newlines[number - 2] + 1 if number > 1 else 0
        return _bad_byte(self.text, index, number, start)


def _load_json(path: Path, text: str) -> tuple[Any, bool]:
    """The file's data, and whether some object in it names a key twice (then it holds the last value)."""
    try:
        try:
            return _parse_json(text), False
        except _RepeatedKey:  # some item's error, found item by item (_repeated_keys_of_items)
            return json.loads(text), True
    except json.JSONDecodeError as err:
        if ESCAPED_BYTE.match(text, err.pos):  # a byte that is not UTF-8 where JSON expected structure
            raise DataError(f"{path}: not UTF-8 text outside a string: {_Lines(text).bad_byte(err.pos)}") from None
        raise DataError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except RecursionError:
        raise DataError(f"{path}: not usable JSON: nested too deeply") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise DataError(f"{path}: not usable JSON: {err}") from None


def _json_list_spans(text: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` in ``text`` of each item of the JSON list it holds, which json.loads has accepted."""
    decoder = json.JSONDecoder()
    position = JSON_SPACE.match(text).end() + 1  # past the opening bracket
    while True:
        position = JSON_SPACE.match(text, position).end()
        if text[position] == "]":
            return
        _, end = decoder.raw_decode(text, position)
        yield position, end
        position = JSON_SPACE.match(text, end).end()
        if text[position] == ",":
            position += 1


def _bad_bytes_of_items(text: str) -> Iterator[str | None]:
    """For each item of the JSON list in ``text``: where its first byte that is not UTF-8 lies, or None."""
    lines = _Lines(text)
    for start, end in _json_list_spans(text):
        undecodable = ESCAPED_BYTE.search(text, start, end)
        yield None if undecodable is None else lines.bad_byte(undecodable.start())


def _repeated_keys_of_items(text: str) -> Iterator[_RepeatedKey | None]:
    """For each item of the JSON list in ``text``: the key it names twice in one object, or None."""
    for start, end in _json_list_spans(text):
        try:
            _parse_json(text[start:end])
        except _RepeatedKey as err:
            yield err
        else:
            yield None


def _read_json(path: Path, on_bad_row: BadRowHandler | None) -> Iterator[tuple[int, Row]]:
    text = path.read_text(encoding="utf-8-sig", errors="surrogateescape")
    data, any_repeated_key = _load_json(path, text)
    if not isinstance(data, list):
        raise DataError(
            f"{path}: a .json dataset must hold a list of objects, got {type(data).__name__} "
            "(use .jsonl for one object per line)"
        )
    # Only a file with bytes that are not UTF-8 is parsed a second time, item by item, to find them.
    bad_bytes = _bad_bytes_of_items(text) if ESCAPED_BYTE.search(text) else itertools.repeat(None)
    # So is a file in which some object names a key twice.
    repeated = _repeated_keys_of_items(text) if any_repeated_key else itertools.repeat(None)
    for number, (row, bad_byte, repeated_key) in enumerate(zip(data, bad_bytes, repeated), start=1):
        where = RowRef(str(path), number)
        if bad_byte is not None:
            _reject(_not_utf8(where, bad_byte), on_bad_row)
            continue
        if repeated_key is not None:
            _reject(_repeated_key(where, repeated_key), on_bad_row)
            continue
        if not isinstance(row, dict):
            _reject(_not_an_object(where, row), on_bad_row)
            continue
        yield number, row


def _refuse_repeated_columns(path: Path, names: list[str], kind: str) -> None:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        # A row would keep one of them and drop the other's values without a word.
        raise DataError(f"{path}: the {kind} names column(s) {', '.join(map(repr, repeated))} more than once")


def _rows_of_batches(batches: Iterator[pa.RecordBatch], first_row: int = 1) -> Iterator[tuple[int, Row]]:
    number = first_row
    for batch in batches:
        for row in batch.to_pylist():
            yield number, row
            number += 1


def _read_parquet(path: Path, on_bad_row: BadRowHandler | None) -> Iterator[tuple[int, Row]]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: cannot open as parquet (truncated or not a parquet file?): {err}") from None
    _refuse_repeated_columns(path, parquet.schema_arrow.names, "parquet schema")
    first_row = 1
    for group in range(parquet.num_row_groups):
        group_rows = parquet.metadata.row_group(group).num_rows
        try:
            table = parquet.read_row_group(group)
        except (pa.ArrowException, OSError) as err:
            last_row = first_row + group_rows - 1
            raise DataError(f"{path}, rows {first_row}-{last_row} (row group {group}): corrupt data: {err}") from None
        yield from _rows_of_batches(iter(table.to_batches()), first_row)
        first_row += group_rows


def _csv_column_names(path: Path) -> list[str]:
    # The header only: pyarrow's own schema sniffing would already parse (and fail on) the first rows.
    # Lines are decoded one at a time, so a byte that is not UTF-8 further down is its row's problem.
    try:
        with path.open("rb") as handle:
            lines = (line.decode("utf-8-sig" if number == 0 else "utf-8") for number, line in enumerate(handle))
            names = next(csv.reader(lines), [])
    except (csv.Error, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the CSV header: {err}") from None
    _refuse_repeated_columns(path, names, "CSV header")
    return names


def _decoded_cells(row: dict[str, bytes | None]) -> dict[str, str | None] | str:
    """The row's cells as text, or where its first byte that is not UTF-8 lies."""
    decoded = {}
    for name, cell in row.items():
        try:
            decoded[name] = None if cell is None else cell.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"byte 0x{cell[err.start]:02x} at byte offset {err.start} of column {name!r}"
    return decoded


def _read_csv(path: Path, on_bad_row: BadRowHandler | None) -> Iterator[tuple[int, Row]]:
    # CSV cells carry no types: every column is text, so a prompt "42" stays a string. They are read as
    # bytes and decoded row by row, so that a byte that is not UTF-8 is its own row's error (skippable).
    names = _csv_column_names(path)
    bad_rows: list[Any] = []

    def handle_invalid_row(invalid: Any) -> str:
        bad_rows.append(invalid)
        if on_bad_row is None or invalid.number is None:
            return "error"
        data_row = invalid.number - 1  # pyarrow counts the header as row 1
        problem = f"expected {invalid.expected_columns} columns, got {invalid.actual_columns}: {invalid.text!r:.80}"
        on_bad_row(RowRef(str(path), data_row).error(None, problem, "bad_csv_row"))
        return "skip"

    try:
        table = pa_csv.read_csv(
            path,
            # Single-threaded parsing is what lets pyarrow report the number of a bad row.
            read_options=pa_csv.ReadOptions(use_threads=False),
            parse_options=pa_csv.ParseOptions(newlines_in_values=True, invalid_row_handler=handle_invalid_row),
            convert_options=pa_csv.ConvertOptions(column_types={name: pa.binary() for name in names}),
        )
    except (pa.ArrowException, OSError) as err:
        where = ""
        if bad_rows and bad_rows[-1].number is not None:
            where = f", row {bad_rows[-1].number - 1}"
        raise DataError(f"{path}{where}: unreadable CSV: {err}") from None
    # Keep the file's own numbering across skipped rows, so later errors point at the right row.
    skipped = {invalid.number - 1 for invalid in bad_rows}
    number = 1
    for _, row in _rows_of_batches(iter(table.to_batches())):
        while number in skipped:
            number += 1
        decoded = _decoded_cells(row)
        if isinstance(decoded, str):
            _reject(_not_utf8(RowRef(str(path), number), decoded), on_bad_row)
        else:
            yield number, decoded
        number += 1


def _open_arrow(path: Path) -> pa.RecordBatchReader | pa.ipc.RecordBatchFileReader:
    # .feather and most .arrow files use the IPC file format; datasets' cache files use the stream format.
    try:
        return pa.ipc.open_file(path)
    except (pa.ArrowException, OSError):
        pass
    try:
        return pa.ipc.open_stream(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: cannot open as an Arrow IPC file or stream (truncated?): {err}") from None


def _read_arrow(path: Path, on_bad_row: BadRowHandler | None) -> Iterator[tuple[int, Row]]:
    reader = _open_arrow(path)
    _refuse_repeated_columns(path, reader.schema.names, "Arrow schema")
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    number = 1
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}, from row {number}: corrupt Arrow data: {err}") from None
        yield from _rows_of_batches(iter([batch]), number)
        number += batch.num_rows


def _read_datasets_folder(path: Path, split: str | None) -> Iterator[tuple[int, Row]]:
    import datasets  # slow to import; only folders need it

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(
            f"{path}: a folder must be saved with datasets.save_to_disk ({err}); files supported: {SUPPORTED_TEXT}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            wanted = "set split to one of" if split is None else f"no split {split!r}; splits:"
            raise DataError(f"{path}: {wanted} {', '.join(splits)}")
        loaded = loaded[split]
    elif split is not None:
        raise DataError(f"{path}: split={split!r} given, but the folder holds a single dataset without splits")
    _refuse_repeated_columns(path, loaded.column_names, "dataset")
    yield from _rows_of_batches(iter(loaded.with_format("arrow").iter(batch_size=1000)))
