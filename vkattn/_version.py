"""vkattn's version (one place: the package and its cache files read it)."""
__version__ = "0.1.0"
