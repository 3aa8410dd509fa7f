"""autopar's version, written into plan files' provenance and emitted scripts' headers."""

__version__ = "0.1.0"
