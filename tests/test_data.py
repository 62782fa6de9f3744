"""Data sources (procedural shapes, image folders, npz) and their errors; job placement."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.cli import main
from netpart.data import DataError, load_data
from netpart.data_images import SHAPE_CLASSES
from netpart.models import load_spec
from netpart.runtime.placement import PlacementError, place

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


def test_pack_keeps_replicas_on_one_host_and_spreads_shards():
    hosts = ["a"] * 3 + ["b"] * 3  # torchrun: node 0 has ranks 0-2, node 1 ranks 3-5
    p = place(hosts, replicas=2, workers=2, shards=2)
    assert p.hosts_of_replica(0) == {"a"} and p.hosts_of_replica(1) == {"b"}
    assert {p.hosts[p.shard_rank(0)], p.hosts[p.shard_rank(1)]} == {"a", "b"}
    ordered = place(hosts, 2, 2, 2, "ordered")
    assert ordered.hosts_of_replica(1) == {"a", "b"}  # the naive order splits replica 1
    spread = place(hosts, 2, 2, 2, "spread")
    assert spread.hosts_of_replica(0) == {"a", "b"}
    with_coordinator = place([*hosts, "b"], 2, 2, 2, coordinators=1)
    assert with_coordinator.coordinator_rank() == 6 and with_coordinator.name(6) == "coordinator"
    assert with_coordinator.hosts_of_replica(0) == {"a"}
    one = place(["x"] * 6, 2, 2, 2)  # one machine: the documented rank arithmetic
    assert [one.worker_rank(r, w) for r in (0, 1) for w in (0, 1)] == [0, 1, 2, 3]
    assert one.shard_rank(1) == 5 and one.name(3) == "replica 1 worker 1"


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["pack", "spread", "ordered"]),
)
@settings(max_examples=200, deadline=None)
def test_every_policy_gives_each_role_exactly_one_rank(slots, replicas, workers, policy):
    hosts = [f"h{i}" for i, n in enumerate(slots) for _ in range(n)]
    shards = len(hosts) - replicas * workers
    if shards < 1:
        with pytest.raises(PlacementError, match="processes for a job"):
            place(hosts, replicas, workers, max(1, shards), policy)
        return
    p = place(hosts, replicas, workers, shards, policy)
    ranks = [p.worker_rank(r, w) for r in range(replicas) for w in range(workers)]
    ranks += [p.shard_rank(s) for s in range(shards)]
    assert sorted(ranks) == list(range(len(hosts)))
    if policy == "pack" and max(slots) >= workers * replicas:
        # Room for every replica on the biggest host: none is split.
        assert all(len(p.hosts_of_replica(r)) == 1 for r in range(replicas))
