"""tidal: an LLM serving engine whose speculative decoding adapts to load."""

from tidal.sampling_params import SamplingParams
from tidal.version import __version__


def __getattr__(name):
    # LLM pulls in torch; import it lazily so `import tidal` stays cheap.
    if name == "LLM":
        from tidal.engine.llm_engine import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
