"""The gateway side of the admission protocol, installable alone (standard library only, no Django)."""
