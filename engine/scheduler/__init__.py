"""The slot scheduler: one engine thread owning the model, the caches and N slots; requests in, plain
event dataclasses out (spec/mtp-speculation.md §6). No HTTP, no Qt, never prints."""
