"""Titans architectures (LMM, MAC, MAG, MAL) and baselines behind one LM class and one config."""

from ..io.state import load_state, save_state
from .config import TITANS_VARIANTS, VARIANTS, TitansConfig
from .decode import StaticDecoder
from .lm import MIXERS, Backbone, TitansLM, sample_next

__all__ = ["VARIANTS", "TITANS_VARIANTS", "TitansConfig", "MIXERS", "Backbone", "TitansLM", "sample_next", "load_state",
           "save_state", "StaticDecoder"]

from .encoder import ClassificationHead, ForecastHead, RegressionHead, TitansEncoder  # noqa: E402

__all__ += ["ClassificationHead", "ForecastHead", "RegressionHead", "TitansEncoder"]
