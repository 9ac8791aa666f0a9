"""sidindex: build Semantic-ID / GTM indexes for eligibility-constrained generative ad retrieval.

This package is the offline half (numpy, numba, polars, faiss, pyarrow). It never imports torch or
triton; the GPU runtime lives in the separate `runtime` package.
"""

from sidindex.errors import ArtifactError, ConfigError, InputError, QualityGateError, SidIndexError

__version__ = "0.1.0"

__all__ = ["ArtifactError", "ConfigError", "InputError", "QualityGateError", "SidIndexError", "__version__"]
