"""An OpenEnv app whose module fails at import, as a server missing its data does: rollflow must say so, naming
the environment and the server's log."""

raise RuntimeError("oe_broken: the word list oe_words.txt is missing")
