"""Type-through: answering a request from the generation it continues (the user typed what
the model was writing)."""
