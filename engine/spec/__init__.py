"""MTP speculative decoding: draft controllers (fixed, the seed's adaptive gate, `auto`), acceptance,
stop handling and the speculative decode loop (spec/mtp-speculation.md). Never prints: it yields events.
"""
