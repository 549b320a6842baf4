"""A block of `COPY (SELECT …) TO STDOUT (FORMAT csv)` output as Arrow string arrays, parsed in C.

The copy reads each column as its type's output function writes it (copy.snapshot_batches); the CSV writes a
NULL as an unquoted empty field and the empty string as `""`, and quotes any value holding the delimiter, a
quote (doubled inside), a newline or a carriage return. Backslashes are data in CSV. So: no escape
character, quoted newlines allowed, an unquoted empty field NULL and a quoted one never, and an empty line a
row (the one column of a row whose only value is NULL). Every column is read as a string: types.py's
convert_text_arrays then gives each the Arrow value the per-value converter would.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.csv as pcsv

_PARSE = pcsv.ParseOptions(delimiter=",", quote_char='"', double_quote=True, escape_char=False,
                           newlines_in_values=True, ignore_empty_lines=False)


def string_arrays(columns: int, data) -> list[pa.Array]:
    """The `columns` string arrays of a block of whole CSV rows (bytes or a buffer)."""
    names = [f"c{i}" for i in range(columns)]
    table = pcsv.read_csv(
        pa.py_buffer(data),
        # one block, one thread: a Spark task has one core, and one chunk needs no concatenation
        read_options=pcsv.ReadOptions(column_names=names, use_threads=False, block_size=len(data) + 1),
        parse_options=_PARSE,
        convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=[""],
                                            strings_can_be_null=True, quoted_strings_can_be_null=False))
    return [table.column(i).combine_chunks() for i in range(columns)]
