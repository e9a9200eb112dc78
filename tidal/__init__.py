"""tidal: an LLM serving engine whose speculative decoding adapts to load."""

__version__ = "0.1.0"

from tidal.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name):
    # LLM pulls in torch; import it lazily so `import tidal` stays cheap.
    if name == "LLM":
        from tidal.engine.llm_engine import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
