"""UCR classification sets: the `.ts` reader, the `ucr` task on the toy set written for these tests
(tests/data/ucr/Toy), its errors, and the sets aeon ships where aeon is installed."""

import importlib.util
from pathlib import Path

import pytest
import torch

from titans.tasks import LabelBatch, get_task
from titans.tasks.ucr import load_ucr, read_ts

ROOT = Path(__file__).resolve().parents[1] / "data" / "ucr"
TOY = ROOT / "Toy"
HEADER = "@problemName T\n@univariate true\n@equalLength true\n@classLabel true a b\n@data\n"


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def toy(**options):
    return get_task("ucr", dataset="Toy", root=str(ROOT), **options)


def test_read_ts_reads_series_labels_and_classes():
    data = read_ts(TOY / "Toy_TRAIN.ts")
    assert data.problem == "Toy" and data.classes == ("rise", "fall")
    assert data.series.shape == (8, 12, 1) and data.series.dtype == torch.float32
    assert data.labels.tolist() == [0, 1] * 4
    first = "-1.571,-1.033,-0.727,-0.672,-0.656,-0.431,0.059,0.626,1.011,1.124,1.123,1.271"  # its first line
    assert data.series[0, :, 0].tolist() == pytest.approx([float(v) for v in first.split(",")])
    rising = data.series[data.labels == 0, :, 0]
    assert (rising[:, -1] > rising[:, 0]).all()  # the labels are the series' own


def test_read_ts_reads_dimensions_comments_and_blank_lines(tmp_path):
    path = tmp_path / "m.ts"
    path.write_text("# a comment\n\n@problemName M\n@univariate false\n@dimensions 2\n@equalLength true\n"
                    "@seriesLength 3\n@classLabel true x y z\n@data\n1,2,3:4,5,6:z\r\n\n7,8,9:10,11,12:x\n")
    data = read_ts(path)
    assert data.series.shape == (2, 3, 2) and data.labels.tolist() == [2, 0]
    assert data.series[0].tolist() == [[1, 4], [2, 5], [3, 6]]  # [time, dimension]


@pytest.mark.parametrize("text, message", [
    (HEADER.replace("@data\n", ""), "no @data"),
    (HEADER, "no series after @data"),
    ("1,2:a\n" + HEADER, "data line before @data"),
    (HEADER.replace("true a b", "false"), "not a classification set"),
    (HEADER.replace("true a b", "true a"), "two or more distinct labels"),
    (HEADER.replace("true a b", "true a a"), "two or more distinct labels"),
    (HEADER + "1,2:c\n", r"line 6: class label 'c' is not in @classLabel \['a', 'b'\]"),
    (HEADER + "1,2\n", "line 6: no ':' before the class label"),
    (HEADER + "1,x:a\n", "line 6: values must be comma-separated numbers"),
    (HEADER + "1,nan:a\n", "line 6: non-finite"),
    (HEADER + "1,2:a\n1,2,3:b\n", "line 7: 1 dimension.*where the set's series have 1 of length 2"),
    (HEADER + "1,2:a\n1,2:3,4:b\n", "line 7: 2 dimension"),
    (HEADER.replace("@data", "@seriesLength 3\n@data") + "1,2:a\n", "line 7: .*of length 3"),
    (HEADER.replace("@data", "@seriesLength three\n@data"), "@seriesLength must be a whole number"),
    (HEADER.replace("@equalLength true", "@equalLength false"), "unequal lengths are not supported"),
    (HEADER.replace("@equalLength true", "@missing true"), "missing values are not supported"),
    (HEADER.replace("@equalLength true", "@timeStamps yes"), "@timestamps must be true or false"),
])
def test_read_ts_refuses_what_it_cannot_read_naming_the_line(tmp_path, text, message):
    path = tmp_path / "bad.ts"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_ts(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_ts(tmp_path / "none.ts")


def test_task_samples_labelled_series_of_its_split():
    task = toy()
    assert (task.num_features, task.num_classes, task.series_length) == (1, 2, 12)
    a, b, c = (task.sample(5, 12, gen(s)) for s in (1, 1, 2))
    assert isinstance(a, LabelBatch) and a.inputs.shape == (5, 12, 1) and a.targets.shape == (5,)
    assert a.targets.dtype == torch.long and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    train = read_ts(TOY / "Toy_TRAIN.ts")
    for series, label in zip(a.inputs, a.targets):  # every row is a series of the training file, with its label
        row = next(i for i in range(len(train.series)) if torch.equal(train.series[i], series))
        assert train.labels[row] == label
    with pytest.raises(ValueError, match="length 13: the series of UCR set Toy are 12 steps long"):
        task.sample(1, 13, gen())


def test_held_out_is_the_test_split_read_whole():
    task = toy()
    test = task.held_out()
    assert test.options.split == "test" and test.options.root == str(ROOT)
    whole = test.full_set(12)
    expected = read_ts(TOY / "Toy_TEST.ts")
    assert torch.equal(whole.inputs, expected.series) and torch.equal(whole.targets, expected.labels)
    assert task.full_set(12).inputs.shape[0] == 8
    with pytest.raises(ValueError, match="split"):
        task.held_out("val")  # the archive has no validation split


def test_files_are_read_on_first_use_and_errors_name_the_set(tmp_path, monkeypatch):
    task = get_task("ucr", dataset="Nope", root=str(ROOT))  # builds: nothing read yet
    with pytest.raises(ValueError, match="no UCR set 'Nope'.*sets there: Toy"):
        task.sample(1, 12, gen())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="aeon is not installed.*pip install aeon.*titans\\[ucr\\]"):
        get_task("ucr").num_classes
    with pytest.raises(ValueError, match="dataset must name one set"):
        get_task("ucr", dataset="../Toy")
    (tmp_path / "Odd").mkdir()
    (tmp_path / "Odd" / "Odd_TRAIN.ts").write_text(HEADER + "1,2:a\n")
    (tmp_path / "Odd" / "Odd_TEST.ts").write_text(HEADER.replace("a b", "a b c") + "1,2:c\n")
    with pytest.raises(ValueError, match="TRAIN and TEST files disagree"):
        load_ucr("Odd", tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("aeon") is None, reason="aeon (the ucr extra) is not installed")
def test_the_sets_aeon_ships():
    for name, sizes, length in (("ItalyPowerDemand", (67, 1029), 24), ("GunPoint", (50, 150), 150)):
        splits = load_ucr(name)
        assert (len(splits["train"].labels), len(splits["test"].labels)) == sizes
        assert splits["train"].series.shape[1:] == (length, 1) and splits["train"].classes == ("1", "2")
        assert set(splits["test"].labels.tolist()) == {0, 1}
