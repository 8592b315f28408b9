"""One module per CLI verb; each defines `register(subparsers)` which adds its parser and sets `func`."""
