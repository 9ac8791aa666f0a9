"""What scores a search: the built-in codebook scorer (codebook), and users' factories named
MODULE:FACTORY, called under a timeout and checked (factory)."""
