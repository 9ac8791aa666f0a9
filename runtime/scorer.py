"""Scorers: the built-in codebook scorer, and users' scorers named MODULE:FACTORY (DESIGN.md §8, §12).

The codebook scorer gives logits without a trained model.

At a semantic level l the logit of token j is -||r - C_l[j]||^2 / temperature, with r the request
embedding's residual after the beam's prefix (r = x - sum_{p<l} C_p[t_p]): the same residual
quantisation that assigned the catalog's SIDs, so the best-scoring SIDs are the request's nearest
ones. The hash level carries no meaning: every token in range gets logit 0. Tokens beyond a
level's size get -inf. Computed as 2 r.C - ||C||^2 (the ||r||^2 term is the same for every token
and cancels in the softmax).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys

import torch

from sidindex.errors import ScorerError
from sidindex.sid.codebook import Codebook


class CodebookScorer:
    """scorer(step, tokens (B, K, step) int64, parent) -> (B, K, V) float32 logits, for request
    embeddings `embedding` (B, D) float32 (`runtime.search.Scorer`; stateless, so `parent` is unused)."""

    def __init__(self, codebook: Codebook, embedding: torch.Tensor, temperature: float = 1.0) -> None:
        dev = embedding.device
        self.x = embedding.float().clone()  # its own: a captured search refreshes it in place
        self.centroids = [torch.from_numpy(c).to(dev) for c in codebook.centroids]
        self.sq_norms = [(c * c).sum(dim=1) for c in self.centroids]
        self.sizes, self.V, self.temperature = codebook.level_sizes, codebook.vocab_size, temperature
        self.inputs = {"embedding": self.x}  # what a captured search copies each batch into (runtime.Searcher)

    def for_embedding(self, embedding: torch.Tensor) -> CodebookScorer:
        """The same scorer for other requests' embeddings (B', D): the codebook's device copy is
        shared, so a batch costs no host-to-device copy of the centroids."""
        other = copy.copy(self)
        other.x = embedding.float().clone()
        other.inputs = {"embedding": other.x}
        return other

    def prefix_independent(self, step: int) -> bool:
        """True when the logits of `step` do not depend on the prefix (the hash level): an
        exhaustive scan asks once instead of once per trie node."""
        return step >= len(self.centroids)

    def __call__(self, step: int, prefix: torch.Tensor, parent: torch.Tensor | None = None) -> torch.Tensor:
        B, K, _ = prefix.shape
        out = torch.full((B, K, self.V), float("-inf"), device=self.x.device)
        if step >= len(self.centroids):  # the hash level
            out[..., :self.sizes[step]] = 0.0
            return out
        r = self.x[:, None, :].expand(B, K, -1)
        for p in range(step):
            r = r - self.centroids[p][prefix[..., p]]
        c = self.centroids[step]
        out[..., :len(c)] = (2 * r @ c.T - self.sq_norms[step]) / self.temperature
        return out


def load_factory(spec: str) -> ScorerFactory:
    """The scorer factory named by 'MODULE:FACTORY' (MODULE importable from the working directory
    or PYTHONPATH): FACTORY(batch: pyarrow.Table, device: torch.device, level_sizes) -> Scorer."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ScorerError(f"scorer {spec!r}: expected MODULE:FACTORY, e.g. my_model:make_scorer")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the working directory, as `python -m` would
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module: any error in it is theirs to fix
        raise ScorerError(f"scorer {spec!r}: cannot import {module!r}: {type(e).__name__}: {e}") from None
    factory = getattr(mod, name, None)
    if not callable(factory):
        raise ScorerError(f"scorer {spec!r}: module {module!r} ({mod.__file__}) has no callable {name!r}")
    return ScorerFactory(factory, spec)


class ScorerFactory:
    """A user's factory and the scorers it makes, failing with one line that names them."""

    def __init__(self, factory, spec: str) -> None:
        self.factory, self.spec = factory, spec

    def for_batch(self, batch, device: torch.device, level_sizes: tuple[int, ...]):
        try:
            scorer = self.factory(batch, device, level_sizes)
        except Exception as e:
            raise ScorerError(f"scorer {self.spec!r}: the factory failed: {type(e).__name__}: {e}") from None
        if not callable(scorer):
            raise ScorerError(f"scorer {self.spec!r}: the factory returned {type(scorer).__name__}, not a scorer "
                              "(a callable scorer(step, tokens, parent) -> logits)")
        return _Checked(scorer, self.spec, max(level_sizes))


class _Checked:
    """Calls a user's scorer and checks what it returns (host metadata only: no device sync)."""

    def __init__(self, scorer, spec: str, V: int) -> None:
        self.scorer, self.spec, self.V = scorer, spec, V

    def __getattr__(self, name: str):  # `inputs`, `prefix_independent`: the wrapped scorer's
        return getattr(self.__dict__["scorer"], name)

    def __call__(self, step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
        try:
            out = self.scorer(step, tokens, parent)
        except Exception as e:
            raise ScorerError(f"scorer {self.spec!r} failed at step {step}: {type(e).__name__}: {e}") from None
        want = (*tokens.shape[:2], self.V)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.is_floating_point() \
                or out.device != tokens.device:
            got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ScorerError(f"scorer {self.spec!r} returned {got} at step {step}; expected float logits of shape "
                              f"{want} on {tokens.device}")
        return out
