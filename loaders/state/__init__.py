"""The loader state and the data identities it is bound to."""
