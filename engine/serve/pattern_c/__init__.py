"""Pattern C's min-length chat, ``POST /chat`` (the map: :mod:`engine.serve`)."""
