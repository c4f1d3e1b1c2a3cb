"""ms-swift's rollout protocol and its weight-sync routes (the map: :mod:`engine.serve`)."""
