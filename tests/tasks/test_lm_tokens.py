"""The lm_tokens task: windows are the shards' tokens, drawn per row from the trainer's seeds; the tokenizer is pinned
by its hash; a window longer than a split holds, or a vocabulary larger than the model's, is refused; evaluation
reports perplexity and bits per byte from the shards' byte counts."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from titans.tasks import get_task
from titans.train import EvalPlan, evaluate, load_train_config
from titans.train.batches import TRAIN_STREAM, sample_rows

pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")


def config(shards, *overrides):
    data = {"model": {"variant": "lmm", "dim": 16, "depth": 1, "heads": 2, "chunk_size": 4, "memory_expansion": 2},
            "task": {"name": "lm_tokens", "options": {"data": str(shards)}, "train_length": 16,
                     "eval_lengths": [16, 32]}}
    return load_train_config(data=data, overrides=list(overrides))


def test_windows_are_consecutive_shard_tokens(token_shards):
    task = get_task("lm_tokens", data=str(token_shards["dir"]))
    shard = np.fromfile(token_shards["dir"] / token_shards["metadata"].splits["train"].shards[0].file, dtype="<u2")
    stream = shard.tobytes()
    batch = sample_rows(task, range(8), 24, TRAIN_STREAM, 0, 3)
    assert batch.inputs.shape == (8, 24) and batch.inputs.dtype == torch.long
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    for row, target in zip(batch.inputs, batch.targets):
        window = np.concatenate([row.numpy(), target[-1:].numpy()]).astype("<u2").tobytes()
        assert stream.find(window) % 2 == 0  # found, at a token boundary
    assert torch.equal(batch.inputs, sample_rows(task, range(8), 24, TRAIN_STREAM, 0, 3).inputs)  # seeded per row
    assert torch.equal(batch.inputs[4:], sample_rows(task, range(4, 8), 24, TRAIN_STREAM, 0, 3).inputs)  # a rank's rows
    assert task.vocab_size == 320 and task.min_length() == 1


def test_too_long_a_window_and_too_small_a_model_are_refused(token_shards):
    val = get_task("lm_tokens", data=str(token_shards["dir"]), split="val")
    tokens = token_shards["metadata"].splits["val"].tokens
    with pytest.raises(ValueError, match=f"longest shard holds {tokens} tokens"):
        val.sample(1, tokens, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"vocab_size \(300\) is smaller than task lm_tokens's vocabulary \(320\)"):
        config(token_shards["dir"], "model.vocab_size=300")
    with pytest.raises(ValueError, match="data must name a shard directory"):
        get_task("lm_tokens")
    with pytest.raises(ValueError, match="does not exist"):
        get_task("lm_tokens", data=str(token_shards["dir"] / "none"))


def test_the_run_records_its_tokenizer_and_refuses_another(token_shards, tmp_path):
    cfg = config(token_shards["dir"])
    sha = token_shards["metadata"].tokenizer.sha256
    assert cfg.task.options["tokenizer_sha256"] == sha and cfg.model.vocab_size == 320
    with pytest.raises(ValueError, match="made with tokenizer"):
        get_task("lm_tokens", data=str(token_shards["dir"]), tokenizer_sha256="0" * 64)
    copy = tmp_path / "copy"
    shutil.copytree(token_shards["dir"], copy)
    assert get_task("lm_tokens", data=str(copy)).text_codec().decode([5, 6]) == \
        get_task("lm_tokens", data=str(token_shards["dir"])).text_codec().decode([5, 6])
    changed = json.loads((copy / "tokenizer.json").read_text())
    merges = changed["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # another tokenizer, in a file of the same name
    (copy / "tokenizer.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="not the tokenizer the shards were made with"):
        get_task("lm_tokens", data=str(copy)).text_codec()


def test_evaluation_reports_perplexity_and_bits_per_byte(token_shards, one_thread):
    from titans import TitansLM

    cfg = config(token_shards["dir"])
    val = get_task("lm_tokens", **{**cfg.task.options, "split": "val"})
    model = TitansLM(cfg.model)
    results = evaluate(model, val, [16], EvalPlan(batches=1, batch_size=2, position_buckets=2))[16]
    stats = token_shards["metadata"].splits["val"]
    assert results["perplexity"] == pytest.approx(math.exp(results["loss"]))
    assert results["bits_per_byte"] == pytest.approx(results["loss"] / math.log(2) * stats.tokens / stats.bytes)
    assert len(results["bits_per_byte_by_position"]) == 2
