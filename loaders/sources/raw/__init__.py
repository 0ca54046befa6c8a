"""Raw text: the source, the loader's feed of lane cursors, the corpus, units and unreadable units."""
