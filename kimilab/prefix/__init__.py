"""Prefix caching: a radix tree over blocks, checkpoint policies, the dual-granularity cache."""
