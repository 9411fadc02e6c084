"""Readers: every format gives the same rows; broken files name the file and the row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylign.data import DataError, RowError, read_rows

FORMATS = ("jsonl", "json", "parquet", "csv", "arrow", "feather", "datasets")  # what the write_dataset fixture writes

TEXT_ROWS = [
    {"prompt": "add 1 and 2", "completion": "3"},
    {"prompt": 'say "hi",\nthen stop', "completion": "hi, then stop"},
    {"prompt": "42", "completion": "the answer"},
]

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "sum 2 2"},
            {"role": "assistant", "content": "4"},
        ]
    },
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_returns_the_same_text_rows_numbered_from_one(write_dataset, fmt):
    path = write_dataset(TEXT_ROWS, fmt)
    assert list(read_rows(path)) == [(1, TEXT_ROWS[0]), (2, TEXT_ROWS[1]), (3, TEXT_ROWS[2])]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "csv"])
def test_nested_conversations_come_back_as_lists_of_dicts(write_dataset, fmt):
    path = write_dataset(CHAT_ROWS, fmt)
    assert [row for _, row in read_rows(path)] == CHAT_ROWS


def test_csv_cells_stay_text_even_when_they_look_like_numbers(write_dataset):
    path = write_dataset([{"prompt": "7", "completion": "0.5"}], "csv")
    assert list(read_rows(path)) == [(1, {"prompt": "7", "completion": "0.5"})]


def test_jsonl_row_numbers_are_line_numbers_counting_blank_lines(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"a": "x"}\n\n{"a": "y"}\n')
    assert list(read_rows(path)) == [(1, {"a": "x"}), (3, {"a": "y"})]


def test_jsonl_bad_line_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": "x"}\n{"a": "y"}\n{"a": oops}\n')
    with pytest.raises(RowError) as info:
        list(read_rows(path))
    assert str(info.value).startswith(f"{path}, row 3: line 3 is not valid JSON")


def test_jsonl_bad_lines_of_every_kind_go_to_the_handler_and_the_rest_is_read(tmp_path):
    path = tmp_path / "bad.jsonl"
    # 1 good, 2 bad JSON, 3 not an object, 4 Latin-1 (not UTF-8), 5 blank, 6 good UTF-8, 7 a lone 0x80
    path.write_bytes(b'{"a": "x"}\n{"a": oops}\n[1, 2]\n{"a": "caf\xe9"}\n\n{"a": "caf\xc3\xa9"}\n{"a": "\x80"}\n')
    rejected = []
    rows = list(read_rows(path, on_bad_row=rejected.append))
    assert rows == [(1, {"a": "x"}), (6, {"a": "caf\u00e9"})]
    assert [(e.row, e.reason) for e in rejected] == [
        (2, "bad_json"),
        (3, "not_an_object"),
        (4, "not_utf8"),
        (7, "not_utf8"),
    ]
    assert str(rejected[3]) == f"{path}, row 7: not UTF-8 text: byte 0x80 at byte offset 7 of line 7"


def test_jsonl_line_that_is_not_utf8_names_the_file_the_line_and_the_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    # line 2: 12 bytes of '{"prompt": "', then e-acute as UTF-8 (2 bytes), 't', e-acute, ' ', then a lone 0xff
    path.write_bytes(b'{"prompt": "x"}\n{"prompt": "\xc3\xa9t\xc3\xa9 \xff"}\n')
    with pytest.raises(RowError) as info:
        list(read_rows(path))
    assert str(info.value) == f"{path}, row 2: not UTF-8 text: byte 0xff at byte offset 18 of line 2"
    assert (info.value.row, info.value.reason) == (2, "not_utf8")


def test_json_item_with_bytes_that_are_not_utf8_is_a_bad_row_and_the_other_items_are_read(tmp_path):
    path = tmp_path / "latin1.json"
    # item 2 holds a Latin-1 byte; item 3 the JSON escape of a lone surrogate, which is ASCII in the file
    path.write_bytes(b'[\n {"a": "x"},\n {"a": "caf\xe9"}, {"a": "\\udce9"},\n {"a": "z"}\n]\n')
    with pytest.raises(RowError) as info:
        list(read_rows(path))
    assert str(info.value) == f"{path}, row 2: not UTF-8 text: byte 0xe9 at byte offset 11 of line 3"
    rejected = []
    rows = list(read_rows(path, on_bad_row=rejected.append))
    assert rows == [(1, {"a": "x"}), (3, {"a": "\udce9"}), (4, {"a": "z"})]
    assert [(e.row, e.reason) for e in rejected] == [(2, "not_utf8")]


def test_json_byte_that_is_not_utf8_outside_a_string_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[\n {"a": 1},\n {"a": 2\xe9}\n]\n')
    with pytest.raises(DataError) as info:
        list(read_rows(path, on_bad_row=lambda err: None))
    assert str(info.value) == f"{path}: not UTF-8 text outside a string: byte 0xe9 at byte offset 8 of line 3"


def test_json_file_must_hold_a_list(tmp_path):
    path = tmp_path / "one.json"
    path.write_text('{"prompt": "x"}')
    with pytest.raises(DataError, match=r"one\.json: a \.json dataset must hold a list of objects, got dict"):
        list(read_rows(path))


def test_json_file_with_a_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"a": "x"},\n{"a": }\n]')
    with pytest.raises(DataError, match=r"broken\.json: not valid JSON: .* at line 3"):
        list(read_rows(path))


def test_truncated_parquet_names_the_file(tmp_path):
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist(TEXT_ROWS * 50), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(DataError) as info:
        list(read_rows(cut))
    assert str(info.value).startswith(f"{cut}: cannot open as parquet (truncated or not a parquet file?)")


def test_corrupt_parquet_row_group_names_its_rows(tmp_path):
    path = tmp_path / "groups.parquet"
    rows = [{"prompt": f"row {i} " + "x" * 50, "completion": "y"} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10, use_dictionary=False)
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)  # the 'prompt' column of rows 11-20
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    data[start : start + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"groups\.parquet, rows 11-20 \(row group 1\): corrupt data"):
        list(read_rows(path))


def test_csv_row_with_too_many_cells_names_the_file_and_row(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("prompt,completion\na,b\nc,d,e\nf,g\n")
    with pytest.raises(DataError) as info:
        list(read_rows(path))
    assert str(info.value).startswith(f"{path}, row 2: unreadable CSV")


def test_csv_row_that_is_not_utf8_is_its_own_bad_row_and_the_others_are_read(tmp_path):
    # Far enough down that the header's read never sees it (it blamed the header), and a bad row of
    # its own (it stopped the whole file, so skip_bad_rows could not skip it).
    path = tmp_path / "latin1.csv"
    rows = [f"q{i},a{i}".encode() for i in range(1, 3001)]
    rows[2000] = "café,ok".encode("latin-1")
    path.write_bytes(b"prompt,completion\n" + b"\n".join(rows) + b"\n")
    with pytest.raises(RowError) as info:
        list(read_rows(path))
    assert str(info.value) == f"{path}, row 2001: not UTF-8 text: byte 0xe9 at byte offset 3 of column 'prompt'"
    rejected = []
    read = list(read_rows(path, on_bad_row=rejected.append))
    assert [(e.row, e.reason) for e in rejected] == [(2001, "not_utf8")]
    assert len(read) == 2999 and read[2000] == (2002, {"prompt": "q2002", "completion": "a2002"})


def test_csv_header_naming_a_column_twice_is_refused(tmp_path):
    # pyarrow keeps one of the two columns: the prompt would silently be the second one's text.
    path = tmp_path / "twice.csv"
    path.write_text("prompt,completion,prompt\nWhat is 2+2?,4,IGNORE\n")
    with pytest.raises(DataError, match=r"twice\.csv: the CSV header names column\(s\) 'prompt' more than once"):
        list(read_rows(path))


def test_a_jsonl_object_naming_a_key_twice_is_its_rows_error_and_the_others_are_read(tmp_path):
    # json keeps the last value: the completion trained on would silently be "5", the nested role "user".
    path = tmp_path / "twice.jsonl"
    path.write_text(
        '{"prompt": "What is 2+2?", "completion": "4", "completion": "5"}\n'
        '{"prompt": "a", "completion": "b"}\n'
        '{"messages": [{"role": "assistant", "role": "user", "content": "hi"}]}\n'
    )
    with pytest.raises(RowError) as info:
        list(read_rows(path))
    assert str(info.value) == f"{path}, row 1: the key 'completion' is given twice in one object; keep one"
    rejected = []
    assert list(read_rows(path, on_bad_row=rejected.append)) == [(2, {"prompt": "a", "completion": "b"})]
    assert [(e.row, e.reason, str(e).split(": ", 1)[1]) for e in rejected] == [
        (1, "repeated_key", "the key 'completion' is given twice in one object; keep one"),
        (3, "repeated_key", "the key 'role' is given twice in one object; keep one"),
    ]


def test_a_json_item_naming_a_key_twice_is_its_rows_error_and_the_others_are_read(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('[{"prompt": "a", "completion": "b"},\n {"prompt": "x", "prompt": "y", "completion": "c"}]')
    rejected = []
    assert list(read_rows(path, on_bad_row=rejected.append)) == [(1, {"prompt": "a", "completion": "b"})]
    assert [(e.row, e.reason) for e in rejected] == [(2, "repeated_key")]
    assert str(rejected[0]) == f"{path}, row 2: the key 'prompt' is given twice in one object; keep one"


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "feather"])
def test_a_table_naming_a_column_twice_is_refused(tmp_path, fmt):
    table = pa.table([["a"], ["4"], ["5"]], names=["prompt", "completion", "completion"])
    path = tmp_path / f"twice.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    kind = "parquet schema" if fmt == "parquet" else "Arrow schema"
    with pytest.raises(DataError, match=rf"twice\.{fmt}: the {kind} names column\(s\) 'completion' more than once"):
        list(read_rows(path))


def test_unknown_extension_lists_the_supported_ones(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(DataError) as info:
        list(read_rows(path))
    assert str(info.value) == (
        f"{path}: unsupported file type '.txt'; supported: .jsonl, .json, .parquet, .csv, .arrow, .feather, "
        "or a folder saved with datasets.save_to_disk"
    )


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"dataset not found: .*nowhere\.jsonl"):
        list(read_rows(tmp_path / "nowhere.jsonl"))


def test_datasets_folder_with_splits_needs_a_split_and_reads_the_chosen_one(tmp_path):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(TEXT_ROWS), "test": datasets.Dataset.from_list(TEXT_ROWS[:1])}
    ).save_to_disk(str(folder))
    with pytest.raises(DataError, match="set split to one of train, test"):
        list(read_rows(folder))
    with pytest.raises(DataError, match="no split 'dev'; splits: train, test"):
        list(read_rows(folder, split="dev"))
    assert list(read_rows(folder, split="test")) == [(1, TEXT_ROWS[0])]


def test_a_folder_that_is_not_a_datasets_folder_is_explained(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="a folder must be saved with datasets.save_to_disk"):
        list(read_rows(tmp_path / "plain"))


def test_split_on_a_file_is_rejected(write_dataset):
    path = write_dataset(TEXT_ROWS, "jsonl")
    with pytest.raises(DataError, match="split='train' applies only to datasets folders"):
        list(read_rows(path, split="train"))


def test_file_the_user_may_not_read_is_named_not_a_traceback(tmp_path):
    from tests.unreadable import run_unable_to_read

    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n')
    code = (
        "import sys; from raylign.data import DataError, read_rows\n"
        f"try: list(read_rows({str(path)!r}))\n"
        "except DataError as err: print(err); sys.exit(3)\n"
    )
    done = run_unable_to_read(path, ["-c", code], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == f"{path}: cannot be read: Permission denied"
