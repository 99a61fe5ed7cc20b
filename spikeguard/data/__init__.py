"""Training data: byte corpora and the random-window batch sampler."""

from spikeguard.data.corpus import DEFAULT_MAX_BYTES, VAL_FRACTION, Corpus, load_corpus, split_bytes

__all__ = ["DEFAULT_MAX_BYTES", "VAL_FRACTION", "Corpus", "load_corpus", "split_bytes"]
