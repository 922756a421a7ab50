"""tandem: one LLM across mixed accelerators over ordinary Ethernet."""

__version__ = "0.1.0"
