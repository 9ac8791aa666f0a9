"""Serving one process's calls: the post stage, SIDs to ranked eligible ads (post), the search and
post stage captured as CUDA graphs and replayed (searcher), the serving object (retriever), and a
whole request table through it (retrieval)."""
