"""Training data: which examples does a replica's step read? Built-in sources, user files and
image folders, served in batches that are a pure function of (replica, step) so a replica's
workers agree without talking."""

from netpart.data.sources import Dataset, load_data
from netpart.errors import DataError

__all__ = ["DataError", "Dataset", "load_data"]
