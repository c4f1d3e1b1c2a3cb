"""Everything that brings weights into a served model: the group's keyed channel (:mod:`engine.weights.channel`)."""
