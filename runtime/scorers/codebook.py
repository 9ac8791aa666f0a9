"""The built-in codebook scorer (docs/design.md §8, §12): logits without a trained model.

At a semantic level the logit of token j is -||r - C_l[j]||^2 / temperature, r the request
embedding's residual after the beam's prefix (r = x - sum_{p<l} C_p[t_p]), the same residual
quantisation that assigned the catalog's SIDs, so the best-scoring SIDs are the request's nearest
ones; every token of the hash level gets 0 (`runtime.ops.codebook`, which also computes a step's
log-probabilities in one fused kernel).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from runtime.ops.codebook import CodebookTables, codebook_log_probs, codebook_logits
from sidindex.errors import ArtifactError, InputError
from sidindex.sid.codebook import Codebook

if TYPE_CHECKING:
    from runtime.index.served import ServedIndex
    from sidindex.request_encoding import EncodedRequests


class CodebookScorer:
    """scorer(step, tokens (B, K, step) int64, parent) -> (B, K, V) float32 logits, for request
    embeddings `embedding` (B, D) float32 (`runtime.search.beam.Scorer`; stateless, so `parent` is
    unused). `log_probs` gives a step's log-probabilities directly (`runtime.search.beam.log_probs_of`)."""

    def __init__(self, codebook: Codebook, embedding: torch.Tensor, temperature: float = 1.0) -> None:
        dev = embedding.device
        self.x = embedding.float().clone()  # its own: a captured search refreshes it in place
        self.tables = CodebookTables.of([torch.from_numpy(c).to(dev) for c in codebook.centroids],
                                        codebook.level_sizes, codebook.vocab_size)
        self.temperature = temperature
        self.temperature_t = torch.tensor([temperature], dtype=torch.float64, device=dev)  # the kernel reads it
        self.inputs = {"embedding": self.x}  # what a captured search copies each batch into (runtime.Searcher)

    def for_embedding(self, embedding: torch.Tensor) -> CodebookScorer:
        """The same scorer for other requests' embeddings (B', D), a copy of its own: the codebook's
        device copy is shared, so a batch costs no host-to-device copy of the centroids."""
        return self.reading(embedding.float().clone())

    def reading(self, embedding: torch.Tensor) -> CodebookScorer:
        """The same scorer reading `embedding` (B', D) float32 on its device where it lies, not a
        copy: a captured search's, whose staged embedding each batch refreshes (`runtime.Searcher`)."""
        other = copy.copy(self)
        other.x = embedding
        other.inputs = {"embedding": other.x}
        return other

    def prefix_independent(self, step: int) -> bool:
        """True when the logits of `step` do not depend on the prefix (the hash level): an
        exhaustive scan asks once instead of once per trie node."""
        return step >= self.tables.semantic

    def __call__(self, step: int, prefix: torch.Tensor, parent: torch.Tensor | None = None) -> torch.Tensor:
        return codebook_logits(self.tables, self.x, self.temperature, step, prefix)

    def log_probs(self, step: int, prefix: torch.Tensor, parent: torch.Tensor | None, size: int) -> torch.Tensor:
        """(B, K, V) float32 `level_log_probs(self(step, prefix, parent), size)`, in one kernel on
        CUDA (`runtime.ops.codebook`): equal where the level is uniform, to a few units in float32's
        last place elsewhere. Reads prefix without writing it."""
        return codebook_log_probs(self.tables, self.x, self.temperature, step, prefix, size,
                                  temperature_t=self.temperature_t)


def embedding_of(requests: EncodedRequests) -> torch.Tensor:
    """The requests' (B, D) embedding, which the codebook scorer scores; an InputError naming the
    requests when they have none."""
    if requests.embedding is None:
        raise InputError(f"{requests.source}: the codebook scorer needs an `embedding` column in the requests")
    return requests.embedding


def codebook_of(index: ServedIndex) -> Codebook:
    """The codebook the index loaded with its snapshot, which the codebook scorer reads; an
    ArtifactError when the snapshot carries none."""
    if index.codebook is None:
        raise ArtifactError(f"snapshot {index.id} carries no codebook; the codebook scorer needs one (serve a "
                            "snapshot built with a codebook, or bring your own scorer)")
    return index.codebook


def codebook_scorer(index: ServedIndex, requests: EncodedRequests,
                    temperature: float = 1.0) -> Callable[[slice], CodebookScorer]:
    """rows -> the codebook scorer for requests[rows], from the codebook the index loaded with the
    snapshot (nothing is read from disk). requests: the encoding whose `embedding` to score, best
    on the index's device (`runtime.requests.to_device`)."""
    cb = codebook_of(index)
    given = embedding_of(requests)
    if given.shape[1] != cb.dim:
        raise InputError(f"{requests.source}: embedding has {given.shape[1]} dimensions, the codebook {cb.dim}")
    emb = torch.as_tensor(given, dtype=torch.float32, device=index.device)
    shared = CodebookScorer(cb, emb[:0], temperature)  # the centroids on the device, once

    def for_rows(rows: slice) -> CodebookScorer:
        return shared.for_embedding(emb[rows])

    return for_rows
