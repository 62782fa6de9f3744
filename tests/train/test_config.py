"""TrainConfig: its JSON round trip and one-line errors."""

import pytest

from netpart.errors import TrainError
from netpart.train.config import TrainConfig


def test_train_config_round_trip_and_errors():
    cfg = TrainConfig.of(replicas=3, shards=2, mode="sync", optimizer="sgd", lr=0.2, steps=7)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    for bad, match in (
        ({"replicas": 0}, "--replicas"),
        ({"shards": 0}, "--ps-shards"),
        ({"n_fetch": 0}, "--n-fetch"),
        ({"n_push": 0}, "--n-push"),
        ({"mode": "async"}, "--mode"),
        ({"lr": 0.0}, "--lr"),
        ({"lr": float("inf")}, "--lr inf: must be a finite number"),
        ({"timeout": float("inf")}, "--timeout inf: must be a finite number"),
        ({"timeout": 1e12}, "--timeout"),
        ({"push_norm": float("nan")}, "--push-norm nan: must be a finite number"),
        ({"dc_lambda": -1.0}, "--dc-lambda"),
        ({"mode": "sync", "push_norm": 1.0}, "apply to --mode downpour"),
        ({"placement": "random"}, "--placement"),
        ({"snapshot_every": -1}, "--snapshot-every"),
        ({"mode": "sandblaster"}, "goes with --optimizer lbfgs"),
        ({"optimizer": "lbfgs"}, "goes with --optimizer lbfgs"),
        ({"mode": "sandblaster", "optimizer": "lbfgs", "line_search": "wolfe"}, "armijo or none"),
        ({"mode": "sandblaster", "optimizer": "lbfgs", "units": 64, "batch": 32}, "--units 64"),
        ({"local_update": "yes"}, "--local-update yes: choose auto, on or off"),
        ({"local_update": "on"}, "--local-update on needs --mode downpour and --optimizer sgd"),
        ({"local_update": "on", "optimizer": "sgd", "dc_lambda": 0.1}, "without --dc-lambda"),
    ):
        with pytest.raises(TrainError, match=match):
            TrainConfig.of(**bad)
    with pytest.raises(TrainError, match="unknown"):
        TrainConfig.from_dict({"replica": 2})


def test_local_steps_where_the_shards_apply_sgd():
    """Downpour with SGD applies each step locally unless turned off; Adagrad, sync and
    delay compensation never do (what the replica would apply is not what the shards do)."""
    sgd = TrainConfig.of(optimizer="sgd")
    assert sgd.local_steps and TrainConfig.of(optimizer="sgd", local_update="on").local_steps
    assert not TrainConfig.of(optimizer="sgd", local_update="off").local_steps
    assert not TrainConfig().local_steps  # adagrad
    assert not TrainConfig.of(optimizer="sgd", mode="sync").local_steps
    assert not TrainConfig.of(optimizer="sgd", dc_lambda=0.5).local_steps


def test_the_config_is_a_tree_of_sections_and_a_flat_schema_1_config_still_reads():
    cfg = TrainConfig.of(replicas=3, data="digits", data_layout="nhwc", optimizer="sgd", log="csv")
    assert cfg.cluster.replicas == 3 and cfg.optimiser.name == "sgd" and cfg.optimiser.lr == 0.05
    assert (cfg.data.source, cfg.data.layout, cfg.run.log) == ("digits", "nhwc", "csv")
    tree = cfg.to_dict()
    assert set(tree) == {"model", "data", "optimiser", "cluster", "run"}
    assert tree["data"]["source"] == "digits" and "replicas" not in tree
    # every field once, under the command line's name
    assert TrainConfig.of(**cfg.flat()) == cfg and cfg.get("data_layout") == "nhwc"
    assert cfg.with_flat(steps=9).run.steps == 9 and cfg.with_flat(steps=9).cluster == cfg.cluster
    # a run written before the sections (train.json schema 1): its config flat
    assert TrainConfig.from_dict(cfg.flat()) == cfg
    for bad, match in (
        ({"cluster": {"replica": 2}}, r"config section cluster: unknown fields \['replica'\]"),
        ({"cluster": {}, "extra": {}}, r"unknown config sections \['extra'\]"),
        ({"run": 3, "cluster": {}}, "config section run must be an object"),
        ({"run": 3}, r"unknown config fields \['run'\]"),
    ):
        with pytest.raises(TrainError, match=match):
            TrainConfig.from_dict(bad, "x/train.json")
