"""tidal's version, in a module of its own so that the package's modules need not import the
package's facade (tidal/__init__.py, which hands the engine's LLM on)."""

__version__ = "0.1.0"
