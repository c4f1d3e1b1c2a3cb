"""The HTTP pieces every surface of the served engine shares (the map: :mod:`engine.serve`)."""
