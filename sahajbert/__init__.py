"""Library for collaborative sahajBERT pretraining: every script in this repository imports its parts from here."""

__version__ = "0.1.0"
