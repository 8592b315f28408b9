"""mtpchat's application layer: the CLI, the HTTP server, storage and remote clients. Never imports Qt."""
