"""Model families shipped with plait, each a plugin registered through an entry point."""
