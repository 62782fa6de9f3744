"""Models: what is the network? Specs (TOML/JSON/zoo), their validation, initial weights,
and the reference model.

`netpart.models.spec`, `zoo` and `init` need only numpy; the reference `nn.Module`
(`netpart.models.reference`) needs torch and is imported on first use, so planning a model
never loads torch.
"""

from typing import Any

from netpart.models.init import init_rows
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

_TORCH_NAMES = ("ReferenceModel", "build_reference")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from netpart.models import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'netpart.models' has no attribute {name!r}")
