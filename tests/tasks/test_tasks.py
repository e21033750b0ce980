"""Task generators: shapes, labels at the right positions, seeds, lengths, bad options."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titans.tasks import IGNORE_INDEX, TASKS, exact_match, get_task, measure_capacity, token_accuracy
from titans.tasks.babilong import DROP_VERBS, MOVE_VERBS, TAKE_VERBS
from titans.tasks.lm import corpus_bytes, file_split, split_files, stdlib_root
from titans.tasks.text import insert_at_sentence

# name -> (options, a length that fits them)
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
    "kv_recall": ({}, 64),
    "lm_bytes": ({}, 128),
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def text(tokens):
    return bytes(tokens.tolist()).decode("ascii")


def scored(targets_row):
    """Positions and target tokens of the scored positions of one row."""
    positions = (targets_row != IGNORE_INDEX).nonzero().flatten()
    return positions.tolist(), targets_row[positions]


def test_every_task_is_covered():
    # ucr, forecast_wind, lm_tokens (on shards a fixture prepares): test_ucr.py, test_wind.py, test_lm_tokens.py
    assert set(TOKEN_TASKS) | {"forecast_sine", "forecast_csv", "ucr", "forecast_wind", "lm_tokens"} == set(TASKS)


@pytest.mark.parametrize("name", sorted(TOKEN_TASKS))
def test_shapes_seeds_vocab_and_next_token_convention(name):
    options, length = TOKEN_TASKS[name]
    task = get_task(name, **options)
    a, b, c = (task.sample(4, length, gen(s)) for s in (1, 1, 2))
    assert a.inputs.shape == a.targets.shape == (4, length)
    assert a.inputs.dtype == a.targets.dtype == torch.long
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert a.inputs.min() >= 0 and a.inputs.max() < task.vocab_size
    mask = a.targets != IGNORE_INDEX
    assert mask.any(1).all()
    # targets[t] is the token at t + 1 wherever it is scored
    assert torch.equal(a.targets[:, :-1][mask[:, :-1]], a.inputs[:, 1:][mask[:, :-1]])
    if name != "lm_bytes":  # only language modelling scores the byte after the window
        assert not mask[:, -1].any()


@pytest.mark.parametrize("name", sorted(TOKEN_TASKS))
@settings(max_examples=12, deadline=None)
@given(extra=st.integers(0, 300))
def test_lengths_are_respected_down_to_the_minimum(name, extra):
    task = get_task(name, **TOKEN_TASKS[name][0])
    length = task.min_length() + extra
    batch = task.sample(2, length, gen(extra))
    assert batch.inputs.shape == batch.targets.shape == (2, length)
    assert (batch.targets != IGNORE_INDEX).any(1).all()
    if task.min_length() > 1:
        with pytest.raises(ValueError, match="length"):
            task.sample(2, task.min_length() - 1, gen())


def test_passkey_answer_is_the_needle_value():
    task = get_task("passkey", value_len=2)
    batch = task.sample(8, 50, gen())
    for row, target in zip(batch.inputs, batch.targets):
        (key_at,) = (row == task.KEY).nonzero().flatten().tolist()
        assert (row == task.QUERY).nonzero().flatten().tolist() == [47]
        positions, answer = scored(target)
        assert positions == [47, 48]
        assert torch.equal(answer, row[key_at + 1 : key_at + 3])
        assert ((answer >= 2) & (answer < 2 + task.options.num_values)).all()
        noise = torch.cat([row[:key_at], row[key_at + 3 : 47]])
        assert (noise >= 2 + task.options.num_values).all()


def test_passkey_depth():
    for depth, key_at in [(0.0, 0), (1.0, 40 - 4), (0.5, 18)]:
        batch = get_task("passkey", depth=depth).sample(3, 40, gen())
        assert (batch.inputs[:, key_at] == 0).all()
    depths = [(row == 0).nonzero().item() for row in get_task("passkey").sample(300, 40, gen()).inputs]
    assert min(depths) == 0 and max(depths) == 36 and 14 < sum(depths) / len(depths) < 22  # uniform on 0..36


NIAH_PATTERNS = {
    "niah_passkey": (r"The pass key is (\d+)\. Remember it\. \1 is the pass key\. ", r"What is the pass key\? "),
    "niah_number": (r"One of the special magic numbers for (\w+) is: (\d+)\. ", r"for (\w+) mentioned"),
    "niah_word": (r"One of the special magic words for (\w+) is: (\w+)\. ", r"for (\w+) mentioned"),
}


@pytest.mark.parametrize("name", sorted(NIAH_PATTERNS))
def test_niah_answer_is_the_inserted_needle(name):
    needle, question = NIAH_PATTERNS[name]
    task = get_task(name)
    for length in (task.min_length(), 500, 1200):
        batch = task.sample(3, length, gen(length))
        for row, target in zip(batch.inputs, batch.targets):
            body = text(row)
            (found,) = re.findall(needle, body)  # exactly one needle
            positions, answer = scored(target)
            answer = text(answer)
            assert positions == list(range(length - len(answer) - 1, length - 1))
            assert body.endswith(" is " + answer)
            if name == "niah_passkey":
                assert found == answer and len(answer) == 7 and answer[0] != "0"
            else:
                assert found == (re.search(question, body).group(1), answer)


@pytest.mark.parametrize("name", sorted(NIAH_PATTERNS))
def test_niah_depth(name):
    task_front, task_back = get_task(name, depth=0.0), get_task(name, depth=1.0)
    front, back = text(task_front.sample(1, 600, gen()).inputs[0]), text(task_back.sample(1, 600, gen()).inputs[0])
    needle = NIAH_PATTERNS[name][0]
    assert re.match(needle, front)
    assert re.search(needle + "What is", back)
    starts = [re.search(needle, text(row)).start() for row in get_task(name).sample(40, 1000, gen()).inputs]
    assert min(starts) < 250 and max(starts) > 500  # uniform depth spreads the needle out


def test_insert_at_sentence():
    assert insert_at_sentence("Aa. Bb. Cc. ", "X. ", 0.5) == "Aa. X. Bb. Cc. "  # cut 6: last start <= 6 is 4
    assert insert_at_sentence("Aa. Bb. Cc. ", "X. ", 0.0) == "X. Aa. Bb. Cc. "
    assert insert_at_sentence("Aa. Bb. Cc. ", "X. ", 1.0) == "Aa. Bb. Cc. X. "
    assert insert_at_sentence("", "X. ", 0.3) == "X. "


def test_mqar_targets_are_the_paired_values():
    task = get_task("mqar", num_pairs=5, vocab=40)
    batch = task.sample(6, 80, gen())
    for row, target in zip(batch.inputs, batch.targets):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys.tolist())) == 5 and len(set(values.tolist())) == 5
        assert ((keys >= 1) & (keys < 20)).all() and ((values >= 20) & (values < 40)).all()
        positions, answers = scored(target)
        assert len(positions) == 5 and all(p >= 10 and p % 2 == 0 for p in positions)
        assert sorted(row[positions].tolist()) == sorted(keys.tolist())  # every key asked once
        pairs = dict(zip(keys.tolist(), values.tolist()))
        assert [pairs[k] for k in row[positions].tolist()] == answers.tolist()
        outside = torch.ones(80, dtype=torch.bool)
        outside[:10] = False
        outside[positions] = False
        outside[[p + 1 for p in positions]] = False
        assert (row[outside] == task.FILLER).all()


@pytest.mark.parametrize("power_a", [0.01, 0.5, 1.0])
def test_mqar_query_slots_follow_the_power_law(power_a):
    # one pair: the query's slot s (1-based, from the end of the pair) has P(s) ∝ s^(power_a - 1)
    batch = get_task("mqar", num_pairs=1, vocab=8, power_a=power_a).sample(20000, 2 + 2 * 16, gen())
    slots = ((batch.targets != IGNORE_INDEX).nonzero()[:, 1] - 2) // 2
    observed = torch.bincount(slots, minlength=16).double() / 20000
    expected = torch.arange(1, 17, dtype=torch.float64) ** (power_a - 1)
    expected /= expected.sum()
    assert (observed - expected).abs().max() < 0.012  # about 4 standard errors of the largest bin


def test_mqar_which_pair_is_asked_first_is_uniform():
    batch = get_task("mqar", num_pairs=4, vocab=64).sample(2000, 64, gen())
    first = torch.stack([row[(target != IGNORE_INDEX).nonzero()[0, 0]] for row, target in
                         zip(batch.inputs, batch.targets)])
    pair_index = (batch.inputs[:, 0:8:2] == first[:, None]).float().argmax(1)
    assert (torch.bincount(pair_index, minlength=4) / 2000 - 0.25).abs().max() < 0.04


def simulate_babi(body: str) -> tuple[dict[str, str], set[str], dict[str, list[str]]]:
    """(where every person and touched object is at the end of a story, the objects lying dropped, the rooms each
    touched object has been in, in order), read off the text."""
    verbs = "|".join(MOVE_VERBS + TAKE_VERBS + DROP_VERBS)
    where, held_by, lies_in, trail = {}, {}, {}, {}

    def arrive(thing, room):
        if trail.setdefault(thing, [])[-1:] != [room]:
            trail[thing].append(room)

    for person, verb, thing in re.findall(rf"(Mary|John|Sandra|Daniel) ({verbs}) the (\w+)\. ", body):
        if verb in MOVE_VERBS:
            where[person] = thing
            for carried in [t for t, p in held_by.items() if p == person]:
                arrive(carried, thing)
        elif verb in TAKE_VERBS:
            held_by[thing] = person
            lies_in.pop(thing, None)
            arrive(thing, where[person])
        else:
            del held_by[thing]
            lies_in[thing] = where[person]
    places = {**where, **lies_in, **{thing: where[person] for thing, person in held_by.items()}}
    return places, set(lies_in), trail


@pytest.mark.parametrize("qa", [1, 2, 3])
def test_babilong_answer_follows_the_facts(qa):
    task = get_task("babilong", qa=qa, num_facts=8)
    asked_about_dropped = 0
    for length, rows in ((task.min_length(), 40), (2000, 4)):
        batch = task.sample(rows, length, gen(qa))
        for row, target in zip(batch.inputs, batch.targets):
            body = text(row)
            positions, answer = scored(target)
            answer = text(answer)
            assert positions == list(range(length - len(answer) - 1, length - 1))
            places, dropped, trail = simulate_babi(body)
            if qa == 3:
                subject = re.search(r"Where was the (\w+) before the (\w+)\? Answer: (\w+)$", body)
                thing, last = subject.group(1), subject.group(2)
                assert subject.group(3) == answer and trail[thing][-2:] == [answer, last]
            else:
                subject = re.search(r"Where is (?:the )?(\w+)\? Answer: (\w+)$", body)
                assert subject.group(2) == answer and places[subject.group(1)] == answer
            asked_about_dropped += subject.group(1) in dropped
            facts = len(re.findall(r"(Mary|John|Sandra|Daniel) ", body))
            assert facts >= 8 + (4 if qa > 1 else 0)
    if qa < 3:
        assert (asked_about_dropped >= 5) == (qa == 2)  # qa2 asks about dropped objects too


@pytest.mark.parametrize("name", ["copy", "selective_copy"])
def test_copy_targets_are_the_data_in_order(name):
    task = get_task(name, num_tokens=5)
    batch = task.sample(50, 30, gen())
    for row, target in zip(batch.inputs, batch.targets):
        region = row[:24]
        data = region[region != task.BLANK]
        assert row[24] == task.DELIM and len(data) == 5 and (data > task.DELIM).all()
        positions, answer = scored(target)
        assert positions == [24, 25, 26, 27, 28] and torch.equal(answer, data)
        if name == "copy":
            assert torch.equal(region[:5], data)
    if name == "selective_copy":  # positions are scattered, not always at the front
        assert (batch.inputs[:, :5] == task.BLANK).any()


def test_capacity_layout():
    task = get_task("capacity", num_pairs=6)
    batch = task.sample(3, 60, gen())
    for row, target in zip(batch.inputs, batch.targets):
        pairs = dict(zip(row[0:12:2].tolist(), row[1:12:2].tolist()))
        assert len(pairs) == 6 and row[60 - 13] == task.SEP and (row[12:47] == task.FILLER).all()
        positions, answers = scored(target)
        assert positions == list(range(48, 60, 2))
        assert sorted(row[positions].tolist()) == sorted(pairs)
        assert [pairs[k] for k in row[positions].tolist()] == answers.tolist()


def test_kv_recall_layout():
    task = get_task("kv_recall", num_pairs=5, num_keys=8, num_values=10, vocab=30)
    batch = task.sample(200, 40, gen())
    for row, target in zip(batch.inputs, batch.targets):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys.tolist())) == 5 and ((keys >= 0) & (keys < 8)).all()
        assert ((values >= 8) & (values < 18)).all()
        assert ((row[10:38] >= 18) & (row[10:38] < 30)).all()  # noise only between the pairs and the query
        positions, answers = scored(target)
        assert positions == [38] and row[38] in keys and answers.tolist() == [row[39].item()]
        assert dict(zip(keys.tolist(), values.tolist()))[row[38].item()] == row[39]
    asked = [row[0:10:2].tolist().index(row[38].item()) for row in batch.inputs]
    assert len(set(asked)) == 5  # any pair may be asked


def test_measure_capacity_finds_the_largest_recalled_count():
    def recall_up_to(limit):
        def predict(inputs):  # an oracle that remembers the first `limit` pairs and guesses 0 for others
            preds = torch.zeros_like(inputs)
            for b, row in enumerate(inputs):
                pairs = dict(zip(row[0 : 2 * limit : 2].tolist(), row[1 : 2 * limit : 2].tolist()))
                preds[b] = torch.tensor([pairs.get(t, 0) for t in row.tolist()])
            return preds
        return predict

    result = measure_capacity(recall_up_to(8), [16, 4, 8, 2], gap=5)
    assert result.capacity == 8
    assert result.accuracy == {2: 1.0, 4: 1.0, 8: 1.0, 16: 0.5}
    assert measure_capacity(recall_up_to(8), [16], threshold=0.5).capacity == 16
    assert measure_capacity(recall_up_to(8), [16]).capacity == 0
    with pytest.raises(ValueError, match="pair_counts"):
        measure_capacity(recall_up_to(8), [])


def test_metrics():
    targets = torch.tensor([[IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 1, IGNORE_INDEX]])
    preds = torch.tensor([[9, 3, 0], [9, 1, 9]])
    assert exact_match(preds, targets).tolist() == [0.0, 1.0]
    assert token_accuracy(preds, targets).item() == pytest.approx(2 / 3)
    logits = torch.nn.functional.one_hot(preds, 10).double()
    assert exact_match(logits, targets).tolist() == [0.0, 1.0]
    assert token_accuracy(logits, targets).item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="logits_or_preds"):
        exact_match(preds[:, :2], targets)


def test_sine_forecasting():
    task = get_task("forecast_sine", num_features=3, num_components=2, noise=0.0)
    a, b = task.sample(5, 40, gen()), task.sample(5, 40, gen())
    assert a.inputs.shape == a.targets.shape == (5, 40, 3) and a.inputs.dtype == torch.float32
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, task.sample(5, 40, gen(1)).inputs)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])  # targets are the next step
    assert a.inputs.abs().max() <= 2 * 1.5 / math.sqrt(2)  # amplitudes in [0.5, 1.5]
    # noise is drawn last, so the same seed with noise > 0 is the clean series plus N(0, noise^2)
    noisy = get_task("forecast_sine", num_features=3, num_components=2, noise=0.5).sample(5, 40, gen())
    assert (noisy.inputs - a.inputs).std().item() == pytest.approx(0.5, rel=0.1)


def write_ett(path, rows=200):
    lines = ["date,HUFL,OT,note"] + [f"2020-01-01 {i:04d},{i * 0.5},{(i % 7) * 1.0},x" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_csv_forecasting(tmp_path):
    path = write_ett(tmp_path / "ett.csv")
    train = get_task("forecast_csv", path=path)
    assert train.columns == ["HUFL", "OT"] and train.num_features == 2 and len(train.data) == 140
    raw = torch.tensor([[i * 0.5, (i % 7) * 1.0] for i in range(200)], dtype=torch.float64)
    mean, std = raw[:140].mean(0), raw[:140].std(0)
    torch.testing.assert_close(train.data, ((raw[:140] - mean) / std).float())
    val = get_task("forecast_csv", path=path, split="val")
    torch.testing.assert_close(val.data, ((raw[140:160] - mean) / std).float())  # train statistics
    batch = train.sample(3, 20, gen())
    assert batch.inputs.shape == batch.targets.shape == (3, 20, 2)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    for window in batch.inputs:  # a contiguous window of the split
        start = (train.data[:, 0] == window[0, 0]).nonzero().item()
        assert torch.equal(window, train.data[start : start + 20])
    test = get_task("forecast_csv", path=path, split="test", columns=["OT"])
    assert test.num_features == 1 and len(test.data) == 40
    with pytest.raises(ValueError, match="length"):
        test.sample(1, 40, gen())


def test_csv_errors(tmp_path):
    no_numbers = tmp_path / "words.csv"
    no_numbers.write_text("date,name\n2020,a\n2021,b\n")
    with pytest.raises(ValueError, match=r"words\.csv has no numeric columns"):
        get_task("forecast_csv", path=str(no_numbers))
    with pytest.raises(ValueError, match=r"missing\.csv does not exist"):
        get_task("forecast_csv", path=str(tmp_path / "missing.csv"))
    short = tmp_path / "short.csv"
    short.write_text("date,v\n2020,1\n2021,2\n2022,3\n")
    with pytest.raises(ValueError, match=r"short\.csv is too short"):
        get_task("forecast_csv", path=str(short))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv has no data rows"):
        get_task("forecast_csv", path=str(empty))
    path = write_ett(tmp_path / "ett.csv")
    with pytest.raises(ValueError, match="has no column"):
        get_task("forecast_csv", path=path, columns=["OT", "load"])
    with pytest.raises(ValueError, match="not numeric"):
        get_task("forecast_csv", path=path, columns=["note"])
    with pytest.raises(ValueError, match="path"):
        get_task("forecast_csv")


@pytest.mark.parametrize("cell", ["nan", "NaN", "inf", "-Infinity"])
@pytest.mark.parametrize("columns", [None, ["b"]])
def test_csv_non_finite_values_name_the_file_column_and_row(tmp_path, cell, columns):
    path = tmp_path / "holes.csv"
    path.write_text("date,a,b\n" + "".join(f"2020-{i},{i},{cell if i >= 2 else i}\n" for i in range(20)))
    with pytest.raises(ValueError, match=rf"holes\.csv: column 'b' has the non-finite value '{cell}' in data row 3 "):
        get_task("forecast_csv", path=str(path), columns=columns)


def test_csv_numeric_column_with_a_hole_is_named_not_dropped(tmp_path):
    """A column of numbers with an empty cell or a short row is an error (silently dropping it would train on fewer
    features); a text column with a stray number is not numeric and is left out, as before."""
    rows = {"empty": lambda i: f"2020-{i},{i},{'' if i == 5 else i % 3}",
            "short": lambda i: f"2020-{i},{i}" if i == 5 else f"2020-{i},{i},{i % 3}"}
    for name, row in rows.items():
        path = tmp_path / f"{name}.csv"
        path.write_text("date,a,b\n" + "".join(row(i) + "\n" for i in range(100)))
        with pytest.raises(ValueError, match=rf"{name}\.csv: numeric column 'b' has no value in data row 6 "):
            get_task("forecast_csv", path=str(path))
    text = tmp_path / "text.csv"
    text.write_text("date,a,flag\n" + "".join(f"2020-{i},{i},{5 if i == 5 else 'yes'}\n" for i in range(100)))
    assert get_task("forecast_csv", path=str(text)).columns == ["a"]


def test_csv_values_too_large_to_standardise_are_refused(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("date,a\n" + "".join(f"2020-{i},{1e307 * (i % 3)}\n" for i in range(100)))
    with pytest.raises(ValueError, match=r"big\.csv: values too large to standardise"):
        get_task("forecast_csv", path=str(path))


def test_csv_that_is_not_a_text_file_is_named(tmp_path):
    binary = tmp_path / "data.csv.gz"
    binary.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"data\.csv\.gz is not UTF-8 text"):
        get_task("forecast_csv", path=str(binary))
    huge = tmp_path / "huge.csv"
    huge.write_text("a,b\n" + "x" * 200_000 + ",1\n")  # one field over the csv module's limit
    with pytest.raises(ValueError, match=r"huge\.csv cannot be read as CSV"):
        get_task("forecast_csv", path=str(huge))
    with pytest.raises(ValueError, match=r"is a directory, not a file"):
        get_task("forecast_csv", path=str(tmp_path))


def test_csv_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path):
    path = tmp_path / "excel.csv"
    lines = ["HUFL,OT"] + [f"{i * 0.5},{i % 7}" for i in range(20)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())  # spreadsheets' 'CSV UTF-8' starts with a BOM
    assert get_task("forecast_csv", path=str(path), columns=["HUFL"]).columns == ["HUFL"]


def test_lm_bytes_splits_by_file(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": f"# module {i}\n" * (i + 1) for i in range(60)}
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(body)
    (tmp_path / "notes.txt").write_text("not matched by the pattern")
    train, val = (split_files(str(tmp_path), "*.py", s, 0.2) for s in ("train", "val"))
    names = lambda paths: {p.relative_to(tmp_path).as_posix() for p in paths}  # noqa: E731
    assert names(train).isdisjoint(names(val)) and names(train) | names(val) == set(files)
    assert 3 <= len(val) <= 25
    assert all(file_split(n, 0.2) == "val" for n in names(val))
    task = get_task("lm_bytes", root=str(tmp_path), split="val", val_fraction=0.2)
    assert bytes(task.data.tolist()) == b"".join(p.read_bytes() + b"\n" for p in val)
    batch = task.sample(4, 16, gen())
    assert torch.equal(batch.targets[:, :-1], batch.inputs[:, 1:])
    corpus = bytes(task.data.tolist())
    for row, target in zip(batch.inputs, batch.targets):  # each row + its last target is a corpus window
        assert bytes(row.tolist() + target[-1:].tolist()) in corpus


def test_lm_bytes_default_corpus_is_the_stdlib():
    root = stdlib_root()
    train, val = (split_files(root, "*.py", s, 0.1) for s in ("train", "val"))
    assert len(val) > 20 and len(train) > 5 * len(val) and set(train).isdisjoint(val)
    assert len(get_task("lm_bytes").data) > 5 * len(get_task("lm_bytes", split="val").data)
    assert corpus_bytes.cache_info().currsize >= 2  # read once per split, then cached


def test_lm_bytes_rows_do_not_look_up_the_stdlib_each(monkeypatch):
    """A training batch is drawn row by row (one generator per row, `train.batches.sample_rows`): the stdlib's path is
    looked up once, not per row (sysconfig's lookup was 0.8 ms a row, most of a batch's build)."""
    import sysconfig

    from titans.train.batches import sample_rows

    task = get_task("lm_bytes")
    before = sample_rows(task, range(8), 64, 1, 0, 0)
    calls = []
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    stdlib_root.cache_clear()
    after = sample_rows(task, range(8), 64, 1, 0, 0)
    assert len(calls) == 1
    assert torch.equal(before.inputs, after.inputs) and torch.equal(before.targets, after.targets)


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("passkey", {"num_values": 1}, "num_values"),
        ("passkey", {"vocab": 10, "num_values": 8}, "vocab"),
        ("passkey", {"depth": 2.0}, "depth"),
        ("passkey", {"value_len": 0}, "value_len"),
        ("niah_word", {"depth": -0.1}, "depth"),
        ("niah_passkey", {"digits": 0}, "digits"),
        ("mqar", {"num_pairs": 0}, "num_pairs"),
        ("mqar", {"vocab": 16, "num_pairs": 8}, "vocab"),
        ("mqar", {"power_a": 0.0}, "power_a"),
        ("capacity", {"vocab": 20, "num_pairs": 10}, "vocab"),
        ("kv_recall", {"num_pairs": 0}, "num_pairs"),
        ("kv_recall", {"num_pairs": 9, "num_keys": 8}, "num_keys"),
        ("kv_recall", {"num_values": 1}, "num_values"),
        ("kv_recall", {"vocab": 32}, "vocab"),
        ("babilong", {"qa": 4}, "qa"),
        ("babilong", {"num_facts": 0}, "num_facts"),
        ("copy", {"vocab": "big"}, "vocab"),
        ("selective_copy", {"num_tokens": 0}, "num_tokens"),
        ("forecast_sine", {"noise": -1.0}, "noise"),
        ("forecast_sine", {"num_features": 0}, "num_features"),
        ("forecast_sine", {"min_period": 1.0}, "min_period"),
        ("forecast_sine", {"noise": math.nan}, "noise"),
        ("forecast_sine", {"noise": math.inf}, "noise"),
        ("forecast_sine", {"min_period": math.nan}, "min_period"),
        ("forecast_sine", {"min_period": math.inf, "max_period": math.inf}, "min_period"),
        ("forecast_sine", {"max_period": math.inf}, "max_period"),
        ("forecast_sine", {"max_period": math.nan}, "max_period"),
        ("forecast_sine", {"max_period": 4.0}, "max_period"),
        ("lm_bytes", {"split": "test"}, "split"),
        ("lm_bytes", {"root": "/no/such/dir"}, "root"),
        ("lm_bytes", {"val_fraction": 1.0}, "val_fraction"),
        ("lm_bytes", {"val_fraction": math.nan}, "val_fraction"),
        ("lm_bytes", {"val_fraction": math.inf}, "val_fraction"),
        ("lm_bytes", {"pattern": ""}, "pattern"),
        ("lm_bytes", {"pattern": "/etc/*.conf"}, "pattern '/etc/\\*.conf' must be relative to root"),
        ("lm_bytes", {"pattern": "../*.py"}, "pattern '../\\*.py' must be relative to root and stay inside it"),
        ("lm_bytes", {"pattern": "pkg/../../*.py"}, "pattern .* must be relative to root and stay inside it"),
        ("lm_bytes", {"pattern": "a**.py"}, "pattern .*'\\*\\*' must be a whole path component"),
        ("passkey", {"colour": "red"}, "colour"),
    ],
)
def test_bad_options_name_the_field(name, options, field):
    with pytest.raises(ValueError, match=field):
        get_task(name, **options)


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="unknown task 'sudoku'.*mqar.*passkey"):
        get_task("sudoku")
    task = get_task("passkey")
    with pytest.raises(ValueError, match="length"):
        task.sample(1, 3, gen())
    with pytest.raises(ValueError, match="length"):
        task.sample(1, 64.0, gen())
    with pytest.raises(ValueError, match="batch_size"):
        task.sample(0, 64, gen())
    with pytest.raises(ValueError, match="generator"):
        task.sample(1, 64, 0)
    with pytest.raises(ValueError, match="^vocab: cannot be changed: PasskeyOptions is read-only$"):
        task.options.vocab = 10
    assert task.options.vocab == 64


def test_held_out_is_the_validation_split_of_data_tasks(tmp_path):
    path = write_ett(tmp_path / "ett.csv")
    train = get_task("forecast_csv", path=path, columns=["OT"])
    val, test = train.held_out(), train.held_out("test")
    assert (val.options.split, test.options.split) == ("val", "test")
    assert val.options.columns == ["OT"] and val.options.path == path  # everything else kept
    assert torch.equal(val.data, get_task("forecast_csv", path=path, columns=["OT"], split="val").data)
    assert get_task("lm_bytes").held_out().options.split == "val"
    generated = get_task("mqar", vocab=64, num_pairs=4)
    assert generated.held_out() is generated  # evaluation rows come from seeds training never draws
    with pytest.raises(ValueError, match="^split"):
        generated.held_out("test")
    with pytest.raises(ValueError, match="split"):
        train.held_out("holdout")


def test_needle_words_never_occur_in_the_haystack_sentences():
    from titans.tasks.text import REPEATED_NOISE, SENTENCE_PARTS, WORDS

    haystack_words = {w.strip(".").lower() for part in SENTENCE_PARTS for phrase in part for w in phrase.split()}
    haystack_words |= {w.strip(".").lower() for w in REPEATED_NOISE.split()}
    assert not set(WORDS) & haystack_words and len(set(WORDS)) == len(WORDS)


def test_an_option_called_name_is_an_unknown_option_not_a_crash():
    with pytest.raises(ValueError, match="name"):
        get_task("passkey", name="x")
