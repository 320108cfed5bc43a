"""audio recipes (see README)."""

__all__: list[str] = []
