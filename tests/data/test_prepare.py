"""`titans data prepare`: every document once, in one split, tokenized and decodable back to its text; what is skipped
is counted (or refused with strict); parallel equals serial; a killed preparation resumes to the same shards; the
tokenizer is checked against the shards' hash; bad input is refused before anything is written."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from titans.cli import app

pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")

from titans.data import read_metadata  # noqa: E402
from titans.data.prepare import PrepareOptions, prepare  # noqa: E402
from titans.data.tokenizer import load_tokenizer, tokenizer_hash  # noqa: E402

runner = CliRunner()


def documents_of(directory: Path, split: str) -> list[str]:
    """The decoded documents of a split's shards, in order (each ends with the end-of-text token)."""
    meta = read_metadata(directory)
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    docs = []
    for shard in meta.splits[split].shards:
        ids = np.fromfile(directory / shard.file, dtype=np.uint16 if meta.dtype == "uint16" else np.uint32)
        assert ids[-1] == meta.tokenizer.eot_id
        cuts = np.flatnonzero(ids == meta.tokenizer.eot_id)
        starts = np.concatenate([[0], cuts[:-1] + 1])
        docs += [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts)]
    return docs


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.glob("*/*.bin"))}


def test_every_document_once_in_one_split(token_shards):
    out, corpus, meta = token_shards["dir"], token_shards["corpus"], token_shards["metadata"]
    train, val = documents_of(out, "train"), documents_of(out, "val")
    assert sorted(train + val) == sorted(corpus["documents"])  # nothing lost, nothing twice, text decodes exactly
    assert train and val and not set(train) & set(val)
    for split, docs in (("train", train), ("val", val)):
        stats = meta.splits[split]
        assert stats.documents == len(docs)
        assert stats.bytes == sum(len(d.encode()) for d in docs)
        assert stats.tokens == sum(s.tokens for s in stats.shards)
    assert meta.skipped == corpus["skipped"]
    assert meta.dtype == "uint16" and meta.tokenizer.vocab_size == 320
    assert meta.tokenizer.sha256 == tokenizer_hash(load_tokenizer(out / "tokenizer.json"))
    assert not (out / ".prepare").exists()  # the work directory goes once the metadata is written


def test_parallel_workers_write_the_same_shards(token_shards, tmp_path):
    corpus = token_shards["corpus"]["root"]
    options = PrepareOptions(inputs=[str(corpus)], tokenizer=str(token_shards["dir"]), val_fraction=0.2,
                             shard_mib=0.01)
    serial = prepare(options, tmp_path / "serial", workers=1, quiet=True)
    parallel = prepare(options, tmp_path / "parallel", workers=2, quiet=True)
    assert len(serial.splits["train"].shards) > 3  # several units, so the pool had work to share
    assert serial == parallel
    assert shard_bytes(tmp_path / "serial") == shard_bytes(tmp_path / "parallel")
    # the loaded tokenizer is the trained one: the same documents in the same splits as the one-unit preparation
    assert sorted(documents_of(tmp_path / "serial", "val")) == sorted(documents_of(token_shards["dir"], "val"))


def test_strict_refuses_what_is_otherwise_skipped(token_shards, tmp_path):
    options = PrepareOptions(inputs=[str(token_shards["corpus"]["root"])], tokenizer=str(token_shards["dir"]),
                             val_fraction=0.2, strict=True)
    with pytest.raises(ValueError, match="image.bin: binary|latin1.txt: undecodable|records.jsonl byte"):
        prepare(options, tmp_path / "strict", workers=1, quiet=True)


def test_a_killed_preparation_resumes_to_the_same_shards(token_shards, tmp_path):
    cli = [sys.executable, "-m", "titans.cli", "data", "prepare", str(token_shards["corpus"]["root"]),
           "--tokenizer", str(token_shards["dir"] / "tokenizer.json"), "--val-fraction", "0.2",
           "--shard-mib", "0.002", "--workers", "1", "--quiet"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cli + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # kill it once a few units are done, not all
        if len(list((killed / ".prepare").glob("unit_*.json"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (killed / "metadata.json").exists(), "finished before the kill"
    assert "unfinished" in one_line_error(runner.invoke(app, ["data", "prepare", str(token_shards["corpus"]["root"]),
                                                              "--vocab-size", "300", "--out", str(killed)]))
    changed = runner.invoke(app, ["data", "prepare", *cli[5:], "--val-fraction", "0.3", "--out", str(killed),
                                  "--resume"])
    assert "val_fraction" in one_line_error(changed)
    # the same options as the command line's, through the library (no second interpreter to start)
    options = PrepareOptions(inputs=[cli[5]], tokenizer=cli[7], val_fraction=0.2, shard_mib=0.002)
    prepare(options, killed, resume=True, workers=1, quiet=True)
    straight = tmp_path / "straight"
    prepare(options, straight, workers=1, quiet=True)
    assert read_metadata(killed) == read_metadata(straight)
    assert shard_bytes(killed) == shard_bytes(straight)
    assert sorted(documents_of(killed, "train") + documents_of(killed, "val")) == \
        sorted(token_shards["corpus"]["documents"])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_bad_input_is_refused_and_nothing_is_overwritten(token_shards, tmp_path):
    corpus = str(token_shards["corpus"]["root"])
    prepare_cli = ["data", "prepare", corpus, "--out"]
    missing = ["data", "prepare", str(tmp_path / "none*.txt"), "--vocab-size", "300", "--out", str(tmp_path / "a")]
    assert "matches no file" in one_line_error(runner.invoke(app, missing))
    assert "not both" in one_line_error(runner.invoke(app, [*prepare_cli, str(tmp_path / "b"), "--vocab-size", "300",
                                                            "--tokenizer", str(token_shards["dir"])]))
    assert "vocab_size" in one_line_error(runner.invoke(app, [*prepare_cli, str(tmp_path / "c"), "--vocab-size", "9"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    assert "empty" in one_line_error(runner.invoke(app, ["data", "prepare", str(empty), "--vocab-size", "300",
                                                         "--out", str(tmp_path / "d")]))
    binary = tmp_path / "binary"
    binary.mkdir()
    for i in range(8):
        (binary / f"{i}.dat").write_bytes(b"\0" * 64)
    assert "no documents" in one_line_error(runner.invoke(app, ["data", "prepare", str(binary), "--vocab-size", "300",
                                                                "--val-fraction", "0.5",
                                                                "--out", str(tmp_path / "e")]))
    # an existing preparation, or a folder titans did not make, is never replaced without --force (and not even then)
    before = shard_bytes(token_shards["dir"])
    assert "--force" in one_line_error(runner.invoke(app, [*prepare_cli, str(token_shards["dir"]), "--vocab-size",
                                                           "300"]))
    assert shard_bytes(token_shards["dir"]) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert "not made by titans" in one_line_error(runner.invoke(app, [*prepare_cli, str(mine), "--vocab-size", "300",
                                                                      "--force"]))
    assert (mine / "notes.txt").read_text() == "keep me"
    assert "no unfinished" in one_line_error(runner.invoke(app, [*prepare_cli, str(tmp_path / "f"), "--vocab-size",
                                                                 "300", "--resume"]))
    # --force with a tokenizer that cannot be read: refused before the preparation it would replace is deleted
    missing_tokenizer = [*prepare_cli, str(token_shards["dir"]), "--force", "--tokenizer", str(tmp_path / "none.json")]
    assert "does not exist" in one_line_error(runner.invoke(app, missing_tokenizer))
    assert shard_bytes(token_shards["dir"]) == before
    for leftover in "abcdef":  # refused before anything was created
        assert not (tmp_path / leftover).exists()


def test_a_loaded_tokenizer_directory_gives_its_eos_and_info_prints(token_shards, tmp_path, monkeypatch):
    # the file named relatively: documents are identified by the path as given, and so split by its hash; under a
    # random tmp path a few documents sometimes put none in the val split
    monkeypatch.chdir(token_shards["corpus"]["root"])
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_bytes((token_shards["dir"] / "tokenizer.json").read_bytes())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    result = runner.invoke(app, ["data", "prepare", "records.jsonl",
                                 "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "out"), "--quiet",
                                 "--val-fraction", "0.3"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == str(tmp_path / "out")
    info = runner.invoke(app, ["data", "info", str(tmp_path / "out")])
    assert info.exit_code == 0 and "'<|endoftext|>' = 0" in info.stdout and "1 malformed" in info.stdout
    unknown_eot = ["data", "prepare", str(token_shards["corpus"]["root"]), "--tokenizer", str(tokenizer_dir),
                   "--eot-token", "<eos>", "--out", str(tmp_path / "x")]
    error = one_line_error(runner.invoke(app, unknown_eot))
    assert "'<eos>' is not in the tokenizer" in error


def test_a_hugging_face_dataset_directory(token_shards, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    texts = token_shards["corpus"]["documents"][:20]
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"content": texts[:12]}),
                          "b": datasets.Dataset.from_dict({"content": texts[12:]})}).save_to_disk(str(tmp_path / "ds"))
    options = PrepareOptions(inputs=[str(tmp_path / "ds")], tokenizer=str(token_shards["dir"]), val_fraction=0.3,
                             text_field="content")
    prepare(options, tmp_path / "out", workers=1, quiet=True)
    assert sorted(documents_of(tmp_path / "out", "train") + documents_of(tmp_path / "out", "val")) == sorted(texts)
    with pytest.raises(ValueError, match="no column 'text'"):
        prepare(options.replace(text_field="text"), tmp_path / "out2", workers=1, quiet=True)
