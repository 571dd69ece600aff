"""Imports every tool module so that each registers itself with the contract."""
from . import plan  # noqa: F401
from . import render  # noqa: F401
from . import train  # noqa: F401
from . import bench  # noqa: F401
from . import doctor  # noqa: F401
from . import validate  # noqa: F401
from . import logs  # noqa: F401
from . import prepare_data  # noqa: F401
