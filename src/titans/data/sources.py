"""Where the documents come from: local text, JSON Lines and Parquet files, and local Hugging Face `datasets`
directories, found from paths, directories and globs; cut into pieces that workers read independently.

A document is a whole text file, one JSON line's text field, one Parquet row's text column or one dataset row's. Each
has an id (`<source>#<row>` or `<source>@<byte offset>`) from which its split is drawn (`document_split`), so a
document lies wholly in one split, and the same corpus splits the same way on every machine.

Reading is forgiving of data and strict about configuration: a binary or undecodable text file, a JSON line that is
malformed or lacks the field, a row whose text is missing are skipped and counted by reason (with `strict`, refused with
an error naming the file and place); a Parquet file or dataset without the text column is an error.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

Kind = Literal["text", "jsonl", "parquet", "hf"]
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
BINARY_PROBE = 8192  # a text file with a NUL byte in its first 8 KiB is binary (what git and grep decide on too)
SKIP_REASONS = ("binary", "undecodable", "malformed", "no_text", "empty")


def document_split(doc_id: str, val_fraction: float) -> Literal["train", "val"]:
    """The split of a document, from a hash of its id: the same on every machine and every run."""
    digest = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return "val" if digest < val_fraction * 2**64 else "train"


@dataclass(frozen=True)
class Source:
    """One input to read: a file (`kind` from its suffix) or a Hugging Face datasets directory split (`part`).
    `name` is how documents are identified (the path relative to the directory argument it was found under, or the
    path as given); `size` and `mtime_ns` tell a resumed preparation whether it changed."""

    path: str
    kind: Kind
    name: str
    size: int
    mtime_ns: int
    part: str = ""  # the split of a DatasetDict directory ("" for a single Dataset)
    rows: int = 0  # rows of a dataset (0 for files)


@dataclass(frozen=True)
class Piece:
    """A range of one source a worker reads on its own: bytes [start, stop) of a text or JSON Lines file (a JSON line
    belongs to the piece its first byte lies in), row groups [start, stop) of a Parquet file, rows of a dataset."""

    source: int  # index into the preparation's sources
    start: int
    stop: int
    size: int  # bytes of text (estimated for Parquet row groups and dataset rows): the progress bar's unit


@dataclass
class ReadCounts:
    """What reading a piece found: documents read, and those skipped by reason (`SKIP_REASONS`), with the first few
    places skipped, to show the user."""

    documents: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {reason: 0 for reason in SKIP_REASONS})
    examples: list[str] = field(default_factory=list)

    def accept(self, text: object, where: str, strict: bool, missing: str) -> bool:
        """Whether `text` is a document (a non-empty string; counted); else it is skipped as no_text (`missing` says
        what was found instead) or empty."""
        if not isinstance(text, str):
            self.skip("no_text", where, strict, missing)
            return False
        if not text:
            self.skip("empty", where, strict)
            return False
        self.documents += 1
        return True

    def skip(self, reason: str, where: str, strict: bool, detail: str = "") -> None:
        if strict and reason != "empty":
            raise ValueError(f"{where}: {reason.replace('_', ' ')}{f' ({detail})' if detail else ''}; without "
                             "--strict such documents are skipped and counted")
        self.skipped[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where} ({reason})")


def _is_dataset_dir(path: Path) -> bool:
    """A directory `datasets.Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) wrote."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                      and (path / "dataset_info.json").is_file())


def _kind(path: Path) -> Kind:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _file_source(path: Path, name: str) -> Source:
    stat = path.stat()
    return Source(str(path.resolve()), _kind(path), name, stat.st_size, stat.st_mtime_ns)


def _visible_files(root: Path) -> Iterator[Path]:
    """Files under `root`, sorted, without hidden files or folders (.git, .cache) and without what a Python install
    keeps beside its sources (site-packages, __pycache__)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(folder) / name


def find_sources(inputs: list[str], text_field: str = "text") -> list[Source]:
    """Every source that `inputs` (files, directories, globs, dataset directories) name, each once, in order."""
    if not inputs:
        raise ValueError("no input given: name files, directories or globs of text, JSON Lines or Parquet")
    found: dict[tuple[str, str], Source] = {}
    for given in inputs:
        path = Path(given)
        if path.is_dir() and _is_dataset_dir(path):
            for source in _dataset_sources(path, text_field):
                found.setdefault((source.path, source.part), source)
        elif path.is_dir():
            files = [(p, p.relative_to(path).as_posix()) for p in _visible_files(path)]
            if not files:
                raise ValueError(f"input directory {given} holds no files")
            for file, rel in files:
                found.setdefault((str(file.resolve()), ""), _file_source(file, f"{path.name}/{rel}"))
        elif path.is_file():
            found.setdefault((str(path.resolve()), ""), _file_source(path, given))
        else:
            matches = sorted(Path(m) for m in glob.glob(given, recursive=True) if Path(m).is_file())
            if not matches:
                raise ValueError(f"input {given!r} is no file or directory and matches no file")
            for match in matches:
                found.setdefault((str(match.resolve()), ""), _file_source(match, match.as_posix()))
    return list(found.values())


def datasets_module():
    try:
        import datasets
    except ImportError:
        raise ValueError('reading a Hugging Face datasets directory needs the datasets package: '
                         'pip install -c constraints.txt -e ".[datasets]"') from None
    return datasets


def _load_dataset(path: str, part: str):
    dataset = datasets_module().load_from_disk(path)
    return dataset[part] if part else dataset


def _dataset_sources(path: Path, text_field: str) -> list[Source]:
    """One source per split of a saved DatasetDict (one for a saved Dataset); each must have the text column."""
    dataset = datasets_module().load_from_disk(str(path))
    parts = sorted(dataset) if hasattr(dataset, "keys") else [""]
    stat = path.stat()
    sources = []
    for part in parts:
        table = dataset[part] if part else dataset
        if text_field not in table.column_names:
            raise ValueError(f"dataset {path}{f' split {part}' if part else ''} has no column {text_field!r} "
                             f"(columns: {', '.join(table.column_names)}); name it with --text-field")
        size = int(table.data.nbytes)
        sources.append(Source(str(path.resolve()), "hf", f"{path.name}/{part}" if part else path.name, size,
                              stat.st_mtime_ns, part, table.num_rows))
    return sources


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError('reading Parquet needs pyarrow: pip install -c constraints.txt -e ".[data]"') from None
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{path} is not a readable Parquet file: {' '.join(str(err).split())[:200]}") from None


def pieces_of(index: int, source: Source, piece_bytes: int, text_field: str) -> list[Piece]:
    """`source` cut into pieces of about `piece_bytes` of text (a text file is one document, so one piece)."""
    if source.kind == "text" or (source.kind == "jsonl" and source.size <= piece_bytes):
        return [Piece(index, 0, source.size, source.size)]
    if source.kind == "jsonl":
        return [Piece(index, start, min(start + piece_bytes, source.size), min(piece_bytes, source.size - start))
                for start in range(0, source.size, piece_bytes)]
    if source.kind == "parquet":
        meta = _parquet(source.path).metadata
        if text_field not in meta.schema.names:
            raise ValueError(f"{source.path} has no column {text_field!r} (columns: {', '.join(meta.schema.names)}); "
                             "name it with --text-field")
        pieces, start, size = [], 0, 0
        for group in range(meta.num_row_groups):
            size += meta.row_group(group).total_byte_size
            if size >= piece_bytes or group == meta.num_row_groups - 1:
                pieces.append(Piece(index, start, group + 1, size))
                start, size = group + 1, 0
        return pieces
    rows_per_piece = max(1, int(piece_bytes * source.rows / max(source.size, 1)))
    return [Piece(index, start, min(start + rows_per_piece, source.rows),
                  source.size * (min(start + rows_per_piece, source.rows) - start) // max(source.rows, 1))
            for start in range(0, source.rows, rows_per_piece)]


def read_piece(source: Source, piece: Piece, text_field: str, strict: bool,
               counts: ReadCounts) -> Iterator[tuple[str, str]]:
    """(document id, text) of each document of `piece`, in order; skipped ones are counted in `counts`."""
    if source.kind == "text":
        yield from _read_text(source, counts, strict)
    elif source.kind == "jsonl":
        yield from _read_jsonl(source, piece, text_field, counts, strict)
    elif source.kind == "parquet":
        table = _parquet(source.path).read_row_groups(list(range(piece.start, piece.stop)), columns=[text_field])
        first = sum(_parquet(source.path).metadata.row_group(g).num_rows for g in range(piece.start))
        yield from _rows(source.name, table.column(text_field).to_pylist(), first, counts, strict)
    else:
        rows = _load_dataset(source.path, source.part)[piece.start:piece.stop][text_field]
        yield from _rows(source.name, rows, piece.start, counts, strict)


def _rows(name: str, texts: list, first: int, counts: ReadCounts, strict: bool) -> Iterator[tuple[str, str]]:
    for offset, text in enumerate(texts):
        if counts.accept(text, f"{name} row {first + offset}", strict, f"the text is {type(text).__name__}"):
            yield f"{name}#{first + offset}", text


def _read_text(source: Source, counts: ReadCounts, strict: bool) -> Iterator[tuple[str, str]]:
    data = Path(source.path).read_bytes()
    if b"\0" in data[:BINARY_PROBE]:
        counts.skip("binary", source.name, strict, "a NUL byte in its first 8 KiB")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        counts.skip("undecodable", source.name, strict, f"not UTF-8 at byte {err.start}")
        return
    text = text.removeprefix("\ufeff")  # a byte-order mark is no part of the text
    if not text:
        counts.skip("empty", source.name, strict)
        return
    counts.documents += 1
    yield f"{source.name}#0", text


def _read_jsonl(source: Source, piece: Piece, text_field: str, counts: ReadCounts,
                strict: bool) -> Iterator[tuple[str, str]]:
    with open(source.path, "rb") as f:
        position = piece.start
        if position > 0:  # the line that holds byte `start` began in the piece before, unless a newline ends there
            f.seek(position - 1)
            if f.read(1) != b"\n":
                position += len(f.readline())
        f.seek(position)
        while position < piece.stop:
            line = f.readline()
            if not line:
                break
            where, start = f"{source.name} byte {position}", position
            position += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, ValueError) as err:
                counts.skip("malformed", where, strict, " ".join(str(err).split())[:80])
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if counts.accept(text, where, strict, f"no string field {text_field!r}"):
                yield f"{source.name}@{start}", text


def source_pieces(sources: list[Source], piece_bytes: int, text_field: str) -> list[Piece]:
    return [piece for i, source in enumerate(sources) for piece in pieces_of(i, source, piece_bytes, text_field)]


def group_pieces(pieces: list[Piece], unit_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces packed into units of at most about `unit_bytes` of text (a larger piece is a unit alone)."""
    units: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        if not units or size + piece.size > unit_bytes:
            units.append([])
            size = 0
        units[-1].append(piece)
        size += piece.size
    return units
