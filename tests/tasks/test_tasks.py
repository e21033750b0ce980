"""Task generators: shapes, labels at the right positions, seeds, lengths, bad options."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titans.tasks import IGNORE_INDEX, TASKS, exact_match, get_task, measure_capacity, token_accuracy
from titans.tasks.lm import file_split

TOKEN_TASKS = {
    "passkey": ({}, 64),
    "niah_passkey": ({}, 300),
    "niah_number": ({}, 400),
    "niah_word": ({}, 400),
    "mqar": ({"num_pairs": 6}, 64),
    "babilong": ({"qa": 2}, 800),
    "copy": ({}, 40),
    "selective_copy": ({}, 40),
    "capacity": ({"num_pairs": 8}, 64),
    "lm_bytes": ({}, 128),
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def text(row):
    return bytes(row.tolist()).decode()


def answer(inputs_row, targets_row):
    scored = targets_row != IGNORE_INDEX
    return targets_row[scored]


@pytest.mark.parametrize("name", sorted(TOKEN_TASKS))
def test_shapes_seeds_and_vocab(name):
    options, length = TOKEN_TASKS[name]
    task = get_task(name, **options)
    a, b, c = (task.sample(4, length, gen(s)) for s in (1, 1, 2))
    assert a.inputs.shape == a.targets.shape == (4, length)
    assert a.inputs.dtype == torch.long and a.targets.dtype == torch.long
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert a.inputs.min() >= 0 and a.inputs.max() < task.vocab_size
    scored = a.targets != IGNORE_INDEX
    assert scored.any(1).all()
    # next-token convention: every scored target is the following input token (MQAR, as in Zoology,
    # keeps filler after each query key: the value is only a label)
    if name != "mqar":
        assert torch.equal(a.targets[:, :-1][scored[:, :-1]], a.inputs[:, 1:][scored[:, :-1]])
    if name != "lm_bytes":  # language modelling also scores the byte after the window
        assert not scored[:, -1].any()


def test_passkey_answer_is_the_needle_value():
    task = get_task("passkey", value_len=2)
    batch = task.sample(8, 50, gen())
    for row, target in zip(batch.inputs, batch.targets):
        key_pos = (row == task.KEY).nonzero().item()
        assert row[-3] == task.QUERY
        assert torch.equal(answer(row, target), row[key_pos + 1 : key_pos + 3])
        assert (target != IGNORE_INDEX).nonzero().flatten().tolist() == [47, 48]


def test_passkey_depth_option():
    task = get_task("passkey", depth=0.0)
    assert (task.sample(4, 40, gen()).inputs[:, 0] == task.KEY).all()


@pytest.mark.parametrize("name", ["niah_passkey", "niah_number", "niah_word"])
def test_niah_answer_matches_the_needle(name):
    batch = get_task(name).sample(3, 500, gen(3))
    for row, target in zip(batch.inputs, batch.targets):
        body = text(row)
        ans = bytes(answer(row, target).tolist()).decode()
        assert body.endswith(ans)
        if name == "niah_passkey":
            assert f"The pass key is {ans}." in body and len(ans) == 5
        else:
            key = re.search(r"for (\w+)\? ", body).group(1)
            assert f"for {key} is: {ans}." in body


def test_mqar_targets_are_the_paired_values():
    task = get_task("mqar", num_pairs=5)
    batch = task.sample(6, 80, gen())
    for row, target in zip(batch.inputs, batch.targets):
        pairs = dict(zip(row[0:10:2].tolist(), row[1:10:2].tolist()))
        positions = (target != IGNORE_INDEX).nonzero().flatten().tolist()
        assert len(positions) == 5 and min(positions) >= 10
        for p in positions:
            assert pairs[row[p].item()] == target[p].item()


def test_mqar_power_law_favours_short_gaps():
    task = get_task("mqar", num_pairs=4, power_a=0.01)
    batch = task.sample(200, 512, gen())
    positions = (batch.targets != IGNORE_INDEX).nonzero()[:, 1].float() - 8
    assert positions.median() < 100  # most queries near the pairs, a long tail far away
    assert positions.max() > 300


@pytest.mark.parametrize("qa", [1, 2])
def test_babilong_answer_follows_the_facts(qa):
    batch = get_task("babilong", qa=qa, num_facts=5).sample(4, 900, gen(qa))
    for row, target in zip(batch.inputs, batch.targets):
        body = text(row)
        ans = bytes(answer(row, target).tolist()).decode()
        assert ans in {"kitchen", "garden", "office", "bathroom", "hallway", "bedroom"}
        if qa == 1:
            person = re.search(r"Where is (\w+)\?", body).group(1)
            assert re.findall(rf"{person} went to the (\w+)\.", body)[-1] == ans


@pytest.mark.parametrize("name", ["copy", "selective_copy"])
def test_copy_targets_are_the_data_in_order(name):
    task = get_task(name, num_tokens=5)
    batch = task.sample(4, 30, gen())
    for row, target in zip(batch.inputs, batch.targets):
        data = row[:24][row[:24] > 1]
        assert row[24] == task.DELIM
        assert torch.equal(answer(row, target), data)


def test_capacity_and_its_measurement():
    task = get_task("capacity", num_pairs=6)
    batch = task.sample(2, 60, gen())
    for row, target in zip(batch.inputs, batch.targets):
        pairs = dict(zip(row[0:12:2].tolist(), row[1:12:2].tolist()))
        for p in (target != IGNORE_INDEX).nonzero().flatten().tolist():
            assert pairs[row[p].item()] == target[p].item()

    def oracle(inputs):  # perfect recall up to 8 pairs, nothing beyond
        preds = torch.zeros_like(inputs)
        for b, row in enumerate(inputs):
            sep = (row == 1).nonzero().flatten()[-1].item()  # SEP, then 2n query tokens
            n = (len(row) - 1 - sep) // 2
            if n <= 8:
                pairs = dict(zip(row[0 : 2 * n : 2].tolist(), row[1 : 2 * n : 2].tolist()))
                preds[b] = torch.tensor([pairs.get(t, 0) for t in row.tolist()])
        return preds

    assert measure_capacity(oracle, [2, 4, 8, 16], length=80) == 8


def test_metrics():
    targets = torch.tensor([[IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 1, IGNORE_INDEX]])
    preds = torch.tensor([[9, 3, 0], [9, 1, 9]])
    assert exact_match(preds, targets).tolist() == [0.0, 1.0]
    assert token_accuracy(preds, targets).item() == pytest.approx(2 / 3)


@settings(max_examples=20, deadline=None)
@given(length=st.integers(5, 300))
def test_lengths_are_respected(length):
    for name in ("passkey", "mqar", "copy", "selective_copy"):
        task = get_task(name, **({"num_pairs": 1} if name == "mqar" else {}))
        if name in ("copy", "selective_copy"):
            task = get_task(name, num_tokens=2)
        assert task.sample(2, length, gen()).inputs.shape == (2, length)


def test_sine_forecasting():
    task = get_task("forecast_sine", num_features=3)
    a, b = task.sample(2, 40, gen()), task.sample(2, 40, gen())
    assert a.inputs.shape == a.targets.shape == (2, 40, 3)
    assert torch.equal(a.inputs, b.inputs)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])  # targets are the next step


def test_csv_forecasting(tmp_path):
    path = tmp_path / "ett.csv"
    rows = ["date,HUFL,OT,note"] + [f"2020-01-01 {i:04d},{i * 0.5},{(i % 7) * 1.0},x" for i in range(200)]
    path.write_text("\n".join(rows))
    train = get_task("forecast_csv", path=str(path))
    assert train.num_features == 2 and len(train.data) == 140
    assert train.data.mean(0).abs().max() < 1e-4  # standardised with train statistics
    batch = train.sample(3, 20, gen())
    assert batch.inputs.shape == (3, 20, 2) and torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    test = get_task("forecast_csv", path=str(path), split="test", columns=["OT"])
    assert test.num_features == 1 and len(test.data) == 40


def test_csv_errors(tmp_path):
    no_numbers = tmp_path / "words.csv"
    no_numbers.write_text("date,name\n2020,a\n2021,b\n")
    with pytest.raises(ValueError, match="no numeric columns"):
        get_task("forecast_csv", path=str(no_numbers))
    with pytest.raises(ValueError, match="does not exist"):
        get_task("forecast_csv", path=str(tmp_path / "missing.csv"))
    short = tmp_path / "short.csv"
    short.write_text("date,v\n2020,1\n2021,2\n")
    with pytest.raises(ValueError, match="too short"):
        get_task("forecast_csv", path=str(short))


def test_lm_bytes_splits_are_disjoint_by_file():
    names = [f"pkg/mod{i}.py" for i in range(400)]
    splits = [file_split(n, 0.1) for n in names]
    assert 10 < splits.count("val") < 80
    train, val = get_task("lm_bytes"), get_task("lm_bytes", split="val")
    assert len(train.data) > 5 * len(val.data) > 0
    sample = train.sample(2, 64, gen())
    assert torch.equal(sample.targets[:, :-1], sample.inputs[:, 1:])


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("passkey", {"num_values": 1}, "num_values"),
        ("passkey", {"depth": 2.0}, "depth"),
        ("mqar", {"num_pairs": 0}, "num_pairs"),
        ("babilong", {"qa": 3}, "qa"),
        ("passkey", {"colour": "red"}, "colour"),
        ("copy", {"vocab": "big"}, "vocab"),
    ],
)
def test_bad_options_name_the_field(name, options, field):
    with pytest.raises(ValueError, match=field):
        get_task(name, **options)


def test_unknown_task_and_short_length():
    with pytest.raises(ValueError, match="unknown task"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="length"):
        get_task("passkey").sample(1, 3, gen())
    assert set(TOKEN_TASKS) | {"forecast_sine", "forecast_csv"} == set(TASKS)
