"""Importance matrix (llama.cpp's imatrix) with MTP warm-up: statistics, the GGUF file, chunked perplexity.

spec/mtp-speculation.md §9. Nothing here prints; progress leaves as events to the caller.
"""
