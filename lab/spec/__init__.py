"""Speculative decoding: proposers that draft tokens for the target to verify."""
