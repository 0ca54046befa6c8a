"""Hugging Face token datasets: a `datasets` `save_to_disk` directory or Parquet files, one document a row.

`Dataset.save_to_disk` writes Arrow IPC *stream* files (`data-00000-of-00001.arrow`, listed in the
directory's `state.json`); they are read here with pyarrow, so any fsspec URL works and `datasets`
itself is needed only by whoever wrote them. Parquet files go through the build's own Parquet reader
(`shardkit.text.inputs`), with the token column in place of the text column. Each work unit is one
record batch of the token column; a row is a document and its `doc_index` is its row number.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from shardkit.storage import open_filesystem
from shardkit.text.documents import UnitResult
from shardkit.text.inputs import InputFile, WorkUnit, _display, expand_inputs, open_input, iter_units

from .documents import TokenSettings, source_files, token_documents
from .source_index import IndexEntry, read_json_object


def expand_sources(inputs: tuple[str, ...], storage_options) -> list[InputFile]:
    """The Arrow files of `save_to_disk` directories, or the Parquet files the SRCs name (not both)."""
    files: list[InputFile] = []
    for spec in inputs:
        fs, path = open_filesystem(spec, storage_options)
        if fs.isdir(path) and fs.exists(f"{path}/dataset_dict.json"):
            name = _display(fs, f"{path}/dataset_dict.json")
            splits = IndexEntry(read_json_object(fs, f"{path}/dataset_dict.json", name=name, what="a DatasetDict index"),
                                where="", file=name).list("splits")
            splits = [str(split) for split in splits]
            raise ValueError(f"SRC {spec} is a DatasetDict (splits: {', '.join(splits)}); give one split's "
                             f"directory, e.g. {spec.rstrip('/')}/{splits[0] if splits else 'train'}")
        if fs.isdir(path) and fs.exists(f"{path}/state.json"):
            files.extend(source_files([(fs, f"{path}/{name}") for name in _data_files(fs, path)], "hf"))
        else:
            found = expand_inputs([spec], storage_options, content_hashes=True)
            wrong = [f.url for f in found if f.kind != "parquet"]
            if wrong:
                raise ValueError(f"SRC {spec}: {wrong[0]} is neither Parquet nor in a save_to_disk directory "
                                 "(one with state.json)")
            files.extend(found)
    if len({f.kind for f in files}) > 1:
        raise ValueError("give either save_to_disk directories or Parquet files as SRC, not both")
    return files


def _data_files(fs, path: str) -> list[str]:
    """The Arrow files a `save_to_disk` directory's state.json lists, each refused when it leaves the directory.

    Raises:
        ValueError: state.json is not JSON of the documented shape, or names a file outside the directory.
    """
    name = _display(fs, f"{path}/state.json")
    state = IndexEntry(read_json_object(fs, f"{path}/state.json", name=name, what="a save_to_disk state"),
                       where="", file=name)
    return [IndexEntry(entry, where=f"_data_files {number}", file=name).file_name("filename")
            for number, entry in enumerate(state.list("_data_files"))]


def units(files: list[InputFile], *, token_field: str, unit_bytes: int, storage_options,
          start: tuple[int, int, int]) -> Iterator[WorkUnit]:
    """Work units of the token column, from a resume position."""
    if files and files[0].kind == "parquet":
        return iter_units(files, text_field=token_field, unit_bytes=unit_bytes, storage_options=storage_options,
                          start=start)
    return _stream_units(files, token_field=token_field, storage_options=storage_options, start=start)


def _stream_units(files: list[InputFile], *, token_field: str, storage_options,
                  start: tuple[int, int, int]) -> Iterator[WorkUnit]:
    """One unit per record batch of each Arrow stream file (save_to_disk writes ~1,000-row batches)."""
    import pyarrow as pa

    index, first_source, skip = start
    for source in range(first_source, len(files)):
        file = files[source]
        skip_units = skip if source == first_source else 0
        file_unit = record = reached = 0
        try:
            with open_input(file.url, storage_options) as fh:  # the build's input reader: retried like it
                reader = pa.ipc.open_stream(fh)
                if token_field not in reader.schema.names:
                    raise ValueError(f"no column {token_field!r} (columns: {', '.join(reader.schema.names)}); "
                                     "choose one with --token-field")
                for batch in reader:
                    if file_unit >= skip_units:
                        reached = fh.tell()
                        yield WorkUnit(index=index, source=source, file_unit=file_unit, kind="hf", first_record=record,
                                       payload=batch.column(token_field), input_offset=reached,
                                       records_in_payload=batch.num_rows)
                        index += 1
                    file_unit += 1
                    record += batch.num_rows
                end = fh.tell()
            if file_unit >= skip_units and (file_unit == 0 or end > reached):
                # the end-of-stream marker (or an empty file): one empty unit says the file was read to its end
                yield WorkUnit(index=index, source=source, file_unit=file_unit, kind="hf", first_record=record,
                               payload=None, input_offset=file.size)
                index += 1
        except (OSError, ValueError, pa.ArrowException) as err:
            if file_unit >= skip_units:
                yield WorkUnit(index=index, source=source, file_unit=file_unit, kind="hf", first_record=record,
                               file_error=f"read failed after {record} rows: {type(err).__name__}: {err}",
                               input_offset=reached)
                index += 1


def read_rows(unit: WorkUnit, settings: TokenSettings) -> UnitResult:
    """The rows of one batch of the token column as documents (runs in a worker process or a Ray task)."""
    import pyarrow as pa

    column = unit.payload
    if column is None or len(column) == 0:
        return token_documents(unit, np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), settings)
    records = unit.first_record + np.arange(len(column), dtype=np.int64)
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
            or not pa.types.is_integer(kind.value_type):
        reason = f"the token column is {kind}, not a list of integer ids"
        return token_documents(unit, np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), settings,
                               rejected=[(int(r), reason) for r in records])
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    valid = ~np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    rejected = [(int(r), "the token list is null") for r in records[~valid]]
    values = column.flatten()
    if values.null_count:  # a null inside a list: reject those rows
        owners = np.repeat(np.arange(len(column)), lengths)  # null rows have length 0 and no values
        for row in np.unique(owners[values.is_null().to_numpy(zero_copy_only=False)]).tolist():
            rejected.append((int(records[row]), "the token list holds a null id"))
            valid[row] = False
        values = values.filter(pa.array(np.repeat(valid, lengths)))
    tokens = values.to_numpy(zero_copy_only=False)
    return token_documents(unit, tokens, lengths[valid], records[valid], settings, rejected=rejected)
