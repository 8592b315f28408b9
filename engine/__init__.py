"""mtpchat's inference engine: GGUF loading, text, the Qwen3.5/3.6 model, caches, MTP speculation.

Never imports Qt, HTTP or anything of app/ or ui/; never prints (events and logging only).
"""
