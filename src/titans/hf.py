"""`import titans.hf` registers the Hugging Face classes: the module is `titans.io.hf`, kept importable here by the
name the saved models' users have been given."""

from .io.hf import *  # noqa: F401,F403
from .io.hf import __all__  # noqa: F401
