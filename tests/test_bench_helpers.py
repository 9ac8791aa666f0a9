"""The SID benchmark compares against faiss RQ only after unpacking its bit-packed codes."""

import faiss
import numpy as np

from bench.bench_sid import unpack_rq_codes


def test_unpacked_faiss_codes_reconstruct_like_faiss():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 6)).astype(np.float32)
    levels, nbits = 3, 5  # 15 bits: codes straddle byte boundaries
    rq = faiss.ResidualQuantizer(6, levels, nbits)
    rq.train(x)
    codes = rq.compute_codes(x[:300])
    tokens = unpack_rq_codes(codes, nbits, levels)
    assert tokens.shape == (300, levels) and tokens.min() >= 0 and tokens.max() < 1 << nbits
    books = faiss.vector_to_array(rq.codebooks).reshape(levels, 1 << nbits, 6)
    recon = sum(books[lv][tokens[:, lv]] for lv in range(levels))
    np.testing.assert_allclose(recon, rq.decode(codes), rtol=0, atol=1e-6)
