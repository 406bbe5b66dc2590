"""draftline: train DFlash speculative-decoding drafters for any Hugging Face target."""

__version__ = "0.1.0"
