"""The constrained beam search: the search in every mode and the decoder seam (beam), one batch's
trie walk and mask per step (constraint), the search over several devices (sharded), and the same
mask inside Hugging Face `generate` (hf)."""
