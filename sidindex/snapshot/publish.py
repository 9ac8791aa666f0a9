"""Transitional: the runtime still imports these names; `sidindex.root.Root` replaces them."""

from sidindex.root import Root

CURRENT = "CURRENT"


def current_id(root):
    return Root(root).current_id()
