"""`titans data prepare`: local text -> a tokenizer and token shards that training memory-maps (`shards.py`).

The work is planned first: the sources are found and cut into units of about `shard_mib` of text (whole small files
grouped, large JSON Lines files cut at byte offsets, Parquet files at row groups, datasets at rows). The plan is saved,
then the tokenizer is trained (a byte-level BPE on a sample of the training split's documents) or loaded, and the
units are tokenized, in parallel over processes where there are several units and cores. Each unit writes its own
shard per split and, last, a record of what it wrote: a preparation that is killed resumes (`resume=True`) by redoing
exactly the units that have no record, whose shards are then rewritten whole, so no document is lost or written twice.
`metadata.json` is written when every unit is done.

A resumed preparation must be the same preparation: the same sources (path, size, modification time) and options, and
the tokenizer it started with; anything else is refused, naming the difference.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from pydantic import Field, model_validator
from tqdm.auto import tqdm

from ..config import Config
from . import tokenizer as tok
from .shards import (
    FORMAT_VERSION,
    METADATA_FILE,
    SPLITS,
    ShardFile,
    ShardMetadata,
    SplitStats,
    TokenizerInfo,
    token_dtype,
)
from .sources import (
    SKIP_REASONS,
    Piece,
    ReadCounts,
    Source,
    document_split,
    find_sources,
    group_pieces,
    read_piece,
    source_pieces,
)

WORK_DIR = ".prepare"  # the plan and the units' records while a preparation runs
MiB = 2**20
ENCODE_BATCH_BYTES = 4 * MiB  # documents are encoded (and written) this much text at a time: memory stays bounded


class PrepareOptions(Config):
    """What to prepare. Exactly one of `vocab_size` (train a byte-level BPE of that many tokens) and `tokenizer` (a
    tokenizer.json, or a directory holding one) is given."""

    inputs: list[str] = Field(min_length=1)
    vocab_size: Optional[int] = Field(None, ge=tok.MIN_VOCAB, le=2**32)
    tokenizer: Optional[str] = None
    eot_token: Optional[str] = None  # the document separator of a loaded tokenizer (default: found, `end_of_text`)
    val_fraction: float = Field(0.01, gt=0, lt=1)  # of the documents, drawn by a hash of each document's id
    text_field: str = "text"  # the JSON Lines field / Parquet or dataset column holding the text
    shard_mib: float = Field(64.0, gt=0)  # text per unit of work (and so per shard)
    tokenizer_sample_mib: float = Field(256.0, gt=0)  # training-split text the BPE is trained on, at most
    strict: bool = False  # refuse binary or undecodable files and malformed records instead of skipping them

    @model_validator(mode="after")
    def check_rules(self) -> PrepareOptions:
        if (self.vocab_size is None) == (self.tokenizer is None):
            raise ValueError("give either vocab_size (train a BPE tokenizer here) or tokenizer (a tokenizer.json to "
                             "load), not both and not neither")
        if self.vocab_size is not None and self.eot_token is not None:
            raise ValueError(f"eot_token names the separator of a loaded tokenizer; a trained one uses {tok.EOT_TOKEN}")
        return self


@dataclass(frozen=True)
class UnitJob:
    """One unit's work, as sent to a worker process."""

    index: int
    pieces: tuple[Piece, ...]
    sources: tuple[Source, ...]  # those the pieces index (the whole list: a few hundred bytes per source)
    out: str
    text_field: str
    val_fraction: float
    strict: bool
    dtype: str


def shard_name(split: str, unit: int) -> str:
    return f"{split}/{unit:06d}.bin"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ workers

_WORKER: dict[str, Any] = {}  # the tokenizer of this worker process (loaded once, by `_init_worker`)


def _init_worker(tokenizer_path: str, eot_id: int, threads: Optional[int]) -> None:
    if threads is not None:  # several worker processes: one tokenizer thread each, not one per core in every process
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tok.load_tokenizer(tokenizer_path), eot_id=eot_id)


def _documents(job: UnitJob, counts: ReadCounts) -> Iterator[tuple[str, str]]:
    for piece in job.pieces:
        yield from read_piece(job.sources[piece.source], piece, job.text_field, job.strict, counts)


def encode_unit(job: UnitJob) -> dict[str, Any]:
    """Tokenize one unit into its shards (one per split that has documents) and write its record; returns it."""
    tokenizer, eot = _WORKER["tokenizer"], _WORKER["eot_id"]
    out, dtype = Path(job.out), np.dtype(job.dtype)
    counts = ReadCounts()
    stats = {split: {"documents": 0, "tokens": 0, "bytes": 0} for split in SPLITS}
    tmp = {split: out / split / f".{job.index:06d}.bin.tmp" for split in SPLITS}
    files = {split: open(path, "wb") for split, path in tmp.items()}
    try:
        batch: dict[str, list[str]] = {split: [] for split in SPLITS}
        pending = 0

        def flush() -> None:
            for split, texts in batch.items():
                if texts:
                    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                        ids = np.asarray(encoding.ids + [eot], dtype=dtype)
                        ids.tofile(files[split])
                        stats[split]["tokens"] += len(ids)
                    texts.clear()

        for doc_id, text in _documents(job, counts):
            split = document_split(doc_id, job.val_fraction)
            batch[split].append(text)
            size = len(text.encode("utf-8"))
            stats[split]["documents"] += 1
            stats[split]["bytes"] += size
            pending += size
            if pending >= ENCODE_BATCH_BYTES:
                flush()
                pending = 0
        flush()
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    for split in SPLITS:
        final = out / shard_name(split, job.index)
        if stats[split]["tokens"]:
            os.replace(tmp[split], final)
        else:
            tmp[split].unlink()
            final.unlink(missing_ok=True)
    record = {"unit": job.index, "splits": stats, "skipped": counts.skipped, "examples": counts.examples}
    _write_atomic(out / WORK_DIR / f"unit_{job.index:06d}.json", json.dumps(record))
    return record


# ------------------------------------------------------------------------------------------------ planning


def _plan(options: PrepareOptions, sources: list[Source], units: list[list[Piece]]) -> dict[str, Any]:
    """What the preparation is: compared field by field on --resume."""
    return {"version": FORMAT_VERSION,
            "options": options.to_dict(),
            "sources": [[s.path, s.part, s.size, s.mtime_ns] for s in sources],
            "units": [[[p.source, p.start, p.stop] for p in unit] for unit in units]}


def _plan_difference(saved: dict[str, Any], plan: dict[str, Any]) -> Optional[str]:
    """What differs between a saved plan and this one, in words; None when they are the same preparation."""
    for key, value in plan["options"].items():
        if saved.get("options", {}).get(key) != value:
            return f"option {key} ({saved.get('options', {}).get(key)!r} -> {value!r})"
    old = {(p, part): (size, mtime) for p, part, size, mtime in saved.get("sources", [])}
    new = {(p, part): (size, mtime) for p, part, size, mtime in plan["sources"]}
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            return f"source {key[0]} is gone"
        if key not in old:
            return f"source {key[0]} is new"
        if old[key] != new[key]:
            return f"source {key[0]} changed (size or modification time)"
    if saved.get("units") != plan["units"]:
        return "the division of the work into units"
    return None


def check_out_dir(out: Path, resume: bool, force: bool) -> None:
    """Whether the preparation may use `out`: a new or empty directory; with `resume`, an unfinished preparation; with
    `force`, a directory titans prepared (finished or not), which is then replaced. Touches nothing."""
    finished, unfinished = (out / METADATA_FILE).is_file(), (out / WORK_DIR / "plan.json").is_file()
    if resume:
        if finished:
            raise ValueError(f"--resume: {out} holds a finished preparation; pass --force to prepare it again")
        if not unfinished:
            raise ValueError(f"--resume: {out} holds no unfinished preparation")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            state = ("prepared shards" if finished else "an unfinished preparation (pass --resume to continue it)"
                     if unfinished else "other files")
            raise ValueError(f"{out} already exists and holds {state}; pass --force to replace it")
        if not (finished or unfinished):
            raise ValueError(f"--force: {out} was not made by titans data prepare (no {METADATA_FILE} or "
                             f"{WORK_DIR}/ in it); refusing to delete it")


def _sample_texts(units: list[list[Piece]], sources: list[Source], options: PrepareOptions,
                  counts: ReadCounts) -> Iterator[str]:
    """Training-split documents for the BPE, up to `tokenizer_sample_mib` of text, from units spread evenly over the
    corpus (every k-th unit), so that a sample of a large corpus is not only its first files."""
    budget = options.tokenizer_sample_mib * MiB
    total = sum(p.size for unit in units for p in unit)
    stride = max(1, int(total // budget)) if budget < total else 1
    order = [i for offset in range(stride) for i in range(offset, len(units), stride)]
    taken = 0
    for index in order:
        for piece in units[index]:
            for doc_id, text in read_piece(sources[piece.source], piece, options.text_field, options.strict, counts):
                if document_split(doc_id, options.val_fraction) == "train":
                    yield text
                    taken += len(text.encode("utf-8"))
                    if taken >= budget:
                        return


def _tokenizer(options: PrepareOptions, out: Path, units: list[list[Piece]], sources: list[Source],
               resume: bool, quiet: bool) -> TokenizerInfo:
    """The preparation's tokenizer, saved as out/tokenizer.json: on --resume the one it started with (a --tokenizer
    given again must be that one), else trained or loaded now."""
    info_path = out / WORK_DIR / "tokenizer.json"
    if resume and info_path.is_file():
        info = TokenizerInfo.from_dict(json.loads(info_path.read_text()))
        saved = tok.load_tokenizer(out / tok.TOKENIZER_FILE)
        if tok.tokenizer_hash(saved) != info.sha256:
            raise ValueError(f"{out / tok.TOKENIZER_FILE} was changed since the preparation began (its SHA-256 is not "
                             f"{info.sha256}); pass --force to start over")
        if options.tokenizer is not None and tok.tokenizer_hash(tok.load_tokenizer(options.tokenizer)) != info.sha256:
            raise ValueError(f"--tokenizer {options.tokenizer} is not the tokenizer this preparation began with "
                             f"(SHA-256 {info.sha256}): the shards written so far would not match")
        return info
    if options.tokenizer is not None:
        source = tok.tokenizer_file(options.tokenizer)
        tokenizer = tok.load_tokenizer(source)
        eot_token, eot_id = tok.end_of_text(tokenizer, options.eot_token, source)
        origin = str(source.resolve())
    else:
        if not quiet:
            tqdm.write(f"training a byte-level BPE tokenizer of {options.vocab_size} tokens on up to "
                       f"{options.tokenizer_sample_mib:g} MiB of the training split")
        counts = ReadCounts()
        tokenizer = tok.train_bpe(_sample_texts(units, sources, options, counts), options.vocab_size)
        eot_token, eot_id = tok.EOT_TOKEN, tokenizer.token_to_id(tok.EOT_TOKEN)
        origin = f"byte-level BPE trained here (vocab_size {options.vocab_size})"
    sha = tok.save_tokenizer(tokenizer, out / tok.TOKENIZER_FILE)
    info = TokenizerInfo(sha256=sha, vocab_size=tok.vocab_size(tokenizer), eot_token=eot_token, eot_id=eot_id,
                         origin=origin)
    _write_atomic(info_path, json.dumps(info.to_dict()))
    return info


def _check_val_reachable(sources: list[Source], options: PrepareOptions) -> None:
    """Where every source is a text file (one document each, ids known now), a split that would get no document is
    refused before any work."""
    if sources and all(s.kind == "text" for s in sources):
        splits = {document_split(f"{s.name}#0", options.val_fraction) for s in sources}
        for split in SPLITS:
            if split not in splits:
                raise ValueError(f"none of the {len(sources)} documents falls in the {split} split at val_fraction "
                                 f"{options.val_fraction:g}; " + ("raise it" if split == "val" else "lower it"))


def _run_units(jobs: list[UnitJob], info: TokenizerInfo, out: Path, workers: int, bar: tqdm) -> None:
    """Encode `jobs`: in this process with one worker (the tokenizer then uses every core itself), else in a pool of
    `workers` processes, one tokenizer thread each."""
    tokenizer_path = str(out / tok.TOKENIZER_FILE)
    if workers <= 1 or len(jobs) <= 1:
        _init_worker(tokenizer_path, info.eot_id, None)
        for job in jobs:
            encode_unit(job)
            bar.update(sum(p.size for p in job.pieces))
        return
    context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                initargs=(tokenizer_path, info.eot_id, 1)) as pool:
        futures = {pool.submit(encode_unit, job): job for job in jobs}
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update(sum(p.size for p in futures[future].pieces))
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def prepare(options: PrepareOptions, out: str | Path, resume: bool = False, force: bool = False,
            workers: Optional[int] = None, quiet: bool = False) -> ShardMetadata:
    """Prepare `options.inputs` into the shard directory `out` (see the module docstring); returns its metadata.

    `workers`: processes tokenizing units at once (default: one per core, at most one per unit)."""
    out = Path(out)
    check_out_dir(out, resume, force)
    sources = find_sources(options.inputs, options.text_field)
    if sum(s.size for s in sources) == 0:
        raise ValueError(f"the corpus is empty: {', '.join(options.inputs)} hold(s) no text")
    units = group_pieces(source_pieces(sources, int(options.shard_mib * MiB), options.text_field),
                         int(options.shard_mib * MiB))
    _check_val_reachable(sources, options)
    if options.tokenizer is not None:  # a tokenizer that cannot be read is refused before --force deletes anything
        source = tok.tokenizer_file(options.tokenizer)
        tok.end_of_text(tok.load_tokenizer(source), options.eot_token, source)
    plan = _plan(options, sources, units)
    work = out / WORK_DIR
    if resume:
        saved = json.loads((work / "plan.json").read_text())
        difference = _plan_difference(saved, plan)
        if difference is not None:
            raise ValueError(f"--resume: this is not the preparation {out} began: {difference} differs; pass --force "
                             "to start over")
    else:
        if out.exists() and force:
            shutil.rmtree(out)
        for folder in (work, *(out / split for split in SPLITS)):
            folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(work / "plan.json", json.dumps(plan))
    try:
        return _prepare_planned(options, out, units, sources, resume, workers, quiet)
    except ValueError:
        # Refused data (strict, or nothing readable): a preparation begun here is removed, as it could not resume
        # (the data must change first). One interrupted otherwise (a kill, Ctrl-C) stays for --resume.
        if not resume:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare_planned(options: PrepareOptions, out: Path, units: list[list[Piece]], sources: list[Source],
                     resume: bool, workers: Optional[int], quiet: bool) -> ShardMetadata:
    work = out / WORK_DIR
    for stale in out.glob("*/.*.tmp"):  # a unit killed while writing: it has no record and is done again
        stale.unlink()
    info = _tokenizer(options, out, units, sources, resume, quiet)
    if info.vocab_size > 2**32:
        raise ValueError(f"the tokenizer has {info.vocab_size} tokens, more than uint32 shards hold")
    dtype = token_dtype(info.vocab_size)
    done = {int(p.stem[5:]) for p in work.glob("unit_*.json")}
    jobs = [UnitJob(i, tuple(unit), tuple(sources), str(out), options.text_field, options.val_fraction,
                    options.strict, dtype.str) for i, unit in enumerate(units) if i not in done]
    total = sum(p.size for unit in units for p in unit)
    workers = workers or min(os.cpu_count() or 1, len(jobs))
    with tqdm(total=total, initial=total - sum(p.size for job in jobs for p in job.pieces), unit="B",
              unit_scale=True, desc="tokenizing", disable=True if quiet else None, dynamic_ncols=True) as bar:
        _run_units(jobs, info, out, workers, bar)
    records = [json.loads((work / f"unit_{i:06d}.json").read_text()) for i in range(len(units))]
    metadata = _metadata(options, info, dtype, sources, records)
    _write_atomic(out / METADATA_FILE, json.dumps(metadata.to_dict(), indent=2))
    shutil.rmtree(work)
    return metadata


def _metadata(options: PrepareOptions, info: TokenizerInfo, dtype: np.dtype, sources: list[Source],
              records: list[dict[str, Any]]) -> ShardMetadata:
    splits = {split: SplitStats() for split in SPLITS}
    skipped = {reason: 0 for reason in SKIP_REASONS}
    examples: list[str] = []
    for record in records:
        for split, stats in record["splits"].items():
            total = splits[split]
            total.documents += stats["documents"]
            total.bytes += stats["bytes"]
            total.tokens += stats["tokens"]
            if stats["tokens"]:
                total.shards.append(ShardFile(file=shard_name(split, record["unit"]), tokens=stats["tokens"]))
        for reason, count in record["skipped"].items():
            skipped[reason] += count
        examples.extend(record["examples"][:max(0, 10 - len(examples))])
    skip_note = (f" ({sum(skipped.values())} documents skipped: "
                 + ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in skipped.items() if n) + ")"
                 if any(skipped.values()) else "")
    for split in SPLITS:
        if splits[split].documents == 0:
            raise ValueError(f"the {split} split has no documents{skip_note}: " + (
                f"raise val_fraction ({options.val_fraction:g})" if split == "val" and splits["train"].documents
                else "the corpus holds no readable text"))
    return ShardMetadata(tokenizer=info, dtype="uint16" if dtype.itemsize == 2 else "uint32",
                         val_fraction=options.val_fraction, text_field=options.text_field, splits=splits,
                         skipped={r: n for r, n in skipped.items() if n}, skipped_examples=examples,
                         inputs=list(options.inputs), sources=len(sources))


__all__ = ["PrepareOptions", "UnitJob", "check_out_dir", "encode_unit", "prepare"]
