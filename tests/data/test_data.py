"""Data sources (synthetic, procedural shapes, digits, image folders, npz) and their errors."""

import numpy as np
import pytest
import torch

from netpart.cli import main
from netpart.data import DataError, load_data
from netpart.data.images import SHAPE_CLASSES
from netpart.models import load_spec

SPEC = load_spec("tiny-local")  # 1 x 16 x 16 input, 10 classes
IMAGE = load_spec("image-80m")  # 3 x 100 x 100


def test_shapes_are_pure_any_resolution_and_hold_out_unseen_ids():
    data = load_data("shapes", SPEC, seed=5, examples=500)
    x1, y1 = data.batch(1, 2, 3, 16, torch.float32)
    x2, y2 = data.batch(1, 2, 3, 16, torch.float32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (16, 256)
    other = load_data("shapes", SPEC, seed=6, examples=500).batch(1, 2, 3, 16, torch.float32)[0]
    assert not torch.equal(x1, other)  # the seed matters
    xt, yt = data.held_out_set()
    assert xt.shape == (1000, 256) and set(np.unique(yt)) == set(range(len(SHAPE_CLASSES)))
    big = load_data("shapes", IMAGE, seed=5, examples=10).batch(0, 1, 1, 2, torch.float32)[0]
    assert big.shape == (2, 3 * 100 * 100) and torch.isfinite(big).all()


def test_shapes_are_learnable_by_a_linear_model():
    from sklearn.linear_model import LogisticRegression

    data = load_data("shapes", SPEC, seed=0, examples=3000)
    x, y = data.render(np.arange(3000))
    xt, yt = data.held_out_set()
    score = LogisticRegression(max_iter=300).fit(x, y).score(xt, yt)
    assert 0.2 < score < 0.9  # twice chance from raw pixels (measured 0.26), far from trivial


def _folder(root, classes=3, per_class=4, size=(12, 9)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            a = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
            Image.fromarray(a).save(d / f"{i}.png")
    (root / "class_0" / "notes.txt").write_text("not an image, skipped")
    return root


def test_image_folder_is_resized_labelled_by_sorted_name_and_split(tmp_path):
    root = _folder(tmp_path / "imgs")
    data = load_data(str(root), SPEC)
    xt, yt = data.held_out_set()
    assert data.n + len(xt) == 12 and data.x.shape[1] == 256 and len(xt) == 2  # 20% held out
    assert sorted(np.concatenate([data.y, yt]).tolist()) == [0] * 4 + [1] * 4 + [2] * 4
    assert abs(float(np.concatenate([data.x, xt]).mean())) < 1e-5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: r.mkdir(), "no class subfolders"),
        (lambda r: (r / "a").mkdir(parents=True), "a: class folder holds no images"),
        (lambda r: _folder(r, classes=11, per_class=1), "11 class folders, but the model has 10"),
        (
            lambda r: (_folder(r), (r / "class_1" / "9.png").write_bytes(b"not a png")),
            "class_1/9.png: cannot read image",
        ),
    ],
    ids=["empty", "class-without-images", "too-many-classes", "unreadable-image"],
)
def test_bad_image_folders_are_named_errors(tmp_path, make, message):
    root = tmp_path / "imgs"
    make(root)
    with pytest.raises(DataError, match=message):
        load_data(str(root), SPEC)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((5, 3)), "y": np.zeros(5, np.int64)}, r"x is \(5, 3\).*needs x \[n, 256\]"),
        ({"x": np.zeros((5, 256)), "y": np.arange(5) * 4}, r"classes in \[0, 10\).*0\.\.16"),
        ({"x": np.zeros((5, 256)), "y": np.zeros(5)}, "must be integer classes"),
        ({"x": np.zeros((0, 256)), "y": np.zeros(0, np.int64)}, "x holds no examples"),
        ({"x": np.full((5, 256), np.nan), "y": np.zeros(5, np.int64)}, "finite numbers"),
        ({"x": np.zeros((5, 256))}, "no array 'y'"),
    ],
    ids=["wrong-shape", "label-out-of-range", "float-labels", "empty", "nan", "missing-y"],
)
def test_bad_npz_data_is_a_named_error(tmp_path, arrays, message):
    with pytest.raises(DataError, match=message):
        load_data(_npz(tmp_path / "d.npz", **arrays), SPEC)


def test_npz_test_arrays_are_the_held_out_set(tmp_path):
    x, y = np.ones((6, 16, 16)), np.arange(6)
    data = load_data(_npz(tmp_path / "d.npz", x=x, y=y, x_test=x[:2], y_test=y[:2]), SPEC)
    assert data.n == 6 and data.held_out_set()[0].shape == (2, 256)
    assert load_data(_npz(tmp_path / "e.npz", x=x, y=y), SPEC).n == 5  # 20% held out instead


def test_bad_data_on_the_command_line_exits_2_in_one_line(tmp_path, capsys):
    root = tmp_path / "imgs"
    _folder(root)
    (root / "class_2" / "3.png").write_bytes(b"\x89PNG broken")
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-local", "--workers", "2", "--data", str(root)]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "class_2/3.png: cannot read image" in err
    assert not out.exists()  # nothing written


# ---- placement -----------------------------------------------------------------------------


def test_replicas_read_disjoint_shards_and_batches_are_pure():
    spec = load_spec("tiny-mlp")
    data = load_data("synthetic", spec, seed=3, examples=100)
    seen = [set(data.indices(r, 3, 1, 33).tolist()) for r in range(3)]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    x1, y1 = data.batch(1, 3, 5, 8, torch.float64)
    x2, y2 = data.batch(1, 3, 5, 8, torch.float64)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    epoch = data.indices(0, 3, 1, 34)
    assert sorted(epoch.tolist()) == list(range(0, 100, 3))  # one epoch = the whole shard


def test_in_memory_batches_are_the_examples_their_indices_name():
    """Batches sliced from each epoch's gathered examples are exactly the gathered ones, in
    every epoch and across an epoch's end, and drawing them changes nothing."""
    spec = load_spec("digits-mlp")
    data = load_data("digits", spec)
    for replica, replicas in ((0, 1), (1, 3)):
        count = len(range(replica, data.n, replicas))
        for step in (1, 2, count // 32, count // 32 + 1, count // 32 + 2, 3 * count // 32):
            x, y = data.batch(replica, replicas, step, 32, torch.float64)
            want = data.examples(data.indices(replica, replicas, step, 32), torch.float64)
            assert torch.equal(x, want[0]) and torch.equal(y, want[1]), (replica, step)
            x += 1  # a batch is the caller's to change
            again = data.batch(replica, replicas, step, 32, torch.float64)[0]
            assert torch.equal(again, want[0])


def test_npz_data_is_checked(tmp_path):
    spec = load_spec("tiny-mlp")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((5, 3)), y=np.zeros(5, dtype=np.int64))
    with pytest.raises(DataError, match="needs x"):
        load_data(str(bad), spec)
    with pytest.raises(DataError, match="synthetic"):
        load_data("data.csv", spec)


def test_digits_are_resized_standardised_and_hold_out_a_fixed_fifth():
    spec = load_spec("tiny-local")  # 1 x 16 x 16 input, 10 classes
    data = load_data("digits", spec, seed=1)
    x_test, y_test = data.held_out
    assert data.x.shape == (1438, 256) and x_test.shape == (359, 256)
    assert abs(float(np.concatenate([data.x, x_test]).mean())) < 1e-5
    assert set(np.unique(y_test)) == set(range(10))
    again = load_data("digits", spec, seed=2)  # the split does not depend on the seed
    assert np.array_equal(again.held_out[1], y_test)
    train_rows = {r.tobytes() for r in data.x}
    assert not any(r.tobytes() in train_rows for r in x_test)  # no example on both sides
    assert load_data("digits", load_spec("tiny-mlp")).x.shape[1] == 64  # flat 64 features
    with pytest.raises(DataError, match="takes 440 features, not 64"):
        load_data("digits", load_spec("speech"))


def test_a_folder_the_model_cannot_learn_from_is_refused_or_warned_about(tmp_path, caplog):
    """Issue 80, item 3: one class trains to 'accuracy 1.0' and says nothing; fewer classes
    than outputs leave outputs that are never a label; a missing path is missing."""
    with pytest.raises(DataError, match=r"one class folder \(class_0\); a classifier needs"):
        load_data(str(_folder(tmp_path / "one", classes=1)), SPEC)
    with caplog.at_level("WARNING", logger="netpart.data.images"):
        load_data(str(_folder(tmp_path / "three", classes=3)), SPEC)
    assert "3 classes for a model of 10 outputs: outputs 3-9 are never a label" in caplog.text
    with pytest.raises(DataError, match="no_such_dir/: no such file or directory"):
        load_data(str(tmp_path / "no_such_dir") + "/", SPEC)


def test_every_unreadable_image_is_named_and_a_fifo_is_not_opened(tmp_path):
    import os

    root = _folder(tmp_path / "imgs")
    (root / "class_1" / "9.png").write_bytes(b"not a png")
    (root / "class_2" / "8.png").write_bytes(b"nor this")
    os.mkfifo(root / "class_0" / "pipe.png")  # opened, it would block for ever
    with pytest.raises(DataError) as err:
        load_data(str(root), SPEC)
    text = str(err.value)
    assert "3 images cannot be read" in text and "\n" not in text
    assert "class_0/pipe.png: not a regular file" in text
    assert "class_1/9.png: cannot read image" in text and "class_2/8.png" in text


def test_a_decompression_bomb_and_an_npz_larger_than_memory_are_one_line_errors(tmp_path):
    import io
    import zipfile

    from PIL import Image

    root = _folder(tmp_path / "imgs")
    Image.new("L", (9000, 9000)).save(root / "class_1" / "big.png")  # 81M pixels
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 1_000_000  # the guard raises above twice this
    try:
        with pytest.raises(DataError, match=r"big.png: cannot read image \(more pixels than"):
            load_data(str(root), SPEC)
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    # an .npy header claiming 2 TiB of float64, with no data behind it
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (2**38,)}
    )
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", header.getvalue())
        z.writestr("y.npy", header.getvalue())
    with pytest.raises(DataError, match=r"declare 4,096.0 GiB, more than this machine's"):
        load_data(str(path), SPEC)  # from the headers, before anything is decompressed
