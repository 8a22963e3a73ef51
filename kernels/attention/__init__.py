"""Attention: ``prefill`` (causal, a prompt chunk against the cache) and ``decode`` (one query per sequence,
split over the keys, then combined)."""
