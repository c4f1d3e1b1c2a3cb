"""Pure, backend-neutral rules about a growing output. No torch, no backend imports.

One module per rule; each backend gets a thin adapter elsewhere (``engine/backends``).
"""
