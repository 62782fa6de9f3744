"""Model specs (TOML/JSON/zoo), their validation, and the single-process reference model."""

from netpart.models.reference import ReferenceModel, build_reference, init_rows
from netpart.models.spec import InputSpec, LayerSpec, ModelSpec, Shape
from netpart.models.zoo import ZOO, load_spec, zoo_names

__all__ = [
    "ZOO",
    "InputSpec",
    "LayerSpec",
    "ModelSpec",
    "ReferenceModel",
    "Shape",
    "build_reference",
    "init_rows",
    "load_spec",
    "zoo_names",
]
